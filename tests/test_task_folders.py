"""Harbor task folders are untrusted input: regular files only, bounded, typed; compose and GPUs refused by name."""

from __future__ import annotations

import json
import os

import pytest

from hermes_batch.formats import dataset, task_folders
from hermes_batch.formats.task_folders import TaskError, find_tasks, read_task


def make_task(root, name="t1", toml=None, dockerfile="FROM hermes-batch-test/busybox-a:1\n",
              test="echo 1 > /logs/verifier/reward.txt\n", solve="echo hi > hello.txt\n"):
    folder = root / name
    (folder / "environment").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "solution").mkdir()
    (folder / "task.toml").write_text(toml if toml is not None else (
        'version = "1.0"\n[metadata]\ndifficulty = "easy"\ntags = ["a"]\n[agent]\ntimeout_sec = 120\n'
        '[verifier]\ntimeout_sec = 60.5\nenv = { MODE = "strict" }\n'
        '[environment]\ncpus = 1\nmemory = "2G"\nstorage_mb = 10240\nallow_internet = false\n'))
    (folder / "instruction.md").write_text("Write hello.txt.\n")
    if dockerfile is not None:
        (folder / "environment" / "Dockerfile").write_text(dockerfile)
    (folder / "tests" / "test.sh").write_text(test)
    (folder / "solution" / "solve.sh").write_text(solve)
    return folder


def test_a_task_is_read_with_its_limits_metadata_tests_and_image(tmp_path):
    task = read_task(make_task(tmp_path))
    assert task.name == "t1" and task.instruction == "Write hello.txt.\n"
    assert (task.agent_timeout, task.verifier_timeout, task.cpus, task.memory_mb, task.storage_mb) == (
        120.0, 60.5, 1.0, 2048, 10240)
    assert task.allow_internet is False and task.verifier_env == (("MODE", "strict"),)
    assert task.metadata == {"difficulty": "easy", "tags": ["a"]}
    assert dict(task.tests) == {"test.sh": "echo 1 > /logs/verifier/reward.txt\n"}
    assert task.image == task_folders.image_reference(task.context_digest)


def test_the_image_is_keyed_by_the_build_contexts_content_names_and_modes(tmp_path):
    a, b = read_task(make_task(tmp_path, "a")), read_task(make_task(tmp_path, "b"))
    assert a.image == b.image  # equal environments: one image
    (tmp_path / "b" / "environment" / "Dockerfile").write_text("FROM hermes-batch-test/busybox-b:1\n")
    assert read_task(tmp_path / "b").image != a.image
    os.chmod(tmp_path / "a" / "environment" / "Dockerfile", 0o755)  # the executable bit is content too
    assert read_task(tmp_path / "a").image != a.image


def test_a_dataset_row_names_a_task_inside_the_datasets_folder(tmp_path):
    make_task(tmp_path / "suite")
    (tmp_path / "d.jsonl").write_text('{"task": "suite/t1", "id": "x"}\n{"task": "../elsewhere"}\n'
                                      '{"task": "suite/t1", "prompt": "other"}\n')
    report = dataset.validate_dataset(tmp_path / "d.jsonl")
    assert report.valid == 1 and report.invalid == 2
    assert "leads outside the dataset's folder" in report.problems[0]
    assert "$.prompt: a task row takes it from its task folder" in report.problems[1]
    (row,) = dataset.iter_rows(tmp_path / "d.jsonl")
    assert row.prompt == "Write hello.txt.\n" and row.id == "x" and row.image.startswith("hermes-batch-task:")
    assert row.extra["task"] == "t1" and row.extra["task_metadata"]["difficulty"] == "easy"
    assert row.extra["tests_timeout"] == 60.5 and "/logs/verifier/reward.txt" in row.extra["tests"]
    assert row.task_options.context == str(tmp_path / "suite" / "t1" / "environment")
    assert row.task_options.agent_timeout == 120.0


def test_a_json_row_can_never_name_a_build_context(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "p", "task_options": "/etc", "build": "/etc"}) + "\n")
    (row,) = dataset.iter_rows(tmp_path / "d.jsonl")
    assert row.task_options is None


@pytest.mark.parametrize("where", ["instruction.md", "task.toml", "tests/test.sh", "environment/extra"])
def test_links_anywhere_in_a_task_are_refused(tmp_path, where):
    folder = make_task(tmp_path)
    target = folder / where
    if target.exists():
        target.unlink()
    target.symlink_to("/etc/passwd")
    with pytest.raises(TaskError, match="link"):
        read_task(folder)


def test_a_fifo_in_the_build_context_is_refused_without_waiting_on_it(tmp_path):
    folder = make_task(tmp_path)
    os.mkfifo(folder / "environment" / "pipe")
    with pytest.raises(TaskError, match="FIFO"):
        read_task(folder)


def test_a_fifo_as_the_instruction_is_refused_without_waiting_on_it(tmp_path):
    folder = make_task(tmp_path)
    (folder / "instruction.md").unlink()
    os.mkfifo(folder / "instruction.md")
    with pytest.raises(TaskError, match="not a regular file"):
        read_task(folder)


