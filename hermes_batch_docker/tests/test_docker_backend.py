"""The docker backend against a real engine: hardening, labels, images, start storms, faults, cleanup."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import docker.errors
import pytest

import hermes_batch
from hermes_batch import ConfigError, ExecResult, SandboxError, structure_config
from hermes_batch_docker import DockerBackend, DockerConfig
from hermes_batch_docker.config import BASE_CAPABILITIES, default_max_starting
from hermes_batch_docker.engine import (
    LABEL_CONTENT_KEY,
    LABEL_HOST,
    LABEL_PID,
    LABEL_PROMPT,
    LABEL_RUN,
    LABEL_RUN_DIR,
    LABEL_SESSION,
    LIVE_SESSIONS,
)
from hermes_batch_docker.sandbox import LOST_NOTICE
from hermes_batch_docker.streams import ExecStream

from docker_rig import IMAGE_A, IMAGE_B, MISSING_IMAGE, containers_of, make_backend, spec

DEAD_PID = "2147483646"  # above any pid_max: no process has it


@pytest.fixture
async def sandbox(backend, run_name):
    sandbox = await backend.open(spec(run_name))
    yield sandbox
    await sandbox.close()


# --- the plugin ------------------------------------------------------------------------------


def test_installed_distribution_registers_the_backend_and_the_cleanup_command(runner):
    assert hermes_batch.get_plugin_manager(strict=True).registry().get("sandboxes", "docker") is DockerBackend
    result = runner.cli("docker", "cleanup", "--help")
    assert result.exit_code == 0, result.output
    assert "--run NAME" in result.output


# --- options ---------------------------------------------------------------------------------


def structure(options: dict) -> DockerConfig:
    return structure_config(options, DockerConfig, "options for the docker sandbox (-S)")


def test_options_parse_sizes_capabilities_and_defaults():
    config = structure({"memory": "512m", "cpus": 1, "cap_add": "net_raw,CAP_SYS_PTRACE", "network": "none"})
    assert config.memory_bytes == 512 * 1024**2
    assert config.cpus == 1.0
    assert config.cap_add == ("NET_RAW", "SYS_PTRACE")
    assert structure({"memory": 1073741824}).memory_bytes == 1024**3
    assert structure({"memory": "1.5g"}).memory_bytes == int(1.5 * 1024**3)
    assert structure({"cap_add": ["NET_RAW"]}).cap_add == ("NET_RAW",)
    assert structure({"user": 1000}).user == "1000"  # -S user=1000, as the README writes it, reads as a number
    default = DockerConfig()
    assert default.max_starting == default_max_starting()
    assert 2 <= default.max_starting <= 16
    assert default.memory_bytes == 4 * 1024**3 and default.pids_limit == 1024 and default.network == "bridge"


@pytest.mark.parametrize(
    "options, says",
    [
        ({"bogus": 1}, "bogus"),
        ({"memory": "lots"}, "memory must be a size"),
        ({"memory": "1k"}, "at least 6m"),
        ({"memory": True}, "memory must be a size"),
        ({"cpus": 0}, "cpus must be at least 0.01"),
        ({"cpus": "two"}, "cpus"),
        ({"pids_limit": 3}, "pids_limit must be at least 16"),
        ({"network": "host"}, "network=host"),
        ({"network": "container:abc"}, "network=container:abc"),
        ({"network": "no spaces"}, "network must be"),
        ({"cap_add": "ALL"}, "cap_add=ALL is refused"),
        ({"cap_add": ["SYS_ADMIN"]}, "SYS_ADMIN would let commands reach past the container"),
        ({"cap_add": "NOT_A_CAP"}, "not a Linux capability"),
        ({"cap_add": 5}, "cap_add must be"),
        ({"pull": "sometimes"}, "pull"),
        ({"workdir": "relative/dir"}, "workdir must be an absolute path"),
        ({"max_starting": 0}, "max_starting must be at least 1"),
        ({"max_output_bytes": 10}, "max_output_bytes must be at least 1024"),
        ({"image": ""}, "image"),
        ({"privileged": True}, "privileged"),
        ({"disk": "lots"}, "disk must be a size"),
        ({"disk": "1m"}, "disk must be at least 64m"),
        ({"user": "nobody"}, "user must be a numeric UID"),
        ({"user": "1000:"}, "user must be a numeric UID"),
    ],
)
def test_bad_options_are_config_errors_naming_the_problem(options, says):
    with pytest.raises(ConfigError) as caught:
        structure(options)
    assert says in str(caught.value)


async def test_more_cpus_than_the_engine_has_is_refused_at_start(tmp_path, run_name, docker_api):
    engine_cpus = docker_api.info()["NCPU"]
    backend = make_backend(tmp_path, run_name, cpus=float(engine_cpus + 1))
    with pytest.raises(ConfigError, match=f"more than the {engine_cpus} CPUs"):
        await backend.start()
    await backend.shutdown()


async def test_an_unknown_network_is_refused_at_start(tmp_path, run_name, docker_api):
    backend = make_backend(tmp_path, run_name, network="hermes-batch-no-such-network")
    with pytest.raises(ConfigError, match="no network of that name"):
        await backend.start()


async def test_an_engine_that_does_not_answer_is_a_config_error_saying_how_to_start_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    backend = make_backend(tmp_path, "engine-down")
    with pytest.raises(ConfigError) as caught:
        await backend.start()
    message = str(caught.value)
    assert f"unix://{tmp_path}/no-engine.sock is not reachable" in message
    assert "systemctl start docker" in message and "DOCKER_HOST" in message
    assert message.endswith(".") and ". " not in message  # one sentence
    await backend.shutdown()  # nothing was started: a no-op


# --- hardening and labels --------------------------------------------------------------------------


async def test_containers_are_hardened(tmp_path, run_name, docker_api):
    backend = make_backend(tmp_path, run_name, memory="256m", cpus=0.5, pids_limit=64, network="none")
    await backend.start()
    try:
        sandbox = await backend.open(spec(run_name))
        host = docker_api.inspect_container(sandbox.id)["HostConfig"]
        assert host["CapDrop"] == ["ALL"]
        assert sorted(host["CapAdd"]) == sorted(BASE_CAPABILITIES)
        assert "no-new-privileges" in host["SecurityOpt"]
        assert host["Privileged"] is False
        assert host["PidsLimit"] == 64
        assert host["Memory"] == host["MemorySwap"] == 256 * 1024**2
        assert host["NanoCpus"] == 500_000_000
        assert host["NetworkMode"] == "none"

        status = (await sandbox.exec("cat /proc/self/status", 10)).output
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        assert fields["NoNewPrivs"].strip() == "1"
        expected = sum(1 << n for n in (0, 1, 3, 4, 5, 6, 7, 10))  # the base capabilities' numbers
        assert int(fields["CapEff"].strip(), 16) == expected
        assert int(fields["CapBnd"].strip(), 16) == expected
        interfaces = [line.split(":")[0].strip() for line in (await sandbox.exec("cat /proc/net/dev", 10)).output.splitlines()[2:]]
        assert interfaces == ["lo"]
        mounted = await sandbox.exec("mkdir -p /mnt && mount -t tmpfs none /mnt", 10)
        assert mounted.exit_code != 0 and "permission denied" in mounted.output.lower()
        forks = await sandbox.exec(
            "i=0; while [ $i -lt 100 ]; do sleep 5 >/dev/null 2>&1 & i=$((i+1)); done; echo spawned", 30
        )
        assert "fork" in forks.output.lower()  # the pids limit refused some of the hundred
        await sandbox.close()
    finally:
        await backend.shutdown()


async def test_extra_capabilities_are_added_to_the_base_set(tmp_path, run_name, docker_api):
    backend = make_backend(tmp_path, run_name, cap_add="NET_RAW")
    await backend.start()
    try:
        sandbox = await backend.open(spec(run_name))
        assert "NET_RAW" in docker_api.inspect_container(sandbox.id)["HostConfig"]["CapAdd"]
    finally:
        await backend.shutdown()


async def test_default_limits_apply_to_every_container(backend, sandbox, docker_api):
    host = docker_api.inspect_container(sandbox.id)["HostConfig"]
    assert host["Memory"] == 4 * 1024**3
    assert host["NanoCpus"] == int(min(2, docker_api.info()["NCPU"]) * 1e9)
    assert host["PidsLimit"] == 1024
    assert host["NetworkMode"] == "bridge"  # documented, with -S network=none and the metadata endpoint
    assert (await sandbox.exec("id -u", 10)).output == "0\n"  # the image's user; documented, with -S user=


async def test_containers_are_labelled_with_run_and_prompt(backend, run_name, docker_api, tmp_path):
    sandbox = await backend.open(spec(run_name, index=7))
    try:
        labels = docker_api.inspect_container(sandbox.id)["Config"]["Labels"]
        assert labels[LABEL_RUN] == run_name
        assert labels[LABEL_PROMPT] == "7"
        assert labels[LABEL_CONTENT_KEY] == "00000007c0ffee"
        assert labels[LABEL_RUN_DIR] == str((tmp_path / "run").resolve())
        assert labels[LABEL_HOST] == socket.gethostname()
        assert labels[LABEL_PID] == str(os.getpid())
        assert labels[LABEL_SESSION] == backend.session
        assert sandbox.name.startswith(f"hermes-batch-{run_name}-p7-")
    finally:
        await sandbox.close()
    assert containers_of(docker_api, run_name) == []


# --- working directory and environment -----------------------------------------------------------


@pytest.mark.parametrize("cwd, expected", [(None, "/workspace"), ("project/src", "/project/src"), ("/app/", "/app")])
async def test_working_directory_comes_from_the_row_and_is_created(backend, run_name, cwd, expected):
    sandbox = await backend.open(spec(run_name, cwd=cwd))
    try:
        assert sandbox.workdir == expected
        assert (await sandbox.exec("pwd", 10)).output == f"{expected}\n"
    finally:
        await sandbox.close()


async def test_workdir_option_is_the_default_working_directory(tmp_path, run_name):
    backend = make_backend(tmp_path, run_name, workdir="/srv/task")
    await backend.start()
    try:
        sandbox = await backend.open(spec(run_name))
        assert (await sandbox.exec("pwd", 10)).output == "/srv/task\n"
        sandbox = await backend.open(spec(run_name, index=1, cwd="/elsewhere"))
        assert (await sandbox.exec("pwd", 10)).output == "/elsewhere\n"
    finally:
        await backend.shutdown()


async def test_the_command_runs_in_the_rows_image(backend, run_name):
    first = await backend.open(spec(run_name, 0, image=IMAGE_A))
    second = await backend.open(spec(run_name, 1, image=IMAGE_B))
    default = await backend.open(spec(run_name, 2))
    try:
        assert (await first.exec("cat /etc/hermes-image", 10)).output == f"{IMAGE_A}\n"
        assert (await second.exec("cat /etc/hermes-image", 10)).output == f"{IMAGE_B}\n"
        assert (await default.exec("cat /etc/hermes-image", 10)).output == f"{IMAGE_A}\n"
    finally:
        for sandbox in (first, second, default):
            await sandbox.close()


# --- commands and files ------------------------------------------------------------------------------


async def test_file_api_refuses_to_replace_a_folder_and_follows_links(sandbox):
    await sandbox.exec("mkdir -p tree/inner && echo kept > tree/inner/file && ln -s tree/inner/file link", 10)
    with pytest.raises(IsADirectoryError):
        await sandbox.write_file("tree", b"would replace the folder")
    with pytest.raises(IsADirectoryError):
        await sandbox.read_file("tree")
    assert await sandbox.read_file("tree/inner/file") == b"kept\n"
    assert await sandbox.read_file("link") == b"kept\n"
    with pytest.raises(FileNotFoundError):
        await sandbox.read_file("no/such/dir/file")
    await sandbox.write_file("/etc/new-config", b"anywhere in the container")
    assert (await sandbox.exec("cat /etc/new-config", 10)).output == "anywhere in the container"


# --- images -----------------------------------------------------------------------------------------------


def count_pulls(backend, monkeypatch, delay=0.3) -> list:
    pulls = []
    real = backend.api.pull

    def pull(name, *args, **kwargs):
        pulls.append(name)
        time.sleep(delay)  # long enough for every waiter to arrive during the pull
        return real(name, *args, **kwargs)

    monkeypatch.setattr(backend.api, "pull", pull)
    return pulls


async def test_a_missing_image_is_pulled_once_however_many_prompts_need_it(backend, monkeypatch):
    pulls = count_pulls(backend, monkeypatch)
    results = await asyncio.gather(*(backend.prepare_image(MISSING_IMAGE) for _ in range(10)), return_exceptions=True)
    assert pulls == [MISSING_IMAGE]
    assert all(isinstance(r, SandboxError) for r in results)
    message = str(results[0])
    assert MISSING_IMAGE in message and "could not be pulled" in message and "docker pull" in message
    with pytest.raises(SandboxError):
        await backend.prepare_image(MISSING_IMAGE)  # remembered: no second pull
    assert pulls == [MISSING_IMAGE]


async def test_an_image_on_the_engine_is_not_pulled(backend, monkeypatch, run_name):
    pulls = count_pulls(backend, monkeypatch)
    await asyncio.gather(*(backend.prepare_image(IMAGE_B) for _ in range(5)), backend.prepare_image(None))
    assert pulls == []
    with pytest.raises(SandboxError, match="could not be pulled"):
        await backend.open(spec(run_name, image=MISSING_IMAGE))


async def test_pull_never_refuses_missing_images_without_pulling(tmp_path, run_name, monkeypatch):
    backend = make_backend(tmp_path, run_name, pull="never")
    await backend.start()
    try:
        pulls = count_pulls(backend, monkeypatch)
        with pytest.raises(SandboxError, match="pull=never"):
            await backend.prepare_image(MISSING_IMAGE)
        assert pulls == []
    finally:
        await backend.shutdown()


# --- start storms -----------------------------------------------------------------------------------------


async def test_max_starting_limits_containers_created_at_once(tmp_path, run_name, monkeypatch):
    backend = make_backend(tmp_path, run_name, max_starting=2)
    await backend.start()
    lock = threading.Lock()
    now = peak = 0
    real = backend.api.create_container

    def create(*args, **kwargs):
        nonlocal now, peak
        with lock:
            now += 1
            peak = max(peak, now)
        try:
            time.sleep(0.2)
            return real(*args, **kwargs)
        finally:
            with lock:
                now -= 1

    monkeypatch.setattr(backend.api, "create_container", create)
    try:
        sandboxes = await asyncio.gather(*(backend.open(spec(run_name, i)) for i in range(6)))
        assert peak == 2
        results = await asyncio.gather(*(s.exec("echo up", 10) for s in sandboxes))
        # dockerd loses a short command's output now and then (LOST_NOTICE): that is not what this tests
        assert [r.exit_code for r in results] == [0] * 6
        assert {r.output for r in results} <= {"up\n", LOST_NOTICE}
    finally:
        await backend.shutdown()


def lose_outputs(monkeypatch) -> list:
    """A one-item list: the number of the next execs whose outputs are lost, as dockerd now and then loses a
    short command's."""
    left = [0]
    start, payload = ExecStream.start, ExecStream._payload

    def lossy_start(self):
        self.lost, left[0] = left[0] > 0, max(left[0] - 1, 0)
        start(self)

    monkeypatch.setattr(ExecStream, "start", lossy_start)
    monkeypatch.setattr(ExecStream, "_payload", lambda self, kind, data: None if self.lost else payload(self, kind, data))
    return left


