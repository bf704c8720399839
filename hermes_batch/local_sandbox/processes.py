"""How the local sandbox starts commands and finds every process a prompt started, to end them at close.

Two modes, chosen once per process (``-S isolation=``):

``namespace``
    Each prompt gets a PID and mount namespace of its own (with a user
    namespace when not root), whose first process reaps orphans and starts
    the prompt's commands itself: a request on its input names a script in a
    control folder, and it forks ``/bin/sh -c`` with the output going to a
    FIFO there.  That first process is the compiled helper
    (:mod:`~hermes_batch.local_sandbox.namespace_init`, which makes the
    namespace and lowers its privileges itself) where it builds and works;
    else HELPER, bash started through ``unshare`` and ``setpriv``, which
    speaks the same protocol; without bash it idles, and commands enter the
    namespace with ``nsenter``.  Killing that first process (through a
    pidfd, so the kill reaches it or nothing) makes the kernel kill everything
    in the namespace, whatever left its process group or session, cleared its
    environment or changed folder.  The namespace mounts its own ``/proc``, so
    commands see only the prompt's processes, not the runner or the rest of
    the machine; if the runner dies, even by SIGKILL, the namespace dies with
    it (its first process reads a pipe only the runner holds open).
``process``
    Plain subprocesses.  At close the sandbox kills the sessions its commands
    led (while it still holds their leaders, so the numbers are theirs), every
    process whose environment carries the prompt's marker variable or whose
    working folder is inside the prompt folder, and their descendants, each
    through a pidfd checked after it was read.  A process that clears its
    environment, leaves the folder and starts a new session escapes this;
    ``namespace`` has no such gap.

No mode ever signals a pid, group or session it merely recorded: see
:mod:`~hermes_batch.sandbox_blocks.processes`.

In both modes commands run with no new privileges (the compiled helper sets it,
else ``setpriv --no-new-privs`` for the helper, and so every command it starts,
or each command in turn; setuid programs
such as sudo grant nothing), and when the runner is root with a capability
bounding set reduced to what a shell session needs, so a command cannot read
the runner's memory or environment through ``/proc`` (no ``CAP_SYS_PTRACE``),
mount, load modules or reach raw devices.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Optional

import attrs

from . import namespace_init
from ..sandbox_blocks.processes import ChildProcess, kill_verified, live_pids, pidfd, pidfds_work, stat_fields

log = logging.getLogger(__name__)

SHELL = "/bin/sh"
MARKER_VARIABLE = "HERMES_BATCH_SANDBOX"
ISOLATIONS = ("auto", "namespace", "process")
# The capabilities a command run as root keeps (the docker backend's base set), as setpriv names them and
# with their numbers in <linux/capability.h> (the compiled helper takes them as one mask).
ROOT_CAPABILITIES = {
    "chown": 0, "dac_override": 1, "fowner": 3, "fsetid": 4, "kill": 5, "setgid": 6, "setuid": 7,
    "net_bind_service": 10,
}
ROOT_CAPABILITY_MASK = sum(1 << number for number in ROOT_CAPABILITIES.values())
# Which first process starts a namespace's commands (-S helper=): the compiled one where it builds and
# works here, else bash (auto); or bash only.
HELPERS = ("auto", "bash")
# First process of a prompt's namespace: says when it is ready, then idles and reaps orphans.  Its
# stdin is a pipe only the runner writes to: when the runner dies, however, the read ends and the
# namespace with it (cheaper than a parent-death signal, which takes a setpriv per prompt).
KEEPALIVE = (
    "trap 'exit 0' TERM INT; exec 5<&0; (read _ <&5; kill -TERM 1) & exec 5<&-; "
    "echo ready; while :; do sleep 3600 & wait $!; done"  # a trap interrupts a wait, not a foreground sleep
)
# Commands start in the prompt's working folder as the namespace sees it.
ENTER_CWD = 'cd -- "$1" || exit 126; exec /bin/sh -c "$2"'
# With bash, the namespace's first process starts the commands itself: a fork of a small shell that is
# already inside the namespace with lowered privileges, where nsenter and setpriv were two more programs
# to exec for every command.  Requests on its input, one per line: an id (run the command in
# <control folder>/<id>.sh, output to the FIFO <id>.out, in the prompt's working folder), d<id> (the same
# in the spill folder: see local_control) or k<pgid> (kill that command's process group).  Answers on its
# output: "p <id> <pgid>" once started, "x <id> <status>" once ended.  `set -m` gives each command a
# process group of its own, as a session leader had.
HELPER = (
    "set -m; trap 'exit 0' TERM INT; ctl=$1 cwd=$2 spill=$3; echo ready; "
    "while IFS= read -r request; do jobs >/dev/null; case $request in "  # jobs: forget the ended ones
    'k*) kill -KILL -- "-${request#k}" 2>/dev/null; continue ;; '
    'd*) dir=$spill id=${request#d} ;; '
    '*) dir=$ctl id=$request ;; '
    "esac; "
    '{ ( cd -- "$cwd" 2>/dev/null || exit 126; IFS= read -r -d "" command < "$dir/$id.sh"; '
    'exec /bin/sh -c "$command" ) </dev/null >"$dir/$id.out" 2>&1; echo "x $id $?"; } & '
    'echo "p $id $!"; '
    "done"
)
HELPER_NAME = "hermes-batch-namespace"  # the helper's $0, which /proc/1/cmdline shows inside the namespace
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
    bash: Optional[str] = None  # with bash, the namespace's first process starts the commands (HELPER)
    # The compiled helper (namespace_init) and its options: it does unshare's, setpriv's and HELPER's work.
    compiled: tuple = ()

    @property
    def helper(self) -> bool:
        """Whether the namespace's first process starts the commands (the compiled helper or HELPER)."""
        return bool(self.compiled) or self.bash is not None

    @property
    def removes_command_files(self) -> bool:
        """Whether the helper removes a command's script and FIFO once it has opened them (the compiled one:
        bash would need an ``rm`` per command)."""
        return bool(self.compiled)

    def init_argv(self) -> list:
        """The first process of a new namespace (it prints ``ready``; it ends when its stdin closes)."""
        return [*self.unshare, "--", SHELL, "-c", KEEPALIVE]

    def helper_argv(self, control: str, cwd: str, spill: str) -> list:
        """The first process of a new namespace that starts its commands (see HELPER), privileges lowered."""
        if self.compiled:
            return [*self.compiled, control, cwd, spill]
        return [*self.unshare, "--", *self.setpriv, self.bash, "-c", HELPER, HELPER_NAME, control, cwd, spill]

    def command_argv(self, command: str, cwd: str, init_pid: Optional[int]) -> list:
        """The argv of one command: in the namespace of ``init_pid`` when given."""
        if init_pid is None:
            return [*self.setpriv, SHELL, "-c", command]
        if self.wdns:
            return [*self.nsenter, "-t", str(init_pid), f"--wdns={cwd}", "--", *self.setpriv, SHELL, "-c", command]
        return [*self.nsenter, "-t", str(init_pid), "--", *self.setpriv, SHELL, "-c", ENTER_CWD, "sh", cwd, command]


