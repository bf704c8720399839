"""How the local sandbox starts commands and finds every process a prompt started, to end them at close.

Two modes, chosen once per process (``-S isolation=``):

``namespace``
    Each prompt gets a PID and mount namespace of its own (``unshare``, with a
    user namespace when not root), whose first process idles and reaps orphans;
    commands enter it with ``nsenter``.  Killing that first process makes the
    kernel kill everything in the namespace, whatever left its process group
    or session, cleared its environment or changed folder.  The namespace
    mounts its own ``/proc``, so commands see only the prompt's processes, not
    the runner or the rest of the machine; if the runner dies, even by SIGKILL,
    the namespace dies with it (its first process reads a pipe only the runner
    holds open).
``process``
    Plain subprocesses.  At close the sandbox kills its commands' process
    groups and sessions, every process whose environment carries the prompt's
    marker variable or whose working folder is inside the prompt folder, and
    their descendants.  A process that clears its environment, leaves the
    folder and starts a new session escapes this; ``namespace`` has no such gap.

In both modes commands run through ``setpriv --no-new-privs`` (setuid programs
such as sudo grant nothing), and when the runner is root with a capability
bounding set reduced to what a shell session needs, so a command cannot read
the runner's memory or environment through ``/proc`` (no ``CAP_SYS_PTRACE``),
mount, load modules or reach raw devices.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
from typing import Optional

import attrs

log = logging.getLogger(__name__)

SHELL = "/bin/sh"
MARKER_VARIABLE = "HERMES_BATCH_SANDBOX"
ISOLATIONS = ("auto", "namespace", "process")
# The capabilities a command run as root keeps (the docker backend's base set).
ROOT_CAPABILITIES = ("chown", "dac_override", "fowner", "fsetid", "kill", "setgid", "setuid", "net_bind_service")
# First process of a prompt's namespace: says when it is ready, then idles and reaps orphans.  Its
# stdin is a pipe only the runner writes to: when the runner dies, however, the read ends and the
# namespace with it (cheaper than a parent-death signal, which takes a setpriv per prompt).
KEEPALIVE = (
    "trap 'exit 0' TERM INT; exec 5<&0; (read _ <&5; kill -TERM 1) & exec 5<&-; "
    "echo ready; while :; do sleep 3600 & wait $!; done"  # a trap interrupts a wait, not a foreground sleep
)
# Commands start in the prompt's working folder as the namespace sees it.
ENTER_CWD = 'cd -- "$1" || exit 126; exec /bin/sh -c "$2"'
READY_TIMEOUT_S = 30.0
KILL_ROUNDS = 10


@attrs.frozen
class Launcher:
    """The programs commands go through, as found on this machine."""

    namespace: bool
    setpriv: tuple = ()  # argv prefix that lowers a command's privileges, () without setpriv
    unshare: tuple = ()
    nsenter: tuple = ()
    wdns: bool = False  # nsenter can set the working folder inside the namespace (util-linux 2.38+)

    def init_argv(self) -> list:
        """The first process of a new namespace (it prints ``ready``; it ends when its stdin closes)."""
        return [*self.unshare, "--", SHELL, "-c", KEEPALIVE]

    def command_argv(self, command: str, cwd: str, init_pid: Optional[int]) -> list:
        """The argv of one command: in the namespace of ``init_pid`` when given."""
        if init_pid is None:
            return [*self.setpriv, SHELL, "-c", command]
        if self.wdns:
            return [*self.nsenter, "-t", str(init_pid), f"--wdns={cwd}", "--", *self.setpriv, SHELL, "-c", command]
        return [*self.nsenter, "-t", str(init_pid), "--", *self.setpriv, SHELL, "-c", ENTER_CWD, "sh", cwd, command]


_launchers: dict = {}


def launcher(isolation: str) -> Launcher:
    """The launcher for ``isolation``; ``namespace`` raises RuntimeError (with the reason) where it cannot work."""
    key = (isolation, os.geteuid())
    if key not in _launchers:
        _launchers[key] = _find_launcher(isolation)
    return _launchers[key]


def _find_launcher(isolation: str) -> Launcher:
    setpriv = _setpriv_prefix()
    if isolation == "process":
        return Launcher(False, setpriv)
    unshare, nsenter = shutil.which("unshare"), shutil.which("nsenter")
    reason = None
    if unshare is None or nsenter is None:
        reason = "unshare and nsenter (util-linux) are not installed"
    else:
        root = os.geteuid() == 0
        user = () if root else ("--user", "--map-current-user")
        candidate = Launcher(
            True,
            # Without root the user namespace already makes setuid programs grant nothing.
            setpriv if root else (),
            (unshare, *user, "--pid", "--mount", "--fork", "--mount-proc", "--kill-child"),
            (nsenter, *(() if root else ("--user", "--preserve-credentials")), "--pid", "--mount"),
            _nsenter_has_wdns(nsenter),
        )
        reason = _try_namespace(candidate)
        if reason is None:
            return candidate
    if isolation == "namespace":
        raise RuntimeError(reason)
    log.info("The local sandbox runs commands as plain processes: %s.", reason)
    return Launcher(False, setpriv)


def _setpriv_prefix() -> tuple:
    path = shutil.which("setpriv")
    if path is None:
        return ()
    prefix = [path, "--no-new-privs"]
    if os.geteuid() == 0:
        keep = ",".join("+" + name for name in ROOT_CAPABILITIES)
        prefix += ["--inh-caps=-all", f"--bounding-set=-all,{keep}"]
    prefix.append("--")
    try:
        done = subprocess.run([*prefix, SHELL, "-c", "exit 0"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return tuple(prefix) if done.returncode == 0 else ()


def _nsenter_has_wdns(nsenter: str) -> bool:
    try:
        shown = subprocess.run([nsenter, "--help"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return b"--wdns" in shown


def _try_namespace(candidate: Launcher) -> Optional[str]:
    """None when a namespace can be made and entered here, else why not."""
    try:
        init = subprocess.Popen(
            candidate.init_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        return f"unshare could not start ({exc})"
    try:
        if init.stdout.readline() != b"ready\n":
            init.kill()
            return f"unshare could not make a namespace ({init.communicate(timeout=30)[1].decode(errors='replace').strip()})"
        pid = first_child(init.pid)
        if pid is None:
            return "the namespace's first process could not be found"
        entered = subprocess.run(
            candidate.command_argv("cat /proc/1/cmdline", "/", pid), capture_output=True, timeout=30
        )
        if KEEPALIVE.encode() not in entered.stdout:  # the namespace's own /proc shows its first process as 1
            return f"nsenter could not enter the namespace ({entered.stderr.decode(errors='replace').strip()})"
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the namespace did not answer ({exc})"
    finally:
        _kill(init.pid)
        try:
            init.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for stream in (init.stdin, init.stdout, init.stderr):
            stream.close()


def first_child(pid: int) -> Optional[int]:
    """The pid of a child of ``pid`` (``unshare --fork`` has exactly one)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
        if children:
            return int(children[0])
    except OSError:
        pass
    for entry in os.scandir("/proc"):  # kernels without the children file
        if entry.name.isdigit() and _stat_fields(int(entry.name))[1] == pid:
            return int(entry.name)
    return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Namespace:
    """The PID and mount namespace of one prompt."""

    def __init__(self, launcher: Launcher):
        self.launcher = launcher
        self.init_pid: Optional[int] = None
        self._proc: Optional[asyncio.subprocess.Process] = None
        self._starting = asyncio.Lock()

    async def ensure(self, cwd: str) -> None:
        """Start the namespace unless it was started; concurrent first commands share one start."""
        async with self._starting:
            if self._proc is None:
                await self.start(cwd)

    async def start(self, cwd: str) -> None:
        """Start the namespace's first process, in ``cwd``; raises OSError or RuntimeError."""
        self._proc = await asyncio.create_subprocess_exec(
            *self.launcher.init_argv(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, cwd=cwd, start_new_session=True,
        )
        try:
            line = await asyncio.wait_for(self._proc.stdout.readline(), READY_TIMEOUT_S)
            if line != b"ready\n":
                raise RuntimeError("the namespace's first process ended before it was ready")
            self.init_pid = first_child(self._proc.pid)
            if self.init_pid is None:
                raise RuntimeError("the namespace's first process could not be found")
        except BaseException:
            await self.kill()
            raise
        finally:
            transport = getattr(self._proc, "_transport", None)
            pipe = transport.get_pipe_transport(1) if transport is not None else None
            if pipe is not None:
                pipe.close()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def kill(self) -> None:
        """Kill every process of the namespace and wait until they are gone."""
        if self._proc is None:
            return
        if self.init_pid is not None:
            _kill(self.init_pid)  # the kernel then kills the rest of the namespace
        else:
            _kill(self._proc.pid)  # --kill-child passes it on
        try:
            # unshare ends once its child, the namespace's first process, has ended, which
            # happens only after every other process of the namespace is gone.
            await asyncio.wait_for(self._proc.wait(), READY_TIMEOUT_S)
        except asyncio.TimeoutError:
            _kill(self._proc.pid)
            log.warning("The namespace of a local sandbox took more than %g s to end.", READY_TIMEOUT_S)


# --- process mode -------------------------------------------------------------------------


def _stat_fields(pid: int) -> tuple:
    """(state, ppid, pgid, sid, start time in clock ticks since boot) of ``pid``; ("", 0, 0, 0, 0) when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return "", 0, 0, 0, 0


def ticks_since_boot() -> int:
    """Now, in the clock ticks of the start times in /proc/<pid>/stat."""
    try:
        with open("/proc/uptime") as f:
            return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return 0


def _inside(link: str, root: str) -> bool:
    return link == root or link.startswith(root + "/")


def marked_processes(root: str, marker: str, groups: set, since: int = 0) -> set:
    """Live processes of a prompt in process mode, with their descendants (never this process).

    Only processes started at ``since`` (clock ticks since boot) or later are read: older ones
    cannot be the prompt's, and reading every process's environment costs most of a close.
    """
    own = os.getpid()
    needle = f"{MARKER_VARIABLE}={marker}\0".encode()
    parents: dict = {}
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        state, ppid, pgid, sid, started = _stat_fields(pid)
        if not state or state in ("Z", "X") or pid == own or started < since:
            continue
        parents[pid] = ppid
        if pgid in groups or sid in groups:
            found.add(pid)
            continue
        try:
            if _inside(os.readlink(f"/proc/{pid}/cwd"), root) or _inside(os.readlink(f"/proc/{pid}/root"), root):
                found.add(pid)
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read():
                    found.add(pid)
        except OSError:
            continue
    grew = True
    while grew:  # descendants, whatever they changed about themselves
        grew = False
        for pid, ppid in parents.items():
            if ppid in found and pid not in found and pid != own:
                found.add(pid)
                grew = True
    return found


def kill_marked(root: str, marker: str, groups: set, since: int = 0) -> int:
    """Kill the processes of a prompt in process mode, again until none is left (they may be forking)."""
    killed = 0
    for _ in range(KILL_ROUNDS):
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        found = marked_processes(root, marker, groups, since)
        if not found:
            break
        for pid in found:
            _kill(pid)
        killed += len(found)
    return killed
