"""The local sandbox as a boundary (issue 32): what its commands see, who they are, what they may use, and what
the run says where a protection cannot be had.  The hostile classes themselves are the shared contract's
(hermes_batch.testing.SandboxContract), which tests/test_local_sandbox.py runs as root and the test below runs
again as a user without root."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

import pytest

from hermes_batch.contract.run_context import RunContext
from hermes_batch.errors import ConfigError
from hermes_batch.formats.records import SandboxSpec
from hermes_batch.local_sandbox import boundary, launchers, namespace_init
from hermes_batch.local_sandbox.backend import LocalSandboxBackend, LocalSandboxConfig
from hermes_batch.sandbox_blocks.trees import remove_tree

REPO = Path(__file__).resolve().parent.parent


def make_backend(tmp_path: Path, **options) -> LocalSandboxBackend:
    return LocalSandboxBackend(LocalSandboxConfig(**options), RunContext("boundary-test", tmp_path / "run", seed=0))


def spec(index: int = 0) -> SandboxSpec:
    return SandboxSpec("boundary-test", index, f"{index:08d}feedface", commands=True)


@pytest.fixture
async def start_backend(tmp_path):
    """Factory: ``await start_backend(**options)``, a started backend with the boundary (else the test skips);
    shut down after the test."""
    if namespace_init.compiler() is None:
        pytest.skip("no C compiler here")
    started = []

    async def start(**options) -> LocalSandboxBackend:
        backend = make_backend(tmp_path, **options)
        started.append(backend)
        await backend.start()
        if not backend.launcher.boundary:
            pytest.skip(f"no namespaces here: {backend.launcher.reason}")
        return backend

    yield start
    for backend in started:
        await backend.shutdown()


@pytest.fixture
async def backend(start_backend):
    return await start_backend()


@pytest.fixture
def no_compiled_helper(monkeypatch):
    monkeypatch.setattr(namespace_init, "build", lambda: (None, "no C compiler was found (cc, gcc or $CC)"))
    monkeypatch.setattr(launchers, "_launchers", {})


def test_options_are_checked():
    for options, message in (
        ({"network": "bridge"}, "network must be one of auto, nat, host, none"),
        ({"allow_groups": "docker,a b"}, "allow_groups takes group names"),
        ({"memory": "lots"}, "memory must be a size"),
        ({"disk": "-1g"}, "disk must be a size"),
        ({"pids": -1}, "pids must be 0"),
        ({"expose": "data:rw"}, "expose takes absolute paths"),
    ):
        with pytest.raises(ValueError, match=message):
            LocalSandboxConfig(**options)
    assert boundary.parse_size("512m", "memory") == 512 << 20 and boundary.parse_size("4G", "disk") == 4 << 30
    assert boundary.parse_expose("/data, /out:rw,/x:ro") == (("/data", False), ("/out", True), ("/x", False))


async def test_commands_run_as_a_user_of_their_own_that_owns_the_prompt_folder(backend):
    first, second = await backend.open(spec(0)), await backend.open(spec(1))
    try:
        await first.write_file("given/by-the-runner.txt", b"from write_file\n")
        done = await first.exec("id -u; id -G; echo more >> given/by-the-runner.txt && cat given/by-the-runner.txt", 30)
        other = (await second.exec("id -u", 30)).output.strip()
    finally:
        await first.close()
        await second.close()
    uid, groups, *content = done.output.splitlines()
    assert content == ["from write_file", "more"], done  # what the file API wrote is the command's to change
    if os.geteuid() == 0:
        assert int(uid) >= boundary.UID_BASE and groups == uid and other != uid  # a user per prompt, no groups
    else:
        assert int(uid) == os.getuid()  # without root: the runner's user, in a user namespace of its own


async def test_the_system_is_read_only_and_tmp_is_private(backend, tmp_path):
    sandbox = await backend.open(spec())
    try:
        done = await sandbox.exec(
            "touch /usr/hb-x 2>&1 | grep -c 'Read-only'; echo private > /tmp/hb-private && cat /tmp/hb-private; "
            "test -r /etc/passwd && echo passwd-readable; ls /dev/shm | wc -l", 30)
    finally:
        await sandbox.close()
    assert done.output.split() == ["1", "private", "passwd-readable", "0"], done
    assert not Path("/tmp/hb-private").exists()


async def test_expose_shows_a_folder_read_only_and_another_writable(tmp_path, start_backend):
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    out.mkdir()
    (data / "input.txt").write_text("the data\n")
    out.chmod(0o777)  # as root the commands run as a user of their own
    backend = await start_backend(expose=f"{data},{out}:rw")
    sandbox = await backend.open(spec())
    done = await sandbox.exec(
        f"cat {data}/input.txt; {{ echo x > {data}/new; }} 2>/dev/null || echo refused; echo result > {out}/result.txt", 30)
    await sandbox.close()
    assert done.output == "the data\nrefused\n", done
    assert (out / "result.txt").read_text() == "result\n" and not (data / "new").exists()


async def test_cpu_time_beyond_the_limit_ends_the_command(start_backend):
    backend = await start_backend(cpu=1)
    sandbox = await backend.open(spec())
    spun = await sandbox.exec("while :; do :; done", 60)
    after = await sandbox.exec("echo next", 30)
    await sandbox.close()
    assert not spun.timed_out and spun.exit_code not in (0, None), spun  # SIGXCPU, then SIGKILL
    assert after.output == "next\n"


async def test_many_files_beyond_disk_stop_the_command_and_the_prompt_goes_on(start_backend):
    # -S disk holds the prompt's folder in all, not only each file: a command writing file after file is stopped
    # while it runs, a quick one fails once it ends; the prompt, and the others, go on.
    backend = await start_backend(disk="20m")
    sandbox, other = await backend.open(spec()), await backend.open(spec(1))
    slow = await sandbox.exec("for i in $(seq 200); do head -c 1048576 /dev/zero > f$i; sleep 0.03; done; "
                              "echo wrote all", 120)
    slow_files = len(list(sandbox.root.glob("f*")))
    removed = await sandbox.exec("rm -f f*; echo removed", 30)
    quick = await sandbox.exec("head -c 12m /dev/zero > g1; head -c 12m /dev/zero > g2; echo wrote", 120)
    listed = await sandbox.exec("ls", 30)  # over, but not growing: a quick command still runs
    again = await sandbox.exec("rm -f g*; echo next", 30)
    unaffected = await other.exec("echo unaffected", 30)
    await sandbox.close()
    await other.close()
    assert "wrote all" not in slow.output and slow.exit_code not in (0, None) and not slow.timed_out, slow
    assert "exceeded -S disk=20m" in slow.output and "the command was stopped" in slow.output, slow
    assert 20 <= slow_files < 60, slow_files
    assert (removed.output, removed.exit_code) == ("removed\n", 0)
    assert quick.output.startswith("wrote\n") and "the command failed" in quick.output and quick.exit_code == 1, quick
    assert (listed.output, listed.exit_code) == ("g1\ng2\n", 0)
    assert (again.output, again.exit_code) == ("next\n", 0)
    assert (unaffected.output, unaffected.exit_code) == ("unaffected\n", 0)


async def test_auto_says_once_which_protections_are_missing(tmp_path, no_compiled_helper, caplog):
    backend = make_backend(tmp_path)
    with caplog.at_level("WARNING", logger="hermes_batch.local_sandbox.backend"):
        await backend.start()
        await backend.check()
    await backend.shutdown()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert backend.isolation in ("pid-namespace", "process")
    for gap in ("a private view of the files", "a user of their own", "limits on memory, processes, disk and CPU time"):
        assert gap in warnings[0]
    assert "no C compiler was found" in warnings[0] and "-S isolation=namespace insists on them" in warnings[0]


async def test_isolation_namespace_refuses_to_start_without_the_protections(tmp_path, no_compiled_helper):
    for options in ({"isolation": "namespace"}, {"isolation": "namespace", "helper": "bash"}):
        backend = make_backend(tmp_path, **options)
        with pytest.raises(ConfigError, match=r"^-S isolation=namespace cannot work on this machine \(.*\); use "):
            await backend.start()
    with pytest.raises(ConfigError, match=r"^-S network=none cannot work on this machine"):
        await make_backend(tmp_path, network="none").start()


NO_USER_NAMESPACES = """
import asyncio, json, logging, sys, tempfile
from pathlib import Path
from hermes_batch.errors import ConfigError
from hermes_batch.local_sandbox.backend import LocalSandboxBackend, LocalSandboxConfig
from hermes_batch.contract.run_context import RunContext

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")

