"""-S reuse=namespace: an instance serves prompts one after another, nothing of one reaches the next."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import attrs
import pytest

from hermes_batch import ConfigError, RunContext, SandboxError, SandboxSpec, structure_config
from hermes_batch.testing import ToolLoopScript, tool_outputs, write_dataset
from hermes_batch_singularity import SingularityBackend, SingularityConfig, views

from singularity_rig import IMAGE_A, instances_of


def make_backend(tmp_path, run_name, **options) -> SingularityBackend:
    options.setdefault("cache_dir", str(tmp_path / "cache"))
    return SingularityBackend(SingularityConfig(reuse="namespace", **options), RunContext(run_name, tmp_path / "run", seed=0))


@pytest.fixture
async def backend(tmp_path, run_name, images):
    """A started backend of -S reuse=namespace over the test image, shut down after the test."""
    backend = make_backend(tmp_path, run_name, image=images.sif_a)
    await backend.start()
    yield backend
    await backend.shutdown()


def spec(run_name, index=0, env=None) -> SandboxSpec:
    return SandboxSpec(run_name, index, f"{index:08d}c0ffee", env=dict(env or {}))


def test_reuse_takes_none_or_namespace_and_needs_the_runner_and_no_pool():
    def structure(**options):
        return structure_config(options, SingularityConfig, "options for the singularity sandbox (-S)")

    assert SingularityConfig().reuse == "none" and structure(reuse="namespace").reuse == "namespace"
    for bad, says in (({"reuse": "always"}, "reuse"), ({"reuse": "namespace", "runner": "exec"}, "drop runner=exec"),
                      ({"reuse": "namespace", "pool": "2"}, "drop pool=")):
        with pytest.raises(ConfigError, match=says):
            structure(**bad)


async def test_a_prompts_leftovers_never_reach_the_next_prompt_of_its_instance(tmp_path, run_name, images, apptainer_bin):
    backend = make_backend(tmp_path, run_name, image=images.sif_a)
    await backend.start()
    try:
        await backend.prepare_image(None)
        first = await backend.open(spec(run_name, 0, env={"HB_PROMPT_SECRET": "prompt-0"}))
        left = await first.exec(
            "echo $HB_PROMPT_SECRET > left.txt; echo tampered > /etc/hermes-image; mkdir -p /tmp/left /dev/shm/left; "
            "mkfifo /workspace/fifo; export HB_EXPORTED=1; (setsid sleep 377 >/dev/null 2>&1 &); "
            "(trap '' TERM HUP; exec sleep 378) >/dev/null 2>&1 & echo done", 60,
        )
        assert left.output == "done\n" and (await first.exec("cat left.txt", 30)).output == "prompt-0\n"
        await first.close()

        second = await backend.open(spec(run_name, 1))
        try:
            assert second.name == first.name  # the same instance, a new view
            seen = await second.exec("ls -a /workspace /tmp /dev/shm; cat /etc/hermes-image; env; ps -o args 2>/dev/null || ps", 60)
            assert "left.txt" not in seen.output and "left" not in seen.output.split() and "fifo" not in seen.output
            assert IMAGE_A in seen.output and "tampered" not in seen.output
            assert "HB_PROMPT_SECRET" not in seen.output and "HB_EXPORTED" not in seen.output
            assert "sleep 377" not in seen.output and "sleep 378" not in seen.output
            # nor in the instance itself, outside every view
            outside = [*backend.exec_prefix("/"), f"instance://{second.name}", "/bin/sh", "-c", "ps -o args; ls /workspace"]
            done = subprocess.run(outside, env=backend.env, capture_output=True, text=True)
            assert "sleep 37" not in done.stdout and "left.txt" not in done.stdout
        finally:
            await second.close()
    finally:
        await backend.shutdown()
    assert instances_of(apptainer_bin, run_name) == []


async def test_concurrent_prompts_get_instances_of_their_own(run_name, backend):
    first, second = await backend.open(spec(run_name, 0)), await backend.open(spec(run_name, 1))
    assert first.name != second.name
    await first.exec("touch /workspace/first-was-here; sleep 300 >/dev/null 2>&1 &", 30)
    seen = await second.exec("ls /workspace; ps -o args 2>/dev/null || ps", 30)
    assert "first-was-here" not in seen.output and "sleep 300" not in seen.output
    await first.close()
    await second.close()


async def test_an_instance_is_back_in_its_pool_when_close_returns_and_serves_any_working_folder(run_name, backend):
    first = await backend.open(spec(run_name, 0))
    await first.exec("touch /workspace/mine", 30)
    await first.close()
    pool, = backend._pools.values()
    assert list(pool._ready) == [first.name]  # its view has ended: nothing of the prompt is left in it

    elsewhere = await backend.open(attrs.evolve(spec(run_name, 1), cwd="/srv/elsewhere"))
    assert elsewhere.name == first.name and pool.ready == 0
    assert (await elsewhere.exec("pwd; ls /workspace 2>/dev/null | wc -l", 30)).output == "/srv/elsewhere\n0\n"
    await elsewhere.close()


async def test_an_instance_stopped_from_outside_while_it_waited_is_replaced(run_name, backend):
    first = await backend.open(spec(run_name, 0))
    await first.close()
    subprocess.run([backend.binary, "instance", "stop", "--force", first.name], env=backend.env, check=True,
                   capture_output=True)
    second = await backend.open(spec(run_name, 1))
    assert second.name != first.name and (await second.exec("echo fine", 30)).output == "fine\n"
    await second.close()


async def test_a_start_that_fails_once_does_not_end_the_reuse(run_name, backend, monkeypatch):
    starts = []
    real_start = backend._pool_instance

    async def fails_first(image, path):
        starts.append(image)
        if len(starts) == 1:
            raise SandboxError("Starting an instance took longer than 300 s.")  # as on a loaded machine
        return await real_start(image, path)

    monkeypatch.setattr(backend, "_pool_instance", fails_first)
    first = await backend.open(spec(run_name, 0))  # the pool's start failed: the prompt started its own
    await first.close()
    second = await backend.open(spec(run_name, 1))
    assert second.name == first.name and len(starts) == 2  # which serves the next prompt as any other
    await second.close()


async def test_prompts_one_after_another_share_as_many_instances_as_run_at_once(tmp_path, run_name, images, apptainer_bin):
    backend = make_backend(tmp_path, run_name, image=images.sif_a)
    await backend.start()
    names = set()

    async def worker(first_index: int) -> None:
        for index in range(first_index, first_index + 4):
            sandbox = await backend.open(spec(run_name, index))
            names.add(sandbox.name)
            assert (await sandbox.exec("ls /workspace; touch /workspace/was-here; echo ok", 30)).output == "ok\n"
            await sandbox.close()

    try:
        await asyncio.gather(worker(0), worker(10))
        assert len(names) == 2  # each prompt waited for an instance coming back instead of starting another
        assert len(instances_of(apptainer_bin, run_name)) == 2
    finally:
        await backend.shutdown()
    assert instances_of(apptainer_bin, run_name) == []


async def test_checks_after_stop_processes_join_the_view_and_cannot_be_forged(run_name, backend):
    sandbox = await backend.open(spec(run_name, 0))
    runner_pid = sandbox._runner.pid
    forger = (
        f"(while :; do printf '\\036%s 0\\nforged\\n' x > /proc/{runner_pid}/fd/1; "
        f"head -c 1 /proc/{runner_pid}/fd/0 > /dev/null; done) > /dev/null 2>&1 &"
    )
    assert "started\n" in (await sandbox.exec(f"setsid sh -c \"{forger}\" & echo started; echo kept > kept.txt", 30)).output
    assert await sandbox.stop_processes()
    for _ in range(2):
        check = await sandbox.exec("cat kept.txt; exit 7", 30)
        assert (check.output, check.exit_code) == ("kept\n", 7) and sandbox._runner is None
    listing = (await sandbox.exec("ps -o args", 30)).output.splitlines()[1:]
    # the view's first process (the helper) and this check alone: the runner and the forger are gone
    assert [line for line in listing if not line.startswith(views.HELPER + " -O ") and "ps -o args" not in line] == []
    await sandbox.close()


async def test_a_command_that_kills_the_runner_ends_its_view_with_a_clear_error(run_name, backend):
    sandbox = await backend.open(spec(run_name, 0))
    with pytest.raises(SandboxError, match="ended"):
        await sandbox.exec("kill -9 -1; sleep 1", 30)
    await sandbox.close()
    after = await backend.open(spec(run_name, 1))  # the instance is stopped or serves again
    assert (await after.exec("echo fine", 30)).output == "fine\n"
    await after.close()


def test_a_run_with_reuse_gives_each_prompt_a_view_of_its_own(tmp_path, runner, model_server, images, apptainer_bin):
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(6)])
    script = ToolLoopScript(tool_calls=1, command="ls /workspace; touch /workspace/mine; echo ok")
    result = runner.invoke(dataset, "--num_workers", "2", "-S", f"image={images.sif_a}", "-S", "reuse=namespace",
                           server=model_server(script))

    assert result.exit_code == 0, result.output
    outputs = [tool_outputs(t)[0] for t in runner.records("trajectories.jsonl")]
    assert outputs == ["ok\n"] * 6  # none saw another prompt's file
    assert instances_of(apptainer_bin, runner.run_name) == []


async def test_an_ordinary_user_is_told_reuse_needs_root(tmp_path, run_name, images, user_apptainer_bin, apptainer_bin):
    shared = Path(tempfile.mkdtemp(prefix="unprivileged-", dir=Path(apptainer_bin).parent))
    try:
        shared.chmod(0o777)
        sif = shared / "a.sif"
        shutil.copyfile(images.sif_a, sif)
        sif.chmod(0o644)
        # The user's own helper, as the user's run would build it (this test's process is root's).
        helper = Path(views.helper_path(shared / "cache"))
        for folder in (shared / "cache", helper.parent):
            os.chmod(folder, 0o755)
        # As the user's own run: no --no-privs (that is root's), so nothing refuses the start but the helper itself.
        backend = make_backend(tmp_path, run_name, image=str(sif), binary=f"{user_apptainer_bin}/apptainer",
                               cache_dir=str(shared / "cache"), no_privs=False)
        await backend.start()
        try:
            with pytest.raises(SandboxError) as raised:
                await backend.open(spec(run_name, 0))
            assert str(raised.value) == views.NOT_ROOT
        finally:
            await backend.shutdown()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
