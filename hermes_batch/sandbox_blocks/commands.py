"""Running one command of a sandbox: a timeout, bounded output, its process group killed.

:func:`run_command` is the whole of ``Sandbox.exec`` for a backend whose
commands are processes started on this machine (the local backend's process
mode; a bubblewrap, chroot or ``nsenter`` backend: only the argv differs).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from typing import Callable, Optional

from ..formats.records import ExecResult
from ..session.command_output import BoundedOutput
from .processes import ChildProcess

# Once a command ended, how long its output may still take to arrive: past this, what a background
# process of it still holds open is not waited for.
OUTPUT_DRAIN_S = 0.25
# After the kill at the timeout, only processes that left the process group can still hold the output open.
POST_KILL_DRAIN_S = 0.5


class OutputPipe(asyncio.Protocol):
    """Collects a command's output into a :class:`BoundedOutput`; ``closed`` is done once every writer closed it."""

    def __init__(self, limit: int, closed: asyncio.Future):
        self.buffer = BoundedOutput(limit)
        self.closed = closed

    def data_received(self, data: bytes) -> None:
        self.buffer.add(data)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def text(self) -> str:
        return self.buffer.text()


async def wait_for_command(ended: asyncio.Future, output_closed: asyncio.Future, timeout: float) -> bool:
    """Wait until the command ``ended``, then at most OUTPUT_DRAIN_S for its ``output_closed``; True at ``timeout``.

    A command's end, not its output's, is what ``exec`` waits for: ``server &``
    leaves a process holding the output open, and the command is still done.
    """
    done, _ = await asyncio.wait((ended,), timeout=max(timeout, 0.0))
    if not done:
        return True
    if not output_closed.done():
        await asyncio.wait((output_closed,), timeout=OUTPUT_DRAIN_S)
    return False


async def run_command(
    argv: list,
    timeout: float,
    *,
    cwd: Optional[str] = None,
    env: Optional[dict] = None,
    max_output_bytes: int = 1_000_000,
    nicer: int = 0,
    settle: Optional[Callable[[ChildProcess], None]] = None,
) -> ExecResult:
    """Run ``argv`` as the leader of a new session and process group; its stdout and stderr merged.

    Returns once the process ends (its output kept within ``max_output_bytes``,
    the first and last halves, see :class:`~hermes_batch.BoundedOutput`), even
    if a background process of it still holds the output open: that output is
    read for at most OUTPUT_DRAIN_S more, then the pipe is closed.  At
    ``timeout`` seconds, or when the caller is cancelled, the whole process
    group is killed (SIGKILL), and the result has ``timed_out=True`` and
    ``exit_code=None``.  A signal's end is reported as the shell does (128 + N).
    stdin is ``/dev/null``; ``nicer`` runs it that much nicer than this process.

    ``settle(child)`` is called with the :class:`ChildProcess` once the command
    is over; the default reaps it.  A backend that must later kill what the
    command left running in its session holds it unreaped instead (its session
    id stays its own until :meth:`ChildProcess.reap`), as the local backend does.
    Raises ``OSError`` (or ``subprocess.SubprocessError``) when the process
    cannot start.
    """
    loop = asyncio.get_running_loop()
    read_fd, write_fd = os.pipe()
    try:
        child = await ChildProcess.start(
            argv, stdin=subprocess.DEVNULL, stdout=write_fd, stderr=write_fd, cwd=cwd, env=env, nicer=nicer
        )
    except BaseException:  # also cancelled while it started (ChildProcess.start killed it)
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    pipe = os.fdopen(read_fd, "rb", buffering=0)
    closed = loop.create_future()
    transport = None
    timed_out = False
    output = OutputPipe(max_output_bytes, closed)
    try:
        transport, _ = await loop.connect_read_pipe(lambda: output, pipe)
        if await wait_for_command(child.exited, closed, timeout):
            timed_out = not child.exited.done()
            child.kill_group()
            await asyncio.wait((closed, child.exited), timeout=POST_KILL_DRAIN_S)
    finally:
        if not child.exited.done():
            child.kill_group()  # also reached when the caller cancels us
        if transport is not None:
            transport.close()
        else:
            pipe.close()
        code = child.exit_code()
        if not child.exited.done():  # killed, still ending
            child.reap_when_exited()
        elif settle is not None:
            settle(child)
        else:
            child.reap()
    if timed_out or code is None:
        return ExecResult(output.text(), None, timed_out)
    return ExecResult(output.text(), code if code >= 0 else 128 - code, False)
