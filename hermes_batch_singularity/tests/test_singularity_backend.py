"""The singularity backend against a real Apptainer: runtimes, images and their cache, instances, faults, leftovers."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import hermes_batch
from hermes_batch import ConfigError, RunContext, SandboxError, SandboxSpec, structure_config
from hermes_batch.testing import Runner
from hermes_batch_singularity import SingularityBackend, SingularityConfig, instances, runtime
from hermes_batch_singularity.config import default_max_starting
from hermes_batch_singularity.images import classify

from singularity_rig import IMAGE_A, IMAGE_B, instances_of

DEAD_PID = 2147483646  # above any pid_max: no process has it
RIG_CONTAINER = os.environ.get("HERMES_APPTAINER_CONTAINER", "hermes-batch-apptainer")


def make_backend(tmp_path, run_name, **options) -> SingularityBackend:
    options.setdefault("cache_dir", str(tmp_path / "cache"))
    return SingularityBackend(SingularityConfig(**options), RunContext(run_name, tmp_path / "run", seed=0))


def spec(run_name, index=0, image=None, cwd=None, env=None) -> SandboxSpec:
    return SandboxSpec(run_name, index, f"{index:08d}c0ffee", image=image, cwd=cwd, env=dict(env or {}))


def logging_runtime(tmp_path: Path, apptainer_bin: str) -> tuple[str, Path]:
    """An ``apptainer`` that notes when each of its calls starts and ends, then does the real work."""
    log = tmp_path / "calls.log"
    wrapper = tmp_path / "logged" / "apptainer"
    wrapper.parent.mkdir()
    wrapper.write_text(
        "#!/bin/bash\n"
        f'echo "$(date +%s.%N) begin $$ $1 $2" >> {log}\n'
        f'{apptainer_bin}/apptainer "$@"; status=$?\n'
        f'echo "$(date +%s.%N) end $$ $1 $2" >> {log}\n'
        'exit "$status"\n'
    )
    wrapper.chmod(0o755)
    log.touch()
    return str(wrapper), log


def calls(log: Path, *words: str) -> list:
    """The calls (begin, end) whose first arguments are ``words``."""
    begun, ended = {}, {}
    for line in log.read_text().splitlines():
        stamp, kind, pid, *args = line.split()
        if tuple(args[: len(words)]) == words:
            (begun if kind == "begin" else ended)[pid] = float(stamp)
    return [(begun[pid], ended.get(pid)) for pid in begun]


def peak_overlap(spans: list) -> int:
    events = sorted([(begin, 1) for begin, _ in spans] + [(end, -1) for _, end in spans])
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


@pytest.fixture
async def backend(tmp_path, run_name, images):
    backend = make_backend(tmp_path, run_name, image=images.sif_a)
    await backend.start()
    yield backend
    await backend.shutdown()


@pytest.fixture
async def sandbox(backend, run_name):
    sandbox = await backend.open(spec(run_name))
    yield sandbox
    await sandbox.close()


# --- the plugin and its options ---------------------------------------------------------------------


def test_installed_distribution_registers_the_backend_and_the_cleanup_command(tmp_path):
    pm = hermes_batch.get_plugin_manager(strict=True)
    assert pm.registry().get("sandboxes", "singularity") is SingularityBackend
    result = Runner(tmp_path).cli("singularity", "cleanup", "--help")
    assert result.exit_code == 0 and "--run NAME" in result.output


def test_options_parse_flags_and_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    default = SingularityConfig()
    assert default.cache_path == tmp_path / "xdg" / "hermes-batch" / "singularity"
    assert default.max_starting == default_max_starting() and 2 <= default.max_starting <= 16
    assert default.drop_privileges == (os.geteuid() == 0)
    parsed = structure_config({"extra_args": "--nv --bind '/a b:/data'", "network": "none"}, SingularityConfig, "x")
    assert parsed.extra_args == ("--nv", "--bind", "/a b:/data") and parsed.network == "none"
    assert structure_config({"extra_args": ["--nv"]}, SingularityConfig, "x").extra_args == ("--nv",)


@pytest.mark.parametrize(
    "options, says",
    [
        ({"extra_args": "--bind 'unclosed"}, "extra_args must be flags"),
        ({"extra_args": 5}, "extra_args must be a string"),
        ({"network": "bridge"}, "network"),
        ({"image": ""}, "image"),
        ({"max_output_bytes": 10}, "max_output_bytes must be at least 1024"),
    ],
)
def test_bad_options_are_config_errors_naming_the_problem(options, says):
    with pytest.raises(ConfigError) as caught:
        structure_config(options, SingularityConfig, "options for the singularity sandbox (-S)")
    assert says in str(caught.value)


def test_the_runtime_keeps_the_runners_secrets_out_of_its_environment(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("APPTAINERENV_INJECTED", "into-every-container")
    monkeypatch.setenv("APPTAINER_CACHEDIR", "/site/cache")
    monkeypatch.setenv("https_proxy", "http://proxy:3128")
    env = runtime.runtime_environment()
    assert "OPENAI_API_KEY" not in env and "APPTAINERENV_INJECTED" not in env and "https_proxy" not in env
    assert env["APPTAINER_CACHEDIR"] == "/site/cache" and env["PATH"]
    assert runtime.runtime_environment(proxies=True)["https_proxy"] == "http://proxy:3128"


# --- runtimes -------------------------------------------------------------------------------------------------


async def test_apptainer_is_preferred_and_singularity_is_the_fallback(tmp_path, run_name, apptainer_bin, monkeypatch):
    backend = make_backend(tmp_path, run_name)
    await backend.check()
    assert backend.binary == os.path.join(apptainer_bin, "apptainer")
    only_singularity = tmp_path / "only-singularity"
    only_singularity.mkdir()
    (only_singularity / "singularity").symlink_to(os.path.join(apptainer_bin, "singularity"))
    others = [p for p in os.environ["PATH"].split(os.pathsep) if p != apptainer_bin]
    monkeypatch.setenv("PATH", os.pathsep.join([str(only_singularity), *others]))
    fallback = make_backend(tmp_path, run_name)
    await fallback.check()
    assert fallback.binary == str(only_singularity / "singularity")
    assert "version" in fallback.version
    chosen = make_backend(tmp_path, run_name, binary=os.path.join(apptainer_bin, "apptainer"))
    await chosen.check()
    assert chosen.binary == os.path.join(apptainer_bin, "apptainer")


async def test_a_runtime_that_does_not_run_is_a_config_error(tmp_path, run_name):
    broken = tmp_path / "apptainer"
    broken.write_text("#!/bin/sh\necho 'FATAL:   broken installation' >&2\nexit 255\n")
    broken.chmod(0o755)
    backend = make_backend(tmp_path, run_name, binary=str(broken))
    with pytest.raises(ConfigError, match="--version failed \\(broken installation\\)"):
        await backend.check()


# --- images ----------------------------------------------------------------------------------------------------


def test_images_are_files_folders_or_uris_and_bare_names_mean_docker(tmp_path):
    (tmp_path / "box").mkdir()
    assert classify("python:3.11-slim").location == "docker://python:3.11-slim"
    assert classify("ghcr.io/org/tool:1").location == "docker://ghcr.io/org/tool:1"
    assert classify("oras://registry/img:1").location == "oras://registry/img:1"
    assert classify("library://alpine:3").location == "library://alpine:3"
    assert classify("docker-daemon://img:1").location == "docker-daemon://img:1"
    assert classify(f"{tmp_path}/x.sif").kind == "file"
    assert classify("images/x.sif").location == os.path.abspath("images/x.sif")
    assert (classify(str(tmp_path / "box")).kind, classify(str(tmp_path / "box")).location) == ("folder", str(tmp_path / "box"))
    assert classify("docker-archive://rel.tar").location == f"docker-archive://{os.path.abspath('rel.tar')}"
    with pytest.raises(SandboxError, match="scheme ftp://, which Apptainer cannot build from"):
        classify("ftp://host/image")


async def test_a_uri_is_converted_once_when_ten_prompts_of_two_runs_need_it_at_once(tmp_path, run_name, images, apptainer_bin):
    binary, log = logging_runtime(tmp_path, apptainer_bin)
    cache = tmp_path / "shared-cache"
    # Two backends (their own image bookkeeping, their own lock files) stand for two processes.
    first = make_backend(tmp_path, run_name, binary=binary, cache_dir=str(cache), image=images.archive_a)
    second = make_backend(tmp_path, run_name, binary=binary, cache_dir=str(cache), image=images.archive_a)
    await first.start()
    await second.start()
    try:
        async def prompt(index):
            await first.prepare_image(None)
            sandbox = await first.open(spec(run_name, index))
            try:
                return (await sandbox.exec("cat /etc/hermes-image", 30)).output
            finally:
                await sandbox.close()

        outputs, _ = await asyncio.gather(
            asyncio.gather(*(prompt(i) for i in range(10))),
            asyncio.gather(*(second.prepare_image(None) for _ in range(10))),
        )
        assert outputs == [f"{IMAGE_A}\n"] * 10
        assert len(calls(log, "build")) == 1
        [sif] = (cache / "sif").glob("*.sif")
        assert sif.name.startswith("busybox-a.tar-")
        assert not list((cache / "sif").glob("*.tmp"))
    finally:
        await first.shutdown()
        await second.shutdown()
    later = make_backend(tmp_path, run_name, binary=binary, cache_dir=str(cache), image=images.archive_a)
    await later.start()
    try:
        await later.prepare_image(None)  # a later run finds it in the cache
        assert len(calls(log, "build")) == 1
    finally:
        await later.shutdown()


async def test_two_images_converted_at_once_leave_apptainers_shared_layer_cache_alone(tmp_path, run_name, images, monkeypatch):
    # Apptainer rewrites its cache's index.json in place at every build; two builds sharing it
    # failed about 1 in 20 with "unexpected end of JSON input". Conversions keep out of it.
    shared = tmp_path / "apptainer-cache"
    shared.mkdir()
    monkeypatch.setenv("APPTAINER_CACHEDIR", str(shared))
    backend = make_backend(tmp_path, run_name, cache_dir=str(tmp_path / "sifs"))
    await backend.start()
    try:
        sifs = await asyncio.gather(*(backend.images.path(image) for image in (images.archive_a, images.archive_b)))
        assert [os.path.basename(sif).split(".tar-")[0] for sif in sifs] == ["busybox-a", "busybox-b"]
        assert list(shared.iterdir()) == []
    finally:
        await backend.shutdown()


async def test_a_conversion_that_fails_is_tried_once_and_fails_every_prompt_needing_it(tmp_path, run_name, apptainer_bin):
    binary, log = logging_runtime(tmp_path, apptainer_bin)
    backend = make_backend(tmp_path, run_name, binary=binary)
    await backend.start()
    bad = f"docker-archive://{tmp_path}/missing.tar"
    try:
        results = await asyncio.gather(*(backend.prepare_image(bad) for _ in range(5)), return_exceptions=True)
        assert all(isinstance(r, SandboxError) for r in results)
        message = str(results[0])
        assert message.startswith(f"The image {bad!r} could not be converted to a SIF (")
        assert message.endswith("check its name and that its source can be reached, or name a .sif file instead.")
        with pytest.raises(SandboxError):
            await backend.open(spec(run_name, image=bad))
        assert len(calls(log, "build")) == 1
    finally:
        await backend.shutdown()


async def test_a_missing_sif_file_fails_without_a_conversion(tmp_path, run_name, apptainer_bin):
    binary, log = logging_runtime(tmp_path, apptainer_bin)
    backend = make_backend(tmp_path, run_name, binary=binary)
    await backend.start()
    try:
        with pytest.raises(SandboxError, match="names no SIF file"):
            await backend.prepare_image(str(tmp_path / "nowhere.sif"))
        assert calls(log, "build") == []
    finally:
        await backend.shutdown()


async def test_sif_files_and_sandbox_folders_are_used_as_they_are(backend, run_name, images):
    for index, (image, marker) in enumerate(((images.sif_a, IMAGE_A), (images.folder_b, IMAGE_B))):
        sandbox = await backend.open(spec(run_name, index, image=image))
        try:
            assert (await sandbox.exec("cat /etc/hermes-image", 30)).output == f"{marker}\n"
        finally:
            await sandbox.close()
    assert not (Path(backend.config.cache_dir) / "sif").exists()


# --- instances ---------------------------------------------------------------------------------------------------


async def test_instance_names_carry_the_run_and_the_prompt(backend, run_name, apptainer_bin):
    sandbox = await backend.open(spec(run_name, 7))
    try:
        parsed = instances.InstanceName.parse(sandbox.name)
        assert parsed.prompt_index == 7 and parsed.of_run(run_name) and parsed.pid == os.getpid()
        assert parsed.dir_hash == instances.folder_hash(backend.run.run_dir)
        assert instances_of(apptainer_bin, run_name) == [sandbox.name]
    finally:
        await sandbox.close()
    assert instances_of(apptainer_bin, run_name) == []


async def test_instances_are_contained_with_a_writable_tmpfs_of_their_own(backend, run_name, tmp_path):
    (tmp_path / "host-file.txt").write_text("on the host")
    first = await backend.open(spec(run_name, 0))
    second = await backend.open(spec(run_name, 1))
    try:
        # /tmp is shared with the runtime (it holds the image), yet --containall keeps it out.
        assert (await first.exec(f"cat {tmp_path}/host-file.txt", 30)).exit_code != 0
        assert (await first.exec("echo changed > /etc/hermes-image && cat /etc/hermes-image", 30)).output == "changed\n"
        assert (await second.exec("cat /etc/hermes-image", 30)).output == f"{IMAGE_A}\n"
        assert (await first.exec('echo "$HOME"; ls -A "$HOME" | wc -l', 30)).output.split() == ["/root", "0"]
    finally:
        await first.close()
        await second.close()


# The interfaces of the command's own network namespace (/sys/class/net may show the host's).
INTERFACES = "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '"


async def test_network_none_leaves_only_loopback(tmp_path, run_name, images):
    backend = make_backend(tmp_path, run_name, image=images.sif_a, network="none")
    await backend.start()
    try:
        sandbox = await backend.open(spec(run_name))
        assert (await sandbox.exec(INTERFACES, 30)).output.split() == ["lo"]
        default = make_backend(tmp_path, run_name, image=images.sif_a)
        await default.start()
        try:
            shared = await default.open(spec(run_name, 1))
            assert len((await shared.exec(INTERFACES, 30)).output.split()) > 1
        finally:
            await default.shutdown()
    finally:
        await backend.shutdown()


async def test_extra_args_reach_the_instance_start(tmp_path, run_name, images):
    data = tmp_path / "site-data"
    data.mkdir()
    (data / "readme.txt").write_text("bound in")
    backend = make_backend(tmp_path, run_name, image=images.sif_a, extra_args=f"--bind {data}:/data:ro")
    await backend.start()
    try:
        sandbox = await backend.open(spec(run_name))
        assert (await sandbox.exec("cat /data/readme.txt", 30)).output == "bound in"
        assert (await sandbox.exec("touch /data/new", 30)).exit_code != 0
    finally:
        await backend.shutdown()


async def test_max_starting_limits_instances_started_at_once(tmp_path, run_name, images, apptainer_bin):
    binary, log = logging_runtime(tmp_path, apptainer_bin)
    backend = make_backend(tmp_path, run_name, binary=binary, image=images.sif_a, max_starting=2)
    await backend.start()
    try:
        sandboxes = await asyncio.gather(*(backend.open(spec(run_name, i)) for i in range(6)))
        starts = calls(log, "instance", "start")
        assert len(starts) == 6
        assert peak_overlap(starts) == 2
        results = await asyncio.gather(*(s.exec("echo up", 30) for s in sandboxes))
        assert [r.output for r in results] == ["up\n"] * 6
    finally:
        await backend.shutdown()


def image_without_setsid(folder: Path, base: str) -> None:
    """A sandbox folder whose /bin/sh is dash and that has no setsid (busybox's ash runs its applets itself)."""
    shutil.copytree(base, folder, symlinks=True)
    (folder / "bin" / "setsid").unlink()
    (folder / "bin" / "sh").unlink()
    shutil.copy2("/bin/dash", folder / "bin" / "sh")
    libraries = subprocess.run(["ldd", "/bin/dash"], capture_output=True, text=True, check=True).stdout
    for path in re.findall(r"(/\S+\.so[.\d]*)", libraries):
        target = folder / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(path), target)


