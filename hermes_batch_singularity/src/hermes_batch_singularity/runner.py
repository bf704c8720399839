"""An instance's command runner: one ``apptainer exec instance://NAME /bin/sh -c SCRIPT`` per prompt.

Every ``apptainer exec`` costs the runtime a process that joins the instance's
namespaces (about 0.1 s of CPU, and with the test rig a ``docker exec`` more), and a
prompt of a few commands spent more on them than on its commands.  The runner is
one such exec, started once per prompt, that runs the script of
:mod:`hermes_batch.sandbox_blocks.runner` (the Docker plugin's runner too): its
requests go to the exec's stdin, their output and status come back on its stdout,
so a command or a file through it costs the runtime nothing.  It runs in the
prompt's own instance, with ``--cleanenv``; the prompt's variables go with each
command (in its wrapper), as with an exec.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
from typing import Optional

from hermes_batch import command_runner

from . import runtime

log = logging.getLogger("hermes_batch.singularity")

NO_WORKDIR = 97  # the runner could not make the working folder
# $1 is the working folder: made first (so the prompt needs no exec for it), then the runner's loop.
START_SCRIPT = 'mkdir -p "$1" 2>/dev/null; [ -d "$1" ] || exit 97\n' + command_runner.AGENT_SCRIPT
_STDERR_LIMIT = 4096


class Runner:
    """The runner of one instance, over the pipes of its exec; one request at a time."""

    def __init__(self, proc: asyncio.subprocess.Process, keep):
        loop = asyncio.get_running_loop()
        self.proc = proc
        self.pid: Optional[int] = None  # the runner's pid in the instance
        self.started = loop.create_future()  # its pid once its first line came, None when it died first
        self.dead = False
        self.busy = False  # a request is out
        self.stderr = bytearray()
        self._request: Optional["command_runner.Request"] = None
        # ``keep`` starts them as the backend's background work, which its shutdown waits for
        self._reading = keep(self._read())
        self._errors = keep(self._read_errors())

    @classmethod
    async def start(cls, argv: list, env: dict, keep) -> "Runner":
        """Start ``argv`` (an exec of :data:`START_SCRIPT` with the working folder); OSError when it cannot run."""
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            start_new_session=True,  # a Ctrl-C at the terminal is hermes-batch's to handle
        )
        return cls(proc, keep)

    def usable(self) -> bool:
        return not self.dead and not self.busy and self.pid is not None

    async def until_started(self, timeout: float) -> bool:
        """Wait for its first line; False when it died first or did not answer in ``timeout`` (then it is closed)."""
        return await command_runner.until_started(self, timeout)

    def exit_reason(self) -> str:
        """Why it did not start, once it died."""
        code = self.proc.returncode
        if code == command_runner.NO_SETSID_OR_CAT:
            return "the image has no setsid or cat"
        if code == NO_WORKDIR:
            return "the working folder could not be made"
        return runtime.Completed(code, b"", bytes(self.stderr)).reason()

    def submit(self, nonce: str, stdout, stderr=None) -> "command_runner.Request":
        """A new request of ``nonce``; the runner is busy until its end."""
        request = command_runner.Request(asyncio.get_running_loop(), nonce, stdout, stderr)
        self.busy = True
        self._request = request
        if self.dead:
            self._request = None
            request.lost()
        request.done.add_done_callback(self._finished)
        return request

    def _finished(self, _future) -> None:
        self.busy = False

    async def send(self, data: bytes) -> None:
        """Write a request (and what follows it); OSError when the runner is gone."""
        if self.dead or self.proc.stdin is None:
            raise BrokenPipeError("the command runner is gone")
        self.proc.stdin.write(data)
        try:
            await self.proc.stdin.drain()
        except ConnectionResetError as exc:
            raise BrokenPipeError(str(exc)) from exc

    def close(self) -> None:
        """Close its stdin (it exits at its next read) and end the exec here; the instance's stop ends the rest."""
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        runtime.kill(self.proc)

    async def finish(self, timeout: float) -> bool:
        """Close its stdin only and wait up to ``timeout`` for its exec to end; True when it did (then it is closed)."""
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout)
        except asyncio.TimeoutError:
            pass
        ended = self.proc.returncode is not None
        self.close()
        return ended

    async def _read(self) -> None:
        first = bytearray()
        try:
            while chunk := await self.proc.stdout.read(65536):
                if self.pid is None:
                    started = command_runner.first_line(first, chunk)
                    if started is None:
                        continue
                    self.pid, chunk = started
                    _set(self.started, self.pid)
                self._feed(chunk)
        except (OSError, ValueError) as exc:
            log.debug("singularity command runner: %s", exc)
        finally:
            self.dead = True
            request, self._request = self._request, None
            if request is not None:
                request.lost()
            if self.pid is None:
                await self._reap()  # its status says why it did not start
            _set(self.started, self.pid)
            self.close()
            await self._reap()

    async def _reap(self) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self.proc.wait()), 5.0)
        except asyncio.TimeoutError:
            pass

    def _feed(self, data: bytes) -> None:
        while data:
            request = self._request
            if request is None:
                return  # nothing asked: written by a process of the prompt through the runner's stdout
            rest = request.feed(data)
            if rest is None:
                return
            if self._request is request:
                self._request = None
            data = rest

    async def _read_errors(self) -> None:
        try:
            while chunk := await self.proc.stderr.read(65536):
                if len(self.stderr) < _STDERR_LIMIT:
                    self.stderr += chunk[:_STDERR_LIMIT - len(self.stderr)]
        except OSError:
            pass


def _set(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
