"""``hermes-batch run --sandbox docker`` end to end: real engine, real containers, scripted model server."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from hermes_batch.testing import RoutedScript, ToolLoopScript, tool_outputs, wait_for, write_dataset
from hermes_batch_docker.engine import LABEL_HOST, LABEL_PID, LABEL_PROMPT, LABEL_RUN, LABEL_RUN_DIR, LABEL_SESSION, LIVE_SESSIONS

from docker_rig import IMAGE_A, IMAGE_B, MISSING_IMAGE, containers_of

DEAD_PID = "2147483646"
SLEEPER = ToolLoopScript(tool_calls=1, command="sleep 30")
FAST = ToolLoopScript(tool_calls=1, command="echo fine")


def running_commands(docker_api, container_id: str) -> str:
    try:
        top = docker_api.top(container_id)
    except Exception:
        return ""
    return "\n".join(" ".join(process) for process in top.get("Processes") or [])


# --- images per row -----------------------------------------------------------------------------


def test_twenty_prompts_run_each_in_the_image_its_row_names(tmp_path, runner, model_server, docker_api):
    rows, expected = [], {}
    for i in range(20):
        prompt = f"task {i}: which image are you in?"
        kind = i % 4
        if kind == 0:
            row, image, cwd = {"prompt": prompt}, IMAGE_B, "/workspace"  # the -S image default
        elif kind == 1:
            row, image, cwd = {"prompt": prompt, "image": IMAGE_A}, IMAGE_A, "/workspace"
        elif kind == 2:
            row, image, cwd = {"prompt": prompt, "docker_image": IMAGE_B}, IMAGE_B, "/workspace"
        else:
            row, image, cwd = {"prompt": prompt, "image": IMAGE_A, "cwd": f"/tasks/{i}"}, IMAGE_A, f"/tasks/{i}"
        rows.append(row)
        expected[i] = (image, cwd)
    dataset = write_dataset(tmp_path / "data.jsonl", rows)
    server = model_server(ToolLoopScript(tool_calls=1, command="cat /etc/hermes-image; pwd; hostname"))

    result = runner.invoke(dataset, "--num_workers", "8", "-S", f"image={IMAGE_B}", server=server)

    assert result.exit_code == 0, result.output
    trajectories = runner.records("trajectories.jsonl")
    assert [t["prompt_index"] for t in trajectories] == list(range(20))
    hostnames = set()
    for trajectory in trajectories:
        image, cwd = expected[trajectory["prompt_index"]]
        [output] = tool_outputs(trajectory)
        marker, pwd, hostname = output.splitlines()
        assert marker == image, trajectory["prompt_index"]
        assert pwd == cwd
        hostnames.add(hostname)
        assert trajectory["metadata"]["sandbox"] == "docker"
        assert trajectory["metadata"]["image"] == image  # the image actually used, -S image=... included
    assert len(hostnames) == 20  # one container per prompt
    assert all(server.calls_for(row["prompt"]) == 2 for row in rows)
    assert runner.records("failed.jsonl") == []


def test_a_missing_image_fails_only_its_prompts_without_a_model_call(tmp_path, runner, model_server):
    rows = [{"prompt": f"task {i}", **({"image": MISSING_IMAGE} if i in (1, 4) else {})} for i in range(6)]
    dataset = write_dataset(tmp_path / "data.jsonl", rows)
    server = model_server(FAST)

    result = runner.invoke(dataset, "--num_workers", "3", server=server)

    assert result.exit_code == 3, result.output
    failed = runner.records("failed.jsonl")
    assert sorted(f["prompt_index"] for f in failed) == [1, 4]
    for failure in failed:
        assert failure["error_kind"] == "sandbox"
        assert MISSING_IMAGE in failure["message"] and "could not be pulled" in failure["message"]
    for i, row in enumerate(rows):
        assert server.calls_for(row["prompt"]) == (0 if i in (1, 4) else 2), i
    assert sorted(t["prompt_index"] for t in runner.records("trajectories.jsonl")) == [0, 2, 3, 5]


def test_a_prompt_whose_deadline_fires_is_saved_as_partial_and_its_container_removed(
    tmp_path, runner, model_server, docker_api
):
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": "sleepy"}, {"prompt": "quick"}])
    server = model_server(RoutedScript({"sleepy": SLEEPER}, default=FAST))

    started = time.monotonic()
    result = runner.invoke(dataset, "--num_workers", "2", "--prompt_timeout", "4", "--no_filters", server=server)

    assert result.exit_code == 0, result.output
    assert time.monotonic() - started < 25  # the 30 s sleep was cut by the 4 s deadline
    by_prompt = {t["conversations"][1]["value"]: t for t in runner.records("trajectories.jsonl")}
    assert by_prompt["sleepy"]["partial"] and by_prompt["sleepy"]["metadata"]["end_reason"] == "timeout"
    assert by_prompt["quick"]["completed"]
    assert containers_of(docker_api, runner.run_name) == []


# --- faults ---------------------------------------------------------------------------------------------


def test_a_container_killed_from_outside_fails_its_prompt_and_the_run_goes_on(
    tmp_path, runner, model_server, docker_api, procs
):
    prompts = [f"task {i}" for i in range(6)]
    victim = 2
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    server = model_server(RoutedScript({prompts[victim]: SLEEPER}, default=FAST))
    # pool=0: the victim's container is found by the prompt label, which only a container made for it has
    proc = runner.spawn(dataset, "--num_workers", "3", "-S", "pool=0", server=server)
    procs.append(proc)

    def victim_sleeping():
        for container in containers_of(docker_api, runner.run_name):
            if container["Labels"][LABEL_PROMPT] == str(victim) and "sleep 30" in running_commands(docker_api, container["Id"]):
                return container["Id"]
        return None

    container_id = wait_for(victim_sleeping, 60, "the victim's command to run", proc)
    docker_api.kill(container_id)
    _out, err = proc.communicate(timeout=120)

    assert proc.returncode == 3, err[-3000:]
    [failure] = runner.records("failed.jsonl")
    assert failure["prompt_index"] == victim
    assert failure["error_kind"] == "sandbox"
    assert "killed or stopped from outside" in failure["message"] and "--resume" in failure["message"]
    assert sorted(t["prompt_index"] for t in runner.records("trajectories.jsonl")) == [0, 1, 3, 4, 5]
    assert containers_of(docker_api, runner.run_name) == []

    again = model_server(FAST)
    result = runner.invoke(dataset, "--resume", server=again)
    assert result.exit_code == 0, result.output
    assert [again.calls_for(p) for p in prompts] == [0, 0, 2, 0, 0, 0]
    assert sorted(t["prompt_index"] for t in runner.records("trajectories.jsonl")) == list(range(6))


def test_ctrl_c_in_the_middle_of_a_run_leaves_no_container(tmp_path, runner, model_server, docker_api, procs):
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(8)])
    proc = runner.spawn(dataset, "--num_workers", "4", server=model_server(SLEEPER))
    procs.append(proc)

    def sleeping():
        busy = [c for c in containers_of(docker_api, runner.run_name) if "sleep 30" in running_commands(docker_api, c["Id"])]
        return len(busy) >= 3

    wait_for(sleeping, 60, "three prompts in their containers", proc)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)

    assert proc.returncode == 130, err[-3000:]
    assert "Interrupted" in err
    assert containers_of(docker_api, runner.run_name) == []


def leave_containers_behind(tmp_path, runner, model_server, docker_api, procs, count=3) -> list:
    """Start a run and SIGKILL it while its prompts are in their containers."""
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(count)])
    proc = runner.spawn(dataset, "--num_workers", str(count), server=model_server(SLEEPER))
    procs.append(proc)
    wait_for(lambda: len(containers_of(docker_api, runner.run_name)) == count, 60, "the containers", proc)
    proc.kill()
    proc.communicate(timeout=30)
    left = containers_of(docker_api, runner.run_name)
    assert len(left) == count  # nothing could clean up after SIGKILL
    return dataset


def test_resume_removes_the_containers_a_killed_process_left(tmp_path, runner, model_server, docker_api, procs):
    dataset = leave_containers_behind(tmp_path, runner, model_server, docker_api, procs)
    server = model_server(FAST)
    result = runner.invoke(dataset, "--resume", server=server)
    assert result.exit_code == 0, result.output
    assert "Removed 3 container(s) left behind by an earlier process" in result.output
    assert [server.calls_for(f"task {i}") for i in range(3)] == [2, 2, 2]
    assert containers_of(docker_api, runner.run_name) == []


def test_cleanup_command_removes_the_leftovers_of_one_run(tmp_path, runner, model_server, docker_api, procs):
    leave_containers_behind(tmp_path, runner, model_server, docker_api, procs)
    other_run = f"{runner.run_name}-other"
    labels = {LABEL_RUN: other_run, LABEL_RUN_DIR: "/x", LABEL_HOST: socket.gethostname(), LABEL_PID: DEAD_PID}
    other = docker_api.create_container(IMAGE_A, command=["sleep", "3600"], labels=labels)["Id"]
    try:
        result = runner.cli("docker", "cleanup", "--run", runner.run_name)
        assert result.exit_code == 0, result.output
        assert f"Removed 3 leftover container(s) of run {runner.run_name!r}" in result.output
        assert containers_of(docker_api, runner.run_name) == []
        assert [c["Id"] for c in containers_of(docker_api, other_run)] == [other]

        result = runner.cli("docker", "cleanup", "--run", runner.run_name)
        assert "No leftover containers of run" in result.output
        result = runner.cli("docker", "cleanup", "--run", other_run)
        assert "Removed 1 leftover container(s)" in result.output
        assert containers_of(docker_api, other_run) == []
    finally:
        for container in containers_of(docker_api, other_run):
            docker_api.remove_container(container["Id"], force=True)


def test_cleanup_leaves_containers_of_runs_that_may_be_in_progress_unless_forced(run_name, docker_api, runner):
    LIVE_SESSIONS.add("in-progress")
    here = {LABEL_RUN: run_name, LABEL_RUN_DIR: "/x", LABEL_HOST: socket.gethostname(), LABEL_PID: str(os.getpid()), LABEL_SESSION: "in-progress"}
    elsewhere = {**here, LABEL_HOST: "another-machine", LABEL_PID: DEAD_PID, LABEL_SESSION: "remote"}
    for labels in (here, elsewhere):
        docker_api.create_container(IMAGE_A, command=["sleep", "3600"], labels=labels)
    try:
        result = runner.cli("docker", "cleanup", "--run", run_name)
        assert result.exit_code == 0
        assert "Left 2 container(s) of runs that may still be in progress" in result.output
        assert f"{os.getpid()} on {socket.gethostname()}" in result.output and "on another-machine" in result.output
        assert len(containers_of(docker_api, run_name)) == 2
        result = runner.cli("docker", "cleanup", "--run", run_name, "--force")
        assert "Removed 2 leftover container(s)" in result.output
    finally:
        LIVE_SESSIONS.discard("in-progress")


# --- the engine and the options, before anything is sent ----------------------------------------------------


def test_an_engine_that_is_down_stops_the_run_at_start_with_status_2(tmp_path, runner, model_server, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/dead.sock")
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": "task"}])
    server = model_server(FAST)

    result = runner.invoke(dataset, server=server)

    assert result.exit_code == 2
    assert f"Error: The Docker engine at unix://{tmp_path}/dead.sock is not reachable" in result.output
    assert "start it (`sudo systemctl start docker`" in result.output
    assert server.request_count == 0  # the engine is checked before the model preflight
    assert not runner.folder().exists()

    cleanup = runner.cli("docker", "cleanup")
    assert cleanup.exit_code == 2 and "is not reachable" in cleanup.output


@pytest.mark.parametrize(
    "option, says",
    [
        ("memory=lots", "memory must be a size such as 512m or 4g, got 'lots'"),
        ("bogus=1", "has no option 'bogus' (it takes image, "),
        ("network=host", "network=host would share a network namespace"),
        ("cap_add=SYS_ADMIN", "cap_add: SYS_ADMIN would let commands reach past the container"),
    ],
)
def test_bad_options_stop_the_run_before_anything_is_sent(tmp_path, runner, model_server, option, says):
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": "task"}])
    server = model_server(FAST)
    result = runner.invoke(dataset, "-S", option, server=server)
    assert result.exit_code == 2
    assert "Error: " in result.output and "docker sandbox (-S)" in result.output and says in result.output
    assert server.request_count == 0
    assert not runner.folder().exists()


# --- defaults of issue 7 ------------------------------------------------------------------------------


def test_a_prompt_that_fills_its_pids_limit_finishes_and_is_not_run_again_on_resume(
    tmp_path, runner, model_server, docker_api
):
    # A real fork bomb at a small pids limit, then a command that must still run. This engine can still
    # start commands in a full container; the restart of one that cannot is test_docker_backend's
    # ..._restarted_not_failed_simulated.
    fill = "b() {{ b | b & }}; b; sleep 1000"
    script = ToolLoopScript(
        tool_calls=2, command=f"if [ {{turn}} = 0 ]; then {fill}; else cat /etc/hermes-image; fi"
    )
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": "fork bomb"}, {"prompt": "quiet"}])
    server = model_server(RoutedScript({"fork bomb": script}, default=FAST))

    result = runner.invoke(
        dataset, "--num_workers", "2", "--command_timeout", "3", "--no_filters", "-S", "pids_limit=32", server=server
    )

    assert result.exit_code == 0, result.output
    assert runner.records("failed.jsonl") == []
    bomb = next(t for t in runner.records("trajectories.jsonl") if t["conversations"][1]["value"] == "fork bomb")
    assert bomb["completed"]
    assert tool_outputs(bomb)[-1].strip().endswith(IMAGE_A)  # the sandbox ran commands after the bomb
    assert containers_of(docker_api, runner.run_name) == []

    again = model_server(FAST)
    result = runner.invoke(dataset, "--resume", server=again)
    assert result.exit_code == 0, result.output
    assert again.calls_for("fork bomb") == again.calls_for("quiet") == 0
