"""Which programs start a local sandbox's commands on this machine, found once per process.

``-S isolation=`` chooses between two modes: ``namespace`` (see
:mod:`~hermes_batch.local_sandbox.namespace`) and ``process`` (see
:mod:`~hermes_batch.local_sandbox.sweep`); ``auto`` takes ``namespace`` where it
works here.  A namespace's first process is the compiled helper
(:mod:`~hermes_batch.local_sandbox.namespace_init`, which makes the namespace
and lowers its privileges itself) where it builds and passes its check; else
HELPER, bash started through ``unshare`` and ``setpriv``, which speaks the same
protocol; without bash it idles, and commands enter the namespace with
``nsenter``.  Each candidate is tried before it is used (``_try_namespace``,
``_helper_works``), within READY_TIMEOUT_S.

In both modes commands run with no new privileges (the compiled helper sets it,
else ``setpriv --no-new-privs`` for the helper, and so every command it starts,
or each command in turn; setuid programs
such as sudo grant nothing), and when the runner is root with a capability
bounding set reduced to what a shell session needs, so a command cannot read
the runner's memory or environment through ``/proc`` (no ``CAP_SYS_PTRACE``),
mount, load modules or reach raw devices.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import subprocess
import tempfile
import time
from typing import Optional

import attrs

from . import namespace_init, nat
from ..sandbox_blocks.processes import pidfds_work, stat_fields

log = logging.getLogger(__name__)

SHELL = "/bin/sh"
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
# namespace with it (cheaper than a parent-death signal, which takes a setpriv per prompt).  Its commands
# can signal it (the kernel passes on a signal it has a handler for, and dash has one for INT): each
# handler is a no-op, so that `kill -TERM 1` never ends the namespace under the prompt, as the compiled
# helper ignores them too.  The runner ends it with SIGKILL, which it cannot catch.
KEEPALIVE = (
    "trap : TERM INT; exec 5<&0; (read _ <&5) & w=$!; exec 5<&-; "
    "echo ready; while :; do wait $w; [ $? -gt 128 ] || break; done"  # a trap interrupts the wait: wait again
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
    "set -m; trap : TERM INT; ctl=$1 cwd=$2 spill=$3; echo ready; "  # signals from its commands: see KEEPALIVE
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
CHECK_UID = 65534  # as root, the user a check of the compiled helper's boundary runs its command as


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
    # Why a launcher without the compiled helper (or without namespaces) is the one found, "" when it was chosen.
    reason: str = attrs.field(default="", eq=False)

    @property
    def helper(self) -> bool:
        """Whether the namespace's first process starts the commands (the compiled helper or HELPER)."""
        return bool(self.compiled) or self.bash is not None

    @property
    def boundary(self) -> bool:
        """Whether the namespace's first process also builds the commands' view of the files, runs them as a
        user of their own and holds them to limits (the compiled helper: see local_sandbox.boundary)."""
        return bool(self.compiled)

    @property
    def user_namespace(self) -> bool:
        """Whether its namespaces include a user namespace (those of a runner without root)."""
        return "-u" in self.compiled or "--user" in self.unshare

    def with_network(self) -> "Launcher":
        """This launcher with a network namespace in each of its namespaces, where unshare makes them (the compiled
        helper takes -n per sandbox instead)."""
        if self.compiled or not self.namespace:
            return self
        return attrs.evolve(self, unshare=(self.unshare[0], "--net", *self.unshare[1:]),
                            nsenter=(self.nsenter[0], "--net", *self.nsenter[1:]))

    @property
    def level(self) -> str:
        """The isolation level a run records: ``namespace`` (every protection), ``pid-namespace`` (a process
        namespace only: the bash helper or nsenter) or ``process``."""
        return "namespace" if self.boundary else "pid-namespace" if self.namespace else "process"

    @property
    def removes_command_files(self) -> bool:
        """Whether the helper removes a command's script and FIFO once it has opened them (the compiled one:
        bash would need an ``rm`` per command)."""
        return bool(self.compiled)

    def init_argv(self) -> list:
        """The first process of a new namespace (it prints ``ready``; it ends when its stdin closes)."""
        return [*self.unshare, "--", SHELL, "-c", KEEPALIVE]

    def helper_argv(self, control: str, cwd: str, spill: str, options: tuple = ()) -> list:
        """The first process of a new namespace that starts its commands (see HELPER), privileges lowered;
        ``options`` are the compiled helper's (its view, user, network and limits: see local_sandbox.boundary)."""
        if self.compiled:
            return [*self.compiled, *options, control, cwd, spill]
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