@pytest.fixture
async def exec_sandbox(tmp_path, run_name, docker_api):
    """A sandbox whose commands are each a docker exec (-S runner=exec)."""
    backend = make_backend(tmp_path, run_name, runner="exec")
    await backend.start()
    sandbox = await backend.open(spec(run_name))
    yield sandbox
    await sandbox.close()
    await backend.shutdown()


async def test_output_the_engine_lost_is_said_for_a_command_and_read_again_for_a_file(exec_sandbox, monkeypatch):
    sandbox = exec_sandbox
    await sandbox.write_file("notes.txt", b"kept")
    lose = lose_outputs(monkeypatch)
    lose[0] = 1
    result = await sandbox.exec("echo up", 10)
    assert (result.output, result.exit_code) == (LOST_NOTICE, 0)
    assert (await sandbox.exec("echo up", 10)).output == "up\n"

    lose[0] = 2  # the read is made again
    assert await sandbox.read_file("notes.txt") == b"kept"
    lose[0] = 3  # three times lost: an error, never an empty file
    with pytest.raises(OSError, match="lost what the read returned"):
        await sandbox.read_file("notes.txt")


# --- faults ------------------------------------------------------------------------------------------------


async def test_a_container_killed_from_outside_fails_with_a_clear_reason(sandbox, docker_api):
    task = asyncio.ensure_future(sandbox.exec("sleep 30", 60))
    await asyncio.sleep(0.5)
    docker_api.kill(sandbox.id)
    with pytest.raises(SandboxError) as caught:
        await asyncio.wait_for(task, 20)
    message = str(caught.value)
    assert sandbox.name in message and "killed or stopped from outside" in message and "--resume" in message
    with pytest.raises(SandboxError, match="killed or stopped from outside"):
        await sandbox.exec("echo again", 10)