async def test_a_timeout_kills_the_process_tree_also_in_an_image_without_setsid(tmp_path, run_name, images):
    folder = tmp_path / "no-setsid"
    image_without_setsid(folder, images.folder_b)
    backend = make_backend(tmp_path, run_name, image=str(folder))
    await backend.start()
    try:
        sandbox = await backend.open(spec(run_name))
        assert (await sandbox.exec("command -v setsid || echo none", 30)).output == "none\n"
        started = time.monotonic()
        result = await sandbox.exec("(sleep 3; touch killed-marker) & (sleep 3; touch second-marker) & sleep 60", 1)
        assert result.timed_out and result.exit_code is None
        assert time.monotonic() - started < 15
        await asyncio.sleep(4)
        assert (await sandbox.exec("ls", 30)).output == ""
    finally:
        await backend.shutdown()


def rig_processes() -> str:
    """Command lines of every process in the Apptainer test rig's container."""
    done = subprocess.run(
        ["docker", "exec", RIG_CONTAINER, "/bin/sh", "-c",
         'for f in /proc/[0-9]*/cmdline; do tr "\\0" " " < "$f" 2>/dev/null; echo; done'],
        capture_output=True, text=True,
    )
    return done.stdout


async def test_closing_ends_every_process_of_the_prompt_daemons_included(backend, run_name):
    sandbox = await backend.open(spec(run_name))
    await sandbox.exec("setsid sh -c 'sleep 313 & sleep 314' > /dev/null 2>&1 < /dev/null &", 30)
    await sandbox.exec("(sleep 315 &) > /dev/null 2>&1", 30)
    running = rig_processes()
    assert "sleep 313" in running and "sleep 314" in running and "sleep 315" in running
    await sandbox.close()
    running = rig_processes()
    assert "sleep 313" not in running and "sleep 314" not in running and "sleep 315" not in running