async def main():
    seen = {}
    for isolation in ("auto", "namespace"):
        backend = LocalSandboxBackend(LocalSandboxConfig(isolation=isolation), RunContext("r", Path(sys.argv[1]), seed=0))
        try:
            await backend.start()
            seen[isolation] = backend.isolation
            await backend.shutdown()
        except ConfigError as exc:
            seen[isolation] = str(exc)
    print(json.dumps(seen))

asyncio.run(main())
"""


def test_without_user_namespaces_auto_names_what_is_missing_and_namespace_refuses(tmp_path):
    # A runner without root on a machine that refuses it user namespaces: a user namespace of ours (its root,
    # which may) allows only the one the runner runs in, so the runner's own unshare(CLONE_NEWUSER) fails.
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("simulating the machine takes root and util-linux unshare")
    script = (f"echo 1 > /proc/sys/user/max_user_namespaces && exec unshare --user --map-user=4321 --map-group=4321 "
              f"{sys.executable} -c \"$0\" {tmp_path / 'run'}")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script, NO_USER_NAMESPACES],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["auto"] == "process", seen
    assert seen["namespace"].startswith("-S isolation=namespace cannot work on this machine (")
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, done.stderr
    for gap in ("a private view of the files", "a user of their own", "limits on", "a process namespace"):
        assert gap in warnings[0]


def _pytest_as_a_user(*arguments: str) -> subprocess.CompletedProcess:
    """pytest with ``arguments``, run as a user made for the test (so through user namespaces), or skip."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv"):
        pytest.skip("making a user takes root, useradd and setpriv")
    if namespace_init.compiler() is None:
        pytest.skip("no C compiler here")
    # The runner's Python may live in a folder only root reads (pyenv under /root): the system's of the same
    # version, with this checkout's packages.
    python = shutil.which(f"python{sys.version_info[0]}.{sys.version_info[1]}", path="/usr/local/bin:/usr/bin:/bin")
    if python is None:
        pytest.skip("no system Python of this version for the user")
    name = f"hbtest{os.getpid() % 100000}"
    made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    tun = OpenTun()  # the NAT of -S network=auto, as for any user of a stock machine
    base = Path(tempfile.mkdtemp(prefix="hermes-batch-unprivileged-"))
    try:
        user = pwd.getpwnam(name)
        for folder in ("home", "pytest", "cache"):
            (base / folder).mkdir()
            os.chown(base / folder, user.pw_uid, user.pw_gid)
        base.chmod(0o755)
        # a session keyring of its own before any thread starts, shared by all of them, as a login session's is
        code = ("import ctypes, platform, site, sys; "
                "ctypes.CDLL(None).syscall({'x86_64': 250, 'aarch64': 219}.get(platform.machine(), -1), 1, None); "
                f"site.addsitedir({sysconfig.get_paths()['purelib']!r}); import pytest; sys.exit(pytest.main(sys.argv[1:]))")
        return subprocess.run(
            ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "env", "-i",
             f"PATH={os.environ.get('PATH', os.defpath)}", f"HOME={base / 'home'}", f"XDG_CACHE_HOME={base / 'cache'}",
             "PYTHONDONTWRITEBYTECODE=1", python, "-c", code, "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
             f"--basetemp={base / 'pytest' / 'basetemp'}", *arguments],
            capture_output=True, text=True, timeout=900, cwd=base,
        )
    finally:
        tun.restore()
        subprocess.run(["userdel", name], capture_output=True)
        remove_tree(base)  # whatever a failing class left (shutil.rmtree recurses once per level)