def test_huge_files_are_refused_without_being_read_whole(tmp_path, monkeypatch):
    folder = make_task(tmp_path)
    with open(folder / "instruction.md", "wb") as handle:
        handle.truncate(task_folders.MAX_INSTRUCTION_BYTES + 1)  # sparse: no disk used
    with pytest.raises(TaskError, match="larger than 1 MiB"):
        read_task(folder)
    folder = make_task(tmp_path, "t2")
    monkeypatch.setattr(task_folders, "MAX_CONTEXT_BYTES", 1000)
    (folder / "environment" / "big").write_bytes(b"x" * 2000)
    with pytest.raises(TaskError, match="holds more than 1000 bytes"):
        read_task(folder)


@pytest.mark.parametrize("toml, message", [
    ('[agent]\ntimeout_sec = "soon"\n', r"\[agent\].timeout_sec must be a number above 0"),
    ("[agent]\ntimeout_sec = -1\n", r"\[agent\].timeout_sec must be a number above 0"),
    ("[verifier]\ntimeout_sec = nan\n", r"\[verifier\].timeout_sec must be a number above 0"),
    ('[environment]\nmemory = "lots"\n', r"\[environment\].memory must be a size"),
    ("[environment]\nmemory_mb = 1.5\n", r"memory_mb must be an integer"),
    ('[environment]\nallow_internet = "no"\n', "allow_internet must be true or false"),
    ("[environment]\ndocker_image = 3\n", "docker_image must be an image name"),
    ("metadata = 3\n", r"\[metadata\] must be a table"),
    ("[verifier]\nenv = { 1X = \"a\" }\n", r"\[verifier\].env must be a table"),
    ("[environment]\ngpus = 1\n", "asks for GPUs"),
    ("not toml = = 1\n", "is not valid TOML"),
])
def test_bad_toml_types_get_one_clear_sentence(tmp_path, toml, message):
    with pytest.raises(TaskError, match=message):
        read_task(make_task(tmp_path, toml=toml))


def test_docker_compose_services_are_refused_by_name(tmp_path):
    folder = make_task(tmp_path)
    (folder / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    with pytest.raises(TaskError, match="docker-compose services are not supported"):
        read_task(folder)


def test_a_task_without_tests_or_environment_is_refused(tmp_path):
    folder = make_task(tmp_path)
    (folder / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError, match="no tests/test.sh"):
        read_task(folder)
    with pytest.raises(TaskError, match="neither environment/Dockerfile"):
        read_task(make_task(tmp_path, "t2", dockerfile=None))


def test_find_tasks_takes_one_task_or_a_suite_and_skips_linked_folders(tmp_path):
    make_task(tmp_path, "b")
    make_task(tmp_path, "a")
    (tmp_path / "c").symlink_to(tmp_path / "a")
    assert [os.path.basename(p) for p in find_tasks(tmp_path)] == ["a", "b"]
    assert find_tasks(tmp_path / "a") == (str(tmp_path / "a"),)
    with pytest.raises(TaskError, match="holds no task folder"):
        find_tasks(tmp_path / "a" / "tests")


def test_the_context_archive_matches_its_digest_and_sees_a_change(tmp_path):
    import io

    folder = make_task(tmp_path)
    task = read_task(folder)
    buffer = io.BytesIO()
    assert task_folders.write_context_archive(task.environment, buffer) == task.context_digest
    (folder / "environment" / "Dockerfile").write_text("FROM other\n")
    assert task_folders.write_context_archive(task.environment, io.BytesIO()) != task.context_digest


def test_a_harbor_reward_json_is_read_only_for_task_rows():
    from hermes_batch.default_plugins.verifiers import reward_from_file

    assert reward_from_file(b'{"reward": 0.5, "other": 3}', harbor=True) == 0.5
    assert reward_from_file(b'{"accuracy": 1}', harbor=True) == 1.0
    for bad in (b'{"reward": 2}', b'{"reward": "1"}', b'{"a": 1, "b": 1}', b"[1]", b"{"):
        with pytest.raises(ValueError):
            reward_from_file(bad, harbor=True)
    with pytest.raises(ValueError):
        reward_from_file(b'{"reward": 1}')


def test_a_sandbox_without_images_refuses_a_task_before_any_model_call(tmp_path, model_server):
    """The local sandbox runs no image: a task's tests, which replace /tests and /logs, never run on the machine."""
    from hermes_batch.testing import Runner, ToolLoopScript, read_jsonl, run_cli

    suite = tmp_path / "suite"
    make_task(suite, "alpha", toml='[environment]\ndocker_image = "busybox"\n', dockerfile=None)
    server = model_server(ToolLoopScript(tool_calls=1, command="echo hi > hello.txt"))
    runner = Runner(tmp_path, run_name="suite")
    args = runner.args("unused.jsonl", "--verifier", "command:apart=false", server=server)
    args[args.index("--dataset_file"):args.index("--dataset_file") + 2] = ["--tasks", str(suite)]
    result = run_cli(*args, ok=False)
    assert result.exit_code == 3, result.output
    (failure,) = read_jsonl(runner.folder() / "failed.jsonl")
    assert "cannot run a Harbor task" in failure["message"] and failure["api_calls"] == 0
    assert server.calls_for("Write hello.txt.\n") == 0