_launchers: dict = {}


def launcher(isolation: str, helper: str = "auto") -> Launcher:
    """The launcher for ``isolation`` and ``helper`` (HELPERS); ``namespace`` raises RuntimeError (with the
    reason) where it cannot work."""
    key = (isolation, helper, os.geteuid())
    if key not in _launchers:
        _launchers[key] = _find_launcher(isolation, helper)
    return _launchers[key]


def _find_launcher(isolation: str, helper: str) -> Launcher:
    setpriv = _setpriv_prefix()
    if isolation == "process":
        return Launcher(False, setpriv)
    if pidfds_work():
        found, reason = _namespace_launcher(setpriv, helper)
        if found is not None:
            return found
    else:
        reason = "this kernel has no pidfds (Linux 5.3 or later), which a namespace's kill relies on"
    if isolation == "namespace":
        raise RuntimeError(reason)
    log.info("The local sandbox runs commands as plain processes: %s.", reason)
    return Launcher(False, setpriv)


def _namespace_launcher(setpriv: tuple, helper: str) -> tuple:
    """(a namespace launcher that works here, None), else (None, why not): the compiled helper first (with
    ``helper`` auto), then unshare with the bash helper, then unshare with nsenter for each command."""
    root = os.geteuid() == 0
    compiled_failed = ""
    if helper == "auto":
        built, why = namespace_init.build()
        if built is not None:
            # As root its commands keep what a shell session needs; without, the user namespace's nothing.
            keep = ROOT_CAPABILITY_MASK if root else 0
            candidate = Launcher(True, setpriv, compiled=(built, *(() if root else ("-u",)), "-k", f"{keep:x}"))
            if _helper_works(candidate):
                return candidate, None
            why = f"{built} did not pass its check"
        log.info("The local sandbox's namespaces use unshare, setpriv and bash, not their compiled helper: %s.", why)
        compiled_failed = f"; the compiled helper: {why}"
    unshare, nsenter = shutil.which("unshare"), shutil.which("nsenter")
    if unshare is None or nsenter is None:
        return None, "unshare and nsenter (util-linux) are not installed" + compiled_failed
    candidate = Launcher(
        True,
        # Without root the user namespace already makes setuid programs grant nothing.
        setpriv if root else (),
        (unshare, *(() if root else ("--user", "--map-current-user")), "--pid", "--mount", "--fork", "--mount-proc",
         "--kill-child"),
        (nsenter, *(() if root else ("--user", "--preserve-credentials")), "--pid", "--mount"),
        _nsenter_has_wdns(nsenter),
        shutil.which("bash"),
    )
    reason = _try_namespace(candidate)
    if reason is not None:
        return None, reason + compiled_failed
    if candidate.bash is not None and not _helper_works(candidate):
        candidate = attrs.evolve(candidate, bash=None)  # commands enter with nsenter instead
    return candidate, None


