"""-S reuse=namespace: a container serves prompts one after another; nothing of a prompt reaches another.

Real containers of a real engine; every hostile command runs in its own prompt's view.
"""

from __future__ import annotations

import asyncio
import errno
import os
import uuid

import docker
import pytest

from hermes_batch import ConfigError, SandboxError, structure_config

from hermes_batch_docker import DockerConfig
from hermes_batch_docker.config import BASE_CAPABILITIES, CAPABILITY_NUMBERS, HELPER_CAPABILITIES
from hermes_batch_docker.views import files_bytes

from docker_rig import IMAGE_A, make_backend, spec


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


async def until_ready(backend, timeout: float = 60) -> None:
    """Until the pool holds a container (with reuse, one whose next view is made)."""
    for _ in range(int(timeout / 0.05)):
        if backend.pooled():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the pool never held a container")


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


# --- -S user=, cap_add and the environment, as the strict mode has them ----------------------------------------

# What a command sees of its user, capabilities and home; the same in both modes.
WHO = "id -u; id -g; grep -E '^Cap(Eff|Prm|Amb)' /proc/self/status; echo HOME=$HOME; stat -c '%u:%g' ."
# What it says as 1234:2345, a user the image's /etc/passwd does not name (Docker gives it HOME=/)
AS_1234 = ["1234", "2345", "CapPrm:", "0" * 16, "CapEff:", "0" * 16, "CapAmb:", "0" * 16, "HOME=/", "1234:2345"]


@pytest.mark.parametrize("reuse", ["none", "namespace"])
async def test_user_option_runs_commands_files_and_checks_as_that_user_in_both_modes(
    tmp_path, run_name, docker_api, reuse
):
    backend = make_backend(tmp_path, run_name, user="1234:2345", reuse=reuse, pool=1)
    await backend.start()
    try:
        await backend.prepare_image(IMAGE_A)  # the pool starts filling
        containers = set()
        for cwd in ("/work/project", None):  # a folder the row names (made for it), and the image's working folder
            await until_ready(backend)  # (a prompt that comes while the view is being made gets a new container)
            sandbox = await backend.open(spec(run_name, 0, cwd=cwd))
            containers.add(sandbox.id)
            assert (await sandbox.exec(WHO, 10)).output.split() == AS_1234
            assert (await sandbox.exec("echo x > made-here && cat made-here", 10)).output == "x\n"
            await sandbox.write_file("deep/new/file.txt", b"mine")
            owners = await sandbox.exec("stat -c '%u:%g %a' deep deep/new deep/new/file.txt", 10)
            assert owners.output.split() == ["1234:2345", "755"] * 2 + ["1234:2345", "644"]
            appended = await sandbox.exec("echo more >> deep/new/file.txt && cat deep/new/file.txt", 10)
            assert appended.output == "minemore\n"
            with pytest.raises(PermissionError):
                await sandbox.write_file("/etc/hermes-image", b"x")
            # the checks of a verifier, after stop_processes: as that user too, seeing the prompt's files
            assert await sandbox.stop_processes() is True
            assert (await sandbox.exec(WHO, 10)).output.split() == AS_1234
            assert (await sandbox.exec("cat deep/new/file.txt", 10)).output == "minemore\n"
            await sandbox.write_file("after-stop.txt", b"checked")
            assert (await sandbox.exec("stat -c '%u:%g' after-stop.txt", 10)).output == "1234:2345\n"
            await sandbox.close()
        await until_ready(backend)
        clean = await backend.open(spec(run_name, 1))  # the next prompt starts clean
        assert (await clean.exec("ls -A; ls -A /work/project 2>/dev/null; echo end", 10)).output == "end\n"
        assert (await clean.exec(WHO, 10)).output.split() == AS_1234
        if reuse == "namespace":
            assert containers == {clean.id}  # each prompt in turn in the same container
        await clean.close()
    finally:
        await backend.shutdown()


async def test_the_images_user_runs_a_views_commands_as_docker_runs_the_strict_modes(tmp_path, run_name, docker_api):
    # The test images name no USER: the backend is given the image's description with one (Docker's exec, which
    # the strict mode's commands are, runs as it; the helper runs as root and must lower every command to it).
    info = docker_api.inspect_image(IMAGE_A)
    info["Config"] = dict(info.get("Config") or {}, User="1234:2345")
    backend = reuse_backend(tmp_path, run_name)
    described = asyncio.get_running_loop().create_future()
    described.set_result(info)
    backend._images[IMAGE_A] = described
    await backend.start()
    try:
        sandbox = await backend.open(spec(run_name, 0, cwd="/work/project"))
        assert (await sandbox.exec(WHO, 10)).output.split() == AS_1234
        assert await sandbox.stop_processes() is True
        assert (await sandbox.exec(WHO, 10)).output.split() == AS_1234
        await sandbox.close()
    finally:
        await backend.shutdown()


def capability_mask(names) -> int:
    return sum(1 << CAPABILITY_NUMBERS[name] for name in names)


