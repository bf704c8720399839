"""A local STAND-IN for Modal's servers, so the unmodified ``modal`` SDK can be tested on the wire.

Modal's cloud cannot be reached from the test machines.  This stand-in is a
grpclib server on 127.0.0.1 that speaks the ``modal_proto`` service
definitions shipped inside the ``modal`` package (the control plane
``modal.client.ModalClient`` and the per-task ``TaskCommandRouter``) for the
RPCs that hermes-batch's modal backend makes, and runs each sandbox as a real
container of the local Docker engine (images come from that engine, never from
a registry).  The SDK is pointed at it with ``MODAL_SERVER_URL`` and a
stand-in token.  It is a stand-in, not Modal: see the README of
hermes-batch-modal for what it does and does not prove.

Faults it injects on request: throttled creation (RESOURCE_EXHAUSTED), a
sandbox that never becomes ready, an image that fails to build, a sandbox
terminated from outside.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from typing import Optional

from grpclib import GRPCError, Status
from grpclib.events import RecvRequest, listen
from grpclib.server import Server
from modal._utils.grpc_utils import custom_detail_codec
from modal_proto import api_pb2

from .control import KEEP_ALIVE, ControlPlane
from .engine import LABEL, LABEL_ISSUE, Engine
from .router import CommandRouter
from .state import Faults, Sandbox

__all__ = ["ModalStandIn", "Faults"]

CONTROL_PREFIX = "/modal.client.ModalClient/"


class ModalStandIn:
    """The stand-in server, run on its own event loop in a thread of the test process."""

    def __init__(self):
        self.id = uuid.uuid4().hex[:12]
        self.token_id = f"ak-standin-{uuid.uuid4().hex[:16]}"
        self.token_secret = f"as-standin-{uuid.uuid4().hex}"
        self.faults = Faults()
        self.url = ""
        self.apps: dict[str, str] = {}
        self.images: dict[str, dict] = {}
        self.sandboxes: dict[str, Sandbox] = {}
        self.tasks: dict[str, Sandbox] = {}
        self.auth_tokens: set[str] = set()
        self.calls: collections.Counter = collections.Counter()
        self.unimplemented: list[str] = []
        self.refused_credentials = 0
        self.create_attempts = 0
        self.throttled = 0
        self.terminate_calls = 0
        self.exec_count = 0
        self.starting = 0
        self.peak_starting = 0
        self.peak_running = 0
        self.never_ready_ids: set[str] = set()
        self._create_times: collections.deque = collections.deque()
        self.warm: dict[str, list] = {}  # started containers per image, taken by plain sandboxes (see prewarm)
        self.engine: Optional[Engine] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._server: Optional[Server] = None

    # --- life ----------------------------------------------------------------------------------

    def start(self) -> "ModalStandIn":
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._serve())
            except BaseException as exc:  # reported to start()
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name="modal-standin", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failure:
            raise failure[0]
        return self

    async def _serve(self) -> None:
        self.engine = Engine()
        await self.engine.ping()
        self._server = Server([ControlPlane(self), CommandRouter(self)], status_details_codec=custom_detail_codec)
        listen(self._server, RecvRequest, self._on_request)
        await self._server.start(host="127.0.0.1", port=0)
        port = self._server._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def _on_request(self, event: RecvRequest) -> None:
        name = event.method_name.rsplit("/", 1)[-1]
        self.calls[name] += 1
        if event.method_name.startswith(CONTROL_PREFIX):
            metadata = dict(event.metadata)
            if metadata.get("x-modal-token-id") != self.token_id or metadata.get("x-modal-token-secret") != self.token_secret:
                self.refused_credentials += 1
                # Like Modal, and unlike a careless server: the refusal does not repeat the token.
                raise GRPCError(Status.UNAUTHENTICATED, "Invalid or missing token credentials")

    def stop(self) -> None:
        if self._loop is None:
            return
        try:
            self.call(self._shutdown(), timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop = None

    async def _shutdown(self) -> None:
        for sandbox in list(self.sandboxes.values()):
            await self.finish(sandbox, api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_TERMINATED))
        for container in await self.engine.containers(f"{LABEL}={self.id}"):
            await self.engine.remove(container["Id"])
        self._server.close()
        await self.engine.close()

    def call(self, coro, timeout: float = 30):
        """Run ``coro`` on the stand-in's loop from another thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # --- what the SDK and the tests see ----------------------------------------------------------

    def env(self) -> dict:
        """Environment variables that point the ``modal`` SDK at the stand-in with its token."""
        return {"MODAL_SERVER_URL": self.url, "MODAL_TOKEN_ID": self.token_id, "MODAL_TOKEN_SECRET": self.token_secret}

    def running(self, **tags: str) -> list[Sandbox]:
        """Sandboxes still running whose tags include ``tags``."""
        return [s for s in list(self.sandboxes.values()) if s.running and all(s.tags.get(k) == v for k, v in tags.items())]

    def running_count(self) -> int:
        return sum(1 for s in self.sandboxes.values() if s.running and s.container_id)

    def exec_in(self, sandbox: Sandbox, command: str) -> str:
        """Run a shell command in a sandbox's container directly (not through the SDK), for assertions."""

        async def run() -> str:
            engine_exec = await self.engine.exec_create(sandbox.container_id, ["/bin/sh", "-c", command], "", {})
            connection = await self.engine.exec_start(engine_exec)
            connection.close_stdin()
            data = bytearray()
            try:
                while True:
                    header = await connection.reader.readexactly(8)
                    size = int.from_bytes(header[4:8], "big")
                    data += await connection.reader.readexactly(size)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            connection.close()
            return data.decode(errors="replace")

        return self.call(run())

    def prewarm(self, image: str, count: int) -> None:
        """Start ``count`` containers of ``image`` now, so that creating plain sandboxes later costs no container start.

        Used by the benchmark, to measure the client rather than the local engine's start rate.
        """

        async def start() -> None:
            labels = {LABEL: self.id, LABEL_ISSUE: "11"}
            for index in range(count):
                container = await self.engine.run_container(
                    f"hb-i11-modal-standin-{self.id}-warm{index}", image, KEEP_ALIVE, {}, labels, {"NetworkMode": "bridge"}
                )
                self.warm.setdefault(image, []).append(container)

        self.call(start(), timeout=60 + 10 * count)

    def terminate_from_outside(self, sandbox: Sandbox) -> None:
        """Kill a sandbox behind the client's back (as Modal's dashboard or a worker failure would)."""
        self.call(self.finish(sandbox, api_pb2.GenericResult(
            status=api_pb2.GenericResult.GENERIC_STATUS_TERMINATED, exception="terminated from outside (stand-in)"
        )))

    # --- used by the services ---------------------------------------------------------------------

    async def finish(self, sandbox: Sandbox, outcome: api_pb2.GenericResult) -> None:
        if sandbox.result is not None:
            return
        sandbox.result = outcome
        if sandbox.lifetime is not None and sandbox.lifetime is not asyncio.current_task():
            sandbox.lifetime.cancel()
        if sandbox.container_id:
            await self.engine.remove(sandbox.container_id)
        for process in sandbox.execs.values():
            for output in (process.stdout, process.stderr):
                await output.wake()
            if process.connection is not None:
                process.connection.close()
        sandbox.finished.set()

    def create_rate_ok(self, per_second: float) -> bool:
        now = time.monotonic()
        while self._create_times and self._create_times[0] < now - 1.0:
            self._create_times.popleft()
        if len(self._create_times) >= per_second:
            return False
        self._create_times.append(now)
        return True
