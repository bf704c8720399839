"""The PID and mount namespace of one prompt (``-S isolation=namespace``), and its end.

Each prompt gets a PID and mount namespace of its own (with a user namespace
when not root), whose first process reaps orphans and starts the prompt's
commands itself: a request on its input names a script in a control folder,
and it forks ``/bin/sh -c`` with the output going to a FIFO there (which
programs do that on this machine: :mod:`~hermes_batch.local_sandbox.launchers`).
Killing that first process (through a pidfd, so the kill reaches it or
nothing) makes the kernel kill everything in the namespace, whatever left its
process group or session, cleared its environment or changed folder.  The
namespace mounts its own ``/proc``, so commands see only the prompt's
processes, not the runner or the rest of the machine; if the runner dies, even
by SIGKILL, the namespace dies with it (its first process reads a pipe only the
runner holds open).

No mode ever signals a pid, group or session it merely recorded: see
:mod:`~hermes_batch.sandbox_blocks.processes`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
from typing import Optional

from .launchers import READY_TIMEOUT_S, Launcher, first_child
from .nat import Attached, Nat
from ..sandbox_blocks.processes import ChildProcess, pidfd, stat_fields

log = logging.getLogger(__name__)


class Namespace:
    """The PID and mount namespace of one prompt.

    With a ``control`` folder (and bash, or the compiled helper), its first process is the HELPER that
    starts the commands (``submit``), and it runs with ``env``, which the
    commands inherit; else commands enter it with nsenter.  ``spill`` is the
    helper's second control folder, for what ``control`` cannot hold.
    """

    def __init__(self, launcher: Launcher, env: Optional[dict] = None, control: Optional[str] = None,
                 spill: Optional[str] = None, nicer: int = 0, options: tuple = (), nat: Optional[Nat] = None):
        self.launcher = launcher
        self.nat = nat  # the NAT program that gives the namespace's own network (-n) its way out
        self._attached: Optional[Attached] = None
        self.options = options  # the compiled helper's view, user, network and limits (local_sandbox.boundary)
        self.env = env
        self.nicer = nicer  # how much nicer than the runner its processes run
        self.control = control if launcher.helper else None
        self.spill = (spill or control) if self.control is not None else None
        self.init_pid: Optional[int] = None
        self._unshare: Optional[ChildProcess] = None
        self._init_fd: Optional[int] = None  # pidfd of the namespace's first process: kills reach only it
        self._starting = asyncio.Lock()
        self._killed = False
        self._answers: dict[str, tuple] = {}  # command id -> (started: its pgid, ended: its status)
        self._listener: Optional[asyncio.Task] = None

    async def ensure(self, cwd: str) -> None:
        """Start the namespace unless it was started; concurrent first commands share one start."""
        async with self._starting:
            if self._unshare is None:
                await self.start(cwd)

    async def start(self, cwd: str) -> None:
        """Start the namespace's first process, in ``cwd``; raises OSError or RuntimeError."""
        loop = asyncio.get_running_loop()
        helper = self.control is not None
        argv = self.launcher.helper_argv(self.control, cwd, self.spill, self.options) if helper else self.launcher.init_argv()
        self._unshare = await ChildProcess.start(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=cwd,
            env=self.env if helper else None, nicer=self.nicer,
        )
        reader = asyncio.StreamReader()
        transport = None
        try:
            transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), self._unshare.stdout
            )
            async with asyncio.timeout(READY_TIMEOUT_S):  # not wait_for: see Namespace.kill
                line = await reader.readline()
            if line != b"ready\n":
                raise RuntimeError("the namespace's first process ended before it was ready")
            self.init_pid, self._init_fd = _first_child_pidfd(self._unshare.pid)
            if self._init_fd is None:
                raise RuntimeError("the namespace's first process could not be found")
            if self.nat is not None:
                # through the outer process, which made the namespaces and is in them: the first one, not dumpable,
                # would take CAP_SYS_PTRACE to open (a runner without root has none)
                self._attached = await self.nat.attach(self._unshare.pid, self.launcher.user_namespace, self.nicer)
            if helper:
                os.set_blocking(self._unshare.stdin.fileno(), False)
                self._listener = asyncio.ensure_future(self._listen(reader, transport))
                transport = None  # the listener's now
        except BaseException:
            await self.kill()
            raise
        finally:
            if transport is not None:
                transport.close()
            elif not helper:
                self._unshare.stdout.close()

    # --- commands through the helper ------------------------------------------------------------

    def submit(self, ident: str, spilled: bool = False, tests: bool = False) -> tuple:
        """Have the helper start the command written to ``<control>/<ident>.sh`` (its output FIFO opened;
        with ``spilled``, both in the spill folder); with ``tests``, a verifier's tests (``grading.h``: the
        script, its environment ``<ident>.env`` and its FIFO in the spill folder).

        Returns futures: its process group once started, its exit status once
        ended, and the tests' report (the hexadecimal of ``grading.h``; None for
        a command) (None for each when the namespace ended first).  Raises
        OSError when the helper cannot be reached.
        """
        loop = asyncio.get_running_loop()
        answers = self._answers[ident] = (loop.create_future(), loop.create_future(), loop.create_future())
        if not self.alive or self._listener is None or self._listener.done():
            self._settle(answers)
            return answers
        kind = "g" if tests else "d" if spilled else ""
        try:
            os.write(self._unshare.stdin.fileno(), f"{kind}{ident}\n".encode())
        except BlockingIOError:
            self._answers.pop(ident)
            raise OSError("the namespace's first process does not read its requests") from None
        except OSError:
            self._settle(answers)
        return answers

    def forget(self, ident: str) -> None:
        self._answers.pop(ident, None)

    def kill_group(self, pgid: int) -> None:
        """SIGKILL a command's process group, through the helper, which leads it (nothing if it is gone)."""
        try:
            os.write(self._unshare.stdin.fileno(), f"k{pgid}\n".encode())
        except OSError:
            pass

    async def _listen(self, reader: asyncio.StreamReader, transport) -> None:
        try:
            while line := await reader.readline():
                try:
                    kind, ident, value = line.split()
                    answers = self._answers[ident.decode()]
                    if kind == b"r":  # a verifier's tests' report, before their status
                        future, value = answers[2], value.decode("ascii")
                    else:
                        future, value = answers[0 if kind == b"p" else 1], int(value)
                    if not future.done():
                        future.set_result(value)
                except (ValueError, KeyError, IndexError):
                    continue
        finally:
            transport.close()
            for answers in self._answers.values():
                self._settle(answers)

    @staticmethod
    def _settle(answers: tuple) -> None:
        for future in answers:
            if not future.done():
                future.set_result(None)

    async def end_reason(self) -> str:
        """How the namespace's first process ended, as a user reads it (waited for up to a second)."""
        if self._unshare is None:
            return "it never started"
        try:
            async with asyncio.timeout(1.0):
                await asyncio.shield(self._unshare.exited)
        except TimeoutError:
            return "its first process no longer answers"
        code = self._unshare.exit_code()
        if code is None:
            return "its first process ended"
        if code < 0 or code > 128:  # a signal ended it (the compiled helper and bash exit with 128 + its number)
            number = -code if code < 0 else code - 128
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = f"signal {number}"
            return f"its first process was ended by {name}"
        return f"its first process exited with status {code}"

    @property
    def alive(self) -> bool:
        return self._unshare is not None and not self._unshare.exited.done()

    async def kill(self) -> None:
        """Kill every process of the namespace and wait until they are gone."""
        if self._unshare is None or self._killed:
            return
        self._killed = True
        unshare = self._unshare
        if self._init_fd is not None:
            _pidfd_kill(self._init_fd)  # the kernel then kills the rest of the namespace
        else:
            unshare.kill()  # its --kill-child passes it on
        try:
            # unshare ends once its child, the namespace's first process, has ended, which
            # happens only after every other process of the namespace is gone.  Not wait_for: on
            # Python 3.11 a cancel that comes as the namespace ends is lost in it, and the prompt's
            # task, told to stop, went on (a worker that never stopped after its driver was killed).
            async with asyncio.timeout(READY_TIMEOUT_S):
                await asyncio.shield(unshare.exited)
        except TimeoutError:
            unshare.kill()
            log.warning("The namespace of a local sandbox took more than %g s to end.", READY_TIMEOUT_S)
        finally:
            if self._attached is not None:
                self._attached.stop()
            unshare.reap_when_exited()
            if self._init_fd is not None:
                os.close(self._init_fd)
                self._init_fd = None
            if unshare.stdin is not None:
                unshare.stdin.close()
            if self._listener is not None:
                await asyncio.wait((self._listener,), timeout=READY_TIMEOUT_S)  # its pipe ended with the helper


def _first_child_pidfd(parent: int) -> tuple:
    """(pid, pidfd) of the one child of ``parent``, an unreaped child of ours; (pid or None, None) if not found.

    The process read has ``parent`` as its parent, and is alive after the read
    through the pidfd: so the pidfd is of that child, not of a process that took
    its number over.
    """
    pid = first_child(parent)
    if pid is None:
        return None, None
    fd = pidfd(pid)
    if fd is None:
        return pid, None
    if stat_fields(pid)[1] == parent and _pidfd_alive(fd):
        return pid, fd
    os.close(fd)
    return pid, None


def _pidfd_alive(fd: int) -> bool:
    try:
        signal.pidfd_send_signal(fd, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _pidfd_kill(fd: int) -> None:
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