_private_networks: dict = {}


def private_network_works(found: Launcher) -> bool:
    """Whether the compiled helper of ``found`` can give its namespaces a network of their own (checked once)."""
    if not found.boundary:
        return False
    if found not in _private_networks:
        _private_networks[found] = _helper_works(found, boundary=True, options=("-n",))
    return _private_networks[found]


_tests_apart: dict = {}


def tests_apart_missing(found: Launcher) -> str:
    """Why the compiled helper of ``found`` cannot run a verifier's tests apart from the agent (grading.h: a user
    namespace of their own), or "" when it can (checked once)."""
    if not found.boundary:
        return f"its commands run without the compiled helper's namespaces ({found.reason or found.level})"
    if found not in _tests_apart:
        _tests_apart[found] = _grading_works(found)
    return _tests_apart[found]


def _grading_works(candidate: Launcher) -> str:
    """"" when the helper runs a verifier's tests (request g) here and reports the reward they wrote, else why not."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="hermes-batch-check-") as control:
        with open(os.path.join(control, "1.sh"), "w") as f:
            f.write('echo 0.5 > "$HERMES_REWARD_FILE"')
        with open(os.path.join(control, "1.env"), "wb") as f:
            f.write(b"PATH=/usr/bin:/bin\0")
        os.mkfifo(os.path.join(control, "1.out"))
        cwd, options = _check_view(control, ())
        try:
            helper = subprocess.Popen(
                candidate.helper_argv(control, cwd, control, options), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, start_new_session=True, bufsize=0,
            )
        except OSError as exc:
            return f"its helper could not start ({exc})"
        try:
            if _read_lines(helper.stdout.fileno(), 1, deadline) != [b"ready"]:
                return "its helper did not start"
            fifo = os.open(os.path.join(control, "1.out"), os.O_RDONLY | os.O_NONBLOCK)
            try:
                helper.stdin.write(b"g1\n")
                answers = {line[:1]: line.split() for line in _read_lines(helper.stdout.fileno(), 3, deadline)}
                output = b"".join(_read_until_end(fifo, deadline)).decode(errors="replace").strip()
            finally:
                os.close(fifo)
            report = answers.get(b"r", [b""] * 3)[-1]
            if answers.get(b"x") == [b"x", b"1", b"0"] and report == (b"f0.5\n").hex().encode():
                return ""
            last = output.splitlines()[-1] if output else "no output"
            return f"the check of its tests' namespaces failed ({last})"
        except OSError as exc:  # TimeoutError among them
            return f"the check of its tests' namespaces did not answer ({exc})"
        finally:
            helper.kill()
            try:
                helper.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            for stream in (helper.stdin, helper.stdout):
                stream.close()


_nats: dict = {}


def find_nat(found: Launcher, loopback: bool = False) -> tuple:
    """(the NAT program that gives the namespaces of ``found`` their network and a way out here, None), else (None,
    why not); found once per launcher (see local_sandbox.nat).  Without the compiled helper ``found`` is the
    launcher ``with_network()``."""
    key = (found, loopback)
    if key not in _nats:
        if not found.namespace:
            _nats[key] = (None, "commands run as plain processes, without namespaces")
        elif found.boundary and not private_network_works(found):
            _nats[key] = (None, "the local sandbox cannot give its namespaces a network of their own here"
                                f"{' (' + found.reason + ')' if found.reason else ''}")
        else:
            _nats[key] = nat.find(lambda program: _in_a_namespace(found, lambda pid: nat.attach_now(
                program, pid, found.user_namespace)), loopback)
    return _nats[key]


def _in_a_namespace(found: Launcher, check) -> Optional[str]:
    """``check(pid)`` of the outer process of a namespace of ``found`` with a network of its own (the compiled
    helper's -n, else unshare's --net); None when it passes, else why not."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="hermes-batch-check-") as control:
        try:
            helper = subprocess.Popen(
                found.helper_argv(control, control, control, ("-n",)) if found.compiled else found.init_argv(),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, start_new_session=True, bufsize=0,
            )
        except OSError as exc:
            return f"could not be checked ({exc})"
        try:
            if _read_lines(helper.stdout.fileno(), 1, deadline) != [b"ready"]:
                return "could not be checked (the namespace did not start)"
            return check(helper.pid)  # the outer process, in the namespaces it made (see Namespace.start)
        except OSError as exc:
            return f"could not be checked ({exc})"
        finally:
            helper.kill()
            try:
                helper.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            for stream in (helper.stdin, helper.stdout):
                stream.close()


