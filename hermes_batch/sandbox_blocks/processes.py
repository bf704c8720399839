"""Signals that reach only the processes they are meant for, never one that took a number over.

A pid names a process only until the process is reaped, and a process group or
session id only while the group or session has members; after that the kernel
hands the number to the next process it starts.  Killing a pid or group that
was merely recorded earlier can therefore kill an unrelated process.  The local
sandbox signals only:

- its own children before it reaps them (:class:`ChildProcess`).  An unreaped child,
  even a zombie, keeps its pid, and with it the process group and session it
  leads; only processes of that session can be in that group or session.
- other processes through a pidfd (:func:`kill_verified`), opened before what
  identifies them is read and checked alive after the read.  A pidfd refers to
  one process for good, and a process still alive after the read is the one the
  read was about.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import logging
import os
import platform
import signal
import subprocess
import threading
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

# Starting a process is a fork and an exec; a few threads keep up with any rate the event loop asks for.
SPAWN_THREADS = 4


@functools.cache
def _spawn_executor(nicer: int = 0) -> concurrent.futures.ThreadPoolExecutor:
    """The threads that start processes ``nicer`` steps nicer than this process.

    Linux keeps a niceness per thread and a child is born with its forking
    thread's, so what these threads start, and all it starts in turn, runs
    nicer from its first instruction: no ``nice`` program to exec, no renice
    that comes after the child has begun.
    """
    return concurrent.futures.ThreadPoolExecutor(
        SPAWN_THREADS, thread_name_prefix="hermes-batch-spawn", initializer=_start_thread, initargs=(nicer,)
    )


def _start_thread(nicer: int) -> None:
    own_session_keyring()
    if nicer:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, _own_niceness()[0] + nicer))
        except OSError:  # raising one's own niceness is always allowed; without it the children run as we do
            log.warning("Could not make the spawn threads nicer: sandbox commands run at the run's priority.")


def own_session_keyring() -> bool:
    """Give the calling thread a new, empty session keyring (Linux keeps one per thread); whether it could.

    A child is born with its forking thread's session keyring, and with the
    runner's it could search and read whatever the runner's session holds
    (Kerberos caches, fscrypt keys): what the spawn threads start never
    possesses it.
    """
    call = _KEYCTL.get(platform.machine())
    if call is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(call, 1, None) >= 0  # KEYCTL_JOIN_SESSION_KEYRING, anonymous


_KEYCTL = {"x86_64": 250, "aarch64": 219, "i686": 288, "armv7l": 311, "ppc64le": 271, "s390x": 280, "riscv64": 219}


def pidfd(pid: int) -> Optional[int]:
    """A pidfd of ``pid``, or None when no such process exists (or the kernel has no pidfds)."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _signal(fd: int, sig: int) -> bool:
    """Send ``sig`` through a pidfd; False when its process has ended."""
    try:
        signal.pidfd_send_signal(fd, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


_pidfds: list = []


def pidfds_work() -> bool:
    """Whether this kernel and Python have pidfds (Linux 5.3 or later)."""
    if not _pidfds:
        fd = pidfd(os.getpid())
        _pidfds.append(fd is not None)
        if fd is not None:
            os.close(fd)
    return _pidfds[0]


class ChildProcess:
    """A child started in a new session, reaped only by this object, so that it can be signalled safely.

    ``exited`` is done once the child ended; its pid, process group and session
    stay reserved for it until :meth:`reap`.  asyncio's subprocesses cannot be
    used here: their watcher reaps a child the moment it ends, and a kill after
    that could reach whatever process got the number next.
    """

    def __init__(self, popen: subprocess.Popen, loop: asyncio.AbstractEventLoop):
        self.pid = popen.pid
        self._popen = popen
        self._loop = loop
        self.exited: asyncio.Future = loop.create_future()
        self.returncode: Optional[int] = None  # the exit status once reaped; -N for signal N
        self._reaped = False
        self._fd = pidfd(self.pid)  # cannot fail for a child not yet reaped, except without pidfds
        if self._fd is not None:
            loop.add_reader(self._fd, self._on_exit)  # a pidfd turns readable when its process ends
        else:
            threading.Thread(target=self._wait_in_thread, name="hermes-batch-child", daemon=True).start()

    @classmethod
    async def start(cls, argv: list, *, nicer: int = 0, **popen_args) -> "ChildProcess":
        """Start ``argv`` as the leader of a new session (``subprocess.Popen`` arguments); raises OSError.

        The fork and exec run on a thread of ours: at hundreds of commands a
        second, the millisecond each one holds its caller was a large share of
        the event loop's time.  ``nicer``: the child and its session run that
        much nicer than this process (see :func:`_spawn_executor` and
        :func:`lower_priority`).  Cancelled while the process starts, it still
        waits for the start, kills what started and reaps it, then raises.
        """
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(_spawn_executor(nicer), functools.partial(_spawn, argv, nicer, popen_args))
        try:
            popen = await asyncio.shield(future)
        except asyncio.CancelledError:
            while not future.done():
                try:
                    await asyncio.wait((future,))
                except asyncio.CancelledError:
                    pass
            if not future.cancelled() and future.exception() is None:
                child = cls(future.result(), loop)
                child.kill_group()
                child.reap_when_exited()
            raise
        return cls(popen, loop)

    @property
    def stdin(self):
        return self._popen.stdin

    @property
    def stdout(self):
        return self._popen.stdout

    def _wait_in_thread(self) -> None:
        try:
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)  # ended, but left unreaped
        except ChildProcessError:
            pass
        try:
            self._loop.call_soon_threadsafe(self._on_exit)
        except RuntimeError:  # the event loop is closed
            pass

    def _on_exit(self) -> None:
        if self._fd is not None and not self._reaped:
            self._loop.remove_reader(self._fd)
        if not self.exited.done():
            self.exited.set_result(None)

    def kill_group(self) -> None:
        """SIGKILL the process group the child leads (nothing once it was reaped)."""
        if not self._reaped:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self) -> None:
        """SIGKILL the child (nothing once it was reaped)."""
        if not self._reaped:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def exit_code(self) -> Optional[int]:
        """The child's exit status (-N when signal N ended it) once it ended, without reaping it; else None."""
        if self._reaped:
            return self.returncode
        if not self.exited.done():
            return None
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        except ChildProcessError:
            return None
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def reap(self) -> None:
        """Release the child's pid (and group and session); only once it ended."""
        if self._reaped or not self.exited.done():
            return
        code = self.exit_code()
        try:
            os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pass
        self._reaped = True
        self.returncode = self._popen.returncode = code if code is not None else 255
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def reap_when_exited(self) -> None:
        """Reap the child as soon as it ends, with nobody waiting (after a kill, on cancellation)."""
        if self.exited.done():
            self.reap()
        else:
            self.exited.add_done_callback(lambda _: self.reap())


