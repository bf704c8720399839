"""One prompt's container: commands through the Docker exec API, files through exec and archives."""

from __future__ import annotations

import asyncio
import errno
import io
import logging
import os
import posixpath
import socket as socket_module
import tarfile
import time
from typing import TYPE_CHECKING, Optional

import attrs

from hermes_batch import BoundedOutput, ExecResult, FirstBytes, Sandbox, SandboxError, TestsRun, grading

from . import agent as agents
from . import grading as tests
from .engine import docker, engine_errors, requests_exceptions
from .streams import ExecStream, close_quietly, read_frames
from .views import VIEW_ENDED, VIEW_READY_S

if TYPE_CHECKING:
    from .backend import DockerBackend
    from .views import View

log = logging.getLogger("hermes_batch.docker")
IDENTITY_ATTEMPTS = 3  # a lost output of the identity exec is asked again (see _agent_identity)

SHELL = "/bin/sh"
# Every exec is the leader of a new session and process group (runc calls setsid), so the wrapper's
# pid names the group to kill.  It prints that pid, merges stderr into stdout (their order kept),
# then becomes the command's own non-login shell.
RUN_WRAPPER = 'echo "$$"; exec 2>&1; exec /bin/sh -c "$1"'
# Files: a folder exits 21, a missing path 2, anything but a regular file (links followed) 22, so that
# a FIFO or a device is never opened; then at most $2 bytes are read ("" for all of it).
_FILE_CHECK = (
    'if [ -d "$1" ]; then exit 21; fi; if [ ! -e "$1" ]; then exit 2; fi; if [ ! -f "$1" ]; then exit 22; fi; '
)
READ_WRAPPER = 'echo "$$"; ' + _FILE_CHECK + 'if [ -n "$2" ]; then exec head -c "$2" -- "$1"; fi; exec cat -- "$1"'
# Before a write: parent folders are made by the container's user (so with -S user= they are that user's),
# and what the user may not write is refused with 13, since the archive API writes as root.
WRITE_CHECK = (
    'echo "$$"; if [ -d "$1" ]; then exit 21; fi; if [ -e "$1" ] && [ ! -f "$1" ]; then exit 22; fi; '
    'd=$(dirname -- "$1"); mkdir -p -- "$d" || exit 1; '
    'if [ -e "$1" ]; then [ -w "$1" ] || exit 13; else [ -w "$d" ] || exit 13; fi; exit 0'
)
# A write through the command runner: exactly $2 bytes come on stdin and are all read whatever happens
# (so that the runner's next request line is not in them), after the checks of WRITE_CHECK, as the
# container's user; a new file gets 0666 less the umask, an existing one keeps its mode and owner.
WRITE_WRAPPER = (
    'echo "$$"; head -c "$2" | { e=0; if [ -d "$1" ]; then e=21; elif [ -e "$1" ] && [ ! -f "$1" ]; then e=22; '
    'else d=$(dirname -- "$1"); mkdir -p -- "$d" || e=1; if [ "$e" = 0 ]; then '
    'if [ -e "$1" ]; then [ -w "$1" ] || e=13; else [ -w "$d" ] || e=13; fi; fi; fi; '
    'if [ "$e" = 0 ]; then cat > "$1" || e=1; fi; [ "$e" = 0 ] || cat > /dev/null; exit "$e"; }'
)
MAX_RUNNER_WRITE = 64 * 1024 * 1024  # larger files go through the engine's archive API
KILL_GROUP = 'kill -9 -"$1" 2>/dev/null || kill -9 "$1" 2>/dev/null; exit 0'
# After the kill, only processes that left the group can still hold the output open.
POST_KILL_DRAIN_S = 0.5
PID_WAIT_S = 2.0
READ_TIMEOUT_S = 120.0
DEATH_NOTICE_POLLS = 60  # times 50 ms
MAX_READ_BYTES = 256 * 1024 * 1024
READ_ATTEMPTS = 3  # reads change nothing, so one whose output the engine lost is made again
AGENT_STARTS = 4  # command runners a sandbox starts at most (one with its container, again when one died)
AGENT_READY_S = 10.0
STOP_PROCESSES_TIMEOUT_S = 30.0  # as Sandbox.stop_processes gives its kill command
PIDS_HEADROOM = 16  # processes a view at its pids limit is allowed for a moment, so that the helper can stop it
AGENT_DIED_NOTICE = (
    "[The sandbox's command runner was killed while this command ran (by a kill of every process?): the "
    "command's output from about then on and its exit status are lost; status 137 stands for it.]\n"
)
LOST_NOTICE = (
    "[The command ran and exited 0, but the Docker engine lost its output (a race of dockerd with short "
    "commands); run it again to see it.]\n"
)


@attrs.define
class _Outcome:
    exit_code: Optional[int]
    timed_out: bool
    not_started: bool = False  # the container could not start the command (its wrapper never ran)
    recovered: bool = False  # every process of the container was stopped so that it could run
    lost: bool = False  # it ran, but the engine lost its whole output (LOST_NOTICE)


