"""The local sandbox: the shared sandbox contract, plus what only the local backend does."""

from __future__ import annotations

import asyncio
import collections
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import attrs
import pytest

from hermes_batch.local_sandbox.control import DEFAULT_BASE, SPILL_BYTES, ControlRoot, run_key
from hermes_batch.local_sandbox import launchers, namespace_init
from hermes_batch.local_sandbox.launchers import HELPER_NAME
from hermes_batch.local_sandbox.backend import (
    HELD_BEFORE_CHECK,
    LocalSandbox,
    LocalSandboxBackend,
    LocalSandboxConfig,
)
from hermes_batch.sandbox_blocks.processes import ChildProcess
from hermes_batch.errors import SandboxError
from hermes_batch.contract.plugins import collect, get_plugin_manager
from hermes_batch.formats.records import SandboxSpec
from hermes_batch.contract.run_context import RunContext
from hermes_batch.testing.sandbox_contract import RUNNER_SECRET, SandboxContract


# A Python the sandbox's commands see: the system's (hermes-batch's own virtual environment is hidden from them).
SANDBOX_PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or sys.executable


def make_backend(tmp_path: Path, **options) -> LocalSandboxBackend:
    return LocalSandboxBackend(LocalSandboxConfig(**options), RunContext("local-test", tmp_path / "run", seed=0))


def spec(index: int = 0, cwd=None, env=None) -> SandboxSpec:
    return SandboxSpec("local-test", index, f"{index:08d}feedface", cwd=cwd, env=dict(env or {}))


class TestLocalSandboxContract(SandboxContract):
    max_output_chars = 10_100  # the limit below, plus the omission notice
    options: dict = {}  # the backend's options besides max_output_bytes
    stops_processes = True

    @staticmethod
    def check_launcher(launcher) -> None:
        """What the variant must have found on this machine."""

    @pytest.fixture
    async def backend(self, tmp_path):
        backend = make_backend(tmp_path, max_output_bytes=10_000, **self.options)
        await backend.start()
        self.check_launcher(backend.launcher)
        network = backend.isolation_details.get("network")
        if network == "host" and "network_isolation" not in self.not_applicable:  # no NAT program here: said at start
            gaps = [gap for gap in backend.isolation_details["missing"] if gap.startswith("a network")]
            self.not_applicable = {**self.not_applicable, "network_isolation": "; ".join(gaps) or "network=host"}
        yield backend
        await backend.shutdown()

    async def sandbox_exists(self, sandbox: LocalSandbox) -> bool:
        return sandbox.root.exists()

    limits = {"memory": 128 * 1024 * 1024, "pids": 32, "disk": 16 * 1024 * 1024}

    @pytest.fixture
    async def limited_backend(self, tmp_path):
        self._applies("memory")
        backend = make_backend(tmp_path / "limited", memory="128m", pids=32, disk="16m", **self.options)
        await backend.start()
        yield backend
        await backend.shutdown()

    @pytest.fixture
    async def offline_backend(self, tmp_path):
        self._applies("network")
        backend = make_backend(tmp_path / "offline", network="none", **self.options)
        await backend.start()
        yield backend
        await backend.shutdown()

    async def group_only_file(self, sandbox: LocalSandbox):
        if os.geteuid() != 0:
            return None  # only root can give a file to another owner (a runner in a privileged group is refused)
        secret = sandbox.root / "group-only.txt"
        secret.write_bytes(RUNNER_SECRET)
        os.chown(secret, 0, os.getgroups()[0] if os.getgroups() else 0)  # root's, readable by a group of the runner
        secret.chmod(0o040)
        return str(secret)

    async def setuid_program(self, sandbox: LocalSandbox):
        if os.geteuid() != 0:
            return None  # only root can make a program setuid root
        program = sandbox.root / "setuid-id"
        shutil.copy("/usr/bin/id", program)
        os.chown(program, 0, 0)
        program.chmod(0o4755)
        return str(program)

    async def test_exec_returns_when_the_command_ends_though_a_background_child_holds_its_output(self, sandbox):
        # Sandbox.exec's rule, stricter than the shared contract's "not past the timeout"
        started = time.monotonic()
        result = await sandbox.exec("(sleep 6; touch lived) & echo started", 60)
        assert time.monotonic() - started < 4.5  # not the 6 s of the child that holds the output
        assert (result.output, result.exit_code, result.timed_out) == ("started\n", 0, False)
        await asyncio.sleep(max(0.0, 7 - (time.monotonic() - started)))
        for _ in range(50):  # it lives on, in the sandbox, until close
            if "lived" in (await sandbox.exec("ls", 30)).output:
                break
            await asyncio.sleep(0.1)
        assert "lived" in (await sandbox.exec("ls", 30)).output


# What a sandbox without the compiled helper does not protect (the start of the run says so: see
# test_auto_says_once_which_protections_are_missing).
NO_BOUNDARY = {
    name: f"{why} (-S isolation=auto says so at start)"
    for name, why in {
        "neighbours": "commands see the machine's files", "home": "commands see the machine's files",
        "run_folder": "commands see the machine's files", "write_outside": "commands write as the runner",
        "setuid": "as root, commands keep a shell's capabilities", "memory": "no limits",
        "pids": "no limits", "disk": "no limits", "network": "-S network=none is refused",
        "groups": "commands run as the runner's user (as root: root, with a shell's capabilities)",
        "keyring": "prompts may share a session keyring, and as root root's user keyring",
        "first_process": "nothing is hidden to be named",
    }.items()
}


class TestLocalSandboxContractProcessMode(TestLocalSandboxContract):
    """The same contract where commands run as plain processes (no namespaces on the machine)."""

    options = {"isolation": "process"}
    not_applicable = {**NO_BOUNDARY, "ipc": "no IPC namespace (-S isolation=auto says so at start)",
                      "network_isolation": "commands use the machine's network (-S isolation=auto says so at start)",
                      "init_kill": "commands are plain processes: pid 1 is the machine's own"}

    @staticmethod
    def check_launcher(launcher) -> None:
        assert not launcher.namespace