def test_the_hostile_classes_hold_for_a_runner_without_root(tmp_path):
    # The contract's boundary classes, run by pytest itself as a user made for the test (user namespaces).
    done = _pytest_as_a_user(f"{REPO}/tests/test_local_sandbox.py::TestLocalSandboxContract",
                             "-k", "neighbour or home or run_folder or outside or setuid or beyond or network or group "
                                   "or keyring or ipc or abstract or first_process or deep or signalling")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    # skipped: the setuid and group classes (only root can place a setuid program, or give a file to another owner)
    assert "15 passed, 2 skipped" in summary, summary


PRIVILEGED_GROUP = """
import asyncio, json, logging, sys
from pathlib import Path
from hermes_batch.errors import ConfigError
from hermes_batch.formats.records import SandboxSpec
from hermes_batch.local_sandbox.backend import LocalSandboxBackend, LocalSandboxConfig
from hermes_batch.contract.run_context import RunContext

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")

async def main():
    seen = {}
    for name, options in (("auto", {}), ("namespace", {"isolation": "namespace"}),
                          ("allowed", {"allow_groups": "disk"}), ("process", {"isolation": "process"})):
        backend = LocalSandboxBackend(LocalSandboxConfig(**options), RunContext("r", Path(sys.argv[1]) / name, seed=0))
        try:
            await backend.start()
        except ConfigError as exc:
            seen[name] = str(exc)
            continue
        sandbox = await backend.open(SandboxSpec("r", 0, "0123456789abcdef"))
        done = await sandbox.exec("id -G", 30)
        seen[name] = [backend.isolation, backend.isolation_details, done.output]
        await sandbox.close()
        await backend.shutdown()
    print(json.dumps(seen))

asyncio.run(main())
"""


