"""Instances started ahead of need (``-S pool=``): each still serves one prompt, then is stopped.

Starting an instance costs a second or more of the runtime's work, and when many
prompts start at once the last waits several seconds.  A pool per image keeps
that many instances started (with the default working folder made) before
prompts ask.  A pooled instance is a new instance of the image like any other:
it has run nothing but the making of its working folder, is handed to exactly
one prompt, and is stopped when that prompt ends.  Each instance taken is
replaced when its prompt ends (not when it is taken, which would slow the
prompts' first commands), or at once while prompts wait for one; so a pool of N
costs N instances more than the run's prompts (stopped unused at the end) and N
idle instances.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Callable, Optional

from hermes_batch import SandboxError

log = logging.getLogger("hermes_batch.singularity")


class InstancePool:
    """Started instances of one image and working folder, waiting to be handed to prompts."""

    def __init__(self, image: str, workdir: str, size: int, create: Callable, discard: Callable):
        self._discard = discard  # (instance name) -> None: stop an instance no prompt got
        self.image = image
        self.workdir = workdir
        self.size = size
        self._create = create  # async () -> instance name
        self._ready: collections.deque = collections.deque()
        self._waiters: collections.deque = collections.deque()  # futures of prompts waiting for an instance
        self._creating: set[asyncio.Task] = set()
        self.broken: Optional[BaseException] = None  # a start failed: prompts start their own instances
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

    async def take(self) -> Optional[str]:
        """The name of a started instance, or None when the pool cannot start them (start one yourself)."""
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
        except Exception as exc:  # the prompts start their own and report why
            if self.broken is None:
                log.warning("Could not start an instance ahead of need for the image %s (%s); each prompt "
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
            self._discard(made)
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(made)
                return
        self._ready.append(made)

    def close(self) -> None:
        """Stop starting instances and stop the idle ones."""
        self.closed = True
        for task in list(self._creating):
            task.cancel()
        while self._ready:
            self._discard(self._ready.popleft())
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(SandboxError("The singularity sandbox backend is shutting down."))
