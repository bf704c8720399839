"""Instances started ahead of need (-S pool=): each serves one prompt, nothing of a prompt reaches the next."""

from __future__ import annotations

import asyncio
import time

import pytest

from hermes_batch import ConfigError, RunContext, SandboxSpec, structure_config
from hermes_batch.testing import ToolLoopScript, tool_outputs, wait_for, write_dataset
from hermes_batch_singularity import SingularityBackend, SingularityConfig, instances

from singularity_rig import IMAGE_A, instances_of


def make_backend(tmp_path, run_name, **options) -> SingularityBackend:
    options.setdefault("cache_dir", str(tmp_path / "cache"))
    return SingularityBackend(SingularityConfig(**options), RunContext(run_name, tmp_path / "run", seed=0))


def spec(run_name, index=0, image=None, cwd=None, env=None) -> SandboxSpec:
    return SandboxSpec(run_name, index, f"{index:08d}c0ffee", image=image, cwd=cwd, env=dict(env or {}))


async def until_pooled(backend, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while backend.pooled() < count:
        assert time.monotonic() < deadline, f"the pool never held {count} instances ({backend.pooled()})"
        await asyncio.sleep(0.05)


def test_the_pool_option_takes_a_number_or_auto():
    def structure(value):
        return structure_config({"pool": value}, SingularityConfig, "options for the singularity sandbox (-S)")

    assert structure("auto").pool_size(16) == 16
    assert structure("2").pool_size(16) == 2
    assert SingularityConfig().pool_size(16) == 0
    for bad in ("some", -1, True):
        with pytest.raises(ConfigError, match="pool must be a number of instances"):
            structure(bad)
    parsed = instances.InstanceName.parse(instances.instance_name("r", "/x", "pool", "abcd"))
    assert parsed is not None and parsed.prompt_index is None and parsed.of_run("r")


async def test_a_prompts_leftovers_never_reach_the_next_prompt_of_the_pool(tmp_path, run_name, images, apptainer_bin):
    backend = make_backend(tmp_path, run_name, image=images.sif_a, pool=1)
    await backend.start()
    try:
        await backend.prepare_image(None)
        await until_pooled(backend, 1)
        pooled = set(instances_of(apptainer_bin, run_name))
        first = await backend.open(spec(run_name, 0, env={"HB_PROMPT_SECRET": "prompt-0"}))
        assert first.name in pooled and ".ppool." in first.name  # started ahead of need
        left = await first.exec(
            "echo $HB_PROMPT_SECRET > left.txt; echo tampered > /etc/hermes-image; mkdir -p /tmp/left; "
            "export HB_EXPORTED=1; (setsid sleep 377 >/dev/null 2>&1 &); echo done", 60,
        )
        assert left.output == "done\n" and (await first.exec("cat left.txt", 30)).output == "prompt-0\n"
        await first.close()

        await until_pooled(backend, 1)
        pooled = set(instances_of(apptainer_bin, run_name))
        second = await backend.open(spec(run_name, 1))
        try:
            assert second.name != first.name and second.name in pooled
            seen = await second.exec("ls -a /workspace /tmp; cat /etc/hermes-image; env; ps -o args 2>/dev/null || ps", 60)
            assert "left.txt" not in seen.output and "left" not in seen.output.split()
            assert IMAGE_A in seen.output and "tampered" not in seen.output
            assert "HB_PROMPT_SECRET" not in seen.output and "HB_EXPORTED" not in seen.output
            assert "sleep 377" not in seen.output
        finally:
            await second.close()
        assert first.name not in instances_of(apptainer_bin, run_name)
    finally:
        await backend.shutdown()
    assert instances_of(apptainer_bin, run_name) == []


async def test_pooled_instances_of_a_dead_process_are_stopped_by_the_next_one(tmp_path, run_name, images, apptainer_bin):
    crashed = make_backend(tmp_path, run_name, image=images.sif_a, pool=2)
    await crashed.start()
    await crashed.prepare_image(None)
    await until_pooled(crashed, 2)
    assert len(instances_of(apptainer_bin, run_name)) == 2
    instances.LIVE_SESSIONS.discard(crashed.session)  # as if its process had died without shutting down

    resumed = make_backend(tmp_path, run_name, image=images.sif_a)
    try:
        await resumed.start()
        assert instances_of(apptainer_bin, run_name) == []
    finally:
        await resumed.shutdown()


def test_a_run_with_a_pool_gives_each_prompt_an_instance_of_its_own(tmp_path, runner, model_server, images, apptainer_bin):
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(6)])
    script = ToolLoopScript(tool_calls=1, command="ls /workspace; touch /workspace/mine; echo ok")
    result = runner.invoke(dataset, "--num_workers", "2", "-S", f"image={images.sif_a}", "-S", "pool=auto",
                           server=model_server(script))

    assert result.exit_code == 0, result.output
    outputs = [tool_outputs(t)[0] for t in runner.records("trajectories.jsonl")]
    assert outputs == ["ok\n"] * 6  # none saw another prompt's file
    assert instances_of(apptainer_bin, runner.run_name) == []
