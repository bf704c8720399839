"""Containers started ahead of need (``-S pool=``): each still serves one prompt, then is removed.

Creating and starting a container costs the engine most of a prompt's work
(on 2 cores, 0.15 s of engine CPU and 0.5 to 10 s of waiting when many prompts
start at once).  A pool per image keeps that many containers created and
started before prompts ask, so a prompt's first command waits only for its
exec.  A pooled container is a new container from the image like any other:
it has run nothing but its idle first process, is handed to exactly one
prompt, and is removed when that prompt ends.  Each container taken is
replaced when its prompt ends (not when it is taken: 32 starts beside 32
prompts' first commands made those commands wait seconds), or at once while
prompts wait for one; so a pool of N costs N containers more than the run's
prompts (removed unused at the end) and N idle containers on the engine (their
memory is mostly the engine's shim process per container).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING, Callable, Optional

from hermes_batch import SandboxError

if TYPE_CHECKING:
    from .backend import DockerBackend

log = logging.getLogger("hermes_batch.docker")


class ContainerPool:
    """Started containers of one image and working folder, waiting to be handed to prompts."""

    def __init__(self, backend: "DockerBackend", image: str, workdir: str, size: int, create: Callable):
        self.backend = backend
        self.image = image
        self.workdir = workdir
        self.size = size
        self._create = create  # async () -> (container id, name)
        self._ready: collections.deque = collections.deque()
        self._waiters: collections.deque = collections.deque()  # futures of prompts waiting for a container
        self._creating: set[asyncio.Task] = set()
        self.broken: Optional[BaseException] = None  # a creation failed: prompts make their own containers
        self.closed = False

    def fill(self, most: Optional[int] = None) -> None:
        """Start making what is missing for the waiting prompts and, at most ``most`` of them, for ``size`` ready."""
        if self.closed or self.broken is not None:
            return
        missing = len(self._waiters) + self.size - len(self._ready) - len(self._creating)
        if most is not None:
            missing = min(missing, max(0, len(self._waiters) - len(self._creating)) + most)
        for _ in range(max(0, missing)):
            task = asyncio.get_running_loop().create_task(self._create_one())
            self._creating.add(task)
            task.add_done_callback(self._creating.discard)

    def release(self) -> None:
        """A prompt gave back (removed) what it took: start its replacement now that the prompt's work is done."""
        self.fill(most=1)

    @property
    def ready(self) -> int:
        return len(self._ready)

    async def take(self) -> Optional[tuple]:
        """(container id, name) of a started container, or None when the pool cannot make them (make one yourself)."""
        if self.broken is not None or self.closed:
            return None
        if self._ready:
            return self._ready.popleft()  # replaced when released: its start must not slow the commands
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self.fill(most=0)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                self._give(waiter.result())  # handed over as we were cancelled: the next prompt gets it
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    async def _create_one(self) -> None:
        try:
            made = await self._create()
        except asyncio.CancelledError:
            return
        except Exception as exc:  # SandboxError or an engine error: the prompts make their own and report it
            if self.broken is None:
                log.warning("Could not start a container ahead of need for the image %s (%s); each prompt "
                            "starts its own instead.", self.image, exc)
            self.broken = exc
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
            return
        self._give(made)

    def _give(self, made: tuple) -> None:
        if self.closed:
            self.backend.discard_container(made[0])
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(made)
                return
        self._ready.append(made)

    def close(self) -> None:
        """Stop making containers and remove the idle ones (``shutdown`` sweeps the rest by session)."""
        self.closed = True
        for task in list(self._creating):
            task.cancel()
        while self._ready:
            self.backend.discard_container(self._ready.popleft()[0])
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(SandboxError("The docker sandbox backend is shutting down."))