def _find_launcher(isolation: str, helper: str) -> Launcher:
    setpriv = _setpriv_prefix()
    if isolation == "process":
        return Launcher(False, setpriv, reason="-S isolation=process asks for plain processes")
    if pidfds_work():
        found, reason = _namespace_launcher(setpriv, helper)
        if found is not None:
            return found
    else:
        reason = "this kernel has no pidfds (Linux 5.3 or later), which a namespace's kill relies on"
    if isolation == "namespace":
        raise RuntimeError(reason)
    log.info("The local sandbox runs commands as plain processes: %s.", reason)
    return Launcher(False, setpriv, reason=reason)


def _namespace_launcher(setpriv: tuple, helper: str) -> tuple:
    """(a namespace launcher that works here, None), else (None, why not): the compiled helper first (with
    ``helper`` auto), then unshare with the bash helper, then unshare with nsenter for each command."""
    root = os.geteuid() == 0
    compiled_failed = ""
    why = "-S helper=bash asks for the bash helper"
    if helper == "auto":
        built, why = namespace_init.build()
        if built is not None:
            # As root its commands keep what a shell session needs; without, the user namespace's nothing.
            keep = ROOT_CAPABILITY_MASK if root else 0
            candidate = Launcher(True, setpriv, compiled=(built, *(() if root else ("-u",)), "-k", f"{keep:x}"))
            if _helper_works(candidate, boundary=True):
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
        (unshare, *(() if root else ("--user", "--map-current-user")), "--pid", "--mount", "--ipc", "--fork",
         "--mount-proc", "--kill-child"),
        (nsenter, *(() if root else ("--user", "--preserve-credentials")), "--pid", "--mount", "--ipc"),
        _nsenter_has_wdns(nsenter),
        shutil.which("bash"),
        reason=f"the compiled helper cannot be used ({why})",
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
        prefix += ["--inh-caps=-all", f"--bounding-set=-all,{keep}", "--clear-groups"]
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


def _helper_works(candidate: Launcher, boundary: bool = False, options: tuple = ()) -> bool:
    """Whether a namespace's helper runs a command here (``echo`` of its pid 1's name, through the FIFO),
    within READY_TIMEOUT_S; with ``boundary``, in a view of the files of its own (and, as root, as a user of its
    own), with ``options`` besides."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="hermes-batch-check-") as control:
        with open(os.path.join(control, "1.sh"), "w") as f:
            f.write("tr '\\0' ' ' < /proc/1/cmdline")
        os.mkfifo(os.path.join(control, "1.out"))
        cwd, options = _check_view(control, options) if boundary else (control, options)
        try:
            helper = subprocess.Popen(
                candidate.helper_argv(control, cwd, control, options), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
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


def _check_view(control: str, options: tuple) -> tuple:
    """(folder, options) of a check of the compiled helper's boundary: a folder of the command's own, in a view of
    its own, as root as CHECK_UID."""
    cwd = os.path.join(control, "work")
    os.mkdir(cwd)
    options = ("-r", cwd, "-t", "1048576", *options)
    if os.geteuid() == 0:
        os.chown(cwd, CHECK_UID, CHECK_UID)
        options += ("-i", f"{CHECK_UID}:{CHECK_UID}", "-g", f"{CHECK_UID + 1}:{CHECK_UID + 1}")
    return cwd, options


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

