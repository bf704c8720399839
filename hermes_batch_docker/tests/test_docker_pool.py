"""Containers started ahead of need (-S pool=): each serves one prompt, nothing of a prompt reaches the next."""

from __future__ import annotations

import asyncio
import datetime
import time

import pytest

from hermes_batch import ConfigError, structure_config
from hermes_batch.testing import ToolLoopScript, tool_outputs, wait_for, write_dataset
from hermes_batch_docker import DockerBackend, DockerConfig
from hermes_batch_docker.engine import LABEL_PROMPT, LABEL_SESSION, LIVE_SESSIONS

from docker_rig import IMAGE_A, IMAGE_B, containers_of, make_backend, spec


async def until_pooled(backend: DockerBackend, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while backend.pooled() < count:
        assert time.monotonic() < deadline, f"the pool never held {count} containers ({backend.pooled()})"
        await asyncio.sleep(0.05)


def created_at(docker_api, container_id: str) -> float:
    text = docker_api.inspect_container(container_id)["Created"]  # RFC 3339 with nanoseconds
    stamp, _, fraction = text.rstrip("Z").partition(".")
    moment = datetime.datetime.fromisoformat(stamp).replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp() + float(f"0.{fraction or 0}")


def sleeping_in(docker_api, run_name: str) -> int:
    """How many of the run's running containers are running the scripted ``sleep 30``."""
    count = 0
    for container in containers_of(docker_api, run_name):
        if container["State"] != "running":
            continue
        try:
            processes = docker_api.top(container["Id"])["Processes"] or []
        except Exception:  # removed meanwhile
            continue
        count += any("sleep 30" in " ".join(row) for row in processes)
    return count


def test_the_pool_option_takes_a_number_or_auto():
    def structure(value):
        return structure_config({"pool": value}, DockerConfig, "options for the docker sandbox (-S)")

    assert structure("auto").pool_size(32) == 32
    assert structure("3").pool_size(32) == 3
    assert DockerConfig().pool_size(32) == 32  # by default as many as the run works on at once
    assert structure("0").pool_size(32) == 0  # each container made when its prompt asks
    for bad in ("some", -1, True):
        with pytest.raises(ConfigError, match="pool must be a number of containers"):
            structure(bad)


async def test_a_prompts_leftovers_never_reach_the_next_prompt_of_the_pool(tmp_path, run_name, docker_api):
    backend = make_backend(tmp_path, run_name, pool=1)
    await backend.start()
    try:
        await backend.prepare_image(IMAGE_A)
        await until_pooled(backend, 1)
        asked = time.time()
        first = await backend.open(spec(run_name, 0, env={"HB_PROMPT_SECRET": "prompt-0"}))
        assert created_at(docker_api, first.id) < asked  # made ahead of need, not for this prompt
        left = await first.exec(
            "echo $HB_PROMPT_SECRET > left.txt; echo tampered > /etc/hermes-image; mkdir -p /tmp/left; "
            "export HB_EXPORTED=1; (setsid sleep 377 >/dev/null 2>&1 &); echo done", 30,
        )
        assert left.output == "done\n" and (await first.exec("cat left.txt", 10)).output == "prompt-0\n"
        await first.close()

        await until_pooled(backend, 1)
        asked = time.time()
        second = await backend.open(spec(run_name, 1))
        try:
            assert second.id != first.id
            assert created_at(docker_api, second.id) < asked
            seen = await second.exec(
                "ls -a /workspace /tmp; cat /etc/hermes-image; env; ps -o args 2>/dev/null || ps", 30
            )
            assert "left.txt" not in seen.output and "left" not in seen.output.split()
            assert IMAGE_A in seen.output and "tampered" not in seen.output
            assert "HB_PROMPT_SECRET" not in seen.output and "HB_EXPORTED" not in seen.output
            assert "sleep 377" not in seen.output
        finally:
            await second.close()
        # the first prompt's container and its process are gone, not parked
        assert first.id not in {c["Id"] for c in containers_of(docker_api, run_name)}
    finally:
        await backend.shutdown()
    assert containers_of(docker_api, run_name) == []


async def test_each_pooled_container_serves_one_prompt_and_the_pool_refills(tmp_path, run_name, docker_api):
    backend = make_backend(tmp_path, run_name, pool=2)
    await backend.start()
    try:
        await backend.prepare_image(IMAGE_A)
        await backend.prepare_image(IMAGE_B)  # a pool per image
        await until_pooled(backend, 4)
        sandboxes = await asyncio.gather(*(backend.open(spec(run_name, i, image=(IMAGE_A, IMAGE_B)[i % 2])) for i in range(6)))
        try:
            assert len({s.id for s in sandboxes}) == 6
            for index, sandbox in enumerate(sandboxes):
                assert (await sandbox.exec("cat /etc/hermes-image", 10)).output.strip() == (IMAGE_A, IMAGE_B)[index % 2]
            assert backend.pooled() == 0  # the prompts beyond the pool got containers made for them, nothing more
            names = {docker_api.inspect_container(s.id)["Name"] for s in sandboxes}
            assert all(f"-p{i}-" in " ".join(names) for i in range(6))  # renamed for the prompt that has it
            # A row with a working folder of its own gets a container made for it, labelled with its prompt.
            own = await backend.open(spec(run_name, 9, cwd="/task"))
            assert docker_api.inspect_container(own.id)["Config"]["Labels"][LABEL_PROMPT] == "9"
            assert (await own.exec("pwd", 10)).output == "/task\n"
            await own.close()
        finally:
            await asyncio.gather(*(s.close() for s in sandboxes))
        await until_pooled(backend, 4)  # each one released was replaced
        assert len(containers_of(docker_api, run_name)) == 4  # the idle pool
    finally:
        await backend.shutdown()
    assert containers_of(docker_api, run_name) == []


async def test_an_image_that_cannot_start_fails_its_prompts_as_without_a_pool(tmp_path, run_name, docker_api):
    backend = make_backend(tmp_path, run_name, pool=2, workdir="/etc/hermes-image/sub")  # a file: no container starts
    await backend.start()
    try:
        await backend.prepare_image(IMAGE_A)
        with pytest.raises(Exception, match="Could not (start|create) a container"):
            await asyncio.wait_for(backend.open(spec(run_name, 0)), 60)
    finally:
        await backend.shutdown()
    assert containers_of(docker_api, run_name) == []


async def test_pooled_containers_of_a_dead_process_are_removed_by_the_next_one(tmp_path, run_name, docker_api):
    crashed = make_backend(tmp_path, run_name, pool=3)
    await crashed.start()
    await crashed.prepare_image(IMAGE_A)
    await until_pooled(crashed, 3)
    assert {c["Labels"][LABEL_SESSION] for c in containers_of(docker_api, run_name)} == {crashed.session}
    LIVE_SESSIONS.discard(crashed.session)  # as if its process had died without shutting down
    crashed.api.close()

    resumed = make_backend(tmp_path, run_name)
    try:
        await resumed.start()
        assert containers_of(docker_api, run_name) == []
    finally:
        await resumed.shutdown()


# --- whole runs ----------------------------------------------------------------------------------------


def test_a_run_with_a_pool_gives_each_prompt_a_container_of_its_own(tmp_path, runner, model_server, docker_api):
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(8)])
    script = ToolLoopScript(tool_calls=1, command="hostname; ls /workspace; touch /workspace/mine")
    result = runner.invoke(dataset, "--num_workers", "3", "-S", "pool=auto", server=model_server(script))

    assert result.exit_code == 0, result.output
    outputs = [tool_outputs(t)[0] for t in runner.records("trajectories.jsonl")]
    assert len(outputs) == 8
    assert len({output.split()[0] for output in outputs}) == 8  # eight containers
    assert all("mine" not in output for output in outputs)  # none saw another prompt's file
    assert containers_of(docker_api, runner.run_name) == []


def test_a_killed_run_leaves_pooled_containers_that_resume_removes(tmp_path, runner, model_server, docker_api, procs):
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(3)])
    proc = runner.spawn(dataset, "--num_workers", "2", "-S", "pool=3", server=model_server(ToolLoopScript(tool_calls=1, command="sleep 30")))
    procs.append(proc)
    # two prompts at their command in a pooled container, and one container idle beside them for the third prompt
    # (a pool holds no more than the prompts still to come)
    wait_for(lambda: sleeping_in(docker_api, runner.run_name) == 2, 60, "both prompts at their command", proc)
    assert len(containers_of(docker_api, runner.run_name)) == 3
    proc.kill()
    proc.communicate(timeout=30)
    assert len(containers_of(docker_api, runner.run_name)) == 3

    result = runner.invoke(dataset, "--resume", server=model_server(ToolLoopScript(tool_calls=1, command="echo fine")))
    assert result.exit_code == 0, result.output
    assert "container(s) left behind by an earlier process" in result.output
    assert containers_of(docker_api, runner.run_name) == []
