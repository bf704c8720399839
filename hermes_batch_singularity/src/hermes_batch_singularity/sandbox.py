"""One prompt's instance: commands and files through its command runner or ``exec`` on the instance, with time limits."""

from __future__ import annotations

import asyncio
import errno
import os
import posixpath
import shlex
import subprocess
from typing import TYPE_CHECKING, Optional

import attrs

from hermes_batch import BoundedOutput, ExecResult, FirstBytes, Sandbox, SandboxError, TestsRun, command_runner, grading

from . import grading as tests_apart, runtime, views
from .runner import Runner

if TYPE_CHECKING:
    from .backend import SingularityBackend

SHELL = "/bin/sh"
# The wrapper prints its pid, exports the sandbox's variables (given as arguments, so any value
# survives), merges stderr into stdout (their order kept) and becomes the command's non-login shell,
# made the leader of a new session when the image has setsid, so the session names every process
# the command starts.  The instance has its own pid namespace, so the pid is the instance's.
RUN_WRAPPER = (
    'echo "$$"; n=$1; shift; '
    'while [ "$n" -gt 0 ]; do export "$1"; shift; n=$((n - 1)); done; '
    "exec 2>&1; "
    'if command -v setsid >/dev/null 2>&1; then exec setsid /bin/sh -c "$1"; fi; '
    'exec /bin/sh -c "$1"'
)
# The same through the command runner, which already made it a session leader: $1 exports the variables.
RUNNER_RUN_WRAPPER = 'echo "$$"; eval "$1"; exec 2>&1; exec /bin/sh -c "$2"'
# Kills a command's processes: its session (setsid made the command its leader), and every
# descendant (for images without setsid), stopped first so none forks away between scan and kill.
KILL_TREE = r"""
t=$1
case "$t" in ''|*[!0-9]*|0|1) exit 0;; esac
kill -9 -"$t" 2>/dev/null
round=0
while [ "$round" -lt 3 ]; do
    pids=" $t "
    changed=1
    while [ "$changed" = 1 ]; do
        changed=0
        for d in /proc/[0-9]*; do
            p=${d#/proc/}
            case "$pids" in *" $p "*) continue;; esac
            [ "$p" = 1 ] || [ "$p" = "$$" ] && continue
            read -r s < "$d/stat" 2>/dev/null || continue
            set -- ${s##*) }
            case "$pids" in *" $2 "*) pids="$pids$p "; changed=1; continue;; esac
            [ "$4" = "$t" ] && { pids="$pids$p "; changed=1; }
        done
    done
    kill -STOP $pids 2>/dev/null
    kill -9 $pids 2>/dev/null
    round=$((round + 1))
done
exit 0
"""
# Exit statuses of the file wrappers, chosen clear of what cat, head and mkdir return.
_MISSING, _FOLDER, _NOT_REGULAR, _NO_FOLDER, _DENIED = 90, 91, 92, 93, 94
READ_WRAPPER = (
    'if [ -d "$1" ]; then exit 91; fi; '
    'if [ ! -e "$1" ]; then exit 90; fi; '
    'if [ ! -f "$1" ]; then exit 92; fi; '
    'if [ ! -r "$1" ]; then exit 94; fi; '
    'exec head -c "$2" "$1"'
)
WRITE_WRAPPER = (
    'if [ -d "$1" ]; then exit 91; fi; '
    'if [ -e "$1" ] && [ ! -f "$1" ]; then exit 92; fi; '
    'd=${1%/*}; [ -n "$d" ] || d=/; '
    'mkdir -p "$d" 2>/dev/null; [ -d "$d" ] || exit 93; '
    'cat > "$1" || exit 94'
)
# The file wrappers through the runner print their pid first, as every command of it does.  A write reads
# exactly $2 bytes from stdin whatever happens, so that no byte of the content is taken for a request.
RUNNER_READ_WRAPPER = 'echo "$$"; ' + READ_WRAPPER
RUNNER_WRITE_WRAPPER = (
    'echo "$$"; head -c "$2" | { e=0; if [ -d "$1" ]; then e=91; elif [ -e "$1" ] && [ ! -f "$1" ]; then e=92; '
    'else d=${1%/*}; [ -n "$d" ] || d=/; mkdir -p "$d" 2>/dev/null; [ -d "$d" ] || e=93; '
    'if [ "$e" = 0 ]; then cat > "$1" || e=94; fi; fi; [ "$e" = 0 ] || cat > /dev/null; exit "$e"; }'
)
MAX_RUNNER_WRITE = 64 * 1024 * 1024  # larger files are written by an exec of their own
RUNNER_STARTS = 4  # command runners a sandbox starts at most (one with its instance, again when one died)
RUNNER_DIED_NOTICE = (
    "[The sandbox's command runner was killed while this command ran (by a kill of every process?): the "
    "command's output from about then on and its exit status are lost; status 137 stands for it.]\n"
)
# After the kill, only processes that escaped the kill can still hold the output open.
POST_KILL_DRAIN_S = 0.5
KILL_TIMEOUT_S = 30.0
FILE_TIMEOUT_S = 120.0
MAX_READ_BYTES = 256 * 1024 * 1024
_STDERR_LIMIT = 64 * 1024
_MAX_PID_LINE = 32