def test_a_runner_without_root_in_a_privileged_group_is_refused_unless_it_allows_the_group():
    # The commands of a runner without root keep its groups (a user namespace cannot drop them): a user in group
    # disk (or docker, adm...) would hand the prompt the machine's disks.
    if os.geteuid() != 0 or not shutil.which("setpriv") or namespace_init.compiler() is None:
        pytest.skip("running as another user in a group takes root and setpriv; the boundary a C compiler")
    python = shutil.which(f"python{sys.version_info[0]}.{sys.version_info[1]}", path="/usr/local/bin:/usr/bin:/bin")
    if python is None:
        pytest.skip("no system Python of this version for the user")
    disk = grp.getgrnam("disk").gr_gid
    base = Path(tempfile.mkdtemp(prefix="hermes-batch-groups-"))  # pytest's folders are root's alone
    try:
        base.chmod(0o777)
        code = f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r}); exec({PRIVILEGED_GROUP!r})"
        done = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", f"--groups={disk}", "env", "-i", f"PATH={os.defpath}",
             f"HOME={base}", f"XDG_CACHE_HOME={base / 'cache'}", python, "-c", code, str(base / "runs")],
            capture_output=True, text=True, timeout=300, cwd=base,
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    for refused in (seen["auto"], seen["namespace"]):
        assert refused.startswith("The local sandbox cannot take your group disk away from its commands"), seen
        assert refused.endswith("or let the commands have it with -S allow_groups=disk."), refused
    level, details, _ = seen["allowed"]  # kept (shown as the overflow group in the user namespace), and said
    assert level == "namespace" and details["groups"] == ["disk"], seen
    level, details, groups = seen["process"]  # asked for plain processes, which have everything: said at start
    assert level == "process" and any("with its groups disk" in gap for gap in details["missing"]), details
    assert str(disk) in groups.split(), groups


