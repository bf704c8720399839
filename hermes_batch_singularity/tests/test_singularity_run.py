"""``hermes-batch run --sandbox singularity`` end to end: real Apptainer, real instances, scripted model server."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from hermes_batch.testing import RoutedScript, ToolLoopScript, tool_outputs, wait_for, write_dataset
from hermes_batch_singularity import instances

from singularity_rig import IMAGE_A, IMAGE_B, instances_of, singularity_runner

DEAD_PID = 2147483646  # above any pid_max: no process has it
SLEEPER = ToolLoopScript(tool_calls=1, command="sleep 30")
FAST = ToolLoopScript(tool_calls=1, command="echo fine")


def sleeping_instances(apptainer_bin: str, run_name: str) -> list:
    """Instances of the run in which a ``sleep 30`` runs."""
    busy = []
    for name in instances_of(apptainer_bin, run_name):
        done = subprocess.run(
            [os.path.join(apptainer_bin, "apptainer"), "exec", "--no-privs", f"instance://{name}", "/bin/sh", "-c",
             'for f in /proc/[0-9]*/cmdline; do tr "\\0" " " < "$f"; echo; done'],
            capture_output=True, text=True,
        )
        if "sleep 30" in done.stdout:
            busy.append(name)
    return busy


# --- images per row, filters --------------------------------------------------------------------------


def test_twenty_prompts_run_each_in_the_image_its_row_names(tmp_path, runner, model_server, images):
    rows, expected, source = [], {}, {}
    for i in range(20):
        prompt = f"task {i}: which image are you in?"
        kind = i % 4
        if kind == 0:
            row, image, cwd = {"prompt": prompt}, IMAGE_A, "/workspace"  # the -S image default, a SIF file
        elif kind == 1:
            row, image, cwd = {"prompt": prompt, "image": images.archive_b}, IMAGE_B, "/workspace"
        elif kind == 2:
            row, image, cwd = {"prompt": prompt, "docker_image": images.folder_b}, IMAGE_B, "/workspace"
        else:
            row, image, cwd = {"prompt": prompt, "image": images.archive_a, "cwd": f"/tasks/{i}"}, IMAGE_A, f"/tasks/{i}"
        rows.append(row)
        expected[i] = (image, cwd)
        source[i] = row.get("image") or row.get("docker_image") or images.sif_a
    dataset = write_dataset(tmp_path / "data.jsonl", rows)
    command = 'cat /etc/hermes-image; pwd; echo "$APPTAINER_INSTANCE"'
    thinking = ToolLoopScript(tool_calls=1, command=command)
    silent = ToolLoopScript(tool_calls=1, command=command, reasoning=None)  # no reasoning at all
    unreasoned = rows[6]["prompt"]
    server = model_server(RoutedScript({unreasoned: silent}, default=thinking))

    result = runner.invoke(dataset, "--num_workers", "8", "-S", f"image={images.sif_a}", "--filter", "no-reasoning", server=server)

    assert result.exit_code == 0, result.output
    kept = runner.records("trajectories.jsonl")
    [rejected] = runner.records("discarded.jsonl")
    assert [t["prompt_index"] for t in kept] == [i for i in range(20) if i != 6]
    assert rejected["filters"] == ["no-reasoning"]
    discarded = rejected["trajectory"]
    assert discarded["prompt_index"] == 6
    names = set()
    for trajectory in [*kept, discarded]:
        index = trajectory["prompt_index"]
        image, cwd = expected[index]
        [output] = tool_outputs(trajectory)
        marker, pwd, instance = output.splitlines()
        assert marker == image, index  # only that image has this marker file
        assert pwd == cwd, index
        parsed = instances.InstanceName.parse(instance)
        assert parsed is not None and parsed.prompt_index == index and parsed.of_run(runner.run_name)
        names.add(instance)
        assert trajectory["metadata"]["sandbox"] == "singularity"
        assert trajectory["metadata"]["image"] == source[index], index  # the image it ran in, -S image=... included
    assert len(names) == 20  # one instance per prompt
    assert all(server.calls_for(row["prompt"]) == 2 for row in rows)
    assert runner.records("failed.jsonl") == []


def test_a_bad_image_fails_only_its_prompts_without_a_model_call(tmp_path, runner, model_server, images):
    missing = f"docker-archive://{tmp_path}/no-such-archive.tar"
    rows = [{"prompt": f"task {i}", **({"image": missing} if i in (1, 4) else {})} for i in range(6)]
    dataset = write_dataset(tmp_path / "data.jsonl", rows)
    server = model_server(FAST)

    result = runner.invoke(dataset, "--num_workers", "3", "-S", f"image={images.sif_a}", server=server)

    assert result.exit_code == 3, result.output
    failed = runner.records("failed.jsonl")
    assert sorted(f["prompt_index"] for f in failed) == [1, 4]
    for failure in failed:
        assert failure["error_kind"] == "sandbox"
        assert missing in failure["message"] and "could not be converted to a SIF" in failure["message"]
    for i, row in enumerate(rows):
        assert server.calls_for(row["prompt"]) == (0 if i in (1, 4) else 2), i
    assert sorted(t["prompt_index"] for t in runner.records("trajectories.jsonl")) == [0, 2, 3, 5]
    assert not list((tmp_path / "sif-cache" / "sif").glob("*.sif"))  # nothing half-made was kept


def test_a_prompt_whose_deadline_fires_is_saved_as_partial_and_its_instance_stopped(
    tmp_path, runner, model_server, images, apptainer_bin
):
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": "sleepy"}, {"prompt": "quick"}])
    server = model_server(RoutedScript({"sleepy": ToolLoopScript(tool_calls=1, command="sleep 300")}, default=FAST))

    started = time.monotonic()
    result = runner.invoke(
        dataset, "--num_workers", "2", "--prompt_timeout", "20", "--no_filters", "-S", f"image={images.sif_a}"
    , server=server)

    assert result.exit_code == 0, result.output
    assert time.monotonic() - started < 200  # the 300 s sleep was cut by the deadline
    by_prompt = {t["conversations"][1]["value"]: t for t in runner.records("trajectories.jsonl")}
    assert by_prompt["sleepy"]["partial"] and by_prompt["sleepy"]["metadata"]["end_reason"] == "timeout"
    assert by_prompt["quick"]["completed"]
    assert instances_of(apptainer_bin, runner.run_name) == []


# --- no leaks ---------------------------------------------------------------------------------------------


def test_ctrl_c_in_the_middle_of_a_run_leaves_no_instance(tmp_path, runner, model_server, images, apptainer_bin, procs):
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(8)])
    proc = runner.spawn(dataset, "--num_workers", "4", "-S", f"image={images.sif_a}", server=model_server(SLEEPER))
    procs.append(proc)

    wait_for(lambda: len(sleeping_instances(apptainer_bin, runner.run_name)) >= 3, 120, "three prompts sleeping in their instances", proc)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=120)

    assert proc.returncode == 130, err[-3000:]
    assert "Interrupted" in err
    assert instances_of(apptainer_bin, runner.run_name) == []


def leave_instances_behind(tmp_path, runner, model_server, images, apptainer_bin, procs, count=3):
    """Start a run and SIGKILL it while its prompts are in their instances."""
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(count)])
    proc = runner.spawn(dataset, "--num_workers", str(count), "-S", f"image={images.sif_a}", server=model_server(SLEEPER))
    procs.append(proc)
    wait_for(lambda: len(instances_of(apptainer_bin, runner.run_name)) == count, 120, "the instances", proc)
    proc.kill()
    proc.communicate(timeout=30)
    assert len(instances_of(apptainer_bin, runner.run_name)) == count  # nothing could clean up after SIGKILL
    return dataset


def test_resume_stops_the_instances_a_killed_process_left(tmp_path, runner, model_server, images, apptainer_bin, procs):
    dataset = leave_instances_behind(tmp_path, runner, model_server, images, apptainer_bin, procs)
    server = model_server(FAST)
    result = runner.invoke(dataset, "--resume", "-S", f"image={images.sif_a}", server=server)
    assert result.exit_code == 0, result.output
    assert "Stopped 3 instance(s) left behind by an earlier process" in result.output
    assert [server.calls_for(f"task {i}") for i in range(3)] == [2, 2, 2]
    assert instances_of(apptainer_bin, runner.run_name) == []


def start_named_instance(apptainer_bin: str, image: str, name: str) -> None:
    done = subprocess.run(
        [os.path.join(apptainer_bin, "apptainer"), "instance", "start", "--no-privs", "--containall", image, name],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr


def test_cleanup_command_stops_the_leftovers_of_one_run(tmp_path, runner, model_server, images, apptainer_bin, procs):
    leave_instances_behind(tmp_path, runner, model_server, images, apptainer_bin, procs)
    other_run = f"{runner.run_name}-other"
    other = f"hb-{other_run}.{instances.run_hash(other_run)}0000.p0.{DEAD_PID}.abcd.0"
    start_named_instance(apptainer_bin, images.sif_a, other)
    try:
        result = runner.cli("singularity", "cleanup", "--run", runner.run_name)
        assert result.exit_code == 0, result.output
        assert f"Stopped 3 leftover instance(s) of run {runner.run_name!r}" in result.output
        assert instances_of(apptainer_bin, runner.run_name) == []
        assert instances_of(apptainer_bin, other_run) == [other]

        result = runner.cli("singularity", "cleanup", "--run", runner.run_name)
        assert "No leftover instances of run" in result.output
        result = runner.cli("singularity", "cleanup", "--run", other_run)
        assert "Stopped 1 leftover instance(s)" in result.output
        assert instances_of(apptainer_bin, other_run) == []
    finally:
        for name in instances_of(apptainer_bin, other_run):
            subprocess.run([os.path.join(apptainer_bin, "apptainer"), "instance", "stop", "--force", name], capture_output=True)


def test_cleanup_leaves_instances_of_runs_in_progress_unless_forced(run_name, images, apptainer_bin, runner):
    instances.LIVE_SESSIONS.add("beef")
    live = f"hb-{run_name}.{instances.run_hash(run_name)}0000.p0.{os.getpid()}.beef.0"
    start_named_instance(apptainer_bin, images.sif_a, live)
    try:
        result = runner.cli("singularity", "cleanup", "--run", run_name)
        assert result.exit_code == 0
        assert "Left 1 instance(s) of runs that may still be in progress" in result.output
        assert str(os.getpid()) in result.output
        assert instances_of(apptainer_bin, run_name) == [live]
        result = runner.cli("singularity", "cleanup", "--run", run_name, "--force")
        assert "Stopped 1 leftover instance(s)" in result.output
    finally:
        instances.LIVE_SESSIONS.discard("beef")


# --- the runtime and the options, before anything is sent ----------------------------------------------------


def _path_without_runtimes() -> str:
    keep = []
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        if not any(os.path.exists(os.path.join(folder, tool)) for tool in ("apptainer", "singularity")):
            keep.append(folder)
    return os.pathsep.join(keep)


def test_a_missing_runtime_stops_the_run_before_the_preflight_with_status_2(tmp_path, model_server, monkeypatch):
    monkeypatch.setenv("PATH", _path_without_runtimes())
    runner = singularity_runner(tmp_path, "no-runtime")
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": "task"}])
    server = model_server(FAST)

    result = runner.invoke(dataset, server=server)

    assert result.exit_code == 2
    [line] = [line for line in result.output.splitlines() if line.strip()]
    assert line == (
        "Error: Neither apptainer nor singularity is on PATH, so the singularity sandbox cannot run; "
        "install Apptainer (or SingularityCE), load its module, or give its path with -S binary=PATH."
    )
    assert server.request_count == 0  # the runtime is checked before the model preflight
    assert not runner.folder().exists()

    result = runner.invoke(dataset, "-S", f"binary={tmp_path}/no-such-apptainer", server=server)
    assert result.exit_code == 2 and "-S binary=" in result.output and "no such command" in result.output
    assert server.request_count == 0

    cleanup = runner.cli("singularity", "cleanup")
    assert cleanup.exit_code == 2 and "Neither apptainer nor singularity is on PATH" in cleanup.output
    # the fix it names is an option of that command (--binary), not the run's -S binary
    assert "give its path with --binary=PATH." in cleanup.output and "-S binary" not in cleanup.output
    cleanup = runner.cli("singularity", "cleanup", "--binary", f"{tmp_path}/no-such-apptainer")
    assert cleanup.exit_code == 2 and f"--binary={tmp_path}/no-such-apptainer: no such command" in cleanup.output


@pytest.mark.parametrize(
    "option, says",
    [
        ("network=bridge", "network"),
        ("bogus=1", "has no option 'bogus' (it takes image, "),
        ("workdir=relative", "workdir must be an absolute path"),
        ("extra_args=--writable", "--writable would change the image itself"),
        ("max_starting=0", "max_starting must be at least 1"),
    ],
)
def test_bad_options_stop_the_run_before_anything_is_sent(tmp_path, model_server, option, says):
    runner = singularity_runner(tmp_path, "bad-options")
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": "task"}])
    server = model_server(FAST)
    result = runner.invoke(dataset, "-S", option, server=server)
    assert result.exit_code == 2
    assert "Error: " in result.output and "singularity sandbox (-S)" in result.output and says in result.output
    assert server.request_count == 0
    assert not runner.folder().exists()