async def test_cap_add_is_the_mask_a_prompt_keeps_and_none_of_the_helpers(tmp_path, run_name, docker_api):
    backend = reuse_backend(tmp_path, run_name, cap_add="NET_RAW,SYS_NICE")
    await backend.start()
    try:
        mask = capability_mask(BASE_CAPABILITIES + ("NET_RAW", "SYS_NICE"))
        assert backend.config.prompt_capability_mask == mask
        assert mask & capability_mask(HELPER_CAPABILITIES) == 0
        sandbox = await backend.open(spec(run_name))
        # the runner's commands and, after stop_processes, the checks' execs
        for _ in range(2):
            seen = await sandbox.exec("grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status", 10)
            assert seen.output == f"CapPrm:\t{mask:016x}\nCapEff:\t{mask:016x}\nCapBnd:\t{mask:016x}\n", seen
            assert await sandbox.stop_processes() is True
        await sandbox.close()
    finally:
        await backend.shutdown()


def test_cap_add_of_what_keeps_prompts_apart_is_refused_with_reuse():
    def structure(**options):
        return structure_config(options, DockerConfig, "options for the docker sandbox (-S)")

    for name in ("SYS_PTRACE", "SYS_CHROOT", "SETPCAP", "NET_ADMIN"):
        with pytest.raises(ConfigError, match=f"cap_add={name} cannot be combined with reuse=namespace"):
            structure(reuse="namespace", cap_add=name)
        assert structure(cap_add=name).cap_add == (name,)  # the strict mode grants it
    with pytest.raises(ConfigError, match="SYS_ADMIN would let commands reach past the container"):
        structure(reuse="namespace", cap_add="SYS_ADMIN")
    # with network=none each view has a network namespace of its own: NET_ADMIN changes nothing the next prompt sees
    assert structure(reuse="namespace", network="none", cap_add="NET_ADMIN").cap_add == ("NET_ADMIN",)


@pytest.mark.parametrize("names", ["runner", "exec"])  # names the runner exports, and one it cannot (the view gets it)
async def test_a_prompts_environment_reaches_its_commands_and_checks_and_never_the_next_prompt(reused, run_name, names):
    env = {"HB_SECRET": "prompt-0", "HB_SPACES": "a b  c"}
    # a name no shell exports makes the prompt's view start with its environment (which /bin/sh then drops, as
    # it does in the strict mode)
    first = await reused.open(spec(run_name, 0, env=env | ({"hb-odd.name": "odd"} if names == "exec" else {})))
    container = first.id
    show = "env | grep '^HB' | sort"
    expected = "HB_SECRET=prompt-0\nHB_SPACES=a b  c\n"
    assert (await first.exec(show, 10)).output == expected
    await first.exec("export HB_EXPORTED=1; echo HB_FILE=1 >> /etc/environment", 10)
    assert await first.stop_processes() is True
    assert (await first.exec(show, 10)).output == expected
    await first.close()
    second = await reused.open(spec(run_name, 1))
    assert second.id == container
    seen = await second.exec(f"{show}; cat /etc/environment 2>/dev/null | grep -c HB_; echo end", 10)
    assert seen.output == "0\nend\n"
    assert await second.stop_processes() is True
    assert (await second.exec(f"{show}; echo end", 10)).output == "end\n"
    await second.close()


# --- hostile prompts -----------------------------------------------------------------------------------------


async def test_a_prompt_that_fills_its_memory_file_system_gets_no_space_and_the_next_starts_clean(
    tmp_path, run_name, docker_api
):
    backend = reuse_backend(tmp_path, run_name, memory="256m")
    await backend.start()
    try:
        first = await backend.open(spec(run_name, 0))
        container = first.id
        filled = await first.exec("dd if=/dev/zero of=big bs=1M; echo status=$?; df -k / | tail -1", 60)
        assert "No space left on device" in filled.output and "status=1" in filled.output, filled
        size_kib = int(filled.output.split()[-5])  # df: the file system's size
        assert size_kib * 1024 == files_bytes(256 * 1024**2)
        with pytest.raises(OSError) as raised:
            await first.write_file("more.bin", b"x" * (8 * 1024**2))
        assert raised.value.errno == errno.ENOSPC
        assert (await first.exec("echo alive", 10)).output == "alive\n"  # no process was killed for memory
        await first.close()
        second = await backend.open(spec(run_name, 1))
        assert second.id == container
        written = await second.exec("ls -A; dd if=/dev/zero of=fresh bs=1M count=64 2>/dev/null && echo wrote", 30)
        assert written.output == "wrote\n", written
        await second.close()
    finally:
        await backend.shutdown()


# Fills the pids limit and holds it (as in test_docker_backend.py); and a command that starts 2000 processes.
FILL_AND_HOLD = "(while :; do sleep 1000 & done) 2>/dev/null; sleep 1000 & exec sleep 1000"
TWO_THOUSAND = "for i in $(seq 2000); do sleep 1000 & done 2>/dev/null; wait"