class DockerSandbox(Sandbox):
    """A container of its own; each command is a ``/bin/sh -c`` exec with the container's environment only."""

    own_pid_namespace = True  # its container: stop_processes is a command's kill -9 -1

    def __init__(
        self, backend: "DockerBackend", container_id: str, name: str, workdir: str, prompt_index: int, image: str = "",
        env: Optional[dict] = None, agent: Optional[agents.Agent] = None, view: Optional["View"] = None,
    ):
        self.id = container_id
        self.name = name
        self._image = image
        self.prompt_index = prompt_index
        self._workdir = workdir
        self._backend = backend
        self._max_output = backend.config.max_output_bytes
        self._user = backend.config.user or ""  # commands run as -S user= (PID 1 stays root); "" the image's user
        self._closed = False
        # A pooled container was made before its prompt was known: the prompt's environment goes with each exec
        # (in a view, after the user's HOME, which the helper's exec as root would not give).
        env = {**(view.env if view is not None else {}), **(env or {})}
        self._exec_env = {"environment": env} if env else {}
        # The command runner (-S runner=agent): started with the container; None with -S runner=exec.
        self._agent = agent
        self._agent_starts = 1 if agent is not None else 0
        self._agent_starting = False
        self._use_agent = backend.config.runner == "agent"
        # -S reuse=namespace: the prompt's view in a reused container; every exec joins it through the helper,
        # as root (the helper lowers the command to the prompt's user and capabilities).
        self._view = view
        self._exec_user = "0" if view is not None else self._user
        self._spoiled = False  # its container must not serve another prompt

    def _argv(self, argv: list) -> list:
        return self._view.join_argv(argv) if self._view is not None else argv

    @property
    def workdir(self) -> str:
        return self._workdir

    @property
    def image(self) -> str:
        return self._image

    @property
    def view(self) -> Optional["View"]:
        """The prompt's view in a reused container (-S reuse=namespace), else None."""
        return self._view

    # --- commands ------------------------------------------------------------------------

    async def exec(self, command: str, timeout: float) -> ExecResult:
        """Run ``command`` with ``/bin/sh -c``; at ``timeout`` SIGKILL its whole process group."""
        outcome, output, _ = await self._run_recovering(
            [SHELL, "-c", RUN_WRAPPER, "sh", command], timeout, lambda: (BoundedOutput(self._max_output), None)
        )
        text = LOST_NOTICE if outcome.lost else output.text()
        if outcome.recovered:
            text = self._recovery_notice() + text
        return ExecResult(text, outcome.exit_code, outcome.timed_out)

    def _recovery_notice(self) -> str:
        return (
            f"[The sandbox had reached its process limit (-S pids_limit={self._backend.config.pids_limit}) and could "
            "not start anything, so every process in it was stopped; its files are kept.]\n"
        )

    async def _run_recovering(self, argv: list, timeout: float, buffers, attempts: int = 1) -> tuple:
        """``_run`` with fresh ``buffers()``; a command the container cannot start is run again after recovery.

        A container whose processes fill its pids limit (a fork bomb) can start no
        command, not even the kill of a timed-out one.  Restarting it stops every
        process and keeps its files, so the prompt goes on, and ends as the model
        makes it end, instead of failing again each time ``--resume`` runs it.  A command whose output
        the engine lost is run up to ``attempts`` times in all (for reads, which change nothing).
        """
        stdout, stderr = buffers()
        outcome = await self._run(argv, timeout, stdout, stderr)
        while outcome.lost and attempts > 1:
            attempts -= 1
            stdout, stderr = buffers()
            outcome = await self._run(argv, timeout, stdout, stderr)
        if not outcome.not_started:
            return outcome, stdout, stderr
        if not await self._raise_if_dead("while a command was started"):
            await self._recover()
        stdout, stderr = buffers()
        outcome = await self._run(argv, timeout, stdout, stderr)
        if outcome.not_started:
            raise SandboxError(
                f"The container {self.name} of prompt {self.prompt_index} cannot start commands even after a restart "
                f"({stdout.text().strip()[:200]}); run again with --resume to retry the prompt."
            )
        outcome.recovered = True
        return outcome, stdout, stderr

    async def _recover(self) -> None:
        if self._view is not None:
            await self._recover_view()
            return
        log.warning(
            "The container %s of prompt %d could not start a process (its pids limit %d reached?); restarting it, "
            "which stops every process in it and keeps its files.", self.name, self.prompt_index,
            self._backend.config.pids_limit,
        )
        await self._call(self._backend.api.restart, self.id, timeout=0)

    async def _recover_view(self) -> None:
        """A view's ``_recover``: a restart would end the view, so every process of the view but its first is killed
        (as ``stop_processes`` does, without starting a process in the view) and its later commands run as execs
        that join it.  Where even that cannot run, the prompt fails and its container is removed."""
        log.warning(
            "The view of prompt %d in the container %s could not start a process (its pids limit %d reached?); "
            "stopping every process of the view, which keeps its files.", self.prompt_index, self.name,
            self._backend.config.pids_limit,
        )
        self._use_agent = False  # the runner is one of the processes stopped
        said = BoundedOutput(4096)
        outcome = await self._run_exec(self._view.stop_argv(), STOP_PROCESSES_TIMEOUT_S, said, wrap=False)
        if outcome.not_started:
            # The runtime could not start even the helper (it starts a process of its own in the container): with
            # a few more processes allowed for a moment it can, and the helper then starts none; the limit is
            # put back after, else the container never serves another prompt.
            limit = self._backend.config.pids_limit
            try:
                await self._call(self._backend.set_pids_limit, self.id, limit + PIDS_HEADROOM)
                try:
                    said = BoundedOutput(4096)
                    outcome = await self._run_exec(self._view.stop_argv(), STOP_PROCESSES_TIMEOUT_S, said, wrap=False)
                finally:
                    await self._call(self._backend.set_pids_limit, self.id, limit)
            except SandboxError:
                self._spoiled = True
                raise
        if outcome.exit_code == 0:
            return
        self._spoiled = True
        raise SandboxError(
            f"The container {self.name} of prompt {self.prompt_index} could not start a process (its pids limit "
            f"{self._backend.config.pids_limit} reached?) and the processes of the prompt's view could not be "
            f"stopped (exit status {outcome.exit_code}: {said.text().strip()[:200]}); run again with --resume to "
            "retry the prompt."
        )

    async def _run(self, argv: list, timeout: float, stdout: BoundedOutput, stderr: Optional[BoundedOutput] = None) -> _Outcome:
        self._check_open()
        nonce = agents.new_nonce()
        line = agents.request_line(nonce, "X", argv)
        agent = await self._free_agent() if line is not None else None
        if agent is not None:
            request = agent.submit(nonce, stdout, stderr)
            outcome = await self._run_agent(agent, request, line, timeout, stdout, stderr)
            if outcome is not None:
                return outcome
        return await self._run_exec(argv, timeout, stdout, stderr)

    async def _free_agent(self) -> Optional[agents.Agent]:
        """The sandbox's command runner if it is free (started first if it has none or it died), else None."""
        if not self._use_agent:
            return None
        agent = self._agent
        if agent is not None and agent.pid is None and not agent.dead and not agent.busy:
            # started with its container (or view), not yet waited for; a view's runner is not replaced, so a
            # loaded engine gets longer before it is given up (which ends the view)
            await agent.until_started(VIEW_READY_S if self._view is not None else AGENT_READY_S)
            if self._agent is not agent:
                return await self._free_agent()
        if agent is not None and agent.usable():
            return agent
        if not self._use_agent or self._agent_starting or (agent is not None and not agent.dead):
            return None
        if self._agent_starts >= AGENT_STARTS:
            return None
        self._agent_starting = True
        self._agent_starts += 1
        try:
            loop = asyncio.get_running_loop()
            wrap = self._view.join_argv if self._view is not None else None
            self._agent = await self._backend.blocking(
                self._backend.start_agent, self.id, self._workdir, loop, self._exec_env.get("environment"), True,
                wrap, self._exec_user,
            )
        except (*engine_errors(), SandboxError) as exc:
            log.debug("no command runner in %s: %s", self.name, exc)
            return None
        finally:
            self._agent_starting = False
        if self._closed:
            self._agent.close()
            return None
        return self._agent if self._agent.usable() else None

    async def set_env(self, env: dict) -> bool:
        """Give a pooled container's runner the prompt's environment; False when it cannot take it."""
        if not env:
            return True
        agent = await self._free_agent() if self._agent is not None else None
        if agent is None or not agent.usable() or not all(agents.exportable(key) for key in env):
            return False
        pairs = [f"{key}={value}" for key, value in env.items()]
        for start in range(0, len(pairs), agents.MAX_ARGS):
            nonce = agents.new_nonce()
            line = agents.request_line(nonce, "E", pairs[start:start + agents.MAX_ARGS])
            if line is None or not agent.usable():
                return False
            request = agent.submit(nonce, BoundedOutput(1024))
            try:
                await self._backend.blocking(agent.send, line)
                if await asyncio.wait_for(asyncio.shield(request.done), AGENT_READY_S) != 0:
                    return False
            except (OSError, asyncio.TimeoutError):
                agent.close()
                return False
        return True

    def drop_agent(self) -> None:
        """Run every command as an exec from now on."""
        if self._agent is not None:
            self._agent.close()
            self._agent = None
        self._use_agent = False

    async def _run_agent(self, agent, request, line: bytes, timeout: float, stdout, stderr) -> Optional[_Outcome]:
        """Run a request through the runner; None when it never reached the runner (run it as an exec)."""
        try:
            await self._backend.blocking(agent.send, line)
        except OSError:
            agent.close()  # the runner is gone and took no whole line: the command did not run
            return None
        timed_out = await self._wait_or_kill(request, timeout)
        if timed_out is not None:
            return timed_out
        status = request.done.result()
        if status is None:
            # The runner died after it took the request: whether the command ran is not known (even its pid
            # line may have died in the pipe), so it is never run again.
            recovered = await self._raise_if_dead("while a command ran")
            stdout.add(AGENT_DIED_NOTICE.encode())
            return _Outcome(137, False, recovered=recovered)
        if stderr is not None and status != 0:
            stderr.add(stdout.value())  # the runner merges stderr: on failure what came is the message
        if request.pid is None and status == agents.NO_STATUS:
            return _Outcome(status, False, not_started=True)  # the runner could not start it (no fork)
        return _Outcome(status, False)

    async def stop_processes(self) -> bool:
        """Kill every process but PID 1 with an exec, the runner too, and run every later command as an exec.

        What runs after this (a verifier's checks) must not go through a process the session's commands could reach:
        they ran beside the runner, as its user, and could write to its output or its memory.
        """
        self._check_open()
        if self._view is not None:
            # Its runner's stream stays open until close (closing it ends the view); the helper kills every
            # process of the view but its first, which then outlives the runner.
            self._use_agent = False
            outcome = await self._run_exec(
                self._view.stop_argv(), STOP_PROCESSES_TIMEOUT_S, BoundedOutput(4096), wrap=False
            )
            return outcome.exit_code == 0
        self.drop_agent()
        return await super().stop_processes()

    # --- a verifier's tests ------------------------------------------------------------------------

    async def run_tests(self, command: str, files: tuple, timeout: float) -> TestsRun:
        """The tests as the container's root under the static helper's supervisor, apart from the agent (grading.py)."""
        self._check_open()
        why = self._backend.tests_apart_missing
        if why:
            raise NotImplementedError(f"the docker sandbox cannot run tests apart from the agent here: {why}")
        uid, gid, agent_env = await self._agent_identity()
        info = await self._backend.blocking(self._backend.image_info, self._image)
        folders = tests.agent_folders(self._workdir, agent_env.get("HOME"))
        stage = tests.new_stage()
        script = grading.tests_script(command, files, self._workdir)
        run, script_path = tests.script_command(script, stage)
        if self._view is None:
            program = f"{stage}/helper"  # a fresh folder of root's: nothing of the agent's can be there
            archive = tests.stage_archive(stage, await self._backend.helper_program(), script_path, script)
            await self._call(self._backend.put_archive, self.id, archive)
        else:
            program = "/proc/self/exe"
            if script_path is not None:
                await self._write_as_tests(stage, script_path, script.encode("utf-8", "surrogateescape"))
        argv = tests.supervisor_argv(program, tests.new_grade(), f"{uid}:{gid}", folders, agent_env,
                                     tests.tests_environment(info, folders), run)
        if self._view is not None:
            argv = self._view.tests_argv(argv)
        stdout, stderr = BoundedOutput(self._max_output), BoundedOutput(64 * 1024)
        exit_code, timed_out = await self._run_as_tests(argv, timeout, stdout, stderr)
        result = ExecResult(stdout.text(), exit_code, timed_out)
        report = grading.report_in(stderr.text())
        if timed_out:
            return TestsRun(result, None, "")
        if report is None:
            said = stderr.text().strip()
            return TestsRun(result, None, "the tests ended without a report" + (f" ({said[:200]})" if said else ""))
        return TestsRun(result, *grading.read_report(report))

    async def snapshot(self) -> Optional[str]:
        """--branch_at: this container's filesystem committed to an image of the run, which the backend removes at
        shutdown; None for a view (-S reuse=namespace), whose files are not the container's alone."""
        self._check_open()
        if self._view is not None:
            return None
        return await self._call(self._backend.commit_snapshot, self.id)

    async def copy_workdir_to(self, other: Sandbox) -> None:
        """command:clean=true: make the fresh container ``other``'s working folder what this one's is now (folders,
        regular files and links as the archive API gives them, owners and modes kept; FIFOs, sockets and devices
        left out).  Between containers of the strict mode only: a view's files are not the container's."""
        self._check_open()
        if not isinstance(other, DockerSandbox) or self._view is not None or other._view is not None:
            raise NotImplementedError("the docker sandbox copies a working folder only between containers of "
                                      "-S reuse=none")
        other._check_open()
        workdir = posixpath.normpath(self._workdir)
        if workdir == "/" or posixpath.normpath(other._workdir) != workdir:
            raise SandboxError(f"The working folder {workdir} cannot be copied into a fresh container "
                               "(command:clean=true needs a working folder below /).")
        archive = await self._call(self._backend.folder_archive, self.id, workdir)
        try:
            code, _out, err = await other._call(other._exec_sync, ["rm", "-rf", "--", workdir], "0")
            if code != 0:
                raise SandboxError(f"The fresh container {other.name} could not empty its working folder {workdir} "
                                   f"(exit status {code}: {err[-200:].decode(errors='replace').strip()}).")
            await other._call(self._backend.put_archive, other.id, archive, posixpath.dirname(workdir))
        finally:
            archive.close()

    async def _agent_identity(self) -> tuple:
        """(uid, gid, environment) of the agent's commands: one exec run as they are (its user, its view, its
        environment) that prints them; the identity given run-untrusted for the agent's code."""
        argv = self._argv([SHELL, "-c", tests.IDENTITY_SCRIPT])
        for _attempt in range(IDENTITY_ATTEMPTS):
            code, out, err = await self._call(self._exec_sync, argv, self._exec_user, self._exec_env.get("environment"))
            self._raise_if_view_ended(code, _said(err))
            try:
                if code == 0:
                    return tests.parse_identity(out)
            except ValueError:
                pass
            if code != 0 or out:
                break
            # exit status 0 and no output at all: under load the engine can lose a quick exec's output (1 prompt
            # of 60 in bench_tasks.py at 16 sessions); the script only reads /proc, so it is asked again
        raise SandboxError(
            f"The user of the commands of prompt {self.prompt_index} could not be found in the container {self.name} "
            f"before its tests (exit status {code}: {(err or out)[-200:].decode(errors='replace').strip()})."
        )

    def _exec_sync(self, argv: list, user: str, env: Optional[dict] = None, data: Optional[bytes] = None) -> tuple:
        """(exit status, stdout, stderr) of a short exec in ``/`` (blocking; the engine's request timeout bounds it)."""
        api = self._backend.api
        created = api.exec_create(self.id, argv, stdout=True, stderr=True, stdin=data is not None, tty=False,
                                  user=user, workdir="/", **({"environment": env} if env else {}))
        if data is None:
            out, err = api.exec_start(created["Id"], demux=True)
        else:
            sock = api.exec_start(created["Id"], socket=True)
            parts = {1: bytearray(), 2: bytearray()}
            try:
                raw = getattr(sock, "_sock", sock)
                raw.sendall(data)
                raw.shutdown(socket_module.SHUT_WR)
                read_frames(sock, lambda kind, payload: parts.get(kind, parts[2]).extend(payload[:65536]))
            finally:
                close_quietly(sock)
            out, err = bytes(parts[1]), bytes(parts[2])
        for _ in range(DEATH_NOTICE_POLLS):
            info = api.exec_inspect(created["Id"])
            if not info.get("Running"):
                break
            time.sleep(0.05)
        return info.get("ExitCode"), out or b"", err or b""

    async def _write_as_tests(self, stage: str, path: str, data: bytes) -> None:
        """Write a file of the tests into a fresh folder of root's in the view (the archive API would write the
        container's root, beneath every view)."""
        argv = self._view.tests_argv([SHELL, "-c", 'umask 077 && mkdir -- "$1" && cat > "$2"', "sh", stage, path])
        code, _out, err = await self._call(self._exec_sync, argv, "0", None, data)
        self._raise_if_view_ended(code, _said(err))
        if code != 0:
            raise SandboxError(
                f"The tests' script could not be written into the view of prompt {self.prompt_index} (exit status "
                f"{code}: {err[-200:].decode(errors='replace').strip()})."
            )

    async def _run_as_tests(self, argv: list, timeout: float, stdout: BoundedOutput, stderr: BoundedOutput) -> tuple:
        """(exit status, timed out) of the supervisor's exec as root in ``/``; at ``timeout`` every process of the
        tests is killed (in strict mode every process of the container but its first, in a view every process of
        the view but its first)."""
        api = self._backend.api
        loop = asyncio.get_running_loop()
        created = await self._call(api.exec_create, self.id, argv, stdout=True, stderr=True, stdin=False, tty=False,
                                   user="0", workdir="/")
        sock = await self._call(api.exec_start, created["Id"], socket=True)
        stream = ExecStream(sock, loop, stdout, stderr)
        stream.parser.flush()  # no wrapper prints a pid first: every byte of its stdout is the tests' output
        stream.start()
        settled = False
        try:
            done, _ = await asyncio.wait({stream.done}, timeout=max(timeout, 0.0))
            settled = True
        finally:
            if not settled:  # cancelled: the tests must not run on
                self._backend.in_background(self._kill_tests_sync)
        if not done:
            await self._backend.blocking(self._kill_tests_sync)
            await asyncio.wait({stream.done}, timeout=tests.TESTS_KILL_WAIT_S)
            stream.interrupt()
            return None, True
        exit_code = await self._exit_code(created["Id"], loop.time() + tests.TESTS_KILL_WAIT_S)
        self._raise_if_view_ended(exit_code, stderr)
        if exit_code is None or exit_code >= 128 or stream.error is not None:
            reason = await self._backend.blocking(self._backend.dead_reason, self.id)
            if reason is not None:
                raise self._failure(reason, "while its tests ran")
        return exit_code, False

    def _kill_tests_sync(self) -> None:
        argv = self._view.stop_argv() if self._view is not None else [SHELL, "-c", tests.KILL_EVERYTHING]
        try:
            self._exec_sync(argv, "0")
        except engine_errors() as exc:
            log.warning("The tests of prompt %d in %s could not be stopped: %s", self.prompt_index, self.name, exc)

    async def _run_exec(self, argv: list, timeout: float, stdout: BoundedOutput, stderr: Optional[BoundedOutput] = None,
                        wrap: bool = True) -> _Outcome:
        api = self._backend.api
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 0.0)
        created = await self._call(
            api.exec_create, self.id, self._argv(argv) if wrap else argv, stdout=True, stderr=True, stdin=False,
            tty=False, user=self._exec_user, **self._exec_env,
        )
        exec_id = created["Id"]
        try:
            sock = await self._backend.blocking(api.exec_start, exec_id, socket=True)
        except docker.errors.APIError as exc:
            if exc.status_code not in (404, 409) and "oci runtime" in str(exc.explanation or exc).lower():
                stdout.add(str(exc.explanation or exc).encode())  # the runtime could not start a process
                return _Outcome(126, False, not_started=True)
            raise await self._backend.blocking(self._error_sync, exc, "while a command ran") from exc
        except engine_errors() as exc:
            raise await self._backend.blocking(self._error_sync, exc, "while a command ran") from exc
        stream = ExecStream(sock, loop, stdout, stderr)
        stream.start()
        timed_out = await self._wait_or_kill(stream, timeout)
        if timed_out is not None:
            return timed_out
        exit_code = await self._exit_code(exec_id, deadline)
        self._raise_if_view_ended(exit_code, stdout)
        if exit_code is None:  # the command closed its output but ran on until the timeout
            recovered = await self._kill(stream)
            return _Outcome(None, True, recovered=recovered)
        if stream.pid is None and exit_code != 0:
            return _Outcome(exit_code, False, not_started=True)
        if stream.pid is None and stream.error is None:
            # The wrapper prints its pid before anything else, and it ran: the engine lost the whole
            # output, which dockerd does now and then to a short command (moby/moby#27289).
            return _Outcome(exit_code, False, lost=True)
        if exit_code >= 128 or stream.error is not None:
            # Killed by a signal: maybe the container itself died.
            recovered = await self._raise_if_dead("while a command ran")
            return _Outcome(exit_code, False, recovered=recovered)
        return _Outcome(exit_code, False)

    def _raise_if_view_ended(self, exit_code: Optional[int], output: BoundedOutput) -> None:
        if self._view is not None and exit_code == 125 and VIEW_ENDED in output.text():
            raise SandboxError(
                f"The view of prompt {self.prompt_index} in the container {self.name} has ended (a command killed its "
                "command runner, which ends the view with -S reuse=namespace, or the runner did not start in "
                f"{VIEW_READY_S:g} s); run again with --resume to retry the prompt."
            )

    async def _wait_or_kill(self, stream, timeout: float) -> Optional[_Outcome]:
        """Wait for the end of ``stream`` (an ExecStream or a runner's Request); at ``timeout`` kill its process group
        and return the timed-out outcome, else None.  Cancelled, it stops the command without waiting for it."""
        settled = False  # False while a cancellation could still hit us
        try:
            done, _ = await asyncio.wait({stream.done}, timeout=max(timeout, 0.0))
            settled = True
            if not done:
                recovered = await self._kill(stream)
                await asyncio.wait({stream.done}, timeout=POST_KILL_DRAIN_S)
                return _Outcome(None, True, recovered=recovered)
            return None
        finally:
            if not stream.done.done():
                stream.interrupt()  # an exec's reader stops; a runner stays busy until the command's end
            if not settled:
                self._kill_soon(stream)

    async def _exit_code(self, exec_id: str, deadline: float) -> Optional[int]:
        loop = asyncio.get_running_loop()
        delay = 0.005
        while True:
            info = await self._call(self._backend.api.exec_inspect, exec_id)
            if not info.get("Running"):
                return info.get("ExitCode")
            if loop.time() >= deadline:
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def _kill(self, stream: ExecStream) -> bool:
        """Kill the command's process group; True when the container had to be restarted for it."""
        try:
            pid = await asyncio.wait_for(asyncio.shield(stream.pid_known), PID_WAIT_S)
        except asyncio.TimeoutError:
            pid = None
        if pid is None:
            return False
        if await self._backend.blocking(self._kill_sync, pid, True):
            return False
        if not await self._raise_if_dead("while a command was being stopped"):
            await self._recover()
        return True

    def _kill_soon(self, stream: ExecStream) -> None:
        if stream.pid is not None:
            self._backend.in_background(self._kill_sync, stream.pid, False)

    def _kill_sync(self, pid: int, wait: bool) -> bool:
        """Kill the group of ``pid``; False when the kill could not run (the container cannot start it)."""
        api = self._backend.api
        try:
            created = api.exec_create(
                self.id, self._argv([SHELL, "-c", KILL_GROUP, "sh", str(pid)]), stdout=False, stderr=False,
                user=self._exec_user, **self._exec_env,
            )
            api.exec_start(created["Id"], detach=True)
            if not wait:
                return True
            for _ in range(DEATH_NOTICE_POLLS):
                info = api.exec_inspect(created["Id"])
                if info.get("ExitCode") is not None and not info.get("Running"):
                    return info["ExitCode"] == 0  # the kill wrapper always exits 0 once it runs
                time.sleep(0.05)
            return True  # still running: it started, so it kills
        except docker.errors.NotFound as exc:
            raise self._error_sync(exc, "while a command was being stopped") from exc
        except engine_errors():
            return False

    # --- files -----------------------------------------------------------------------------

    def _path(self, path: str) -> str:
        self._check_open()
        return "/" + posixpath.normpath(posixpath.join(self._workdir, path)).lstrip("/")

    async def read_file(self, path: str, max_bytes: Optional[int] = None) -> bytes:
        """At most ``max_bytes`` bytes of ``path`` as the container sees it (links followed).

        The bytes stream from the container and stop at ``max_bytes`` (``head -c``
        in the container), so a huge file costs the runner only what is returned.
        """
        full = self._path(path)
        limit = MAX_READ_BYTES if max_bytes is None else min(max_bytes, MAX_READ_BYTES)
        if limit <= 0:
            await self._check_file(path, full, READ_WRAPPER, "0")
            return b""
        argv = [SHELL, "-c", READ_WRAPPER, "sh", full, "" if max_bytes is None else str(limit)]
        outcome, stdout, stderr = await self._run_recovering(
            argv, READ_TIMEOUT_S, lambda: (FirstBytes(limit + 1), BoundedOutput(64 * 1024)), READ_ATTEMPTS
        )
        if outcome.timed_out:
            raise OSError(errno.ETIMEDOUT, f"reading took longer than {READ_TIMEOUT_S:g} s (is it a pipe?)", path)
        if outcome.lost:
            raise OSError(errno.EIO, f"the Docker engine lost what the read returned, {READ_ATTEMPTS} times", path)
        if outcome.exit_code == 0:
            data = stdout.value()
            if max_bytes is None and len(data) > MAX_READ_BYTES:
                raise OSError(errno.EFBIG, f"larger than {MAX_READ_BYTES} bytes, too large to read whole", path)
            return data[:limit]
        raise self._file_error(path, outcome.exit_code, stderr.text())

    async def _check_file(self, path: str, full: str, wrapper: str, *extra: str) -> None:
        outcome, _, stderr = await self._run_recovering(
            [SHELL, "-c", wrapper, "sh", full, *extra], READ_TIMEOUT_S, lambda: (BoundedOutput(1024), BoundedOutput(64 * 1024))
        )
        if outcome.timed_out:
            raise OSError(errno.ETIMEDOUT, f"checking took longer than {READ_TIMEOUT_S:g} s", path)
        if outcome.exit_code != 0:
            raise self._file_error(path, outcome.exit_code, stderr.text())

    @staticmethod
    def _file_error(path: str, exit_code: Optional[int], message: str) -> OSError:
        if exit_code == 2:
            return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        if exit_code == 21:
            return IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if exit_code == 13:
            return PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        if exit_code == 22:
            return OSError(
                errno.EINVAL,
                f"{path} is not a regular file (a FIFO, socket or device); the file tools only read and write "
                "regular files (use the terminal for anything else).",
            )
        message = message.strip()
        lowered = message.lower()
        if "permission denied" in lowered:
            return PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        if "not a directory" in lowered:
            return NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        if "no space left" in lowered:
            return OSError(errno.ENOSPC, message, path)
        return OSError(errno.EIO, message or f"reading exited with status {exit_code}", path)

    async def write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path``, creating parent folders; a folder in the way is an error, never replaced."""
        full = self._path(path)
        if full == "/":
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if len(data) <= MAX_RUNNER_WRITE or self._view is not None:
            written = await self._write_through_runner(path, full, data)
            if written is not None:
                return
        if self._view is not None:  # the archive API would write the container's root, under every view
            await self._write_through_exec(path, full, data)
            return
        # The archive API would replace a FIFO or a device by a file; refuse it as every backend does.
        await self._check_file(path, full, WRITE_CHECK)
        archive = _tar_one(full.lstrip("/"), data)
        try:
            await self._backend.blocking(self._backend.put_archive, self.id, archive)
        except docker.errors.NotFound as exc:
            raise self._error_sync(exc, "while a file was written") from exc
        except docker.errors.APIError as exc:
            message = str(exc.explanation or exc)
            lowered = message.lower()
            if "cannot overwrite directory" in lowered or "is a directory" in lowered:
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path) from exc
            if "not a directory" in lowered:
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path) from exc
            if "permission denied" in lowered or "read-only" in lowered:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path) from exc
            raise OSError(errno.EIO, message, path) from exc
        except engine_errors() as exc:
            raise self._error_sync(exc, "while a file was written") from exc
        if self._user:
            try:  # the archive API writes as root
                await self._backend.blocking(self._backend.chown, self.id, full)
            except engine_errors() as exc:
                raise self._error_sync(exc, "while a file was written") from exc

    async def _write_through_exec(self, path: str, full: str, data: bytes) -> None:
        """Write with an exec inside the view that reads the content on its stdin (WRITE_WRAPPER)."""
        api = self._backend.api
        loop = asyncio.get_running_loop()
        argv = self._argv([SHELL, "-c", WRITE_WRAPPER, "sh", full, str(len(data))])
        created = await self._call(
            api.exec_create, self.id, argv, stdout=True, stderr=True, stdin=True, tty=False, user=self._exec_user,
            **self._exec_env,
        )
        try:
            sock = await self._backend.blocking(api.exec_start, created["Id"], socket=True)
        except engine_errors() as exc:
            raise await self._backend.blocking(self._error_sync, exc, "while a file was written") from exc
        output = BoundedOutput(64 * 1024)
        stream = ExecStream(sock, loop, output)
        stream.start()
        try:
            await self._backend.blocking(getattr(sock, "_sock", sock).sendall, data)
        except OSError:
            pass  # the exec ended early: its status says why
        done, _ = await asyncio.wait({stream.done}, timeout=READ_TIMEOUT_S)
        if not done:
            stream.interrupt()
            raise OSError(errno.ETIMEDOUT, f"writing took longer than {READ_TIMEOUT_S:g} s", path)
        status = await self._exit_code(created["Id"], loop.time() + READ_TIMEOUT_S)
        self._raise_if_view_ended(status, output)
        if status != 0:
            raise self._file_error(path, status, output.text())

    async def _write_through_runner(self, path: str, full: str, data: bytes) -> Optional[bool]:
        """Write with the command runner (no engine call); None when it cannot (use the archive API).

        The archive API costs the engine about 0.2 s of CPU per file (dockerd extracts in a process of its own).
        """
        nonce = agents.new_nonce()
        line = agents.request_line(nonce, "I", [SHELL, "-c", WRITE_WRAPPER, "sh", full, str(len(data))])
        agent = await self._free_agent() if line is not None else None
        if agent is None:
            return None
        output = BoundedOutput(64 * 1024)
        request = agent.submit(nonce, output)
        settled = False
        try:
            try:
                await self._backend.blocking(agent.send, line + data)
            except OSError:
                agent.close()
            done, _ = await asyncio.wait({request.done}, timeout=READ_TIMEOUT_S)
            settled = True
        finally:
            if not settled or not request.done.done():
                # Part of the content may still be unread: the runner must never take it for requests.
                agent.close()
                self._kill_soon(request)
        if not done:
            raise OSError(errno.ETIMEDOUT, f"writing took longer than {READ_TIMEOUT_S:g} s", path)
        status = request.done.result()
        if request.pid is None:
            # The runner died, or could not start the write (its pids limit): the archive API.  What it
            # did not read of the content must never be taken for requests.
            agent.close()
            return None
        if status is None:
            raise OSError(errno.EIO, "the sandbox's command runner was killed while the file was written", path)
        if status != 0:
            raise self._file_error(path, status, output.text())
        return True

    # --- life and death ------------------------------------------------------------------------

    async def close(self) -> None:
        """Kill and remove the container; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._view is not None:
            await self._backend.recycle(self, self._agent, not self._spoiled)
            return
        if self._agent is not None:
            self._agent.close()
        await self._backend.remove(self)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"The Docker sandbox of prompt {self.prompt_index} was already closed.")

    async def _call(self, function, *args, **kwargs):
        """A blocking SDK call in the run's pool; engine errors become a SandboxError that says why."""
        try:
            return await self._backend.blocking(function, *args, **kwargs)
        except engine_errors() as exc:
            raise await self._backend.blocking(self._error_sync, exc, "while a command ran") from exc

    async def _raise_if_dead(self, when: str) -> bool:
        """Raise SandboxError if the container died; True when it lives but starts nothing and was restarted."""
        reason = await self._backend.blocking(self._backend.dead_reason, self.id)
        if reason is None:
            # The engine notes a killed container's state a moment after its processes die: a new exec
            # that runs tells a live container from one in that moment.
            if await self._backend.blocking(self._answers):
                return False
            for _ in range(DEATH_NOTICE_POLLS):
                await asyncio.sleep(0.05)
                reason = await self._backend.blocking(self._backend.dead_reason, self.id)
                if reason is not None:
                    break
            else:
                # Alive but starting no process: its pids limit is full (a fork bomb).  Failing the prompt
                # would fail it again on every --resume; a restart stops every process and keeps the files.
                await self._recover()
                return True
        raise self._failure(reason, when)

    def _answers(self) -> bool:
        api = self._backend.api
        try:
            created = api.exec_create(
                self.id, self._argv([SHELL, "-c", "exit 0"]), stdout=True, stderr=True, user=self._exec_user,
                **self._exec_env,
            )
            output = api.exec_start(created["Id"])
            status = api.exec_inspect(created["Id"]).get("ExitCode")
        except engine_errors():
            return False
        said = BoundedOutput(4096)
        said.add(output or b"")
        self._raise_if_view_ended(status, said)
        return status == 0

    def _error_sync(self, exc: BaseException, when: str) -> SandboxError:
        reason = None
        if isinstance(exc, docker.errors.NotFound) or (
            isinstance(exc, docker.errors.APIError) and exc.status_code == 409
        ):
            try:
                reason = self._backend.dead_reason(self.id)
            except engine_errors():
                reason = None
        if reason is not None:
            return self._failure(reason, when)
        if isinstance(exc, requests_exceptions.ConnectionError):
            return SandboxError(f"The Docker engine stopped answering {when} in the container {self.name} ({exc}).")
        detail = getattr(exc, "explanation", None) or str(exc)
        return SandboxError(f"The Docker engine refused a request {when} in the container {self.name}: {detail}")

    def _failure(self, reason: str, when: str) -> SandboxError:
        return SandboxError(
            f"The container {self.name} of prompt {self.prompt_index} {reason} {when}; "
            "run again with --resume to retry the prompt."
        )


def _tar_one(name: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = 0o644
        info.mtime = int(time.time())
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _said(data: bytes) -> BoundedOutput:
    said = BoundedOutput(64 * 1024)
    said.add(data or b"")
    return said
