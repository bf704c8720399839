"""The stand-in's control plane: the ``modal.client.ModalClient`` RPCs the hermes-batch backend's SDK calls make."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import time
from typing import TYPE_CHECKING

from grpclib import GRPCError, Status
from hermes_batch_modal.sandbox import KEEP_ALIVE as BACKENDS_FIRST_PROCESS
from modal._image import LATEST_IMAGE_BUILDER_VERSION
from modal_proto import api_grpc, api_pb2

from .engine import LABEL, LABEL_ISSUE, EngineError
from .state import Sandbox, new_id

if TYPE_CHECKING:
    from . import ModalStandIn

# What a sandbox created without a command runs, and what the warm containers run: the backend's first process, so
# that its sandboxes can take them.
KEEP_ALIVE = list(BACKENDS_FIRST_PROCESS)
LIST_PAGE = 10  # small pages, so the SDK's paging is exercised
_FROM = re.compile(r"^\s*FROM\s+(\S+)", re.IGNORECASE)


def unimplemented(cls, base):
    """Fill every RPC the stand-in does not implement with one that says so (and is recorded)."""
    for name in base.__abstractmethods__:
        if name in cls.__dict__:
            continue

        def make(rpc):
            async def handler(self, stream):
                self.standin.unimplemented.append(rpc)
                raise GRPCError(Status.UNIMPLEMENTED, f"the Modal stand-in does not implement {rpc}")

            return handler

        setattr(cls, name, make(name))
    cls.__abstractmethods__ = frozenset()
    return cls


def make_jwt(claims: dict) -> str:
    def part(value: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}.stand-in"


def result(status: int, exception: str = "") -> api_pb2.GenericResult:
    return api_pb2.GenericResult(status=status, exception=exception)


class ControlPlane(api_grpc.ModalClientBase):
    def __init__(self, standin: "ModalStandIn"):
        self.standin = standin

    # --- session ----------------------------------------------------------------------------

    async def ClientHello(self, stream):
        await stream.recv_message()
        await stream.send_message(api_pb2.ClientHelloResponse())

    async def AuthTokenGet(self, stream):
        await stream.recv_message()
        token = make_jwt({"exp": int(time.time()) + 3600, "sub": "stand-in"})
        self.standin.auth_tokens.add(token)
        await stream.send_message(api_pb2.AuthTokenGetResponse(token=token))

    async def EnvironmentGetOrCreate(self, stream):
        await stream.recv_message()
        settings = api_pb2.EnvironmentSettings(image_builder_version=LATEST_IMAGE_BUILDER_VERSION)
        metadata = api_pb2.EnvironmentMetadata(name="main", settings=settings)
        await stream.send_message(api_pb2.EnvironmentGetOrCreateResponse(environment_id="en-standin", metadata=metadata))

    async def AppGetOrCreate(self, stream):
        request = await stream.recv_message()
        apps = self.standin.apps
        if request.app_name not in apps:
            if request.object_creation_type != api_pb2.OBJECT_CREATION_TYPE_CREATE_IF_MISSING:
                raise GRPCError(Status.NOT_FOUND, f"App '{request.app_name}' not found")
            apps[request.app_name] = new_id("ap")
        app_id = apps[request.app_name]
        metadata = api_pb2.AppHandleMetadata(app_id=app_id, environment_name="main")
        await stream.send_message(api_pb2.AppGetOrCreateResponse(app_id=app_id, handle_metadata=metadata))

    # --- images ------------------------------------------------------------------------------

    async def ImageGetOrCreate(self, stream):
        request = await stream.recv_message()
        self._check_app(request.app_id)
        commands = list(request.image.dockerfile_commands)
        refs = [m.group(1) for m in map(_FROM.match, commands) if m]
        if len(refs) != 1:
            raise GRPCError(Status.INVALID_ARGUMENT, f"the stand-in builds only single FROM images, got {commands!r}")
        image_id = "im-" + hashlib.sha256("\n".join(commands).encode()).hexdigest()[:20]
        images = self.standin.images
        if image_id not in images:
            images[image_id] = {"ref": refs[0], "result": None}
        built = images[image_id]["result"]
        response = api_pb2.ImageGetOrCreateResponse(image_id=image_id)
        if built is not None and built.status == api_pb2.GenericResult.GENERIC_STATUS_SUCCESS:
            response.result.CopyFrom(built)
        await stream.send_message(response)

    async def ImageJoinStreaming(self, stream):
        request = await stream.recv_message()
        image = self.standin.images.get(request.image_id)
        if image is None:
            raise GRPCError(Status.NOT_FOUND, f"no image {request.image_id}")
        ref = image["ref"]
        broken = self.standin.faults.broken_images.get(ref)
        if broken is not None:
            outcome = result(api_pb2.GenericResult.GENERIC_STATUS_FAILURE, broken)
        elif await self.standin.engine.image_exists(ref):
            outcome = result(api_pb2.GenericResult.GENERIC_STATUS_SUCCESS)
        else:
            outcome = result(
                api_pb2.GenericResult.GENERIC_STATUS_FAILURE,
                f"Failed to pull {ref}: manifest unknown (the stand-in takes images from the local Docker engine only)",
            )
        image["result"] = outcome
        log = api_pb2.TaskLogs(data=f"stand-in: FROM {ref}\n", file_descriptor=api_pb2.FILE_DESCRIPTOR_INFO)
        await stream.send_message(api_pb2.ImageJoinStreamingResponse(task_logs=[log], entry_id="1"))
        await stream.send_message(api_pb2.ImageJoinStreamingResponse(result=outcome, entry_id="2", eof=True))

    # --- sandboxes ---------------------------------------------------------------------------

    async def SandboxCreateV2(self, stream):
        request = await stream.recv_message()
        self._check_auth_token(stream)
        standin = self.standin
        self._check_app(request.app_id)
        standin.create_attempts += 1
        faults = standin.faults
        if faults.throttle_creates > 0:
            faults.throttle_creates -= 1
            standin.throttled += 1
            raise GRPCError(Status.RESOURCE_EXHAUSTED, "Too many sandbox creations; slow down (stand-in throttle)")
        if faults.max_creates_per_second is not None and not standin.create_rate_ok(faults.max_creates_per_second):
            standin.throttled += 1
            raise GRPCError(Status.RESOURCE_EXHAUSTED, "Sandbox creation rate limit exceeded (stand-in throttle)")
        definition = request.definition
        image = standin.images.get(definition.image_id)
        if image is None or image["result"] is None or image["result"].status != api_pb2.GenericResult.GENERIC_STATUS_SUCCESS:
            raise GRPCError(Status.FAILED_PRECONDITION, f"image {definition.image_id} is not built")
        if definition.network_access.network_access_type == api_pb2.NetworkAccess.ALLOWLIST:
            raise GRPCError(Status.INVALID_ARGUMENT, "the stand-in does not implement network allowlists")
        env = {}
        for source in request.secret_sources:
            if source.secret_id:
                raise GRPCError(Status.INVALID_ARGUMENT, "the stand-in has no stored secrets")
            env.update(source.env.contents)
        tags = {t.tag_name: t.tag_value for t in request.tags}
        sandbox = Sandbox(
            id=new_id("sb"),
            app_id=request.app_id,
            image_ref=image["ref"],
            tags=tags,
            timeout_secs=definition.timeout_secs or 300,
            workdir=definition.workdir,
            env=env,
            block_network=(
                definition.block_network
                or definition.network_access.network_access_type == api_pb2.NetworkAccess.BLOCKED
            ),
            milli_cpu=definition.resources.milli_cpu,
            memory_mb=definition.resources.memory_mb,
        )
        standin.sandboxes[sandbox.id] = sandbox
        standin.starting += 1
        standin.peak_starting = max(standin.peak_starting, standin.starting)
        try:
            if faults.create_delay:
                await asyncio.sleep(faults.create_delay)
            if faults.never_ready is not None and faults.never_ready(tags):
                standin.never_ready_ids.add(sandbox.id)
            else:
                await self._start(sandbox, list(definition.entrypoint_args) or KEEP_ALIVE)
        finally:
            standin.starting -= 1
        response = api_pb2.SandboxCreateV2Response(sandbox_id=sandbox.id, task_id=sandbox.task_id)
        if sandbox.task_id:
            response.command_router_access.CopyFrom(
                api_pb2.CommandRouterAccess(url=standin.url, jwt=sandbox.jwt)
            )
        await stream.send_message(response)

    async def _start(self, sandbox: Sandbox, command: list) -> None:
        standin = self.standin
        host_config = {"NetworkMode": "none" if sandbox.block_network else "bridge", "Init": False}
        if sandbox.memory_mb:
            host_config["Memory"] = sandbox.memory_mb * 1024 * 1024
        if sandbox.milli_cpu:
            host_config["NanoCpus"] = sandbox.milli_cpu * 1_000_000
        labels = {LABEL: standin.id, LABEL_ISSUE: "11", "org.hermes-batch.modal-standin.sandbox": sandbox.id}
        warm = standin.warm.get(sandbox.image_ref)
        plain = not (sandbox.env or sandbox.block_network or sandbox.memory_mb or sandbox.milli_cpu or sandbox.workdir)
        if warm and plain and command == KEEP_ALIVE:
            sandbox.container_id = warm.pop()  # already started, like capacity Modal keeps warm
        else:
            sandbox.container_id = None
        try:
            if sandbox.container_id is None:
                sandbox.container_id = await standin.engine.run_container(
                    f"hb-i11-modal-standin-{sandbox.id}", sandbox.image_ref, command, sandbox.env, labels, host_config,
                    workdir=sandbox.workdir,
                )
        except EngineError as exc:
            sandbox.result = result(api_pb2.GenericResult.GENERIC_STATUS_INIT_FAILURE, exc.message)
            sandbox.finished.set()
            return
        sandbox.task_id = new_id("ta")
        sandbox.jwt = make_jwt({"exp": int(time.time()) + 3600, "task": sandbox.task_id})
        standin.tasks[sandbox.task_id] = sandbox
        standin.peak_running = max(standin.peak_running, standin.running_count())
        sandbox.lifetime = asyncio.ensure_future(self._expire(sandbox))

    async def _expire(self, sandbox: Sandbox) -> None:
        await asyncio.sleep(sandbox.timeout_secs)
        await self.standin.finish(sandbox, result(api_pb2.GenericResult.GENERIC_STATUS_TIMEOUT))

    async def SandboxGetTaskIdV2(self, stream):
        request = await stream.recv_message()
        sandbox = self._sandbox(request.sandbox_id)
        response = api_pb2.SandboxGetTaskIdResponse(task_id=sandbox.task_id)
        if not sandbox.task_id and sandbox.result is not None:
            response.task_result.CopyFrom(sandbox.result)
        await stream.send_message(response)

    async def SandboxGetCommandRouterAccess(self, stream):
        request = await stream.recv_message()
        sandbox = self.standin.tasks.get(request.task_id) if request.task_id else self._sandbox(request.sandbox_id)
        if sandbox is None or not sandbox.task_id:
            raise GRPCError(Status.NOT_FOUND, "the sandbox has no task")
        if not sandbox.running:
            raise GRPCError(Status.FAILED_PRECONDITION, "Sandbox has already finished")
        await stream.send_message(api_pb2.SandboxGetCommandRouterAccessResponse(url=self.standin.url, jwt=sandbox.jwt))

    async def SandboxWaitV2(self, stream):
        request = await stream.recv_message()
        sandbox = self._sandbox(request.sandbox_id)
        if sandbox.running and request.timeout > 0:
            try:
                await asyncio.wait_for(sandbox.finished.wait(), request.timeout)
            except asyncio.TimeoutError:
                pass
        response = api_pb2.SandboxWaitResponse()
        if sandbox.result is not None:
            response.result.CopyFrom(sandbox.result)
        await stream.send_message(response)

    async def SandboxTerminateV2(self, stream):
        request = await stream.recv_message()
        sandbox = self._sandbox(request.sandbox_id)
        existing = sandbox.result
        self.standin.terminate_calls += 1
        await self.standin.finish(sandbox, result(api_pb2.GenericResult.GENERIC_STATUS_TERMINATED))
        response = api_pb2.SandboxTerminateResponse()
        if existing is not None:
            response.existing_result.CopyFrom(existing)
        await stream.send_message(response)

    async def SandboxListV2(self, stream):
        request = await stream.recv_message()
        wanted = {t.tag_name: t.tag_value for t in request.tags}
        found = [
            s for s in self.standin.sandboxes.values()
            if (not request.app_id or s.app_id == request.app_id)
            and (request.include_finished or s.running)
            and all(s.tags.get(k) == v for k, v in wanted.items())
            and (not request.before_timestamp or s.created_at < request.before_timestamp)
        ]
        found.sort(key=lambda s: s.created_at, reverse=True)
        infos = []
        for sandbox in found[:LIST_PAGE]:
            info = api_pb2.SandboxInfo(
                id=sandbox.id,
                created_at=sandbox.created_at,
                app_id=sandbox.app_id,
                tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sandbox.tags.items()],
            )
            info.task_info.id = sandbox.task_id
            if sandbox.result is not None:
                info.task_info.result.CopyFrom(sandbox.result)
            info.metadata.app_id = sandbox.app_id
            infos.append(info)
        await stream.send_message(api_pb2.SandboxListResponse(sandboxes=infos))

    async def SandboxTagsGetV2(self, stream):
        request = await stream.recv_message()
        sandbox = self._sandbox(request.sandbox_id)
        tags = [api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sandbox.tags.items()]
        await stream.send_message(api_pb2.SandboxTagsGetResponse(tags=tags))

    # --- helpers -----------------------------------------------------------------------------

    def _sandbox(self, sandbox_id: str) -> Sandbox:
        sandbox = self.standin.sandboxes.get(sandbox_id)
        if sandbox is None:
            raise GRPCError(Status.NOT_FOUND, f"Sandbox {sandbox_id} not found")
        return sandbox

    def _check_app(self, app_id: str) -> None:
        if app_id not in self.standin.apps.values():
            raise GRPCError(Status.NOT_FOUND, f"App {app_id} not found")

    def _check_auth_token(self, stream) -> None:
        token = dict(stream.metadata or {}).get("x-modal-auth-token")
        if token not in self.standin.auth_tokens:
            raise GRPCError(Status.UNAUTHENTICATED, "missing or unknown auth token")


unimplemented(ControlPlane, api_grpc.ModalClientBase)