class _Reader:
    """Collects an exec's stdout: its first line is the wrapper's pid, the rest is output."""

    def __init__(self, stream: asyncio.StreamReader, output: BoundedOutput):
        self.stream = stream
        self.output = output
        self.pid: Optional[int] = None
        self.pid_known = asyncio.get_running_loop().create_future()
        self._first = bytearray()
        self._seen_first = False

    async def run(self) -> None:
        try:
            while chunk := await self.stream.read(65536):
                self._add(chunk)
        finally:
            self._flush()

    def _add(self, data: bytes) -> None:
        if not self._seen_first:
            newline = data.find(b"\n")
            if newline < 0 and len(self._first) + len(data) <= _MAX_PID_LINE:
                self._first += data
                return
            if newline >= 0:
                self._first += data[:newline]
                data = data[newline + 1:]
            self._seen_first = True
            line = bytes(self._first)
            if line.isdigit():
                self.pid = int(line)
            elif newline >= 0:
                self.output.add(line + b"\n")
            else:
                self.output.add(line)
            if not self.pid_known.done():
                self.pid_known.set_result(self.pid)
        if data:
            self.output.add(data)

    def _flush(self) -> None:
        if not self._seen_first:
            self._seen_first = True
            if self._first:
                self.output.add(bytes(self._first))
        if not self.pid_known.done():
            self.pid_known.set_result(self.pid)


async def _drain(stream: asyncio.StreamReader, output: BoundedOutput) -> None:
    while chunk := await stream.read(65536):
        output.add(chunk)


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    """``data`` to a command's standard input, then its end; a command that stopped reading early is no error."""
    try:
        stream.write(data)
        await stream.drain()
        stream.close()
    except (BrokenPipeError, ConnectionResetError):
        pass