def _spawn(argv: list, nicer: int, popen_args: dict) -> subprocess.Popen:
    popen = subprocess.Popen(argv, start_new_session=True, **popen_args)
    if nicer:
        lower_priority(popen.pid, nicer)
    return popen


@functools.cache
def _own_niceness() -> tuple:
    """(this process's niceness, its autogroup's niceness or None when the kernel groups no sessions)."""
    own, group = os.getpriority(os.PRIO_PROCESS, 0), None
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            if f.read().strip() == "1":
                with open("/proc/self/autogroup") as g:
                    group = autogroup_niceness(g.read(), own)
    except OSError:
        pass
    return own, group


def autogroup_niceness(text: str, own: int) -> int | None:
    """The niceness our sessions' groups are weighed against, from /proc/self/autogroup's ``text``.

    "/autogroup-42 nice 0": the group's.  Empty: this process is in the
    kernel's default group (the session of PID 1, as a CI job started by it
    is), where each process weighs by its own niceness, so a new session's
    group is weighed against ours.
    """
    fields = text.split()
    if not fields:
        return own
    try:
        return int(fields[-1])
    except ValueError:
        return None


def lower_priority(leader: int, nicer: int) -> None:
    """Make the session that ``leader`` (an unreaped child of ours) leads weigh ``nicer`` steps less than ours.

    Where the kernel puts each session in a scheduling group of its own
    (autogroup), the group's niceness weighs it against ours, whatever its
    processes' own (which their spawn thread gave them).  Hundreds of
    sandboxes starting at once otherwise each weighed as much as the whole
    run, and the event loop that all their prompts wait on waited for the CPU
    a third of the time.
    """
    group = _own_niceness()[1]
    if group is not None:
        try:
            with open(f"/proc/{leader}/autogroup", "w") as f:
                f.write(str(min(19, group + nicer)))
        except OSError:
            pass


def stat_fields(pid: int) -> tuple:
    """(state, ppid, pgid, sid, start time in clock ticks since boot) of ``pid``; ("", 0, 0, 0, 0) when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return "", 0, 0, 0, 0


def live_pids(since: int = 0) -> list:
    """Pids of the machine's live processes started at ``since`` (clock ticks since boot) or later."""
    own = os.getpid()
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != own:
            state, *_, started = stat_fields(int(entry.name))
            if state and state not in ("Z", "X") and started >= since:
                found.append(int(entry.name))
    return found


def kill_verified(pids: list, read: Callable[[int], Any], select: Callable[[dict], set]) -> int:
    """SIGKILL those of ``pids`` that ``select`` picks, each proven to be the process that was read.

    Every process gets a pidfd first; then ``read(pid)`` reads what identifies
    it (from ``/proc``; None when it is gone); then every pidfd is checked
    alive, and only processes alive after the whole read are kept, since their
    numbers could not change hands during it.  ``select`` gets {pid: what was
    read} of those and returns the pids to kill; they are killed through their
    pidfds.  Returns how many were killed.
    """
    fds = {}
    try:
        for pid in pids:
            fd = pidfd(pid)
            if fd is not None:
                fds[pid] = fd
        read_now = {pid: read(pid) for pid in fds}
        alive = {pid: seen for pid, seen in read_now.items() if seen is not None and _signal(fds[pid], 0)}
        killed = 0
        for pid in select(alive):
            if pid in alive and _signal(fds[pid], signal.SIGKILL):
                killed += 1
        return killed
    finally:
        for fd in fds.values():
            os.close(fd)
