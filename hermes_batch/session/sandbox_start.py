"""A prompt's sandbox opened beside its first model request, not before it.

Opening a container takes from a few hundred milliseconds to seconds when many
prompts start at once, and the first model request does not need it: the
model has yet to ask for a tool.  ``OpeningSandbox`` starts the backend's
``open`` as a task of its own and is the sandbox the prompt's tools see; a tool
call waits for the open only when it is made, and a prompt whose model calls
no tool never waits for it.  Closing never waits either: a sandbox still being
opened is closed by ``SandboxCloser`` as soon as it is open, and the run waits
for those closes before it shuts the backend down.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import attrs

from ..errors import SandboxError
from ..contract.interfaces import ExecResult, Sandbox, SandboxBackend
from ..formats.records import SandboxSpec

log = logging.getLogger("hermes_batch.prompt")


class SandboxCloser:
    """Closes the sandboxes prompts no longer wait for; ``drain`` waits for every one of them."""

    def __init__(self) -> None:
        self._pending: set[asyncio.Task] = set()

    def close_when_open(self, opening: asyncio.Task, label: str) -> None:
        task = asyncio.get_running_loop().create_task(self._close_when_open(opening, label))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    @staticmethod
    async def _close_when_open(opening: asyncio.Task, label: str) -> None:
        try:
            sandbox = await opening
        except Exception as exc:  # nobody needed it, so its failure fails nothing
            log.info("%s the sandbox no tool needed could not be opened: %s", label, exc)
            return
        await sandbox.close()

    async def drain(self) -> None:
        """Wait until every sandbox handed over is closed (also when cancelled: closing is not cut short)."""
        while self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)


class OpeningSandbox(Sandbox):
    """The sandbox of one prompt while, and after, the backend opens it."""

    def __init__(self, backend: SandboxBackend, spec: SandboxSpec, closer: SandboxCloser, *, label: str = ""):
        self._backend = backend
        self._spec = spec
        self._closer = closer
        self._label = label
        self._task: Optional[asyncio.Task] = None
        self._closed = False

    def start(self) -> None:
        """Start opening the sandbox, if that has not begun yet."""
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(
                self._backend.open(self._spec), name=f"open sandbox {self._spec.prompt_index}"
            )

    @property
    def started(self) -> bool:
        return self._task is not None

    @property
    def opened(self) -> Optional[Sandbox]:
        """The backend's sandbox once it is open, else None."""
        task = self._task
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return None
        return task.result()

    async def ready(self) -> Sandbox:
        """The open sandbox, opening it now if it was not started; raises SandboxError when it cannot be opened."""
        if self._closed:
            raise SandboxError("The sandbox of this prompt is already closed.")
        self.start()
        # shielded: a deadline that cancels the waiting tool call leaves the open to finish, and close() ends it
        return await asyncio.shield(self._task)

    async def exec(self, command: str, timeout: float) -> ExecResult:
        return await (await self.ready()).exec(command, timeout)

    async def read_file(self, path: str, *args, **kwargs) -> bytes:
        return await (await self.ready()).read_file(path, *args, **kwargs)

    async def write_file(self, path: str, data: bytes, *args, **kwargs) -> None:
        return await (await self.ready()).write_file(path, data, *args, **kwargs)

    async def run_tests(self, command: str, files: tuple, timeout: float):
        return await (await self.ready()).run_tests(command, files, timeout)

    async def copy_workdir_to(self, other: Sandbox) -> None:
        other = await other.ready()
        return await (await self.ready()).copy_workdir_to(other)

    async def snapshot(self):
        if self._task is None:
            return None  # never opened: nothing was written
        return await (await self.ready()).snapshot()

    def open_from(self, image: str) -> None:
        """Open the sandbox from ``image`` (a branch's, a snapshot of its prefix) instead of its spec's own image;
        only before it was started."""
        if self._task is not None:
            raise RuntimeError("a sandbox already being opened cannot change its image")
        self._spec = attrs.evolve(self._spec, image=image)

    async def stop_processes(self) -> bool:
        if self._task is None:
            return True  # never opened: no command ran
        return await (await self.ready()).stop_processes()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        task = self._task
        if task is None:
            return
        if not task.done():
            self._closer.close_when_open(task, self._label)
            return
        if task.cancelled() or task.exception() is not None:
            return  # nothing was opened; a tool that needed it has reported the failure
        await task.result().close()

    @property
    def workdir(self) -> str:
        opened = self.opened
        return opened.workdir if opened is not None else super().workdir

    @property
    def image(self) -> str:
        opened = self.opened
        return opened.image if opened is not None else ""
