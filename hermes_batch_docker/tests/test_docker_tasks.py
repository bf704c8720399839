"""Harbor tasks on the real engine: each environment built once per content, a failed build's log tail, the
concurrency limit, grading through reward.txt and reward.json, and ``hermes-batch tasks check``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid

import pytest

from hermes_batch import SandboxError, task_folders
from hermes_batch.testing import ToolLoopScript, read_jsonl, run_cli
from hermes_batch_docker import images

from docker_rig import IMAGE_A, make_backend

read_task = task_folders.read_task
WRITES_HELLO = ToolLoopScript(tool_calls=1, command="echo hi > hello.txt")


def make_task(root, name, base=IMAGE_A, extra="", test=None, solve="echo hi > hello.txt\n"):
    """A task whose environment is unique to this test (so its image is this test's to remove)."""
    folder = root / name
    for part in ("environment", "tests", "solution"):
        (folder / part).mkdir(parents=True)
    (folder / "task.toml").write_text('[metadata]\nkind = "hello"\n[verifier]\ntimeout_sec = 60\n')
    (folder / "instruction.md").write_text(f"Write hello.txt ({name}).\n")
    (folder / "environment" / "Dockerfile").write_text(f"FROM {base}\nLABEL test={root.name}\n{extra}")
    (folder / "tests" / "test.sh").write_text(test or (
        'if [ -f hello.txt ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n'))
    (folder / "solution" / "solve.sh").write_text(solve)
    return folder


@pytest.fixture
def task_images(docker_api):
    """The images a test builds, removed after it."""
    made: list = []
    yield made
    for image in made:
        try:
            docker_api.remove_image(image, force=True)
        except Exception:
            pass


async def test_each_environment_is_built_once_however_many_prompts_ask(tmp_path, run_name, docker_api, task_images):
    suite = tmp_path / f"s{uuid.uuid4().hex[:8]}"
    a, b, c = (read_task(make_task(suite, n)) for n in ("a", "b", "c"))
    d = read_task(make_task(suite, "d", extra="RUN echo other > /other\n"))
    task_images.extend({a.image, d.image})
    assert a.image == b.image == c.image != d.image
    backend = make_backend(tmp_path, run_name, max_builds=1)
    await backend.start()
    try:
        await asyncio.gather(*(backend.build_image(t.image, t.environment, t.context_digest)
                               for t in (a, b, c, d, a, d)))
        assert set(backend.builder.built) == {a.image, d.image}  # two builds for six asks
        assert docker_api.inspect_image(a.image)["Config"]["Labels"][images.LABEL_CONTEXT] == a.context_digest
        again = make_backend(tmp_path, run_name)
        await again.start()
        try:
            await again.build_image(a.image, a.environment, a.context_digest)
            assert again.builder.built == {}  # on the engine already: not built again
        finally:
            await again.shutdown()
    finally:
        await backend.shutdown()


async def test_builds_run_at_most_max_builds_at_once(tmp_path, run_name, docker_api, task_images, monkeypatch):
    suite = tmp_path / f"s{uuid.uuid4().hex[:8]}"
    tasks = [read_task(make_task(suite, f"t{i}", extra=f"RUN echo {i} > /n\n")) for i in range(4)]
    task_images.extend(t.image for t in tasks)
    running, most = 0, 0
    real = images.build_image

    def counting(*args):
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            return real(*args)
        finally:
            running -= 1

    monkeypatch.setattr(images, "build_image", counting)
    backend = make_backend(tmp_path, run_name, max_builds=2)
    await backend.start()
    try:
        await asyncio.gather(*(backend.build_image(t.image, t.environment, t.context_digest) for t in tasks))
    finally:
        await backend.shutdown()
    assert most == 2 and len(backend.builder.built) == 4


async def test_a_failed_build_fails_with_the_tail_of_its_log_once(tmp_path, run_name, docker_api, task_images):
    task = read_task(make_task(tmp_path / f"s{uuid.uuid4().hex[:8]}", "bad",
                               extra="RUN echo the-last-words-of-the-build && exit 7\n"))
    task_images.append(task.image)
    backend = make_backend(tmp_path, run_name)
    await backend.start()
    try:
        for _ in range(2):  # every prompt of it gets the same error, from the one build
            with pytest.raises(SandboxError) as caught:
                await backend.build_image(task.image, task.environment, task.context_digest)
            assert "could not be built" in str(caught.value) and "the-last-words-of-the-build" in str(caught.value)
    finally:
        await backend.shutdown()


@pytest.mark.parametrize("writes, reward", [
    ("echo 1 > /logs/verifier/reward.txt", 1.0),
    ("echo 0.25 > /logs/verifier/reward.txt", 0.25),
    ('echo \'{"reward": 0.5, "tests": 4}\' > /logs/verifier/reward.json', 0.5),
])
def test_a_task_row_is_graded_through_a_real_container(tmp_path, runner, model_server, docker_api, task_images,
                                                       writes, reward):
    suite = tmp_path / f"s{uuid.uuid4().hex[:8]}"
    test = f'if [ -f hello.txt ]; then {writes}; else echo 0 > /logs/verifier/reward.txt; fi\n'
    make_task(suite, "hello", test=test)
    make_task(suite, "broken", extra="RUN exit 3\n")
    task_images.extend(read_task(suite / n).image for n in ("hello", "broken"))
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(f'{{"task": "{suite.name}/hello"}}\n{{"task": "{suite.name}/broken"}}\n')
    server = model_server(WRITES_HELLO)

    result = runner.invoke(dataset, "--verifier", "command", server=server)

    assert result.exit_code == 3, result.output  # the broken task's prompt failed; the other went on
    (record,) = runner.records("trajectories.jsonl")
    meta = record["metadata"]
    assert meta["reward"] == reward and meta["verified"] is True
    row = json.loads(meta["row"])
    assert row["task"] == "hello" and row["task_metadata"] == {"kind": "hello"}
    assert meta["image"] == read_task(suite / "hello").image
    (failure,) = runner.records("failed.jsonl")
    assert "could not be built" in failure["message"] and server.calls_for("Write hello.txt (broken).\n") == 0
    exported = tmp_path / "export.jsonl"
    run_cli("export", runner.folder(), "--format", "sharegpt", "--output", exported)
    (line,) = read_jsonl(exported)
    kept = json.loads(line["metadata"]["row"])  # the task survives the export, the grader's files do not
    assert kept["task"] == "hello" and kept["task_metadata"] == {"kind": "hello"} and "test_files" not in kept


@pytest.mark.parametrize("forge", [
    "mkdir -p /logs/verifier /tests && echo 1 > /logs/verifier/reward.txt && echo exit 0 > /tests/test.sh",
    "mkdir -p mine/verifier && echo 1 > mine/verifier/reward.txt && rm -rf /logs && ln -s \"$PWD/mine\" /logs",
], ids=["planted", "linked"])
def test_the_agent_cannot_leave_a_reward_for_the_tests(tmp_path, runner, model_server, docker_api, task_images, forge):
    suite = tmp_path / f"s{uuid.uuid4().hex[:8]}"
    make_task(suite, "hello", test="true\n")  # writes no reward: what the agent left must not count
    task_images.append(read_task(suite / "hello").image)
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(f'{{"task": "{suite.name}/hello"}}\n')
    server = model_server(ToolLoopScript(tool_calls=1, command=forge))

    result = runner.invoke(dataset, "--verifier", "command", server=server)

    assert result.exit_code == 0, result.output
    (record,) = runner.records("trajectories.jsonl")
    assert record["metadata"]["reward"] == 0.0
    assert "wrote neither" in json.loads(record["metadata"]["verifiers"])[0]["output"]


def test_tasks_check_lists_the_tasks_that_pass_untouched_or_fail_solved(tmp_path, docker_api, task_images):
    suite = tmp_path / f"s{uuid.uuid4().hex[:8]}"
    make_task(suite, "good")
    make_task(suite, "lazy", test="echo 1 > /logs/verifier/reward.txt\n")  # passes without a solution
    make_task(suite, "wrong", solve="echo nothing\n")  # fails with its solution
    task_images.append(read_task(suite / "good").image)

    result = tasks_check(suite, "-S", "pool=0")

    assert result.returncode == 1, result.stdout + result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert lines["good"].split()[1:] == ["1", "0", "ok"]
    assert "PASSES WITHOUT A SOLUTION" in lines["lazy"] and "FAILS WITH ITS SOLUTION" in lines["wrong"]
    assert "Pass without a solution: lazy" in result.stdout and "Fail with their solution: wrong" in result.stdout
    good = tasks_check(suite / "good")
    assert good.returncode == 0 and "1 of 1 task(s) pass" in good.stdout


def tasks_check(path, *options):
    return subprocess.run([sys.executable, "-m", "hermes_batch", "tasks", "check", str(path), *options],
                          capture_output=True, text=True, timeout=600)


def test_the_documented_example_suite_passes_its_oracle_check(docker_api, task_images):
    """docs/tasks.md shows this table."""
    from pathlib import Path

    suite = Path(__file__).resolve().parents[2] / "examples" / "tasks"
    task_images.extend(read_task(folder).image for folder in sorted(suite.iterdir()))

    result = tasks_check(suite, "--jobs", "2", "-S", "max_builds=2")

    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[1:] == ["count-lines         1          0  ok",
                                              "hello-file          1          0  ok",
                                              "2 of 2 task(s) pass their oracle check."]