async def test_a_container_removed_from_outside_fails_with_a_clear_reason(sandbox, docker_api):
    docker_api.remove_container(sandbox.id, force=True)
    with pytest.raises(SandboxError, match="removed from outside"):
        await sandbox.exec("echo hi", 10)
    with pytest.raises(SandboxError, match="removed from outside"):
        await sandbox.write_file("f.txt", b"x")
    await sandbox.close()  # nothing left to remove: still fine


async def test_a_timed_out_command_in_a_killed_container_is_a_sandbox_error(sandbox, docker_api):
    task = asyncio.ensure_future(sandbox.exec("sleep 30", 1.5))
    await asyncio.sleep(0.5)
    docker_api.kill(sandbox.id)
    with pytest.raises(SandboxError, match="from outside"):
        await asyncio.wait_for(task, 20)


# --- no leaks ---------------------------------------------------------------------------------------------------


async def test_shutdown_removes_containers_left_open_and_half_created(tmp_path, run_name, docker_api, monkeypatch):
    backend = make_backend(tmp_path, run_name)
    await backend.start()
    await backend.open(spec(run_name, 0))
    await backend.open(spec(run_name, 1))
    real = backend.api.create_container
    created = threading.Event()

    def slow_create(*args, **kwargs):
        time.sleep(0.5)
        try:
            return real(*args, **kwargs)
        finally:
            created.set()

    monkeypatch.setattr(backend.api, "create_container", slow_create)
    opening = asyncio.ensure_future(backend.open(spec(run_name, 2)))
    await asyncio.sleep(0.1)
    opening.cancel()  # while the container is being created in a thread
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert len(containers_of(docker_api, run_name)) >= 2
    await backend.shutdown()
    assert created.is_set()
    assert containers_of(docker_api, run_name) == []


