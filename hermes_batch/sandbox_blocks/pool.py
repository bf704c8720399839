"""Sandboxes started ahead of need, each still for one prompt: the warm pool container backends share.

Starting a container or an instance is most of a container backend's work per
prompt, and when many prompts start at once the last waits seconds.  A pool per
image keeps ``size`` of them started before prompts ask, so a prompt's first
command waits only for its exec.  A pooled sandbox is new from the image like any
other: it has run nothing but its idle first process, is handed to exactly one
prompt and removed when that prompt ends, so a pool of N costs N sandboxes more
than the run's prompts (discarded unused at the end) and N idle ones meanwhile.
The Docker and Singularity backends use it for ``-S pool=``; Docker's ``-S reuse=namespace``
gives each container back (``give_back``) when its prompt ends, for the next prompt.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Callable, Optional

from ..errors import SandboxError

log = logging.getLogger("hermes_batch.sandbox")


class WarmPool:
    """Started sandboxes (containers, instances) of one image and working folder, waiting to be handed to prompts.

    ``create`` is an async function making one (it returns what ``take`` hands out); ``discard(made)`` removes
    one no prompt got.  ``what`` names them in messages ("container"), ``backend`` the backend shutting down.
    Each is handed to exactly one prompt; the backend calls ``release`` when that prompt's sandbox is closed,
    so its replacement is made then and does not compete with the first commands of the prompts that took one.
    When the first creation fails the pool is ``broken`` and ``take`` returns None: each prompt makes its own
    (with ``give_up=False``, never); a later failure costs only the prompt waiting for it that (``take`` returns
    None once).
    """

    def __init__(self, image: str, workdir: str, size: int, create: Callable, discard: Callable, *,
                 what: str = "sandbox", backend: str = "sandbox", give_up: bool = True,
                 wanted: Optional[Callable[[], int]] = None):
        self._discard = discard  # (what create made) -> None: remove one no prompt got
        # () -> prompts of the image still to come (ImageDemand.left): no more than that are kept ready
        self._wanted = wanted
        self.what, self.backend = what, backend
        self.image = image
        self.workdir = workdir
        self.size = size
        self._create = create  # async () -> what take hands out
        self._ready: collections.deque = collections.deque()
        self._waiters: collections.deque = collections.deque()  # futures of prompts waiting for one
        self._creating: set[asyncio.Task] = set()
        self._returning = 0  # given back soon (expect_back): prompts wait for them rather than make more
        self.broken: Optional[BaseException] = None  # the first creation failed: prompts make their own
        # False: never ``broken``, every failed creation costs one prompt a start of its own (for a pool whose
        # failures a loaded machine can cause, and whose prompts would each pay for a new one otherwise)
        self._give_up = give_up
        self._worked = False  # a creation succeeded: later failures do not give the pool up
        self.closed = False

    def fill(self, most: Optional[int] = None) -> None:
        """Start making what is missing for the waiting prompts and, at most ``most`` of them, for ``size`` ready."""
        if self.closed or self.broken is not None:
            return
        coming = len(self._creating) + self._returning
        missing = len(self._waiters) + self.target - len(self._ready) - coming
        if most is not None:
            missing = min(missing, max(0, len(self._waiters) - coming) + most)
        for _ in range(max(0, missing)):
            task = asyncio.get_running_loop().create_task(self._create_one())
            self._creating.add(task)
            task.add_done_callback(self._creating.discard)

    def release(self) -> None:
        """A prompt gave back (removed) what it took: start its replacement now that the prompt's work is done."""
        self.fill(most=1)

    def expect_back(self) -> None:
        """What a prompt took will be given back (``give_back``) or given up (``not_back``) soon: until then the
        prompts that ask wait for it instead of making one more (a container costs far more than its next view)."""
        self._returning += 1

    def not_back(self) -> None:
        """What ``expect_back`` announced was discarded instead: its replacement is made now."""
        self._returning = max(0, self._returning - 1)
        self.release()

    def give_back(self, made) -> None:
        """What a prompt took, ready to serve the next prompt (for backends that reuse one, such as Docker's
        ``-S reuse=namespace``, which make each prompt's view in it afresh); discarded once the pool is closed."""
        self._returning = max(0, self._returning - 1)
        self._give(made)

    @property
    def ready(self) -> int:
        return len(self._ready)

    @property
    def target(self) -> int:
        """How many to keep ready besides those the waiting prompts get: ``size``, or fewer when the prompts
        still to come of the image (``wanted``) are fewer."""
        if self._wanted is None:
            return self.size
        return max(0, min(self.size, self._wanted()))

    @property
    def idle(self) -> bool:
        """Nothing ready, being made or waited for: the pool holds nothing and can be dropped."""
        return not (self._ready or self._creating or self._waiters or self._returning)

    def trim(self) -> None:
        """Stop what is being made and discard what is ready beyond ``target`` and the waiting prompts (fewer
        prompts of the image are to come): creations first (one waiting for its start costs nothing yet)."""
        excess = len(self._ready) + len(self._creating) - len(self._waiters) - self.target
        for task in list(self._creating):
            if excess <= 0:
                break
            task.cancel()  # a container it was making is removed when made (the backend's orphan handling)
            self._creating.discard(task)
            excess -= 1
        while excess > 0 and self._ready:
            self._discard(self._ready.pop())
            excess -= 1

    async def take(self, taking: Optional[Callable[[], None]] = None):
        """What ``create`` made, started, or None when the pool cannot make them (make one yourself).

        ``taking()`` is called as soon as the prompt has one or waits for one (``ImageDemand.opened``), so that
        the pool, trimmed to the prompts still to come, counts this one among neither."""
        if self.broken is not None or self.closed:
            if taking is not None:
                taking()
            return None
        if self._ready:
            made = self._ready.popleft()  # replaced when released: its start must not slow the commands
            if taking is not None:
                taking()
            return made
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        if taking is not None:
            taking()
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
            try:
                made = await self._create()
            finally:
                # No longer coming: a prompt that asks once this one is handed out (before this task's end, when
                # its done callback would take it out) must get another made rather than wait for this one.
                self._creating.discard(asyncio.current_task())
        except asyncio.CancelledError:
            return
        except Exception as exc:  # the prompts start their own and report why
            if self._worked or not self._give_up:
                # One start gone wrong (cut short on a loaded machine, say), not a pool that cannot work: one
                # prompt waiting makes its own, and the pool goes on.
                log.info("Could not start a %s ahead of need for the image %s (%s); a prompt starts its own.",
                         self.what, self.image, exc)
                self._give(None)
                return
            if self.broken is None:
                log.warning("Could not start a %s ahead of need for the image %s (%s); each prompt "
                            "starts its own instead.", self.what, self.image, exc)
            self.broken = exc
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
            return
        self._worked = True
        self._give(made)

    def _give(self, made) -> None:
        """Hand ``made`` to the first prompt waiting, else keep it ready; None (a failed start) is only for a prompt
        waiting, which then makes its own."""
        if self.closed and made is not None:
            self._discard(made)
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(made)
                return
        if made is not None and self._wanted is not None and len(self._ready) >= self.target:
            self._discard(made)  # the prompts it was made for started or ended meanwhile
            return
        if made is not None:
            self._ready.append(made)

    def close(self) -> None:
        """Stop making them and discard the idle ones (the backend sweeps the taken ones with its sandboxes)."""
        self.closed = True
        for task in list(self._creating):
            task.cancel()
        while self._ready:
            self._discard(self._ready.popleft())
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(SandboxError(f"The {self.backend} sandbox backend is shutting down."))