class TestLocalSandboxContractBashHelper(TestLocalSandboxContract):
    """The same contract where namespaces start through unshare, setpriv and bash (no C compiler)."""

    options = {"helper": "bash"}
    not_applicable = NO_BOUNDARY
    stops_processes = False  # the helper's own subshells share the namespace: a kill -9 -1 would end them too

    @staticmethod
    def check_launcher(launcher) -> None:
        assert not launcher.compiled


@pytest.fixture(params=["compiled", "bash"])
async def backend(tmp_path, request):
    # Namespaces through the compiled helper (the default where a C compiler is: scripts/test.sh installs
    # one), and through bash.
    if request.param == "compiled" and namespace_init.compiler() is None:
        pytest.skip("no C compiler here")
    backend = make_backend(tmp_path, helper="bash" if request.param == "bash" else "auto")
    await backend.start()
    if request.param == "compiled" and backend.launcher.namespace:
        assert backend.launcher.compiled, "this machine has a C compiler: the compiled helper is used"
    yield backend
    await backend.shutdown()


@pytest.fixture
async def sandbox(backend):
    sandbox = await backend.open(spec())
    yield sandbox
    await sandbox.close()


_sleeps = iter(range(1, 10**6))


def unique_sleep() -> str:
    """A sleep duration no other process of the machine has on its command line."""
    return f"{600 + next(_sleeps)}.{os.getpid()}{int(time.monotonic() * 1000) % 100000}"