def _setpriv_prefix() -> tuple:
    path = shutil.which("setpriv")
    if path is None:
        return ()
    prefix = [path, "--no-new-privs"]
    if os.geteuid() == 0:
        keep = ",".join("+" + name for name in ROOT_CAPABILITIES)  # setpriv's names
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
    """None when a namespace can be made and entered here, else why not (within READY_TIMEOUT_S)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        init = subprocess.Popen(
            candidate.init_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, bufsize=0,
        )
    except OSError as exc:
        return f"unshare could not start ({exc})"
    try:
        if _read_lines(init.stdout.fileno(), 1, deadline) != [b"ready"]:
            init.kill()
            return f"unshare could not make a namespace ({init.communicate(timeout=30)[1].decode(errors='replace').strip()})"
        pid = first_child(init.pid)
        if pid is None:
            return "the namespace's first process could not be found"
        entered = subprocess.run(
            candidate.command_argv("cat /proc/1/cmdline", "/", pid), capture_output=True,
            timeout=max(deadline - time.monotonic(), 1.0),
        )
        if KEEPALIVE.encode() not in entered.stdout:  # the namespace's own /proc shows its first process as 1
            return f"nsenter could not enter the namespace ({entered.stderr.decode(errors='replace').strip()})"
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the namespace did not answer ({exc})"
    finally:
        init.kill()  # unreaped until the wait below, so its pid is still its own
        try:
            init.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for stream in (init.stdin, init.stdout, init.stderr):
            stream.close()


def _helper_works(candidate: Launcher) -> bool:
    """Whether a namespace's helper runs a command here (``echo`` of its pid 1's name, through the FIFO),
    within READY_TIMEOUT_S."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="hermes-batch-check-") as control:
        with open(os.path.join(control, "1.sh"), "w") as f:
            f.write("tr '\\0' ' ' < /proc/1/cmdline")
        os.mkfifo(os.path.join(control, "1.out"))
        try:
            helper = subprocess.Popen(
                candidate.helper_argv(control, control, control), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, start_new_session=True, bufsize=0,
            )
        except OSError:
            return False
        try:
            if _read_lines(helper.stdout.fileno(), 1, deadline) != [b"ready"]:
                return False
            fifo = os.open(os.path.join(control, "1.out"), os.O_RDONLY | os.O_NONBLOCK)
            try:
                helper.stdin.write(b"1\n")
                answers = {line[:1]: line.split() for line in _read_lines(helper.stdout.fileno(), 2, deadline)}
                if answers.get(b"x") != [b"x", b"1", b"0"]:
                    return False
                output = b"".join(_read_until_end(fifo, deadline))
            finally:
                os.close(fifo)
            return HELPER_NAME.encode() in output
        except OSError:  # TimeoutError among them
            return False
        finally:
            helper.kill()
            try:
                helper.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            for stream in (helper.stdin, helper.stdout):
                stream.close()