class SingularitySandbox(Sandbox):
    """An instance of its own; each command a ``/bin/sh -c`` with the sandbox's variables only.

    Commands and files go through the instance's command runner (one exec for the prompt, see runner.py)
    while it is free, else (busy, dead, or after ``stop_processes``) each through an ``exec`` of its own.
    """

    own_pid_namespace = True  # its instance (--containall: --pid): stop_processes is a command's kill -9 -1

    def __init__(self, backend: "SingularityBackend", name: str, workdir: str, prompt_index: int, env: dict,
                 image: str = "", runner: Optional[Runner] = None, view: Optional[views.View] = None):
        self.name = name
        self._image = image
        self.prompt_index = prompt_index
        self._workdir = workdir
        self._backend = backend
        self._env = [f"{k}={v}" for k, v in env.items() if command_runner.ENV_NAME.match(str(k))]
        self._exports = "export " + " ".join(shlex.quote(pair) for pair in self._env) if self._env else ":"
        self._max_output = backend.config.max_output_bytes
        self._closed = False
        self._runner = runner
        self._runner_starts = 1 if runner is not None else 0
        self._runner_starting = False
        self._use_runner = backend.config.runner == "agent"
        # -S reuse=namespace: the prompt's view of a reused instance, whose first process the runner's exec made;
        # that exec (the view's holder) is kept after stop_processes, which ends only the view's other processes.
        self._view = view
        self._holder: Optional[Runner] = None

    @property
    def workdir(self) -> str:
        return self._workdir

    @property
    def image(self) -> str:
        return self._image

    def _argv(self, *command: str, pwd: Optional[str] = None) -> list:
        if self._view is not None:  # the prompt's view, joined by a fresh exec
            return [*self._backend.exec_prefix("/"), f"instance://{self.name}", *self._view.join_argv(list(command), pwd)]
        return [*self._backend.exec_prefix(pwd or self._workdir), f"instance://{self.name}", *command]

    # --- commands ------------------------------------------------------------------------

    async def exec(self, command: str, timeout: float) -> ExecResult:
        """Run ``command`` with ``/bin/sh -c``; at ``timeout`` SIGKILL every process it started."""
        self._check_open()
        nonce = command_runner.new_nonce()
        line = command_runner.request_line(nonce, "X", [SHELL, "-c", RUNNER_RUN_WRAPPER, "sh", self._exports, command])
        runner = await self._free_runner() if line is not None else None
        if runner is not None:
            result = await self._exec_through(runner, nonce, line, timeout)
            if result is not None:
                return result
        return await self._exec_alone(command, timeout)

    async def _exec_alone(self, command: str, timeout: float) -> ExecResult:
        """``exec`` as an ``apptainer exec`` of its own."""
        argv = self._argv(SHELL, "-c", RUN_WRAPPER, "sh", str(len(self._env)), *self._env, command)
        result, _ = await self._run_alone(argv, timeout)
        return result

    async def _run_alone(self, argv: list, timeout: float, stdin: Optional[bytes] = None) -> tuple:
        """``(ExecResult, its standard error)`` of one ``apptainer exec`` whose output starts with its wrapper's pid,
        ``stdin`` (if given) on its standard input; at ``timeout`` every process the wrapper started is killed.
        With ``stdin``, the standard error is read to its end (the tests' report is there)."""
        output, diagnostics = BoundedOutput(self._max_output), BoundedOutput(_STDERR_LIMIT)
        proc = await self._spawn(argv, stdin is not None)
        reader = _Reader(proc.stdout, output)
        reading = asyncio.ensure_future(reader.run())
        errors = asyncio.ensure_future(_drain(proc.stderr, diagnostics))
        exited = asyncio.ensure_future(proc.wait())
        feeding = asyncio.ensure_future(_feed(proc.stdin, stdin)) if stdin is not None else None
        timed_out = settled = exited_in_time = False
        try:
            _, pending = await asyncio.wait({reading, exited}, timeout=max(timeout, 0.0))
            settled = True
            if pending:
                timed_out = True
                exited_in_time = exited.done()  # only its output was still held open
                await self._kill(reader)
                await asyncio.wait({reading, exited}, timeout=POST_KILL_DRAIN_S)
            if stdin is not None:
                await asyncio.wait({errors}, timeout=POST_KILL_DRAIN_S)  # its last words, after its output closed
        finally:
            if not settled:  # cancelled: stop the command, but do not wait for it
                self._backend.in_background(self._kill(reader))
            runtime.kill(proc)
            for task in (reading, errors, exited, feeding):
                if task is not None and not task.done():
                    task.cancel()
        code = proc.returncode if exited.done() and not exited.cancelled() else None
        if timed_out:
            return ExecResult(output.text(), code if exited_in_time else None, True), diagnostics.text()
        if reader.pid is None:  # the runtime never started the wrapper
            raise await self._failure(diagnostics, "while a command was started")
        if code is not None and code >= 128 and not await self._answers():
            raise await self._failure(diagnostics, "while a command ran")
        return ExecResult(output.text(), code, False), diagnostics.text()

    async def _exec_through(self, runner: Runner, nonce: str, line: bytes, timeout: float) -> Optional[ExecResult]:
        """``exec`` through the runner; None when the command never started there (run it as an exec)."""
        output = BoundedOutput(self._max_output)
        request = runner.submit(nonce, output)
        try:
            await runner.send(line)
        except OSError:
            runner.close()  # gone before it took the whole line: the command did not run
            return None
        settled = False
        try:
            done, _ = await asyncio.wait({request.done}, timeout=max(timeout, 0.0))
            settled = True
            if not done:
                await self._kill(request)
                await asyncio.wait({request.done}, timeout=POST_KILL_DRAIN_S)
                return ExecResult(output.text(), None, True)
        finally:
            if not settled:  # cancelled: stop the command, but do not wait for it
                self._backend.in_background(self._kill(request))
        status = request.done.result()
        if status is None and self._view is not None:
            raise self._view_ended("while a command ran")
        if status is None:
            # The runner died after it took the request: whether the command ran is not known, so it is not
            # run again.  The instance may have died with it.
            if not await self._answers():
                raise await self._failure(_bounded(bytes(runner.stderr)), "while a command ran")
            output.add(RUNNER_DIED_NOTICE.encode())
            return ExecResult(output.text(), 137, False)
        if request.pid is None and status == command_runner.NO_STATUS:
            return None  # the runner could not start it (no fork): an exec says why
        return ExecResult(output.text(), status, False)

    async def _free_runner(self) -> Optional[Runner]:
        """The command runner if it is free (started first if there is none or it died), else None."""
        runner = self._runner
        if runner is not None and runner.pid is None and not runner.dead:
            await runner.until_started(self._backend.config.start_timeout)
            if self._runner is not runner:
                return await self._free_runner()
        if runner is not None and runner.usable():
            return runner
        if self._view is not None:
            return None  # the view's runner is not started again: the view ends with it
        if not self._use_runner or self._runner_starting or (runner is not None and not runner.dead):
            return None
        if self._runner_starts >= RUNNER_STARTS or self._closed:
            return None
        self._runner_starting = True
        self._runner_starts += 1
        try:
            runner = await self._backend.start_runner(self.name, self._workdir)
        except SandboxError:
            return None
        finally:
            self._runner_starting = False
        if runner is None:
            return None
        if self._closed or not self._use_runner:
            runner.close()
            return None
        self._runner = runner
        return runner if runner.usable() else None

    def attach_runner(self, runner: Optional[Runner]) -> None:
        """Give the sandbox the runner started with its instance (None: none runs there)."""
        if runner is not None:
            self._runner = runner
            self._runner_starts += 1

    def drop_runner(self) -> None:
        """Run every later command and file as an exec of its own."""
        self._use_runner = False
        if self._view is not None:
            self._holder = self._holder or self._runner  # its input open, or the view would end
            self._runner = None
        if self._runner is not None:
            self._runner.close()
            self._runner = None

    async def stop_processes(self) -> bool:
        """Kill every process but the instance's first with an exec, the runner too; later commands are execs.

        What runs after this (a verifier's checks) must not go through a process the session's commands could
        reach: they ran beside the runner, as its user, and could write to its output.
        """
        self._check_open()
        self.drop_runner()
        if self._view is not None:
            argv = [*self._backend.exec_prefix("/"), f"instance://{self.name}", *self._view.stop_argv()]
            done = await runtime.run(argv, env=self._backend.env, timeout=KILL_TIMEOUT_S)
            if done.returncode != 0 and views.VIEW_ENDED in done.stderr.decode("utf-8", "replace"):
                raise await self._failure(_bounded(done.stderr), "while its processes were stopped")
            return done.returncode == 0
        return await super().stop_processes()

    async def run_tests(self, command: str, files: tuple, timeout: float) -> TestsRun:
        """A verifier's tests apart from the agent: the static helper's supervisor, sent with the tests' script on
        the standard input of one exec (``hermes_batch.grading.launcher``), as grading.py says; the report is read
        from the exec's standard error only."""
        self._check_open()
        helper = await self._backend.grading_helper()
        self.drop_runner()  # stop_processes did; the tests' output must be a stream no process of the prompt holds
        env = dict(pair.split("=", 1) for pair in self._env)
        argv, stdin = grading.launcher(helper, command, files, self._workdir, env)
        if self._view is not None:  # joined lowered as the view's commands are, but keeping what the tests need
            view = attrs.evolve(self._view, mask=tests_apart.TESTS_MASK)
            argv = [*self._backend.exec_prefix("/"), f"instance://{self.name}", *view.join_argv(argv, "/")]
        else:
            argv = [*self._backend.tests_prefix(), f"instance://{self.name}", *argv]
        result, errors = await self._run_alone(argv, timeout, stdin)
        return grading.tests_run(result, errors)

    async def _spawn(self, argv: list, stdin: bool = False):
        try:
            return await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._backend.env,
                start_new_session=True,  # a Ctrl-C at the terminal is hermes-batch's to handle
            )
        except OSError as exc:
            raise SandboxError(f"Could not run {argv[0]} for the instance {self.name}: {exc}") from exc

    async def _kill(self, reader) -> None:
        """Kill the command whose wrapper's pid ``reader`` (an exec's _Reader, a runner's Request) got."""
        try:
            pid = await asyncio.wait_for(asyncio.shield(reader.pid_known), 2.0)
        except asyncio.TimeoutError:
            pid = None
        if pid is None:
            return
        await runtime.run(
            self._argv(SHELL, "-c", KILL_TREE, "sh", str(pid), pwd="/"), env=self._backend.env, timeout=KILL_TIMEOUT_S
        )

    async def _answers(self) -> bool:
        done = await runtime.run(self._argv("/bin/true", pwd="/"), env=self._backend.env, timeout=KILL_TIMEOUT_S)
        return done.returncode == 0

    def _view_ended(self, when: str) -> SandboxError:
        return SandboxError(
            f"The view of prompt {self.prompt_index} in the instance {self.name} ended {when} (a command killed its "
            "command runner, which ends the view); run again with --resume to retry the prompt."
        )

    async def _failure(self, diagnostics: BoundedOutput, when: str) -> SandboxError:
        reason = runtime.Completed(1, b"", diagnostics.value()).reason()
        if self._view is not None and views.VIEW_ENDED in reason:
            return self._view_ended(when)
        if "no instance found" in reason.lower() or not await self._backend.instance_exists(self.name):
            return SandboxError(
                f"The instance {self.name} of prompt {self.prompt_index} was stopped from outside {when}; "
                "run again with --resume to retry the prompt."
            )
        return SandboxError(
            f"The runtime failed {when} in the instance {self.name} of prompt {self.prompt_index} ({reason}); "
            "run again with --resume to retry the prompt."
        )

    # --- files -----------------------------------------------------------------------------

    def _path(self, path: str) -> str:
        self._check_open()
        return "/" + posixpath.normpath(posixpath.join(self._workdir, path)).lstrip("/")

    async def read_file(self, path: str, max_bytes: Optional[int] = None) -> bytes:
        """At most ``max_bytes`` bytes from the start of ``path`` (None: all of it), as the instance sees it."""
        full = self._path(path)
        limit = MAX_READ_BYTES + 1 if max_bytes is None else max(0, int(max_bytes))
        done = await self._file_command(READ_WRAPPER, full, str(limit))
        if done.returncode == 0:
            if max_bytes is None and len(done.stdout) > MAX_READ_BYTES:
                raise OSError(errno.EFBIG, f"larger than {MAX_READ_BYTES} bytes, too large to read whole", path)
            return done.stdout
        self._raise_file_error(done, path, "read")

    async def write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path``, creating parent folders; refuses folders, pipes and devices."""
        full = self._path(path)
        if full == "/":
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        done = await self._file_command(WRITE_WRAPPER, full, input=bytes(data))
        if done.returncode != 0:
            self._raise_file_error(done, path, "written")

    async def _file_command(self, wrapper: str, *args: str, input: Optional[bytes] = None) -> runtime.Completed:
        """A file wrapper with ``args`` (and ``input``): through the runner when it can, else as an exec."""
        done = await self._file_through_runner(wrapper, args, input)
        if done is not None:
            return done
        done = await runtime.run(
            self._argv(SHELL, "-c", wrapper, "sh", *args, pwd="/"), env=self._backend.env, timeout=FILE_TIMEOUT_S, input=input
        )
        if done.timed_out:
            raise OSError(errno.ETIMEDOUT, f"the file took longer than {FILE_TIMEOUT_S:g} s to reach", args[0])
        if done.returncode == 255 and "FATAL" in done.stderr.decode("utf-8", "replace"):
            raise await self._failure(_bounded(done.stderr), "while a file was used")
        return done

    async def _file_through_runner(self, wrapper: str, args: tuple, input: Optional[bytes]) -> Optional[runtime.Completed]:
        """The file wrapper through the runner, its output and status as an exec's; None when it cannot go there."""
        nonce = command_runner.new_nonce()
        if input is None:
            line = command_runner.request_line(nonce, "X", [SHELL, "-c", RUNNER_READ_WRAPPER, "sh", *args])
            output = FirstBytes(int(args[1]))
        elif len(input) <= MAX_RUNNER_WRITE:
            line = command_runner.request_line(nonce, "I", [SHELL, "-c", RUNNER_WRITE_WRAPPER, "sh", args[0], str(len(input))])
            output = BoundedOutput(_STDERR_LIMIT)
        else:
            return None
        runner = await self._free_runner() if line is not None else None
        if runner is None:
            return None
        request = runner.submit(nonce, output)
        settled = False
        try:
            try:
                await runner.send(line + (input or b""))
            except OSError:
                runner.close()
            done, _ = await asyncio.wait({request.done}, timeout=FILE_TIMEOUT_S)
            settled = True
        finally:
            if not settled or not request.done.done():
                # Part of the content may still be unread: the runner must never take it for requests.
                self.drop_runner()
                self._backend.in_background(self._kill(request))
        if not done:
            raise OSError(errno.ETIMEDOUT, f"the file took longer than {FILE_TIMEOUT_S:g} s to reach", args[0])
        status = request.done.result()
        if request.pid is None:
            return None  # the runner died or could not start the wrapper: an exec does it (or says why)
        if status is None:
            raise OSError(errno.EIO, "the sandbox's command runner was killed while the file was used", args[0])
        data = output.value()
        return runtime.Completed(status, data if status == 0 else b"", b"" if status == 0 else data)

    @staticmethod
    def _raise_file_error(done: runtime.Completed, path: str, verb: str):
        code = done.returncode
        if code == _MISSING:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if code == _FOLDER:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if code == _NOT_REGULAR:
            raise OSError(errno.EINVAL, f"not a regular file (a pipe, socket or device), so it is not {verb}", path)
        if code == _NO_FOLDER:
            raise NotADirectoryError(errno.ENOTDIR, "a parent folder cannot be made (a file is in the way)", path)
        message = done.stderr.decode("utf-8", "replace").strip()
        if code == _DENIED or "permission denied" in message.lower() or "read-only" in message.lower():
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        raise OSError(errno.EIO, message or f"exit status {code}", path)

    # --- life and death ------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop the instance, and with it every process of the prompt; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        runner, self._runner = self._runner, None
        if self._view is not None:
            holder, self._holder = self._holder or runner, None
            # Its input closed, the view's first process ends, and the kernel ends every process of the view.
            await self._backend.release(self, holder)
            return
        try:
            await self._backend.stop(self)
        finally:
            if runner is not None:
                runner.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"The singularity sandbox of prompt {self.prompt_index} was already closed.")


def _bounded(data: bytes) -> BoundedOutput:
    output = BoundedOutput(_STDERR_LIMIT)
    output.add(data)
    return output