async def test_start_removes_leftovers_of_a_dead_process_of_the_same_run_only(tmp_path, run_name, docker_api):
    run_dir = str((tmp_path / "run").resolve())
    base = {LABEL_RUN: run_name, LABEL_RUN_DIR: run_dir, LABEL_HOST: socket.gethostname(), LABEL_PROMPT: "0"}
    LIVE_SESSIONS.add("still-running")

    def make(**labels):
        created = docker_api.create_container(IMAGE_A, command=["sleep", "3600"], labels={**base, **labels})
        docker_api.start(created["Id"])
        return created["Id"]

    dead = make(**{LABEL_PID: DEAD_PID, LABEL_SESSION: "crashed"})
    other_folder = make(**{LABEL_PID: DEAD_PID, LABEL_SESSION: "crashed", LABEL_RUN_DIR: "/elsewhere/run"})
    live = make(**{LABEL_PID: str(os.getpid()), LABEL_SESSION: "still-running"})
    backend = make_backend(tmp_path, run_name)
    try:
        await backend.start()
        remaining = {c["Id"] for c in containers_of(docker_api, run_name)}
        assert dead not in remaining
        assert {other_folder, live} <= remaining
    finally:
        LIVE_SESSIONS.discard("still-running")
        await backend.shutdown()
        for container in (other_folder, live):
            docker_api.remove_container(container, force=True)