# --- faults ------------------------------------------------------------------------------------------------


async def test_an_instance_stopped_from_outside_fails_with_a_clear_reason(sandbox, apptainer_bin):
    task = asyncio.ensure_future(sandbox.exec("sleep 30", 60))
    await asyncio.sleep(1.0)
    subprocess.run([os.path.join(apptainer_bin, "apptainer"), "instance", "stop", "--force", sandbox.name], capture_output=True)
    with pytest.raises(SandboxError) as caught:
        await asyncio.wait_for(task, 30)
    message = str(caught.value)
    assert sandbox.name in message and "stopped from outside" in message and "--resume" in message
    with pytest.raises(SandboxError, match="stopped from outside"):
        await sandbox.exec("echo again", 10)
    with pytest.raises(SandboxError, match="stopped from outside"):
        await sandbox.write_file("f.txt", b"x")
    await sandbox.close()  # nothing left to stop: still fine


# --- no leaks -----------------------------------------------------------------------------------------------


async def test_shutdown_stops_instances_left_open_and_starts_cut_short(tmp_path, run_name, images, apptainer_bin):
    binary, log = logging_runtime(tmp_path, apptainer_bin)
    backend = make_backend(tmp_path, run_name, binary=binary, image=images.sif_a)
    await backend.start()
    await backend.open(spec(run_name, 0))
    opening = asyncio.ensure_future(backend.open(spec(run_name, 1)))
    for _ in range(400):  # until its instance start is under way
        if calls(log, "instance", "start")[1:]:
            break
        await asyncio.sleep(0.01)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    await backend.shutdown()
    assert all(end is not None for _, end in calls(log, "instance", "start"))
    assert instances_of(apptainer_bin, run_name) == []


