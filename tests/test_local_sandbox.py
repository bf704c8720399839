"""The local sandbox: the shared sandbox contract, plus what only the local backend does."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest

from hermes_batch.default_plugins.local_sandbox import LocalSandbox, LocalSandboxBackend, LocalSandboxConfig
from hermes_batch.errors import SandboxError
from hermes_batch.plugins import collect, get_plugin_manager
from hermes_batch.records import SandboxSpec
from hermes_batch.run_context import RunContext
from hermes_batch.testing.sandbox_contract import SandboxContract


def make_backend(tmp_path: Path, **options) -> LocalSandboxBackend:
    return LocalSandboxBackend(LocalSandboxConfig(**options), RunContext("local-test", tmp_path / "run", seed=0))


def spec(index: int = 0, cwd=None, env=None) -> SandboxSpec:
    return SandboxSpec("local-test", index, f"{index:08d}feedface", cwd=cwd, env=dict(env or {}))


class TestLocalSandboxContract(SandboxContract):
    max_output_chars = 10_100  # the limit below, plus the omission notice

    @pytest.fixture
    async def backend(self, tmp_path):
        backend = make_backend(tmp_path, max_output_bytes=10_000)
        await backend.start()
        yield backend
        await backend.shutdown()

    async def sandbox_exists(self, sandbox: LocalSandbox) -> bool:
        return sandbox.root.exists()


@pytest.fixture
async def backend(tmp_path):
    backend = make_backend(tmp_path)
    await backend.start()
    yield backend
    await backend.shutdown()


@pytest.fixture
async def sandbox(backend):
    sandbox = await backend.open(spec())
    yield sandbox
    await sandbox.close()


def process_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


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
    pid = int((await sandbox.exec("sleep 60 > /dev/null 2>&1 & echo $!", 10)).output)
    assert process_running(pid)
    await sandbox.close()
    await backend.shutdown()
    assert (sandbox.root / "result.txt").read_bytes() == b"for debugging"
    await asyncio.sleep(0.1)
    assert not process_running(pid)


async def test_close_kills_background_processes_and_removes_the_folder(backend):
    sandbox = await backend.open(spec())
    pid = int((await sandbox.exec("sleep 60 > /dev/null 2>&1 & echo $!", 10)).output)
    await asyncio.sleep(0.2)
    assert process_running(pid)  # background processes outlive the command that started them
    await sandbox.close()
    await asyncio.sleep(0.1)
    assert not process_running(pid)
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
    # setsid leaves the process group, so the kill misses it; the bounded drain must still return.
    started = time.monotonic()
    result = await sandbox.exec("setsid sleep 3 & echo x", 0.5)
    assert result.output == "x\n"
    assert result.timed_out
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


async def test_a_command_spawned_as_the_prompt_is_cancelled_dies_at_close(sandbox, monkeypatch):
    # Ctrl-C can land after the shell started but before exec learned its process group.
    real_spawn = asyncio.create_subprocess_exec

    async def spawn_then_cancel(*args, **kwargs):
        await real_spawn(*args, **kwargs)
        raise asyncio.CancelledError

    marker = f"30.{os.getpid()}{int(time.monotonic() * 1000) % 100000}"
    monkeypatch.setattr(asyncio, "create_subprocess_exec", spawn_then_cancel)
    with pytest.raises(asyncio.CancelledError):
        await sandbox.exec(f"sleep {marker}", 60)
    monkeypatch.undo()
    deadline = time.monotonic() + 5
    while not _alive_with(f"sleep {marker}") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert _alive_with(f"sleep {marker}"), "the command never started"
    await sandbox.close()
    deadline = time.monotonic() + 5
    while _alive_with(f"sleep {marker}") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not _alive_with(f"sleep {marker}")