def _wait_readable(fd: int, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([fd], [], [], left)[0]:
        raise TimeoutError("no answer in time")


def _read_until_end(fd: int, deadline: float):
    """The chunks read from ``fd`` up to its end; TimeoutError at ``deadline``."""
    while True:
        _wait_readable(fd, deadline)
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            continue
        if not chunk:
            return
        yield chunk


def _read_lines(fd: int, count: int, deadline: float) -> list:
    """The first ``count`` lines (without their newlines) read from ``fd``, fewer when it ends first;
    TimeoutError at ``deadline``.  Reads one byte at a time: nothing after them is taken."""
    data = b""
    while data.count(b"\n") < count:
        _wait_readable(fd, deadline)
        chunk = os.read(fd, 1)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n")[:count]


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
        if entry.name.isdigit() and stat_fields(int(entry.name))[1] == pid:
            return int(entry.name)
    return None


class Namespace:
    """The PID and mount namespace of one prompt.

    With a ``control`` folder (and bash), its first process is the HELPER that
    starts the commands (``submit``), and it runs with ``env``, which the
    commands inherit; else commands enter it with nsenter.  ``spill`` is the
    helper's second control folder, for what ``control`` cannot hold.
    """

    def __init__(self, launcher: Launcher, env: Optional[dict] = None, control: Optional[str] = None,
                 spill: Optional[str] = None, nicer: int = 0):
        self.launcher = launcher
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
        argv = self.launcher.helper_argv(self.control, cwd, self.spill) if helper else self.launcher.init_argv()
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

    def submit(self, ident: str, spilled: bool = False) -> tuple:
        """Have the helper start the command written to ``<control>/<ident>.sh`` (its output FIFO opened;
        with ``spilled``, both in the spill folder).

        Returns futures: its process group once started, its exit status once
        ended (None for both when the namespace ended first).  Raises OSError
        when the helper cannot be reached.
        """
        loop = asyncio.get_running_loop()
        answers = self._answers[ident] = (loop.create_future(), loop.create_future())
        if not self.alive or self._listener is None or self._listener.done():
            self._settle(answers)
            return answers
        try:
            os.write(self._unshare.stdin.fileno(), f"{'d' if spilled else ''}{ident}\n".encode())
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
                    future = self._answers[ident.decode()][0 if kind == b"p" else 1]
                    if not future.done():
                        future.set_result(int(value))
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


# --- process mode -------------------------------------------------------------------------


def ticks_since_boot() -> int:
    """Now, in the clock ticks of the start times in /proc/<pid>/stat."""
    try:
        with open("/proc/uptime") as f:
            return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return 0


def _inside(link: str, root: str) -> bool:
    return link == root or link.startswith(root + "/")


def session_members() -> dict:
    """{session id: pids of its live processes} for every session on the machine (one scan of /proc)."""
    members: dict = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            state, _, _, sid, _ = stat_fields(int(entry.name))
            if state not in ("", "Z", "X"):
                members.setdefault(sid, []).append(int(entry.name))
    return members


def alone(leader: int, members: dict) -> bool:
    """Whether nothing but ``leader`` is left in the session it leads, by :func:`session_members`."""
    return all(pid == leader for pid in members.get(leader, ()))


def kill_prompt_processes(root: str, marker: str, sessions: set, since: int = 0) -> int:
    """Kill the processes of a prompt in process mode, again until none is left (they may be forking).

    A prompt's processes: those in ``sessions`` (sessions whose leaders are our
    unreaped children, so the numbers are still theirs), those whose environment
    carries the prompt's marker or whose working or root folder is inside the
    prompt folder, and their descendants.  Only processes started at ``since``
    (clock ticks since boot) or later are read: older ones cannot be the
    prompt's, and reading every process's environment costs most of a close.
    Every kill goes through :func:`kill_verified`, so no process that merely
    took a number over is hit.
    """
    needle = f"{MARKER_VARIABLE}={marker}\0".encode()

    def read(pid: int):
        state, ppid, _, sid, _ = stat_fields(pid)
        if state in ("", "Z", "X"):
            return None
        marked = sid in sessions
        try:
            marked = marked or _inside(os.readlink(f"/proc/{pid}/cwd"), root)
            marked = marked or _inside(os.readlink(f"/proc/{pid}/root"), root)
            if not marked:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    marked = needle in f.read()
        except OSError:
            pass
        return ppid, marked

    def select(seen: dict) -> set:
        found = {pid for pid, (_, marked) in seen.items() if marked}
        grew = True
        while grew:  # descendants, whatever they changed about themselves
            grew = False
            for pid, (ppid, _) in seen.items():
                if ppid in found and pid not in found:
                    found.add(pid)
                    grew = True
        return found

    killed = 0
    for _ in range(KILL_ROUNDS):
        hit = kill_verified(live_pids(since), read, select)
        if not hit:
            break
        killed += hit
    return killed
