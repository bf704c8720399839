"""What the Modal stand-in holds: apps, images, sandboxes and their execs, and the faults a test asks for."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Callable, Optional

import attrs
from modal_proto import api_pb2

from .engine import ExecConnection

_ids = itertools.count(1)

# How much output of one exec the stand-in holds before it stops reading from the engine (as a full pipe would).
OUTPUT_WINDOW = 4 * 1024 * 1024


def new_id(prefix: str) -> str:
    return f"{prefix}-standin{next(_ids):06d}"


@attrs.define
class Faults:
    """Faults the stand-in injects; tests set them through :class:`~standin.ModalStandIn`."""

    #: The next N sandbox creations are refused with RESOURCE_EXHAUSTED (Modal's throttling).
    throttle_creates: int = 0
    #: More creations per second than this are refused with RESOURCE_EXHAUSTED (None: no limit).
    max_creates_per_second: Optional[float] = None
    #: Sandboxes whose tags this returns True for are accepted but never get a task (never become ready).
    never_ready: Optional[Callable[[dict], bool]] = None
    #: Image references whose build fails, with the failure text.
    broken_images: dict = attrs.field(factory=dict)
    #: Seconds each sandbox creation takes beyond the container's own start.
    create_delay: float = 0.0


@attrs.define(eq=False)
class Output:
    """One output stream of an exec, readable from any offset still held."""

    data: bytearray = attrs.field(factory=bytearray)
    base: int = 0  # offset of data[0]
    eof: bool = False
    changed: asyncio.Condition = attrs.field(factory=asyncio.Condition)
    read_offset: int = 0  # how far a reader has been sent

    @property
    def end(self) -> int:
        return self.base + len(self.data)

    async def add(self, chunk: bytes, closing: Callable[[], bool]) -> None:
        async with self.changed:
            # Back-pressure: a reader that falls behind makes the command block on its writes.
            await self.changed.wait_for(lambda: self.end - self.read_offset < OUTPUT_WINDOW or closing())
            self.data += chunk
            self.changed.notify_all()

    async def close(self) -> None:
        async with self.changed:
            self.eof = True
            self.changed.notify_all()

    async def wake(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def forget_before(self, offset: int) -> None:
        # Keep a margin behind the reader, for a retried read that starts a little earlier.
        keep_from = offset - 1024 * 1024
        if keep_from > self.base:
            del self.data[: keep_from - self.base]
            self.base = keep_from


@attrs.define(eq=False)
class Exec:
    id: str
    sandbox: "Sandbox"
    engine_exec_id: str
    connection: Optional[ExecConnection] = None
    stdout: Output = attrs.field(factory=Output)
    stderr: Output = attrs.field(factory=Output)
    exit_code: Optional[int] = None
    exited: asyncio.Event = attrs.field(factory=asyncio.Event)
    stdin_written: int = 0
    stdin_closed: bool = False
    tasks: list = attrs.field(factory=list)


@attrs.define(eq=False)
class Sandbox:
    id: str
    app_id: str
    image_ref: str
    tags: dict
    timeout_secs: int
    workdir: str
    env: dict
    block_network: bool
    milli_cpu: int
    memory_mb: int
    created_at: float = attrs.field(factory=time.time)
    task_id: str = ""
    jwt: str = ""
    container_id: Optional[str] = None
    result: Optional[api_pb2.GenericResult] = None
    finished: asyncio.Event = attrs.field(factory=asyncio.Event)
    execs: dict = attrs.field(factory=dict)
    lifetime: Optional[asyncio.Task] = None

    @property
    def running(self) -> bool:
        return self.result is None