@pytest.mark.parametrize("command", [FILL_AND_HOLD, TWO_THOUSAND], ids=["fill-and-hold", "two-thousand"])
async def test_a_prompt_at_its_pids_limit_goes_on_and_its_container_serves_the_next_prompt_clean(
    tmp_path, run_name, docker_api, command
):
    backend = reuse_backend(tmp_path, run_name, pool=2, pids_limit=64)
    await backend.start()
    try:
        hostile, other = await asyncio.gather(backend.open(spec(run_name, 0)), backend.open(spec(run_name, 1)))
        await hostile.write_file("notes.txt", b"kept")
        stuck = await hostile.exec(command, 3)
        assert stuck.timed_out and stuck.exit_code is None, stuck
        # as in the strict mode: every process of the prompt stopped (by the timeout's kill, or, where that could
        # not start, by the helper), its files kept, and its commands go on
        after = await hostile.exec("ps -o args | grep -c '^sleep 1000'; cat notes.txt", 30)
        assert after.output == "0\nkept", after
        assert (await other.exec("echo unaffected", 10)).output == "unaffected\n"
        await asyncio.gather(hostile.close(), other.close())
        again = await backend.open(spec(run_name, 2))
        assert again.id in (hostile.id, other.id)  # no container was given up
        assert (await again.exec("ls -A; ps -o args | grep -c '^sleep'; echo clean", 10)).output == "0\nclean\n"
        await again.close()
    finally:
        await backend.shutdown()


class _FullEngine:
    """Stands in for engines whose runtime cannot start a process in a container at its pids limit (as in
    test_docker_backend.py): from ``full`` on, every exec fails to start, the helper's too, until the container's
    limit is raised (``starts_with_headroom``), or whatever is done."""

    def __init__(self, backend, monkeypatch, starts_with_headroom: bool):
        self.full = False
        self.limits = []  # what the container's pids limit was set to
        real_start, real_set = backend.api.exec_start, backend.set_pids_limit

        def exec_start(*args, **kwargs):
            if self.full:
                raise docker.errors.APIError(
                    "500 Server Error", explanation="OCI runtime exec failed: exec failed: unable to start container "
                    "process: read init-p: connection reset by peer: unknown",
                )
            return real_start(*args, **kwargs)

        def set_pids_limit(container_id, limit):
            self.limits.append(limit)
            real_set(container_id, limit)
            if starts_with_headroom and limit > backend.config.pids_limit:
                self.full = False

        monkeypatch.setattr(backend.api, "exec_start", exec_start)
        monkeypatch.setattr(backend, "set_pids_limit", set_pids_limit)


@pytest.mark.parametrize("starts_with_headroom", [True, False], ids=["stopped-with-headroom", "cannot-be-stopped"])
async def test_a_view_the_runtime_cannot_start_a_process_in_is_stopped_or_fails_its_prompt_alone_simulated(
    tmp_path, run_name, docker_api, monkeypatch, starts_with_headroom
):
    backend = reuse_backend(tmp_path, run_name, pool=2, pids_limit=64)
    await backend.start()
    try:
        engine = _FullEngine(backend, monkeypatch, starts_with_headroom)
        hostile, other = await asyncio.gather(backend.open(spec(run_name, 0)), backend.open(spec(run_name, 1)))
        await hostile.write_file("notes.txt", b"kept")
        task = asyncio.ensure_future(hostile.exec("sleep 1000", 2))
        await asyncio.sleep(1)
        engine.full = True  # its kill cannot start, nor the helper's stop (until the limit is raised)
        if starts_with_headroom:
            stuck = await task
            assert stuck.timed_out and "process limit (-S pids_limit=64)" in stuck.output
            after = await hostile.exec("ps -o args | grep -c '^sleep 1000'; cat notes.txt", 30)
            assert after.output == "0\nkept", after
        else:
            with pytest.raises(SandboxError, match=r"pids limit 64 reached.*could not be stopped.*--resume"):
                await task
        engine.full = False
        assert engine.limits == [64 + 16, 64]  # raised for the helper's stop, then put back
        assert docker_api.inspect_container(hostile.id)["HostConfig"]["PidsLimit"] == 64
        assert (await other.exec("echo unaffected", 10)).output == "unaffected\n"
        await asyncio.gather(hostile.close(), other.close())
        gone = not [c for c in docker_api.containers(all=True) if c["Id"] == hostile.id]
        assert gone is not starts_with_headroom  # a view that could not be stopped: its container is removed
        # two containers serve again (the one made in place of a removed one too), each clean
        serving = await asyncio.gather(backend.open(spec(run_name, 2)), backend.open(spec(run_name, 3)))
        for sandbox in serving:
            assert (await sandbox.exec("ls -A; ps -o args | grep -c '^sleep'; echo works", 10)).output == "0\nworks\n"
            await sandbox.close()
    finally:
        await backend.shutdown()
