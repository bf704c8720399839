"""One prompt's Modal Sandbox: commands through ``Sandbox.exec``, files through small POSIX shell programs."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import posixpath
import re
from typing import TYPE_CHECKING, Optional

import attrs

from hermes_batch import BoundedOutput, ExecResult, Sandbox, SandboxError, TestsRun, grading

from . import leftovers
from ._sdk import modal
from .connection import explain, transient

if TYPE_CHECKING:
    from .backend import ModalBackend

log = logging.getLogger("hermes_batch.modal")

SHELL = "/bin/sh"
# PID 1 of every sandbox: a shell that idles and, as PID 1, reaps the orphans of commands (`wait` takes any child),
# and never starts a program once the session may have run (hermes_batch.grading.IDLE_FIRST_PROCESS).
KEEP_ALIVE = (SHELL, "-c", grading.IDLE_FIRST_PROCESS)
# Every command prints its process id as the first line of stdout, then runs as the leader of a process
# group of its own (setsid when the exec is not one already), with stderr merged into stdout and stdin
# closed; so one output stream per command, not two.
_GROUP = (
    'hb_pg=; read -r _ _ _ _ hb_pg _ < /proc/$$/stat 2>/dev/null; '
    'if [ "$hb_pg" != "$$" ] && command -v setsid >/dev/null 2>&1; then exec setsid /bin/sh -c "$1"; fi; '
    'exec /bin/sh -c "$1"'
)
RUN_WRAPPER = 'echo "$$"; exec 2>&1 </dev/null; ' + _GROUP
# Stop the tree under a process (children first seen, then theirs), then kill it and its process group.
KILL_TREE = (
    'hb_stop() { kill -STOP "$1" 2>/dev/null; for c in $(cat /proc/"$1"/task/*/children 2>/dev/null); '
    'do hb_stop "$c"; done; echo "$1"; }; '
    'pids=$(hb_stop "$1"); kill -9 -"$1" 2>/dev/null; kill -9 $pids 2>/dev/null; exit 0'
)
# Exit statuses of the file programs: 2 missing, 21 a folder, 22 not a regular file, 20 a parent is not a folder.
READ_FILE = (
    'echo "$$"; f=$1; '
    'if [ -d "$f" ]; then exit 21; fi; if [ ! -e "$f" ]; then exit 2; fi; if [ ! -f "$f" ]; then exit 22; fi; '
    'if [ -n "$2" ]; then exec head -c "$2" "$f"; fi; exec cat "$f"'
)
WRITE_FILE = (
    'echo "$$"; f=$1; d=$(dirname "$f"); '
    'if [ -e "$d" ] && [ ! -d "$d" ]; then exit 20; fi; mkdir -p "$d" || exit 20; '
    'if [ -d "$f" ]; then exit 21; fi; if [ -e "$f" ] && [ ! -f "$f" ]; then exit 22; fi; '
    'if [ -L "$f" ] && [ ! -e "$f" ]; then exit 22; fi; exec cat > "$f"'
)
MAKE_WORKDIR = 'echo "$$"; exec 2>&1; mkdir -p "$1" && cd "$1"'

READ_TIMEOUT_S = 120.0
WRITE_TIMEOUT_S = 120.0
MAX_READ_BYTES = 256 * 1024 * 1024
STDIN_CHUNK = 1024 * 1024
DRAIN_AFTER_EXIT_S = 1.0  # output still in flight when a command exits; background children may hold it open longer
DRAIN_AFTER_KILL_S = 0.5
PID_WAIT_S = 5.0
REPORT_BYTES = 64 * 1024  # of a verifier's tests' standard error, where the supervisor's report line is the last
NOT_REGULAR = "not a regular file (a FIFO, socket or device); only regular files can be read or written"


_SURROGATE = re.compile("[\ud800-\udfff]")


def absolute(path: str) -> str:
    return "/" + posixpath.normpath(posixpath.join("/", path)).lstrip("/")


def utf8(text: str) -> str:
    """``text`` as valid UTF-8 text: a lone surrogate (from a model's JSON) cannot go on the wire, U+FFFD can."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)


@attrs.define
class _Outcome:
    exit_code: Optional[int]
    timed_out: bool


class _Capped:
    """Keeps the first ``limit`` bytes and counts the rest."""

    def __init__(self, limit: int):
        self.limit = limit
        self.data = bytearray()
        self.overflow = 0

    def add(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        self.data += chunk[:room]
        self.overflow += max(0, len(chunk) - room)


class ModalSandbox(Sandbox):
    """A Modal Sandbox of its own; each command is a ``/bin/sh -c`` exec with the sandbox's environment only."""

    own_pid_namespace = True  # its Modal Sandbox: stop_processes is a command's kill -9 -1

    def __init__(self, backend: "ModalBackend", sandbox: modal.Sandbox, workdir: str, prompt_index: int, image: str = ""):
        self.modal_sandbox = sandbox
        self._image = image
        self.id = sandbox.object_id
        self.prompt_index = prompt_index
        self._workdir = workdir
        self._backend = backend
        self._max_output = backend.config.max_output_bytes
        self._closed = False
        self._closing: Optional[asyncio.Future] = None

    @property
    def workdir(self) -> str:
        return self._workdir

    @property
    def image(self) -> str:
        return self._image

    async def make_ready(self) -> None:
        """The first command: creates the working directory, and proves the sandbox runs commands."""
        output = _Capped(4096)
        outcome = await self._run([SHELL, "-c", MAKE_WORKDIR, "sh", self._workdir], None, output, workdir="/")
        if outcome.exit_code != 0:
            raise SandboxError(
                f"The working directory {self._workdir} cannot be made in the Modal sandbox {self.id} of prompt "
                f"{self.prompt_index} ({output.data.decode(errors='replace').strip() or outcome.exit_code}); "
                "fix the row's cwd or -S workdir=..."
            )

    # --- commands ------------------------------------------------------------------------

    async def exec(self, command: str, timeout: float) -> ExecResult:
        """Run ``command`` with ``/bin/sh -c``; at ``timeout`` kill its whole process tree."""
        output = BoundedOutput(self._max_output)
        outcome = await self._run([SHELL, "-c", RUN_WRAPPER, "sh", command], timeout, output)
        return ExecResult(output.text(), outcome.exit_code, outcome.timed_out)

    async def run_tests(self, command: str, files: tuple, timeout: float) -> TestsRun:
        """A verifier's tests apart from the agent: one exec of the static helper's supervisor, sent with the tests'
        script on its standard input (``hermes_batch.grading.launcher``), as the sandbox's root (the agent's user:
        Modal runs every command as the image's); the report is read from the exec's standard error only."""
        helper = await self._backend.grading_helper()
        argv, stdin = grading.launcher(helper, command, files, self._workdir)
        output, errors = BoundedOutput(self._max_output), BoundedOutput(REPORT_BYTES)
        outcome = await self._run(argv, timeout, output, errors, stdin=stdin, workdir="/")
        return grading.tests_run(ExecResult(output.text(), outcome.exit_code, outcome.timed_out), errors.text())

    async def _run(self, argv: list, timeout: Optional[float], stdout, stderr=None, *, stdin: Optional[bytes] = None,
                   workdir: Optional[str] = None) -> _Outcome:
        """Run one exec: stdout's first line is the process id, the rest goes to ``stdout``; stderr to ``stderr`` if given."""
        self._check_open()
        try:
            process = await self.modal_sandbox.exec.aio(
                *map(utf8, argv), workdir=workdir or self._workdir, text=False,
                stderr=modal.stream_type.StreamType.PIPE if stderr is not None else modal.stream_type.StreamType.DEVNULL,
            )
        except (modal.exception.Error, *transient()) as exc:
            raise await self._error(exc, "when a command was started") from None
        loop = asyncio.get_running_loop()
        pid: asyncio.Future = loop.create_future()
        reading = [asyncio.ensure_future(self._read_output(process.stdout, pid, stdout))]
        if stderr is not None:
            reading.append(asyncio.ensure_future(self._read(process.stderr, stderr.add)))
        waiting = asyncio.ensure_future(process.wait.aio())
        settled = False
        try:
            if stdin is not None:
                await self._feed(process, stdin)
            done, _ = await asyncio.wait({waiting}, timeout=timeout)
            settled = True
            if not done:
                await self._kill(pid)
                await asyncio.wait({reading[0]}, timeout=DRAIN_AFTER_KILL_S)
                return _Outcome(None, True)
            exit_code = waiting.result()
            await asyncio.wait(set(reading), timeout=DRAIN_AFTER_EXIT_S)
            if reading[0].done() and reading[0].exception() is not None and exit_code == 0:
                raise reading[0].exception()
        except (modal.exception.Error, *transient()) as exc:
            settled = True
            raise await self._error(exc, "while a command ran") from None
        finally:
            if not settled and pid.done() and pid.result() is not None:
                # Cancelled (Ctrl-C, the prompt's deadline): stop the command, but do not wait for it.
                self._backend.in_background(self._kill_quietly(pid.result()))
            for task in (*reading, waiting):
                task.cancel()
        if exit_code >= 128 or exit_code < 0:
            await self._raise_if_dead("while a command ran")
        return _Outcome(exit_code, False)

    async def _read(self, stream, add) -> None:
        async for chunk in stream:
            add(chunk)

    async def _read_output(self, stream, pid: asyncio.Future, sink) -> None:
        line = bytearray()
        try:
            async for chunk in stream:
                if pid.done():
                    sink.add(chunk)
                    continue
                newline = chunk.find(b"\n")
                if newline < 0:
                    line += chunk
                    if len(line) > 32:  # not the wrapper's pid line (the exec failed to start it): output
                        pid.set_result(None)
                        sink.add(bytes(line))
                    continue
                line += chunk[:newline]
                if line.isdigit():
                    pid.set_result(int(line))
                else:
                    pid.set_result(None)
                    sink.add(bytes(line) + b"\n")
                if chunk[newline + 1:]:
                    sink.add(chunk[newline + 1:])
        finally:
            if not pid.done():
                pid.set_result(None)
                if line:
                    sink.add(bytes(line))

    async def _feed(self, process, data: bytes) -> None:
        for start in range(0, len(data), STDIN_CHUNK):
            process.stdin.write(data[start:start + STDIN_CHUNK])
            await process.stdin.drain.aio()
        process.stdin.write_eof()
        await process.stdin.drain.aio()

    async def _kill(self, pid: asyncio.Future) -> None:
        try:
            target = await asyncio.wait_for(asyncio.shield(pid), PID_WAIT_S)
        except asyncio.TimeoutError:
            target = None
        if target is not None:
            await self._kill_quietly(target)

    async def _kill_quietly(self, target: int) -> None:
        try:
            process = await self.modal_sandbox.exec.aio(SHELL, "-c", KILL_TREE, "sh", str(target), text=False)
            await process.wait.aio()
        except (modal.exception.Error, *transient()):
            pass  # the sandbox is gone or going: its processes with it

    # --- files -----------------------------------------------------------------------------

    def _path(self, path: str) -> str:
        self._check_open()
        return absolute(posixpath.join(self._workdir, path))

    async def read_file(self, path: str, max_bytes: Optional[int] = None) -> bytes:
        """At most ``max_bytes`` from the start of ``path`` (all of it when None); never blocks on a FIFO."""
        full = self._path(path)
        limit = MAX_READ_BYTES if max_bytes is None else max(0, int(max_bytes))
        stdout, stderr = _Capped(limit), _Capped(64 * 1024)
        argv = [SHELL, "-c", READ_FILE, "sh", full, "" if max_bytes is None else str(limit)]
        outcome = await self._run(argv, READ_TIMEOUT_S, stdout, stderr)
        if outcome.timed_out:
            raise OSError(errno.ETIMEDOUT, f"reading took longer than {READ_TIMEOUT_S:g} s", path)
        if outcome.exit_code == 0:
            if stdout.overflow:
                raise OSError(errno.EFBIG, f"larger than {MAX_READ_BYTES} bytes, too large to read whole", path)
            return bytes(stdout.data)
        raise self._file_error(outcome.exit_code, stderr, path)

    async def write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path``, creating parent folders; a folder or a FIFO in the way is an error."""
        full = self._path(path)
        if full == "/":
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        stderr = _Capped(64 * 1024)
        outcome = await self._run([SHELL, "-c", WRITE_FILE, "sh", full], WRITE_TIMEOUT_S, _Capped(64 * 1024), stderr,
                                  stdin=bytes(data), workdir="/")
        if outcome.timed_out:
            raise OSError(errno.ETIMEDOUT, f"writing took longer than {WRITE_TIMEOUT_S:g} s", path)
        if outcome.exit_code != 0:
            raise self._file_error(outcome.exit_code, stderr, path)

    def _file_error(self, exit_code: int, stderr: _Capped, path: str) -> OSError:
        if exit_code == 2:
            return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if exit_code == 21:
            return IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if exit_code == 22:
            return OSError(errno.EINVAL, NOT_REGULAR, path)
        if exit_code == 20:
            return NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        message = stderr.data.decode(errors="replace").strip()
        lowered = message.lower()
        if "permission denied" in lowered or "read-only" in lowered:
            return PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        if "not a directory" in lowered:
            return NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        return OSError(errno.EIO, message or f"exit status {exit_code}", path)

    # --- life and death ------------------------------------------------------------------------

    async def close(self) -> None:
        """Terminate the sandbox (every process in it ends); safe to call more than once."""
        await asyncio.shield(self.close_soon())

    def close_soon(self) -> asyncio.Future:
        """Start terminating the sandbox; the backend's shutdown waits for it."""
        if self._closing is None:
            self._closed = True
            self._backend.forget(self)
            self._closing = self._backend.in_background(self._terminate())
        return self._closing

    async def _terminate(self) -> None:
        try:
            await leftovers.terminate(self.modal_sandbox)
        except (modal.exception.Error, *transient()) as exc:  # the shutdown sweep, or -S timeout, ends it
            log.warning("Could not terminate the Modal sandbox %s of prompt %d: %s", self.id, self.prompt_index, explain(exc))

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"The Modal sandbox of prompt {self.prompt_index} was already closed.")

    async def _dead_reason(self) -> Optional[str]:
        """Why the sandbox no longer runs, or None while it runs."""
        try:
            code = await self.modal_sandbox.poll.aio()
        except modal.exception.NotFoundError:
            return "no longer exists"
        except (modal.exception.Error, *transient()):
            return None
        if code is None:
            return None
        if code == 124:
            return f"reached its lifetime (-S timeout={self._backend.config.timeout})"
        if code == 137:
            return "was terminated from outside"
        return f"stopped (exit status {code})"

    async def _raise_if_dead(self, when: str) -> None:
        reason = await self._dead_reason()
        if reason is not None:
            raise self._failure(reason, when)

    async def _error(self, exc: BaseException, when: str) -> SandboxError:
        if self._closed:
            return SandboxError(f"The Modal sandbox of prompt {self.prompt_index} was closed {when}.")
        reason = await self._dead_reason()
        if reason is not None:
            return self._failure(reason, when)
        return SandboxError(
            f"Modal failed {when} in the sandbox {self.id} of prompt {self.prompt_index} ({explain(exc)}); "
            "run again with --resume to retry the prompt."
        )

    def _failure(self, reason: str, when: str) -> SandboxError:
        return SandboxError(
            f"The Modal sandbox {self.id} of prompt {self.prompt_index} {reason} {when}; "
            "run again with --resume to retry the prompt."
        )