class OpenTun:
    """/dev/net/tun open to every user (its mode on a stock Debian, where udev sets it) while a test runs as one; a
    container may have it root's alone.  Creating an interface still takes CAP_NET_ADMIN in the namespace."""

    PATH = "/dev/net/tun"

    def __init__(self):
        try:
            self.mode = os.stat(self.PATH).st_mode & 0o777
        except OSError:
            self.mode = None
        if self.mode is not None and self.mode != 0o666:
            os.chmod(self.PATH, 0o666)

    def restore(self):
        if self.mode is not None and self.mode != 0o666:
            os.chmod(self.PATH, self.mode)


def test_no_reward_hack_passes_for_a_runner_without_root(tmp_path):
    # The reward-hack corpus, its tests run apart from the agent through user namespaces only.
    done = _pytest_as_a_user(f"{REPO}/tests/test_verifiers.py::TestLocalVerification", "-k", "corpus or forge")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert "2 passed" in summary, summary


def test_the_run_records_its_isolation_in_run_json_and_each_record(tmp_path):
    from hermes_batch.testing import TEST_API_KEY, Runner, ScriptedModelServer, ToolLoopScript, write_dataset

    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Task {i}"} for i in range(2)])
    script = ToolLoopScript(tool_calls=1, command="id -u")
    with ScriptedModelServer(script, api_key=TEST_API_KEY) as server:
        runner = Runner(tmp_path, server)
        result = runner.invoke(dataset, "--sandbox", "local", "--distribution", "terminal_only")
    assert result.exit_code == 0, result.output
    recorded = json.loads((runner.folder() / "run.json").read_text())["sandbox"]
    assert recorded["name"] == "local" and recorded["isolation"] in boundary.LEVELS
    assert recorded["network"] in ("nat", "host") and isinstance(recorded["missing"], list)
    assert (recorded["network"] == "nat") == ("nat" in recorded)  # the NAT program that serves it
    assert (recorded["missing"] == []) == (recorded["isolation"] == "namespace")
    assert [r["metadata"]["isolation"] for r in runner.records("trajectories.jsonl")] == [recorded["isolation"]] * 2


async def test_a_folder_exposed_around_the_run_folder_still_hides_the_run_folder(tmp_path, start_backend):
    # -S expose of a parent of the run folder: what is hidden inside it stays hidden.
    (tmp_path / "shared.txt").write_text("shared\n")
    tmp_path.chmod(0o755)  # pytest's folders are root's alone: the prompt's user could not pass through
    backend = await start_backend(expose=str(tmp_path))
    first, second = await backend.open(spec(0)), await backend.open(spec(1))
    await first.write_file("secret.txt", b"FIRST-SECRET")
    (tmp_path / "run" / "run-marker.txt").write_text("RUN-SECRET")
    seen = await second.exec(f"cat {tmp_path}/shared.txt; cat {first.workdir}/secret.txt {tmp_path}/run/run-marker.txt "
                             f"2>/dev/null; ls {tmp_path}/run/scratch", 30)
    await first.close()
    await second.close()
    assert seen.output.startswith("shared\n") and "SECRET" not in seen.output, seen
    assert Path(first.workdir).name not in seen.output


@pytest.mark.parametrize("helper", ["auto", "bash"])
def test_a_command_that_signals_pid_1_is_ignored(tmp_path, helper):
    # It ended the prompt's namespace and left a record with exit_code null and no error.
    from hermes_batch.testing import TEST_API_KEY, Runner, ScriptedModelServer, ToolLoopScript, write_dataset

    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "Task"}])
    script = ToolLoopScript(tool_calls=1, command="kill -TERM 1; kill -INT 1; echo signalled")
    with ScriptedModelServer(script, api_key=TEST_API_KEY) as server:
        runner = Runner(tmp_path, server)
        runner.invoke(dataset, "--sandbox", "local", "--distribution", "terminal_only", "-S", f"helper={helper}",
                      "-S", "network=host")
    kept, failed = runner.records("trajectories.jsonl"), runner.records("failed.jsonl")
    # the compiled helper and bash alike ignore their commands' signals: the namespace goes on under the prompt
    assert len(kept) == 1 and failed == [], failed
    assert "signalled" in json.dumps(kept[0]["conversations"])