async def wait_until(condition, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        await asyncio.sleep(0.02)
    return condition()


def test_registered_as_default_plugin():
    registry = collect(get_plugin_manager(load_entry_points=False))
    assert registry.get("sandboxes", "local") is LocalSandboxBackend


async def test_prompt_folder_is_named_for_the_prompt_under_scratch(backend):
    sandbox = await backend.open(spec(7))
    try:
        assert sandbox.root.parent == Path(os.path.realpath(backend.run.scratch_dir))
        assert sandbox.root.name.startswith("p7-00000007-")
        assert sandbox.workdir == str(sandbox.root)
    finally:
        await sandbox.close()


@pytest.mark.parametrize(
    "cwd, inside",
    [("/app/src", "app/src"), ("project", "project"), ("../../escape", "escape"), ("/", "")],
)
async def test_cwd_is_mapped_inside_the_prompt_folder(backend, cwd, inside):
    sandbox = await backend.open(spec(cwd=cwd))
    try:
        assert Path(sandbox.workdir) == sandbox.root / inside
        assert Path(sandbox.workdir).is_dir()
        assert (await sandbox.exec("pwd", 10)).output.strip() == sandbox.workdir
    finally:
        await sandbox.close()


async def test_environment_is_clean_and_home_is_the_prompt_folder(sandbox):
    env = dict(
        line.split("=", 1) for line in (await sandbox.exec("env", 10)).output.splitlines() if "=" in line
    )
    assert env["HOME"] == str(sandbox.root)
    assert env["TMPDIR"].startswith(str(sandbox.root) + "/")
    assert env["LANG"] == env["LC_ALL"] == "C.UTF-8"
    assert env["TERM"] == "dumb"
    assert set(env) <= {"PATH", "HOME", "LANG", "LC_ALL", "TERM", "TMPDIR", "PWD", "OLDPWD", "SHLVL", "_"}
    assert (await sandbox.exec('mktemp', 10)).output.startswith(env["TMPDIR"])


@pytest.mark.parametrize(
    "path",
    ["../outside.txt", "a/../../outside.txt", "/etc/passwd"],
)
async def test_paths_outside_the_prompt_folder_are_refused(sandbox, path):
    with pytest.raises(PermissionError, match="outside this prompt's sandbox folder"):
        await sandbox.read_file(path)
    with pytest.raises(PermissionError, match="outside this prompt's sandbox folder"):
        await sandbox.write_file(path, b"x")
    assert not (sandbox.root.parent / "outside.txt").exists()


async def test_symlinks_leading_outside_are_refused(sandbox, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    await sandbox.exec(f"ln -s {outside} link-dir && ln -s {outside}/secret.txt link-file", 10)
    with pytest.raises(PermissionError):
        await sandbox.read_file("link-file")
    with pytest.raises(PermissionError):
        await sandbox.write_file("link-dir/new.txt", b"x")
    assert not (outside / "new.txt").exists()
    # a symlink that stays inside is fine
    await sandbox.exec("mkdir real && echo inside > real/f && ln -s real alias", 10)
    assert await sandbox.read_file("alias/f") == b"inside\n"


async def test_another_prompts_folder_is_refused(backend):
    first = await backend.open(spec(0))
    second = await backend.open(spec(1))
    try:
        await first.write_file("mine.txt", b"first")
        with pytest.raises(PermissionError):
            await second.read_file(str(first.root / "mine.txt"))
    finally:
        await first.close()
        await second.close()


async def test_keep_leaves_the_folder_but_kills_processes(tmp_path):
    backend = make_backend(tmp_path, keep=True)
    await backend.start()
    sandbox = await backend.open(spec())
    await sandbox.write_file("result.txt", b"for debugging")
    marker = unique_sleep()
    await sandbox.exec(f"sleep {marker} > /dev/null 2>&1 &", 10)
    assert await wait_until(lambda: _alive_with(f"sleep {marker}"))
    await sandbox.close()
    await backend.shutdown()
    assert (sandbox.root / "result.txt").read_bytes() == b"for debugging"
    assert not _alive_with(f"sleep {marker}")


async def test_close_kills_background_processes_and_removes_the_folder(backend):
    sandbox = await backend.open(spec())
    marker = unique_sleep()
    await sandbox.exec(f"sleep {marker} > /dev/null 2>&1 &", 10)
    await asyncio.sleep(0.2)
    assert _alive_with(f"sleep {marker}")  # background processes outlive the command that started them
    await sandbox.close()
    assert not _alive_with(f"sleep {marker}")
    assert not sandbox.root.exists()


async def test_close_removes_folders_made_unwritable(backend):
    sandbox = await backend.open(spec())
    await sandbox.exec("mkdir -p locked/inner && touch locked/inner/f && chmod 000 locked/inner locked", 10)
    await sandbox.close()
    assert not sandbox.root.exists()


async def test_shutdown_closes_sandboxes_left_open(tmp_path):
    backend = make_backend(tmp_path)
    await backend.start()
    sandbox = await backend.open(spec())
    await backend.shutdown()
    assert not sandbox.root.exists()
    assert not backend.run.scratch_dir.exists()


async def test_escaped_process_holding_the_pipe_does_not_hang_exec(sandbox):
    # setsid leaves the process group: exec returns as the command ends all the same (the bounded drain),
    # and the command, which ended, did not time out.
    started = time.monotonic()
    result = await sandbox.exec("setsid sleep 3 & echo x", 0.5)
    assert result.output == "x\n"
    assert not result.timed_out and result.exit_code == 0
    assert time.monotonic() - started < 2


async def test_exec_in_a_removed_folder_is_a_sandbox_error(sandbox, tmp_path):
    # Removed from the test process, never by a shell command: a wrong $HOME must not cost the machine.
    assert Path(os.path.realpath(tmp_path)) in sandbox.root.parents
    shutil.rmtree(sandbox.root)
    with pytest.raises(SandboxError):
        await sandbox.exec("echo hi", 10)


async def test_many_concurrent_commands(backend):
    sandboxes = [await backend.open(spec(i)) for i in range(8)]
    try:
        results = await asyncio.gather(*(sandboxes[i % 8].exec(f"echo {i}", 10) for i in range(200)))
    finally:
        for sandbox in sandboxes:
            await sandbox.close()
    assert [r.output for r in results] == [f"{i}\n" for i in range(200)]
    assert all(r.exit_code == 0 for r in results)


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        LocalSandboxConfig(max_starting=0)


def _alive_with(marker: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line contains ``marker``."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


async def _within(seconds: float, condition) -> bool:
    """Whether ``condition()`` holds within ``seconds`` (polled on the event loop)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


@pytest.mark.parametrize("isolation", ["namespace", "process"])
async def test_a_command_spawned_as_the_prompt_is_cancelled_dies_at_close(tmp_path, monkeypatch, isolation):
    # A command whose shell exec lost track of (cancelled right after the spawn) still dies at close:
    # close finds it by its namespace, or in process mode by its marker and folder.
    real_start = ChildProcess.start.__func__

    async def start_then_cancel(cls, *args, **kwargs):
        await real_start(cls, *args, **kwargs)  # started, and the ChildProcess that knew it dropped
        raise asyncio.CancelledError

    backend = make_backend(tmp_path, isolation=isolation)
    await backend.start()
    try:
        sandbox = await backend.open(spec())
        marker = f"30.{os.getpid()}{int(time.monotonic() * 1000) % 100000}"
        await sandbox.exec("true", 10)  # the namespace, if any, is made by the first command
        if sandbox._namespace is not None and sandbox._namespace.control:
            # the namespace's helper started it: the exec is cancelled once it runs, its process group
            # killed through the helper, and close ends whatever is left
            running = asyncio.ensure_future(sandbox.exec(f"setsid sleep {marker}", 60))
            assert await _within(5, lambda: _alive_with(f"sleep {marker}")), "the command never started"
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
        else:
            monkeypatch.setattr(ChildProcess, "start", classmethod(start_then_cancel))
            with pytest.raises(asyncio.CancelledError):
                await sandbox.exec(f"sleep {marker}", 60)
            monkeypatch.undo()
        assert await _within(5, lambda: _alive_with(f"sleep {marker}")), "the command never started"
        await sandbox.close()
        assert await _within(5, lambda: not _alive_with(f"sleep {marker}"))
    finally:
        await backend.shutdown()


async def test_process_mode_holds_only_the_shells_whose_sessions_live_on(tmp_path):
    # A shell is held unreaped while its session may have members (so its number cannot pass to another
    # process before close kills them); a shared scan once HELD_BEFORE_CHECK are held lets the others go.
    backend = make_backend(tmp_path, isolation="process")
    await backend.start()
    try:
        sandbox = await backend.open(spec())
        marker = f"{os.getpid()}{int(time.monotonic() * 1000) % 100000}"
        assert (await sandbox.exec(f"sleep {marker} >/dev/null 2>&1 & echo started", 10)).output.strip() == "started"
        [background] = sandbox._held
        for _ in range(HELD_BEFORE_CHECK):
            assert (await sandbox.exec("true", 10)).exit_code == 0
        assert background in sandbox._held and len(sandbox._held) < HELD_BEFORE_CHECK
        assert _alive_with(f"sleep {marker}")
        await sandbox.close()
        assert not sandbox._held
        assert await _within(5, lambda: not _alive_with(f"sleep {marker}"))
    finally:
        await backend.shutdown()


async def test_a_start_cancelled_while_the_process_starts_kills_and_reaps_it(monkeypatch):
    # The fork and exec run on a thread; a cancel that arrives meanwhile must not leave the process behind.
    started, release = threading.Event(), threading.Event()
    popens = []
    real_popen = subprocess.Popen

    def slow_popen(*args, **kwargs):
        popen = real_popen(*args, **kwargs)
        popens.append(popen)
        started.set()
        release.wait(10)  # the cancel arrives while the start is still on its thread
        return popen

    monkeypatch.setattr(subprocess, "Popen", slow_popen)
    task = asyncio.create_task(ChildProcess.start(["sleep", "60"], stdin=subprocess.DEVNULL))
    assert await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done(), "start must wait for the process it is starting"
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _within(5, lambda: popens[0].returncode is not None)
    assert popens[0].returncode == -signal.SIGKILL  # killed, and reaped by ChildProcess


SWAPPER = """
import ctypes, os
renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
AT_FDCWD, RENAME_EXCHANGE = -100, 2
open("started", "w").close()
while True:  # dir is, in turn, a folder of the prompt and a link that leads out of it
    if renameat2(AT_FDCWD, b"dir", AT_FDCWD, b"other", RENAME_EXCHANGE) != 0:
        raise OSError(ctypes.get_errno(), "renameat2")
"""


async def test_a_folder_swapped_for_a_link_in_a_tight_loop_never_leads_out(sandbox, tmp_path):
    # A swap a few microseconds long, as a hostile command in C or Python makes it: a path check
    # followed by an open (realpath, then open) loses this race every few dozen reads.
    outside = tmp_path / "runner-folder"
    outside.mkdir()
    (outside / "f").write_bytes(b"RUNNER-ONLY")
    await sandbox.write_file("dir/f", b"inside")
    await sandbox.write_file("swapper.py", SWAPPER.encode())
    os.symlink(outside, sandbox.root / "other")
    swapper = asyncio.ensure_future(sandbox.exec(f"exec {SANDBOX_PYTHON} swapper.py", 900))  # past the deadline below
    try:
        assert await wait_until(lambda: (sandbox.root / "started").exists(), timeout=60)
        # The race ran both ways when reads met the folder, and the link, many times each. How many attempts
        # that takes depends on the machine (on a loaded one, a read seldom fits between two swaps), so the
        # reads go on until both have been met, not for a fixed number of attempts.
        outcomes = collections.Counter()
        deadline = time.monotonic() + 600
        while outcomes.total() < 3000 or outcomes["read"] < 50 or outcomes.total() - outcomes["read"] < 50:
            assert time.monotonic() < deadline, f"the race did not run both ways in 600 s: {outcomes}"
            try:
                data = await sandbox.read_file("dir/f")
            except OSError as exc:
                outcomes[type(exc).__name__] += 1
                continue
            assert data == b"inside", outcomes
            outcomes["read"] += 1
            try:
                await sandbox.write_file("dir/f", b"inside")
            except OSError:
                pass
    finally:
        swapper.cancel()
        await asyncio.gather(swapper, return_exceptions=True)
    assert (outside / "f").read_bytes() == b"RUNNER-ONLY"
    assert sorted(p.name for p in outside.iterdir()) == ["f"]


async def test_sockets_are_refused_without_blocking(sandbox):
    listen = "import socket, time; s = socket.socket(socket.AF_UNIX); s.bind('listening.sock'); s.listen(); time.sleep(60)"
    await sandbox.exec(f'{SANDBOX_PYTHON} -c "{listen}" > /dev/null 2>&1 &', 10)
    assert await wait_until(lambda: (sandbox.root / "listening.sock").exists(), timeout=30)
    for call in (sandbox.read_file("listening.sock"), sandbox.write_file("listening.sock", b"x")):
        with pytest.raises(OSError) as info:
            await asyncio.wait_for(call, 10)
        assert info.value.errno == errno.EINVAL
        assert "socket" in info.value.strerror


def test_isolation_must_be_known():
    with pytest.raises(ValueError, match="isolation must be one of"):
        LocalSandboxConfig(isolation="chroot")


async def test_namespace_mode_is_used_where_the_machine_allows_it(backend):
    # This machine (and CI) has util-linux and namespaces; elsewhere auto falls back to process mode.
    assert backend.launcher.namespace


async def test_a_process_that_cleared_its_environment_and_left_dies_with_the_namespace(sandbox):
    # Escapes every trace process mode follows (group, session, folder, marker variable).
    marker = unique_sleep()
    await sandbox.exec(f"(cd / && env -i setsid sh -c 'sleep {marker}' > /dev/null 2>&1 &)", 10)
    assert await wait_until(lambda: _alive_with(f"sleep {marker}"))
    await sandbox.close()
    assert await wait_until(lambda: not _alive_with(f"sleep {marker}"))


async def test_commands_see_only_their_own_processes(sandbox):
    listing = (await sandbox.exec("ls /proc | grep -c '^[0-9]'; cat /proc/1/cmdline | tr '\\0' ' '", 10)).output
    count, init = listing.split("\n", 1)
    assert int(count) < 10  # the namespace's first process, this command's shells: not the machine's
    assert HELPER_NAME in init if sandbox._namespace.control else "while :; do sleep 3600" in init
    assert str(os.getpid()) not in (await sandbox.exec("echo $PPID", 10)).output


def _status_fields(text: str) -> dict:
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


@pytest.mark.parametrize("mode", ["namespace", "process"])
async def test_commands_gain_no_privileges_and_root_keeps_only_a_shells_capabilities(backend, tmp_path, mode):
    if mode == "process":
        backend = make_backend(tmp_path / "process", isolation="process")
        await backend.start()
    sandbox = await backend.open(spec())
    try:
        status = _status_fields((await sandbox.exec("cat /proc/self/status", 10)).output)
    finally:
        await sandbox.close()
        if mode == "process":
            await backend.shutdown()
    if not backend.launcher.setpriv and not backend.launcher.compiled:
        pytest.skip("no setpriv here")
    assert status["NoNewPrivs"].strip() == "1"
    assert int(status["CapInh"], 16) == int(status["CapAmb"], 16) == 0
    if os.geteuid() == 0 and mode == "namespace" and backend.launcher.boundary:
        assert int(status["CapBnd"], 16) == int(status["CapEff"], 16) == int(status["CapPrm"], 16) == 0
        assert status["Uid"].split()[0] != "0"  # a user of the prompt's own
    elif os.geteuid() == 0:
        assert int(status["CapBnd"], 16) == int(status["CapEff"], 16) == launchers.ROOT_CAPABILITY_MASK
        assert not int(status["CapEff"], 16) & (1 << 19 | 1 << 21)  # CAP_SYS_PTRACE, CAP_SYS_ADMIN


async def test_a_command_cannot_uncover_the_machines_proc_below_its_own(sandbox):
    if not sandbox._namespace:
        pytest.skip("no namespaces here")
    result = await sandbox.exec("umount -l /proc; umount /proc; ls /proc | grep -c '^[0-9]'", 10)
    assert int(result.output.split()[-1]) < 10, result.output


async def test_a_prompt_whose_tools_run_commands_gets_its_namespace_as_the_sandbox_opens(backend):
    sandbox = await backend.open(attrs.evolve(spec(), commands=True))
    try:
        if sandbox._namespace is None:
            pytest.skip("no namespaces here")
        assert await wait_until(lambda: sandbox._namespace.alive, 30)  # no command asked for it
        first = (await sandbox.exec("readlink /proc/self/ns/pid", 10)).output
        assert first != os.readlink("/proc/self/ns/pid") + "\n"
        assert (await sandbox.exec("readlink /proc/self/ns/pid", 10)).output == first
    finally:
        await sandbox.close()
    assert not _alive_with(str(sandbox.root))  # the helper names the prompt folder on its command line
    lazy = await backend.open(spec())  # no tool of it runs commands: nothing starts before one does
    try:
        await asyncio.sleep(0.2)
        assert lazy._namespace is None or lazy._namespace.init_pid is None
    finally:
        await lazy.close()


async def test_a_sandbox_closed_while_its_namespace_starts_leaves_no_process(backend):
    for pause in (0, 0, 0.001, 0.005, 0.02):
        sandbox = await backend.open(attrs.evolve(spec(), commands=True))
        if sandbox._namespace is None:
            pytest.skip("no namespaces here")
        await asyncio.sleep(pause)
        await sandbox.close()
        await asyncio.sleep(0.3)  # a start that was not stopped would have its helper by now
        assert not _alive_with(str(sandbox.root)), pause


async def test_a_namespace_that_cannot_start_at_open_is_the_first_commands_error(backend, monkeypatch):
    if not backend.launcher.namespace:
        pytest.skip("no namespaces here")
    if backend.launcher.compiled:
        broken = attrs.evolve(backend.launcher, compiled=("/nonexistent/helper", *backend.launcher.compiled[1:]))
    else:
        broken = attrs.evolve(backend.launcher, unshare=("/nonexistent/unshare",))
    monkeypatch.setattr(backend, "launcher", broken)
    sandbox = await backend.open(attrs.evolve(spec(), commands=True))
    try:
        with pytest.raises(SandboxError, match="Could not start the namespace"):
            await sandbox.exec("echo hi", 10)
    finally:
        await sandbox.close()


async def test_concurrent_first_commands_share_one_namespace(sandbox):
    results = await asyncio.gather(*(sandbox.exec("readlink /proc/self/ns/pid", 30) for _ in range(6)))
    namespaces = {r.output for r in results}
    assert len(namespaces) == 1 and namespaces != {os.readlink("/proc/self/ns/pid") + "\n"}


RUNNER_THAT_DIES = """
import asyncio, sys, tempfile
from pathlib import Path
from hermes_batch.local_sandbox.backend import LocalSandboxBackend, LocalSandboxConfig
from hermes_batch.formats.records import SandboxSpec
from hermes_batch.contract.run_context import RunContext

async def main():
    # with bash, namespaces without the boundary (isolation=namespace insists on it)
    config = LocalSandboxConfig(isolation="namespace" if sys.argv[3] == "auto" else "auto", helper=sys.argv[3])
    backend = LocalSandboxBackend(config, RunContext("r", Path(sys.argv[1]), seed=0))
    await backend.start()
    sandbox = await backend.open(SandboxSpec("r", 0, "0123456789abcdef"))
    await sandbox.exec(f"setsid sleep {sys.argv[2]} > /dev/null 2>&1 &", 10)
    print("started", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.parametrize("helper", ["auto", "bash"])
def test_the_namespace_dies_with_a_runner_killed_by_sigkill(tmp_path, helper):
    marker = unique_sleep()
    runner = subprocess.Popen([sys.executable, "-c", RUNNER_THAT_DIES, str(tmp_path), marker, helper],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert runner.stdout.readline() == "started\n"
        deadline = time.monotonic() + 10
        while not _alive_with(f"sleep {marker}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive_with(f"sleep {marker}")
    finally:
        runner.kill()
        runner.wait()
    deadline = time.monotonic() + 10
    while _alive_with(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive_with(f"sleep {marker}")
    # what it left in memory goes when the next backend of the same run folder starts
    left = _control_roots(tmp_path)
    if left:
        asyncio.run(_start_and_shut_down(make_backend_for(tmp_path)))
        assert not any(path.exists() for path in left)


def make_backend_for(run_dir: Path, **options) -> LocalSandboxBackend:
    return LocalSandboxBackend(LocalSandboxConfig(**options), RunContext("r", run_dir, seed=0))


async def _start_and_shut_down(backend: LocalSandboxBackend) -> None:
    await backend.start()
    await backend.shutdown()


def _control_roots(run_dir: Path) -> list[Path]:
    """The folders in memory that backends of the run folder ``run_dir`` made for their control folders."""
    parent = Path(DEFAULT_BASE, f"hermes-batch-{os.geteuid()}")
    return sorted(parent.glob(run_key(run_dir / "scratch") + "-*"))


# Runs as the only program of a PID namespace of its own (under a shell that reaps orphans), where
# it can choose the next pid (ns_last_pid) without touching the machine's: a process the sandbox once
# started ends, and an unrelated process is given its number before the sandbox closes.
PID_REUSE = """
import asyncio, os, subprocess, sys, time
from pathlib import Path
from hermes_batch.errors import SandboxError
from hermes_batch.local_sandbox.launchers import HELPER, HELPER_NAME, KEEPALIVE
from hermes_batch.local_sandbox.backend import LocalSandboxBackend, LocalSandboxConfig
from hermes_batch.formats.records import SandboxSpec
from hermes_batch.contract.run_context import RunContext

folder, isolation, case, helper = sys.argv[1:]

def pgid_of(needle):
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if Path(entry.path, "cmdline").read_bytes().startswith(needle):
                    return os.getpgid(int(entry.name))
            except OSError:
                pass

async def ended(needle):
    for _ in range(200):
        if pgid_of(needle) is None:
            return
        await asyncio.sleep(0.05)
    raise SystemExit(f"{needle} did not end")

def unrelated_process_numbered(pid):
    # A session leader of its own, as a user's shell or daemon is.
    for _ in range(20):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
        if victim.pid == pid or pid in HELD:
            return victim
        victim.kill()
        victim.wait()
    raise SystemExit(f"could not give the number {pid} to another process")

HELD = set()

async def main():
    config = LocalSandboxConfig(isolation=isolation, helper=helper)
    backend = LocalSandboxBackend(config, RunContext("r", Path(folder), seed=0))
    await backend.start()
    sandbox = await backend.open(SandboxSpec("r", 0, "0123456789abcdef"))
    await sandbox.exec("true", 10)
    if case == "group":  # a command's group, alive when the command ended, empty later
        await sandbox.exec("sleep 1.5 > /dev/null 2>&1 &", 10)
        number = pgid_of(b"sleep\\x001.5\\x00")
        assert number is not None
        await ended(b"sleep\\x001.5\\x00")
    else:  # the namespace's first process, ended by the prompt itself
        number = sandbox._namespace.init_pid
        launcher = sandbox._namespace.launcher
        # its commands' signals are refused or ignored (a no-op handler): ended from outside
        await sandbox.exec("kill -TERM 1; kill -INT 1", 10)
        assert sandbox._namespace.alive
        os.kill(number, 15 if launcher.compiled else 9)
        if launcher.compiled:
            first = [HELPER_NAME]  # what its command line shows (the rest is hidden)
        else:
            first = [launcher.bash, "-c", HELPER] if sandbox._namespace.control else ["/bin/sh", "-c", KEEPALIVE]
        await ended("\\0".join(first).encode() + b"\\x00")
    if os.path.exists(f"/proc/{number}"):  # the sandbox still holds the number: nobody else can get it
        HELD.add(number)
    victim = unrelated_process_numbered(number)
    await sandbox.close()
    await backend.shutdown()
    time.sleep(0.2)
    print("alive" if victim.poll() is None else "killed", victim.pid == number, flush=True)
    victim.kill()

asyncio.run(main())
"""


@pytest.mark.parametrize(
    "isolation, case, helper",
    [("namespace", "group", "auto"), ("process", "group", "auto"), ("namespace", "init", "auto"),
     ("auto", "group", "bash"), ("auto", "init", "bash")],
)
def test_close_never_kills_a_process_that_took_over_a_number_the_sandbox_used(tmp_path, isolation, case, helper):
    if os.geteuid() != 0:
        pytest.skip("choosing the next pid of a PID namespace (ns_last_pid) takes root")
    reaper = '"$@" & wait $!'  # PID 1 of the namespace: reaps orphans as init does
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", reaper, "sh",
         sys.executable, "-c", PID_REUSE, str(tmp_path / "run"), isolation, case, helper],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "alive", done.stdout


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("control_dir", [DEFAULT_BASE, ""])
async def test_the_namespace_helpers_control_folder_is_gone_after_close(tmp_path, keep, control_dir):
    backend = make_backend(tmp_path, isolation="namespace", keep=keep, control_dir=control_dir)
    await backend.start()
    try:
        sandbox = await backend.open(spec())
        if sandbox._namespace.control is None:
            pytest.skip("no bash here: commands enter the namespace with nsenter")
        assert (await sandbox.exec("echo hi", 10)).output == "hi\n"
        control = Path(sandbox._namespace.control)
        assert control.is_dir() and control.name == sandbox.root.name + ".ctl"
        if control_dir and os.path.isdir(control_dir):  # in the backend's private folder in memory
            assert control.parent.parent == Path(control_dir, f"hermes-batch-{os.geteuid()}")
            assert control.parent in _control_roots(tmp_path / "run")
        else:  # beside the prompt folder
            assert control.parent == sandbox.root.parent
        await sandbox.close()
        assert not control.exists()
        assert sandbox.root.exists() == keep
    finally:
        await backend.shutdown()
    assert not _control_roots(tmp_path / "run")


async def test_a_command_too_long_for_memory_runs_from_beside_the_prompt_folder(sandbox):
    if sandbox._namespace.control is None or sandbox._namespace.spill == sandbox._namespace.control:
        pytest.skip("the control folder is not in memory here")
    long = ": '" + "x" * SPILL_BYTES + "'; echo long"
    assert (await sandbox.exec(long, 10)).output == "long\n"
    spill = Path(sandbox._namespace.spill)
    assert spill.is_dir() and spill.parent == sandbox.root.parent and not list(spill.iterdir())
    assert not list(Path(sandbox._namespace.control).iterdir())  # nothing of it went into memory
    assert (await sandbox.exec("echo short", 10)).output == "short\n"
    await sandbox.close()
    assert not spill.exists()


async def test_a_commands_script_and_fifo_are_gone_once_it_ended(sandbox):
    if not (sandbox._namespace and sandbox._namespace.control):
        pytest.skip("no namespace helper here")
    for command in ("echo one", "exit 3", "sleep 5"):
        await sandbox.exec(command, 0.5)
    assert os.listdir(sandbox._namespace.control) == []


async def test_a_command_that_removes_its_control_folder_does_not_stop_the_next(sandbox):
    if sandbox._namespace.control is None or sandbox._namespace.spill == sandbox._namespace.control:
        pytest.skip("the control folder is not in memory here")
    control = sandbox._namespace.control
    await sandbox.exec(f"rm -rf '{control}'", 10)
    if sandbox._launcher.boundary:
        assert os.path.exists(control)  # the commands do not see it
        shutil.rmtree(control)  # gone all the same: removed by hand, say
    assert not os.path.exists(control)
    assert (await sandbox.exec("echo still here", 10)).output == "still here\n"  # through the spill folder


def test_the_control_folders_of_killed_backends_go_when_the_next_starts_and_a_live_ones_stays(tmp_path):
    base = str(tmp_path / "memory")
    os.mkdir(base)
    dead = ControlRoot.make(base, "run-a")
    os.mkdir(dead.folder("p0-0123abcd-xxxxxxxx.ctl"))
    os.close(dead._lock_fd)  # what a SIGKILL leaves: the folder, its lock free
    alive = ControlRoot.make(base, "run-a")  # a worker of the same run, still running
    assert not os.path.exists(dead.path)  # swept by the one after it
    other = ControlRoot.make(base, "run-b")  # another run's, killed too
    os.close(other._lock_fd)
    parent = os.path.join(base, f"hermes-batch-{os.geteuid()}")
    half_made = os.path.join(parent, ".new-abcdefgh")  # killed between making and locking its folder
    os.mkdir(half_made)
    os.utime(half_made, (time.time() - 3600, time.time() - 3600))
    being_made = os.path.join(parent, ".new-ijklmnop")  # another backend making its folder right now
    os.mkdir(being_made)
    new = ControlRoot.make(base, "run-c")
    assert os.path.isdir(alive.path) and os.path.isdir(being_made)
    assert not os.path.exists(other.path) and not os.path.exists(half_made)
    for root in (alive, new):
        root.remove()
        assert not os.path.exists(root.path)
    assert os.listdir(parent) == [".new-ijklmnop"]


def test_a_control_base_whose_user_folder_is_not_ours_alone_is_not_used(tmp_path):
    base = tmp_path / "memory"
    base.mkdir()
    (base / f"hermes-batch-{os.geteuid()}").mkdir(mode=0o777)
    os.chmod(base / f"hermes-batch-{os.geteuid()}", 0o777)  # open to every user: someone else may have made it
    assert ControlRoot.make(str(base), "run-a") is None
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.rmdir(base / f"hermes-batch-{os.geteuid()}")
    os.symlink(elsewhere, base / f"hermes-batch-{os.geteuid()}")
    assert ControlRoot.make(str(base), "run-a") is None
    assert not list(elsewhere.iterdir())


@pytest.mark.parametrize("check", ["namespace", "helper"])
def test_a_namespace_check_that_gets_no_answer_gives_up_at_its_deadline(monkeypatch, check):
    # A first process that never says "ready": the worker's start must not wait for it for ever.

    monkeypatch.setattr(launchers, "READY_TIMEOUT_S", 0.5)
    silent = launchers.Launcher(True, unshare=("sh", "-c", "sleep 20", "sh"), bash="/bin/sh")
    started = time.monotonic()
    if check == "namespace":
        assert "did not answer" in launchers._try_namespace(silent)
    else:
        assert launchers._helper_works(silent) is False
    assert time.monotonic() - started < 5


def test_the_autogroup_niceness_of_a_process_in_pid_1s_session_is_its_own():
    from hermes_batch.sandbox_blocks.processes import autogroup_niceness

    assert autogroup_niceness("/autogroup-42 nice 3\n", 5) == 3
    assert autogroup_niceness("", 5) == 5  # the kernel's default group prints nothing
    assert autogroup_niceness("garbage here\n", 5) is None


@pytest.mark.parametrize("isolation", ["namespace", "process"])
async def test_commands_run_nicer_than_the_run_and_their_sessions_too(tmp_path, isolation):
    backend = make_backend(tmp_path, isolation=isolation, nice=7)
    await backend.start()
    try:
        if isolation == "namespace" and not backend.launcher.namespace:
            pytest.skip("no namespaces here")
        sandbox = await backend.open(spec())
        try:
            own = os.getpriority(os.PRIO_PROCESS, 0)
            result = await sandbox.exec("nice; sh -c nice; cat /proc/self/autogroup", 10)
            niceness = result.output.splitlines()
            assert niceness[:2] == [str(min(19, own + 7))] * 2  # the command, and what it starts
            if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1":
                ours = Path("/proc/self/autogroup").read_text().split()  # empty in PID 1's session: per process
                group = int(ours[-1]) if ours else own
                assert niceness[2].endswith(f"nice {min(19, group + 7)}")  # its session weighs less than ours
        finally:
            await sandbox.close()
    finally:
        await backend.shutdown()
    with pytest.raises(ValueError, match="nice must be from 0 to 19"):
        LocalSandboxConfig(nice=20)


def test_the_compiled_helper_is_built_once_and_then_found(tmp_path):
    if namespace_init.compiler() is None:
        pytest.skip("no C compiler here")
    built, why = namespace_init.build(tmp_path / "cache")
    assert why is None and os.access(built, os.X_OK)
    made = os.stat(built).st_mtime_ns
    assert namespace_init.build(tmp_path / "cache") == (built, None)
    assert os.stat(built).st_mtime_ns == made
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [Path(built).name]  # no partial file left


def test_the_compiled_helper_is_not_run_from_a_folder_others_may_write_to(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    built, why = namespace_init.build(shared)
    assert built is None and "may be written to by other users" in why
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    namespace_init.program_path(mine).symlink_to("/bin/true")
    built, why = namespace_init.build(mine)
    assert built is None and "link" in why


def test_without_a_c_compiler_namespaces_start_through_bash(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert namespace_init.build() == (None, "no C compiler was found (cc, gcc or $CC)")
    monkeypatch.setattr(launchers, "_launchers", {})
    with caplog.at_level("INFO", logger=launchers.__name__):
        found = launchers.launcher("auto")
    if found.namespace:
        assert not found.compiled and found.bash
        assert "not their compiled helper: no C compiler was found" in caplog.text


def test_a_compiler_that_fails_is_reported_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "sh -c 'echo first >&2; echo the last words >&2; exit 1' cc")
    built, why = namespace_init.build(tmp_path / "cache")
    assert built is None and why.endswith("could not build namespace_init.c (the last words)")
    assert not list((tmp_path / "cache").iterdir())


def test_the_compiled_helper_makes_a_user_namespace_for_a_user_without_root(tmp_path):
    # The path a run without root takes (-u), run here as nobody through setpriv.
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("becoming another user takes root and setpriv")
    if namespace_init.compiler() is None:
        pytest.skip("no C compiler here")
    base = Path(tempfile.mkdtemp(prefix="hermes-batch-nobody-"))  # pytest's folders are root's alone
    try:
        _run_as_nobody(base)
    finally:
        shutil.rmtree(base)


def _run_as_nobody(base: Path) -> None:
    built, why = namespace_init.build(base / "cache")
    assert why is None
    control = base / "control"
    control.mkdir()
    (control / "1.sh").write_text("id -u; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; ls /proc | grep -c '^[0-9]'")
    (control / "2.sh").write_text("echo never")
    (control / "3.sh").write_text("sleep 30")
    for path in (base, base / "cache", Path(built), control, *control.glob("*.sh")):
        path.chmod(0o755)
    fifos = {}
    for ident in ("1", "2", "3"):
        os.mkfifo(control / f"{ident}.out")
        (control / f"{ident}.out").chmod(0o666)  # the helper, as nobody, writes the output there
        fifos[ident] = os.open(control / f"{ident}.out", os.O_RDONLY | os.O_NONBLOCK)
    helper = subprocess.Popen(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", built, "-u", "-k", "0", "-m", "1",
         str(control), str(control), str(control)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert helper.stdout.readline() == b"ready\n", helper.stderr.read1()
        helper.stdin.write(b"1\n")
        helper.stdin.flush()
        answers = [helper.stdout.readline() for _ in range(2)]
        assert answers[0].startswith(b"p 1 ") and answers[1] == b"x 1 0\n"
        output = _read_to_the_end(fifos["1"])
        # A command that cannot start (here: one at a time, -m 1, and a first one still running; a failed
        # fork goes the same way) ends at once with 126, and its reader learns why instead of waiting.
        helper.stdin.write(b"3\n2\n")
        helper.stdin.flush()
        assert helper.stdout.readline().startswith(b"p 3 ")
        assert helper.stdout.readline() == b"x 2 126\n"
        assert "the command could not start" in _read_to_the_end(fifos["2"])
    finally:
        for fd in fifos.values():
            os.close(fd)
        helper.stdin.close()
        assert helper.wait(timeout=10) == 0  # its input closed: it ends, and its namespace with it
    uid, capabilities, no_new_privs, processes = output.split("\n")[:4]
    assert uid == "65534" and int(capabilities.split()[1], 16) == 0 and no_new_privs.split()[1] == "1"
    assert int(processes) < 5


def _read_to_the_end(fd: int) -> str:
    os.set_blocking(fd, True)
    return b"".join(iter(lambda: os.read(fd, 65536), b"")).decode()


async def test_with_the_compiled_helper_namespaces_need_no_util_linux(tmp_path, monkeypatch):
    if namespace_init.compiler() is None:
        pytest.skip("no C compiler here")
    real_which = launchers.shutil.which
    monkeypatch.setattr(launchers.shutil, "which",
                        lambda name: None if name in ("unshare", "nsenter", "bash") else real_which(name))
    monkeypatch.setattr(launchers, "_launchers", {})
    backend = make_backend(tmp_path, isolation="namespace")
    await backend.start()
    try:
        assert backend.launcher.compiled and not backend.launcher.unshare
        sandbox = await backend.open(spec())
        result = await sandbox.exec("readlink /proc/self/ns/pid; echo $$", 10)
        await sandbox.close()
    finally:
        await backend.shutdown()
    namespace, pid = result.output.split()
    assert namespace != os.readlink("/proc/self/ns/pid") and int(pid) < 10


def test_a_build_of_another_version_stays_for_the_runs_that_use_it(tmp_path):
    if namespace_init.compiler() is None:
        pytest.skip("no C compiler here")
    (tmp_path / "cache").mkdir(mode=0o700)
    ours = namespace_init.program_path(tmp_path / "cache")
    other = ours.with_name(ours.name.replace(ours.name.split("-")[3], "0123456789abcdef"))  # another digest
    other.write_bytes(b"built from another source")
    built, why = namespace_init.build(tmp_path / "cache")
    assert why is None and Path(built) != other and other.exists()


async def test_a_prompt_folder_filled_deep_leaves_zero_bytes_after_close(tmp_path):
    # 2,500 folders deep with a file at the bottom and locked folders: the folder removal recursed and failed
    backend = make_backend(tmp_path)
    await backend.start()
    try:
        sandbox = await backend.open(spec())
        made = await sandbox.exec(
            "head -c 4194304 /dev/zero > top; p=$(printf 'd/%.0s' $(seq 500)); "
            "for i in 1 2 3 4 5; do mkdir -p $p && cd -P $p || exit 1; done; head -c 1048576 /dev/zero > deep; "
            "chmod 000 .; echo made", 120)
        await sandbox.close()
    finally:
        await backend.shutdown()
    assert made.output.startswith("made"), made
    scratch = tmp_path / "run" / "scratch"
    assert not scratch.exists() or list(scratch.iterdir()) == [], list(scratch.iterdir())