# --- defaults of issue 7: disk, user, a prompt that fills its pids limit ------------------------------------


def _sized(info: dict) -> bool:
    backing = dict(info.get("DriverStatus") or []).get("Backing Filesystem")
    return info.get("Driver") in ("btrfs", "zfs", "devicemapper") or backing == "xfs"


async def test_a_disk_limit_is_applied_where_the_engine_can_and_refused_where_it_cannot(tmp_path, run_name, docker_api):
    sized = _sized(docker_api.info())
    explicit = make_backend(tmp_path, run_name, disk="2g")
    if sized:
        await explicit.start()
        try:
            sandbox = await explicit.open(spec(run_name))
            assert docker_api.inspect_container(sandbox.id)["HostConfig"]["StorageOpt"] == {"size": str(2 * 1024**3)}
        finally:
            await explicit.shutdown()
    else:
        with pytest.raises(ConfigError, match="-S disk=2g: this Docker engine cannot limit a container's disk"):
            await explicit.check()
    for options in ({}, {"disk": "none"}):
        backend = make_backend(tmp_path, run_name, **options)
        await backend.start()
        try:
            sandbox = await backend.open(spec(run_name))
            limit = docker_api.inspect_container(sandbox.id)["HostConfig"].get("StorageOpt")
            if sized and not options:
                assert limit == {"size": str(10 * 1024**3)}
            else:
                assert not limit
        finally:
            await backend.shutdown()