async def test_start_stops_leftovers_of_a_dead_process_of_the_same_run_only(tmp_path, run_name, images, apptainer_bin):
    folder = instances.folder_hash(tmp_path / "run")
    tag = f"{run_name}.{instances.run_hash(run_name)}"
    dead = f"hb-{tag}{folder}.p0.{DEAD_PID}.dead.0"
    other_folder = f"hb-{tag}ffff.p0.{DEAD_PID}.dead.1"
    live = f"hb-{tag}{folder}.p1.{os.getpid()}.cafe.2"
    instances.LIVE_SESSIONS.add("cafe")
    apptainer = os.path.join(apptainer_bin, "apptainer")
    for name in (dead, other_folder, live):
        done = subprocess.run([apptainer, "instance", "start", "--no-privs", "--containall", images.sif_a, name], capture_output=True)
        assert done.returncode == 0, done.stderr
    backend = make_backend(tmp_path, run_name, image=images.sif_a)
    try:
        await backend.start()
        assert sorted(instances_of(apptainer_bin, run_name)) == sorted([other_folder, live])
    finally:
        instances.LIVE_SESSIONS.discard("cafe")
        await backend.shutdown()
        for name in (other_folder, live):
            subprocess.run([apptainer, "instance", "stop", "--force", name], capture_output=True)
