"""-S reuse=namespace: a container serves prompts one after another; nothing of a prompt reaches another.

Real containers of a real engine; every hostile command runs in its own prompt's view.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

from hermes_batch import ConfigError, SandboxError

from hermes_batch_docker import DockerConfig

from docker_rig import make_backend, spec


def reuse_backend(tmp_path, run_name, **options):
    options.setdefault("pool", 1)
    return make_backend(tmp_path, run_name, reuse="namespace", **options)


@pytest.fixture
async def reused(tmp_path, run_name, docker_api):
    """A started backend whose one container serves every prompt in turn."""
    backend = reuse_backend(tmp_path, run_name)
    await backend.start()
    yield backend
    await backend.shutdown()


def unique_marker() -> str:
    return f"hb-reuse-{uuid.uuid4().hex[:12]}"


def host_processes_with(marker: str) -> list:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


async def eventually_gone(marker: str, timeout: float = 10.0) -> bool:
    for _ in range(int(timeout / 0.05)):
        if not host_processes_with(marker):
            return True
        await asyncio.sleep(0.05)
    return False


LEFTOVERS = (
    "echo left > left-in-workdir; echo left > /tmp/left; echo left > /root/left; echo left > /etc/left; "
    "echo left >> /etc/passwd; echo left > /dev/left; echo left > /dev/shm/left; mkfifo /tmp/left-fifo; "
    "mkdir -p /usr/local/left && echo left > /usr/local/left/file; rm -f /bin/cat.bak; cp /bin/sh /bin/left-sh; "
    "echo done"
)
SEEN = (
    "ls -a . /tmp /root /etc /dev /dev/shm /usr/local /bin 2>&1 | grep left; grep -c left /etc/passwd; "
    "ps -o pid,args | grep -v grep | grep -c {marker}; echo checked"
)


async def test_a_prompts_leftovers_never_reach_the_next_prompt_in_the_same_container(reused, run_name):
    first = await reused.open(spec(run_name, 0))
    marker = unique_marker()
    assert (await first.exec(LEFTOVERS, 30)).output == "done\n"
    started = await first.exec(
        f"setsid sh -c 'sleep 600; : {marker}' > /dev/null 2>&1 & "
        f"(setsid sh -c 'trap \"\" TERM HUP INT; while :; do sleep 1; done; : {marker}' > /dev/null 2>&1 &); "
        f"sh -c 'exec 3<> /tmp/left-fifo; sleep 600; : {marker}' > /dev/null 2>&1 & echo started", 30,
    )
    assert started.output == "started\n"
    for _ in range(200):  # the ones started in the background take a moment
        if len(host_processes_with(marker)) >= 3:
            break
        await asyncio.sleep(0.05)
    assert len(host_processes_with(marker)) >= 3
    container = first.id
    await first.close()
    assert await eventually_gone(marker), "a process of the first prompt outlived its close"

    second = await reused.open(spec(run_name, 1))
    assert second.id == container  # the same container serves it
    seen = await second.exec(SEEN.format(marker=marker), 30)
    assert seen.output == "0\n0\nchecked\n", seen
    assert (await second.exec("ls /bin/cat && echo present", 30)).output.endswith("present\n")
    await second.close()


async def test_a_prompt_cannot_mount_unshare_setns_or_see_the_helper(reused, run_name):
    sandbox = await reused.open(spec(run_name, 0))
    tag = sandbox.view.tag
    tried = await sandbox.exec(
        "mount -t tmpfs none /mnt 2>/dev/null && echo mounted; unshare -m true 2>/dev/null && echo unshared; "
        "unshare -U true 2>/dev/null && echo user-namespace; nsenter -t 1 -m true 2>/dev/null && echo entered; "
        "chroot / true 2>/dev/null && echo chrooted; "
        f"ls -A /.hermes-batch; cat /.hermes-batch/helper {tag} 2>/dev/null | wc -c; "
        "grep CapEff /proc/self/status; grep NoNewPrivs /proc/self/status; grep Seccomp: /proc/self/status; "
        "echo x 2>/dev/null > /proc/sysrq-trigger && echo sysrq; cat /proc/keys 2>/dev/null | wc -c; echo end",
        30,
    )
    mask = reused.config.prompt_capability_mask
    assert tried.output.split() == [
        "0", "CapEff:", f"{mask:016x}", "NoNewPrivs:", "1", "Seccomp:", "2", "0", "end",
    ], tried
    await sandbox.close()


async def test_two_prompts_at_once_see_nothing_of_each_other(tmp_path, run_name, docker_api):
    backend = reuse_backend(tmp_path, run_name, pool=2)
    await backend.start()
    try:
        first, second = await asyncio.gather(backend.open(spec(run_name, 0)), backend.open(spec(run_name, 1)))
        assert first.id != second.id
        marker = unique_marker()
        await first.exec(f"echo secret > /tmp/{marker}; sleep 600 > /dev/null 2>&1 & echo $! > /tmp/pid", 30)
        seen = await second.exec(f"ls /tmp; ps -o args; cat /proc/*/root/tmp/* 2>/dev/null", 30)
        assert marker not in seen.output and "secret" not in seen.output and "sleep 600" not in seen.output, seen
        await asyncio.gather(first.close(), second.close())
    finally:
        await backend.shutdown()


async def test_checks_after_stop_processes_see_the_files_and_cannot_be_forged(reused, run_name):
    sandbox = await reused.open(spec(run_name, 0))
    marker = unique_marker()
    await sandbox.write_file("answer.txt", b"42")
    # A process that writes FORGED into every output it can find, and rewrites the answer, again and again.
    forger = (
        "while :; do for f in /proc/[0-9]*/fd/1 /proc/[0-9]*/fd/2; do echo FORGED > $f; done 2>/dev/null; "
        f"echo 0 > answer.txt; sleep 0.01; done; : {marker}"
    )
    await sandbox.exec(f"setsid sh -c '{forger}' > /dev/null 2>&1 & echo started", 30)
    assert host_processes_with(marker)
    assert await sandbox.stop_processes() is True
    assert await eventually_gone(marker)
    await sandbox.write_file("answer.txt", b"42")
    for _ in range(5):
        check = await sandbox.exec("sleep 0.05; cat answer.txt", 30)
        assert check.output == "42" and check.exit_code == 0, check
    assert await sandbox.read_file("answer.txt") == b"42"
    await sandbox.close()


async def test_a_container_killed_from_outside_is_replaced(reused, run_name, docker_api):
    first = await reused.open(spec(run_name, 0))
    container = first.id
    await first.close()
    docker_api.kill(container)
    await asyncio.sleep(0.5)  # killed while idle, a moment before the next prompt asks
    second = await reused.open(spec(run_name, 1))
    assert second.id != container
    assert (await second.exec("echo works", 30)).output == "works\n"
    await second.close()


async def test_a_prompt_that_kills_its_runner_fails_clearly_and_the_container_serves_on(reused, run_name):
    first = await reused.open(spec(run_name, 0))
    with pytest.raises(SandboxError, match="has ended"):
        await first.exec("kill -9 -1", 30)
    with pytest.raises(SandboxError, match="has ended"):
        await first.exec("echo still", 30)
    await first.close()
    second = await reused.open(spec(run_name, 1))
    assert (await second.exec("echo works", 30)).output == "works\n"
    await second.close()


def test_the_exec_runner_cannot_reuse_containers():
    with pytest.raises(ValueError, match="drop runner=exec"):
        DockerConfig(reuse="namespace", runner="exec")


async def test_without_a_c_compiler_the_mode_is_refused_in_one_sentence(tmp_path, run_name, docker_api, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    backend = reuse_backend(tmp_path, run_name)
    with pytest.raises(ConfigError, match=r"no C compiler was found.*leave -S reuse=none"):
        await backend.start()
