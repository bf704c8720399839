"""The modal backend through the real SDK against the local Modal stand-in: options, credentials, sandboxes, faults."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import time

import modal
import pytest

import hermes_batch
from hermes_batch import ConfigError, ExecResult, RunContext, SandboxError, SandboxSpec, structure_config
from hermes_batch.testing import Runner
from hermes_batch_modal import ModalBackend, ModalConfig, backend as backend_module
from hermes_batch_modal.backend import CreationPace
from hermes_batch_modal import connection, leftovers
from hermes_batch_modal.leftovers import LIVE_SESSIONS

from modal_rig import IMAGE_A, IMAGE_B, MISSING_IMAGE

DEAD_PID = "2147483646"  # above any pid_max: no process has it


def make_backend(tmp_path, run_name, **options) -> ModalBackend:
    options.setdefault("image", IMAGE_A)
    options.setdefault("create_rate", 100)
    return ModalBackend(ModalConfig(**options), RunContext(run_name, tmp_path / "run", seed=0))


def spec(run_name, index=0, image=None, cwd=None, env=None) -> SandboxSpec:
    return SandboxSpec(run_name, index, f"{index:08d}c0ffee", image=image, cwd=cwd, env=dict(env or {}))


@pytest.fixture
async def backend(tmp_path, run_name, standin):
    backend = make_backend(tmp_path, run_name)
    await backend.start()
    yield backend
    await backend.shutdown()


@pytest.fixture
def fast_backoff(monkeypatch):
    monkeypatch.setattr(backend_module, "BACKOFF_BASE_S", 0.05)
    monkeypatch.setattr(backend_module, "BACKOFF_MAX_S", 0.2)


# --- the plugin and its options ----------------------------------------------------------------


def test_installed_distribution_registers_the_backend_and_the_cleanup_command(tmp_path):
    pm = hermes_batch.get_plugin_manager(strict=True)
    assert pm.registry().get("sandboxes", "modal") is ModalBackend
    result = Runner(tmp_path).cli("modal", "cleanup", "--help")
    assert result.exit_code == 0, result.output
    assert "--run NAME" in result.output and "--app NAME" in result.output


def structure(options: dict) -> ModalConfig:
    return structure_config(options, ModalConfig, "options for the modal sandbox (-S)")


def test_options_parse_sizes_and_defaults():
    config = structure({"memory": "2g", "cpu": 0.5, "network": "none", "app": "my-app", "timeout": 600})
    assert config.memory_mib == 2048 and config.cpu == 0.5 and config.network == "none" and config.timeout == 600
    assert structure({"memory": 768}).memory_mib == 768
    default = ModalConfig()
    assert (default.app, default.image, default.workdir, default.network) == ("hermes-batch", "python:3.11-slim", "/workspace", "open")
    assert default.memory_mib is None and default.cpu is None
    assert default.max_starting == 32 and default.create_rate == 10 and default.startup_timeout == 180


@pytest.mark.parametrize(
    "options, says",
    [
        ({"bogus": 1}, "bogus"),
        ({"memory": "lots"}, "memory must be a size"),
        ({"memory": "64m"}, "at least 128m"),
        ({"cpu": 0}, "cpu must be between"),
        ({"network": "host"}, "network"),
        ({"workdir": "relative"}, "workdir must be an absolute path"),
        ({"app": "no spaces here"}, "app must be a Modal app name"),
        ({"timeout": 5}, "timeout must be between 10"),
        ({"max_starting": 0}, "max_starting must be between 1"),
        ({"create_rate": 0}, "create_rate must be between"),
        ({"startup_timeout": 0}, "startup_timeout must be between 1"),
    ],
)
def test_bad_options_are_config_errors_naming_the_problem(options, says):
    with pytest.raises(ConfigError) as caught:
        structure(options)
    assert says in str(caught.value)


# --- credentials ---------------------------------------------------------------------------------


def one_sentence(message: str) -> bool:
    return message.endswith(".") and ". " not in message.replace("...", "")


async def test_no_credentials_is_a_config_error_saying_how_to_log_in(tmp_path, monkeypatch):
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    monkeypatch.delenv("MODAL_TOKEN_SECRET", raising=False)
    monkeypatch.setattr(modal.config, "_user_config", {})
    backend = make_backend(tmp_path, "no-credentials")
    with pytest.raises(ConfigError) as caught:
        await backend.check()
    message = str(caught.value)
    assert "No Modal credentials were found (MODAL_TOKEN_ID and MODAL_TOKEN_SECRET not set" in message
    assert "run `modal token new`" in message and one_sentence(message)
    await backend.shutdown()


async def test_a_token_modal_refuses_is_a_config_error_that_does_not_repeat_it(tmp_path, standin, monkeypatch):
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-wrong-secret-0123456789")
    backend = make_backend(tmp_path, "bad-token")
    with pytest.raises(ConfigError) as caught:
        await backend.check()
    message = str(caught.value)
    assert "Modal refused the token" in message and "modal token new" in message and one_sentence(message)
    assert standin.token_id not in message and "as-wrong-secret" not in message
    assert standin.refused_credentials >= 1


async def test_a_server_that_does_not_answer_is_a_config_error(tmp_path, standin, monkeypatch):
    monkeypatch.setattr(connection, "HELLO_TIMEOUT_S", 3.0)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("MODAL_SERVER_URL", f"http://127.0.0.1:{port}")
    backend = make_backend(tmp_path, "no-server")
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        await backend.check()
    assert time.monotonic() - started < 15
    message = str(caught.value)
    assert f"Modal's server at http://127.0.0.1:{port} is not reachable" in message and one_sentence(message)


# --- what each sandbox gets ----------------------------------------------------------------------


async def test_sandboxes_carry_limits_network_and_tags_of_run_and_prompt(tmp_path, run_name, standin):
    backend = make_backend(tmp_path, run_name, cpu=0.5, memory="256m", timeout=900, network="none", app="hb-i11-limits")
    await backend.start()
    try:
        sandbox = await backend.open(spec(run_name, index=7))
        [held] = standin.running()
        assert held.id == sandbox.id
        assert (held.milli_cpu, held.memory_mb, held.timeout_secs, held.block_network) == (500, 256, 900, True)
        assert held.tags[leftovers.TAG_RUN] == run_name
        assert held.tags[leftovers.TAG_PROMPT] == "7"
        assert held.tags[leftovers.TAG_CONTENT_KEY] == "00000007c0ffee"
        assert held.tags[leftovers.TAG_PID] == str(os.getpid())
        assert held.tags[leftovers.TAG_SESSION] == backend.session
        assert held.app_id == standin.apps["hb-i11-limits"]
        interfaces = [line.split(":")[0].strip() for line in (await sandbox.exec("cat /proc/net/dev", 10)).output.splitlines()[2:]]
        assert interfaces == ["lo"]
        await sandbox.close()
        assert standin.running() == []
    finally:
        await backend.shutdown()


async def test_the_app_is_looked_up_once_per_run(backend, run_name, standin):
    first = await backend.open(spec(run_name, 0))
    second = await backend.open(spec(run_name, 1))
    assert standin.calls["AppGetOrCreate"] == 1
    await first.close()
    await second.close()


@pytest.mark.parametrize("cwd, expected", [(None, "/workspace"), ("project/src", "/project/src"), ("/app/", "/app")])
async def test_working_directory_comes_from_the_row_and_is_created(backend, run_name, cwd, expected):
    sandbox = await backend.open(spec(run_name, cwd=cwd))
    try:
        assert sandbox.workdir == expected
        assert (await sandbox.exec("pwd", 10)).output == f"{expected}\n"
    finally:
        await sandbox.close()


async def test_each_row_gets_its_own_image(backend, run_name):
    a = await backend.open(spec(run_name, 0))
    b = await backend.open(spec(run_name, 1, image=IMAGE_B))
    assert (await a.exec("cat /etc/hermes-image", 10)).output == f"{IMAGE_A}\n"
    assert (await b.exec("cat /etc/hermes-image", 10)).output == f"{IMAGE_B}\n"
    await a.close()
    await b.close()


async def test_the_prompts_environment_reaches_the_sandbox(backend, run_name):
    sandbox = await backend.open(spec(run_name, env={"HB_VAR": "a value", "OTHER": "x=y"}))
    result = await sandbox.exec('printf "%s|%s" "$HB_VAR" "$OTHER"', 10)
    assert result.output == "a value|x=y"
    await sandbox.close()


# --- files: bounded, never blocking, never through something that is not a file -------------------


async def test_lone_surrogates_from_the_model_do_not_break_the_wire(backend, run_name):
    sandbox = await backend.open(spec(run_name, env={"HB_ODD": "a\ud800b"}))
    result = await sandbox.exec("echo 'half \ud83d emoji'; printf %s \"$HB_ODD\"", 10)
    assert result == ExecResult("half \ufffd emoji\na\ufffdb", 0, False)
    await sandbox.write_file("odd-\udc80.txt", b"x")
    assert await sandbox.read_file("odd-\udc80.txt") == b"x"
    await sandbox.close()


async def test_read_file_is_bounded_by_max_bytes(backend, run_name):
    sandbox = await backend.open(spec(run_name))
    await sandbox.write_file("big.txt", b"0123456789" * 1000)
    assert await sandbox.read_file("big.txt", max_bytes=15) == b"012345678901234"
    assert await sandbox.read_file("big.txt", max_bytes=0) == b""
    assert len(await sandbox.read_file("big.txt")) == 10_000
    await sandbox.close()


async def test_fifos_and_devices_are_refused_at_once_without_blocking(backend, run_name):
    sandbox = await backend.open(spec(run_name))
    assert (await sandbox.exec("mkfifo pipe && ln -s pipe link-to-pipe && mkdir folder", 10)).exit_code == 0
    started = time.monotonic()
    for path in ("pipe", "link-to-pipe", "/dev/null"):
        with pytest.raises(OSError) as caught:
            await sandbox.read_file(path)
        assert caught.value.errno == errno.EINVAL and "not a regular file" in str(caught.value)
    for path in ("pipe", "link-to-pipe"):
        with pytest.raises(OSError) as caught:
            await sandbox.write_file(path, b"x")
        assert caught.value.errno == errno.EINVAL
    assert time.monotonic() - started < 20  # no read or write waited on the pipe
    with pytest.raises(IsADirectoryError):
        await sandbox.read_file("folder")
    with pytest.raises(IsADirectoryError):
        await sandbox.write_file("folder", b"x")
    with pytest.raises(NotADirectoryError):
        await sandbox.write_file("pipe/x.txt", b"x")
    await sandbox.close()


async def test_large_files_go_through_stdin_intact(backend, run_name):
    sandbox = await backend.open(spec(run_name))
    data = os.urandom(3 * 1024 * 1024 + 17)
    await sandbox.write_file("/data/blob.bin", data)
    assert await sandbox.read_file("/data/blob.bin") == data
    await sandbox.close()


async def test_closing_ends_processes_that_left_the_session(backend, run_name, standin):
    sandbox = await backend.open(spec(run_name))
    await sandbox.exec("setsid sh -c 'sleep 1000' > /dev/null 2>&1 & nohup sleep 1001 > /dev/null 2>&1 &", 10)
    [held] = standin.running()
    assert "sleep 1000" in standin.exec_in(held, "ps -o args")
    container = held.container_id
    await sandbox.close()
    assert not held.running
    assert not standin.call(standin.engine.running(container))


# --- images ---------------------------------------------------------------------------------------


async def test_an_image_modal_cannot_build_fails_with_the_reason_once(backend, run_name, standin):
    standin.faults.broken_images[IMAGE_B] = "RUN step failed: exit code 1 (stand-in build failure)"
    for _ in range(2):
        with pytest.raises(SandboxError) as caught:
            await backend.prepare_image(IMAGE_B)
        assert IMAGE_B in str(caught.value) and "stand-in build failure" in str(caught.value)
    with pytest.raises(SandboxError, match="could not build or pull"):
        await backend.prepare_image(MISSING_IMAGE)
    assert standin.calls["ImageJoinStreaming"] == 2  # one build each; the failure is remembered for the run
    await backend.prepare_image(IMAGE_A)  # the others still work


# --- scale: throttling, pacing, start storms --------------------------------------------------------


async def test_throttled_creation_is_retried_with_backoff(backend, run_name, standin, fast_backoff):
    standin.faults.throttle_creates = 3
    sandbox = await backend.open(spec(run_name))
    assert standin.throttled == 3 and backend.creation_retries == 3
    assert (await sandbox.exec("echo up", 10)).output == "up\n"
    await sandbox.close()


async def test_creation_throttled_beyond_the_retries_fails_the_prompt(tmp_path, run_name, standin, fast_backoff):
    backend = make_backend(tmp_path, run_name, create_retries=2)
    await backend.start()
    standin.faults.throttle_creates = 10
    with pytest.raises(SandboxError) as caught:
        await backend.open(spec(run_name, 4))
    message = str(caught.value)
    assert "kept refusing to create the sandbox of prompt 4" in message and "after 3 attempts" in message
    assert "--resume" in message
    await backend.shutdown()


async def test_max_starting_bounds_creations_in_flight(tmp_path, run_name, standin):
    standin.faults.create_delay = 0.3
    backend = make_backend(tmp_path, run_name, max_starting=3)
    await backend.start()
    sandboxes = await asyncio.gather(*(backend.open(spec(run_name, i)) for i in range(8)))
    assert standin.peak_starting == 3
    await asyncio.gather(*(s.close() for s in sandboxes))
    await backend.shutdown()


async def test_create_rate_spreads_creations_and_avoids_modals_throttle(tmp_path, run_name, standin):
    standin.faults.max_creates_per_second = 4
    backend = make_backend(tmp_path, run_name, create_rate=3)
    await backend.start()
    started = time.monotonic()
    sandboxes = await asyncio.gather(*(backend.open(spec(run_name, i)) for i in range(7)))
    assert time.monotonic() - started >= 6 / 3 - 0.1
    assert standin.throttled == 0
    await asyncio.gather(*(s.close() for s in sandboxes))
    await backend.shutdown()


async def test_creations_stay_spaced_when_the_event_loop_was_held_up_past_their_turns():
    pace = CreationPace(10)  # 0.1 s apart
    released = []

    async def create() -> None:
        await pace.wait()
        released.append(time.monotonic())

    creations = [asyncio.ensure_future(create()) for _ in range(5)]
    await asyncio.sleep(0)  # the first goes at once, the others wait their turn
    time.sleep(0.5)  # the loop busy past every turn (a burst of answers to handle)
    await asyncio.gather(*creations)
    gaps = [later - earlier for earlier, later in zip(released, released[1:])]
    assert min(gaps) >= 0.1 - 0.005, gaps


# --- faults -------------------------------------------------------------------------------------------


async def test_a_sandbox_that_never_becomes_ready_fails_after_startup_timeout(tmp_path, run_name, standin):
    standin.faults.never_ready = lambda tags: tags.get(leftovers.TAG_PROMPT) == "1"
    backend = make_backend(tmp_path, run_name, startup_timeout=3)
    await backend.start()
    try:
        started = time.monotonic()
        with pytest.raises(SandboxError) as caught:
            await backend.open(spec(run_name, 1))
        assert 3 <= time.monotonic() - started < 15
        message = str(caught.value)
        assert "prompt 1 was not ready within -S startup_timeout=3 s" in message and "--resume" in message
        healthy = await backend.open(spec(run_name, 2))
        await healthy.close()
    finally:
        await backend.shutdown()
    [stuck] = standin.never_ready_ids
    assert not standin.sandboxes[stuck].running  # terminated, not left to bill


async def test_a_sandbox_terminated_from_outside_fails_with_the_reason(backend, run_name, standin):
    sandbox = await backend.open(spec(run_name))
    [held] = standin.running()
    standin.terminate_from_outside(held)
    with pytest.raises(SandboxError) as caught:
        await sandbox.exec("echo hi", 10)
    assert "was terminated from outside" in str(caught.value) and "--resume" in str(caught.value)
    with pytest.raises(SandboxError, match="terminated from outside"):
        await sandbox.write_file("f.txt", b"x")
    await sandbox.close()  # nothing left to terminate: still fine


async def test_a_sandbox_terminated_during_a_command_fails_the_command(backend, run_name, standin):
    sandbox = await backend.open(spec(run_name))
    task = asyncio.ensure_future(sandbox.exec("sleep 30", 20))
    [held] = standin.running()
    await asyncio.sleep(1)
    standin.terminate_from_outside(held)
    with pytest.raises(SandboxError, match="terminated from outside"):
        await asyncio.wait_for(task, 30)
    await sandbox.close()


# --- no leaks -------------------------------------------------------------------------------------------


async def test_shutdown_terminates_sandboxes_left_open_and_half_created(tmp_path, run_name, standin):
    backend = make_backend(tmp_path, run_name)
    await backend.start()
    await backend.open(spec(run_name, 0))
    await backend.open(spec(run_name, 1))
    standin.faults.create_delay = 1.0
    opening = asyncio.ensure_future(backend.open(spec(run_name, 2)))
    await asyncio.sleep(0.5)
    opening.cancel()  # while Modal creates it
    with pytest.raises(asyncio.CancelledError):
        await opening
    await backend.shutdown()
    assert len(standin.sandboxes) == 3
    assert standin.running() == []


async def test_start_terminates_leftovers_of_a_dead_process_of_the_same_run_only(tmp_path, run_name, standin):
    client = await modal.Client.from_credentials.aio(standin.token_id, standin.token_secret)
    app = await modal.App.lookup.aio("hermes-batch", create_if_missing=True, client=client)
    image = modal.Image.from_registry(IMAGE_A)
    LIVE_SESSIONS.add("still-running")

    async def make(**tags):
        base = leftovers.sandbox_tags(run_name, tmp_path / "run", 0, "key", "crashed")
        return await modal.Sandbox.create.aio(app=app, image=image, tags={**base, **tags}, client=client)

    dead = await make(**{leftovers.TAG_PID: DEAD_PID})
    other_folder = await make(**{leftovers.TAG_PID: DEAD_PID, leftovers.TAG_RUN_DIR: "elsewhere"})
    live = await make(**{leftovers.TAG_PID: str(os.getpid()), leftovers.TAG_SESSION: "still-running"})
    backend = make_backend(tmp_path, run_name)
    try:
        await backend.start()
        remaining = {s.id for s in standin.running()}
        assert dead.object_id not in remaining
        assert {other_folder.object_id, live.object_id} <= remaining
    finally:
        LIVE_SESSIONS.discard("still-running")
        await backend.shutdown()
        for sandbox in (other_folder, live):
            await sandbox.terminate.aio()
        await client.close.aio()