async def test_user_option_runs_commands_and_writes_files_as_that_user(tmp_path, run_name, docker_api):
    backend = make_backend(tmp_path, run_name, user="1234:2345")
    await backend.start()
    try:
        sandbox = await backend.open(spec(run_name, cwd="/work/project"))
        assert (await sandbox.exec("id -u; id -g", 10)).output == "1234\n2345\n"
        # the background sleep shows as a forked sh until it has exec'd: wait for it, not a fixed moment
        listed = await sandbox.exec(
            "sleep 60 & for i in $(seq 50); do ps -o user,args | grep -q '^1234 *sleep 60' && break; sleep 0.1; done; "
            "ps -o user,args | grep -c '^1234 *sleep 60'", 10,
        )
        assert listed.output == "1\n"
        await sandbox.write_file("deep/new/file.txt", b"mine")
        owners = await sandbox.exec("stat -c '%u:%g' . deep deep/new deep/new/file.txt", 10)
        assert owners.output.split() == ["1234:2345"] * 4
        assert (await sandbox.exec("echo more >> deep/new/file.txt && cat deep/new/file.txt", 10)).output == "minemore\n"
        with pytest.raises(PermissionError):
            await sandbox.write_file("/etc/hermes-batch-test", b"x")
        with pytest.raises(PermissionError):
            await sandbox.write_file("/etc/hermes-image", b"x")
        assert (await sandbox.exec("cat /etc/hermes-image", 10)).output.strip() == IMAGE_A
    finally:
        await backend.shutdown()


# Fills the pids limit and holds it: the subshell forks sleeps until fork fails and dies, the one sleep
# after it takes the pid it freed, and the command's shell becomes a sleep without forking.
FILL_AND_HOLD = "(while :; do sleep 1000 & done) 2>/dev/null; sleep 1000 & exec sleep 1000"


async def test_a_prompt_that_fills_its_pids_limit_goes_on(tmp_path, run_name, docker_api):
    backend = make_backend(tmp_path, run_name, pids_limit=32)
    await backend.start()
    try:
        sandbox = await backend.open(spec(run_name))
        stuck = await sandbox.exec(FILL_AND_HOLD, 3)
        assert stuck.timed_out and stuck.exit_code is None
        assert (await sandbox.exec("ls /etc/hermes-image", 30)) == ExecResult("/etc/hermes-image\n", 0, False)
        await sandbox.close()
    finally:
        await backend.shutdown()


class _FullEngine:
    """Stands in for engines whose runtime cannot start a process in a container at its pids limit.

    The engine of these tests starts an exec even then (cgroup v1 lets runc join a full cgroup), so
    ``exec_start`` fails here as the runtime fails elsewhere, until the container is restarted.
    """

    def __init__(self, api, monkeypatch):
        self.full = False
        self.restarts = 0
        real_start, real_restart = api.exec_start, api.restart

        def exec_start(*args, **kwargs):
            if self.full:
                raise docker.errors.APIError(
                    "500 Server Error", explanation="OCI runtime exec failed: exec failed: unable to start container "
                    "process: read init-p: connection reset by peer: unknown",
                )
            return real_start(*args, **kwargs)

        def restart(*args, **kwargs):
            self.full = False
            self.restarts += 1
            return real_restart(*args, **kwargs)

        monkeypatch.setattr(api, "exec_start", exec_start)
        monkeypatch.setattr(api, "restart", restart)


async def test_a_container_that_can_start_nothing_at_its_pids_limit_is_restarted_not_failed_simulated(
    tmp_path, run_name, docker_api, monkeypatch
):
    backend = make_backend(tmp_path, run_name, pids_limit=32)
    await backend.start()
    try:
        engine = _FullEngine(backend.api, monkeypatch)
        sandbox = await backend.open(spec(run_name))
        await sandbox.write_file("notes.txt", b"kept")
        # A command still running at its timeout whose kill cannot start.
        task = asyncio.ensure_future(sandbox.exec("sleep 1000", 2))
        await asyncio.sleep(1)
        engine.full = True
        stuck = await task
        assert stuck.timed_out and stuck.exit_code is None
        assert "process limit (-S pids_limit=32)" in stuck.output
        assert engine.restarts == 1
        # A command that cannot start.
        engine.full = True
        started = await sandbox.exec("cat notes.txt", 30)
        assert started.exit_code == 0 and started.output.endswith("kept")
        assert "process limit (-S pids_limit=32)" in started.output
        assert engine.restarts == 2
        assert await sandbox.read_file("notes.txt") == b"kept"
        await sandbox.close()
    finally:
        await backend.shutdown()
