"""``hermes-batch run --sandbox modal`` end to end: the real SDK, the Modal stand-in, the scripted model server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import modal

from hermes_batch.testing import RoutedScript, Runner, ToolLoopScript, tool_outputs, wait_for, write_dataset
from hermes_batch_modal import leftovers

from modal_rig import IMAGE_A, IMAGE_B, MISSING_IMAGE

SLEEPER = ToolLoopScript(tool_calls=1, command="sleep 30")
FAST = ToolLoopScript(tool_calls=1, command="echo fine")
DEAD_PID = "2147483646"


def assert_no_token_in(folder, standin) -> None:
    files = [path for path in folder.rglob("*") if path.is_file()]
    assert files
    for path in files:
        data = path.read_bytes()
        for secret in (standin.token_id, standin.token_secret):
            assert secret.encode() not in data, f"{path} holds a Modal token"


def running_sleep(standin, sandbox) -> bool:
    try:
        return "sleep 30" in standin.exec_in(sandbox, "ps -o args")
    except Exception:
        return False


def test_twenty_prompts_run_each_in_a_sandbox_of_its_own_with_the_rows_image_and_cwd(tmp_path, runner, model_server, standin):
    rows, expected = [], {}
    for i in range(20):
        prompt = f"task {i}: which image are you in?"
        kind = i % 4
        if kind == 0:
            row, image, cwd = {"prompt": prompt}, IMAGE_B, "/workspace"  # the -S image default
        elif kind == 1:
            row, image, cwd = {"prompt": prompt, "image": IMAGE_A}, IMAGE_A, "/workspace"
        elif kind == 2:
            row, image, cwd = {"prompt": prompt, "image": IMAGE_B, "cwd": "relative/dir"}, IMAGE_B, "/relative/dir"
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
        assert (marker, pwd) == (image, cwd), trajectory["prompt_index"]
        hostnames.add(hostname)
        assert trajectory["metadata"]["sandbox"] == "modal"
        assert trajectory["metadata"]["image"] == image  # the image it ran in, -S image=... included
    assert len(hostnames) == 20  # one sandbox per prompt
    assert all(server.calls_for(row["prompt"]) == 2 for row in rows)
    assert runner.records("failed.jsonl") == []
    made = [s for s in standin.sandboxes.values() if s.tags.get(leftovers.TAG_RUN) == runner.run_name]
    assert len(made) == 20 and not any(s.running for s in made)
    assert standin.calls["AppGetOrCreate"] == 1
    assert standin.calls["ImageJoinStreaming"] == 2  # each image resolved once for the run
    assert_no_token_in(runner.folder(), standin)


def test_no_credentials_stop_the_run_at_start_with_status_2(tmp_path, runner, model_server, standin):
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": "task"}])
    server = model_server(FAST)
    env = {k: v for k, v in os.environ.items() if k not in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET")}
    env["MODAL_CONFIG_PATH"] = str(tmp_path / "no-such-modal.toml")

    proc = subprocess.run([sys.executable, "-m", "hermes_batch", *runner.args(dataset, server=server)],
                          capture_output=True, text=True, env=env, timeout=120)

    assert proc.returncode == 2, proc.stderr
    error = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("Error:")]
    assert error == [
        "Error: No Modal credentials were found (MODAL_TOKEN_ID and MODAL_TOKEN_SECRET not set in the environment "
        f"nor in {tmp_path / 'no-such-modal.toml'}); run `modal token new` (or set MODAL_TOKEN_ID and "
        "MODAL_TOKEN_SECRET) and run again."
    ]
    assert "Traceback" not in proc.stderr
    assert server.request_count == 0  # no model call
    assert sum(standin.calls.values()) == 0  # nor any call to Modal
    assert not runner.folder().exists()


def test_a_refused_token_stops_the_run_at_start_with_status_2(tmp_path, runner, model_server, standin, monkeypatch):
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-revoked-0123456789")
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": "task"}])
    server = model_server(FAST)
    result = runner.invoke(dataset, server=server)
    assert result.exit_code == 2
    assert "Error: Modal refused the token it was given; run `modal token new`" in result.output
    assert "as-revoked" not in result.output
    assert server.request_count == 0
    assert not runner.folder().exists()


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
        assert MISSING_IMAGE in failure["message"] and "could not build or pull" in failure["message"]
    for i, row in enumerate(rows):
        assert server.calls_for(row["prompt"]) == (0 if i in (1, 4) else 2), i
    assert sorted(t["prompt_index"] for t in runner.records("trajectories.jsonl")) == [0, 2, 3, 5]


def test_a_sandbox_that_never_becomes_ready_fails_its_prompt_and_resume_runs_it(tmp_path, runner, model_server, standin):
    standin.faults.never_ready = lambda tags: tags.get(leftovers.TAG_PROMPT) == "2"
    rows = [{"prompt": f"task {i}"} for i in range(4)]
    dataset = write_dataset(tmp_path / "data.jsonl", rows)
    server = model_server(FAST)

    result = runner.invoke(dataset, "--num_workers", "4", "-S", "startup_timeout=8", server=server)

    assert result.exit_code == 3, result.output
    [failure] = runner.records("failed.jsonl")
    assert failure["prompt_index"] == 2 and failure["error_kind"] == "sandbox"
    assert "was not ready within -S startup_timeout=8 s" in failure["message"]
    assert server.calls_for("task 2") == 1  # the first request went out while the sandbox was starting

    standin.faults.never_ready = None
    again = model_server(FAST)
    result = runner.invoke(dataset, "--resume", "-S", "startup_timeout=8", server=again)
    assert result.exit_code == 0, result.output
    assert [again.calls_for(row["prompt"]) for row in rows] == [0, 0, 2, 0]


def test_a_sandbox_terminated_from_outside_fails_its_prompt_and_the_run_goes_on(tmp_path, runner, model_server, standin):
    prompts = [f"task {i}" for i in range(5)]
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    server = model_server(RoutedScript({"task 2": SLEEPER}, default=FAST))

    def terminate_the_sleeper():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for sandbox in standin.running(**{leftovers.TAG_PROMPT: "2"}):
                if running_sleep(standin, sandbox):
                    standin.terminate_from_outside(sandbox)
                    return
            time.sleep(0.1)

    killer = threading.Thread(target=terminate_the_sleeper)
    killer.start()
    result = runner.invoke(dataset, "--num_workers", "5", server=server)
    killer.join()

    assert result.exit_code == 3, result.output
    [failure] = runner.records("failed.jsonl")
    assert failure["prompt_index"] == 2 and failure["error_kind"] == "sandbox"
    assert "was terminated from outside" in failure["message"] and "--resume" in failure["message"]
    assert sorted(t["prompt_index"] for t in runner.records("trajectories.jsonl")) == [0, 1, 3, 4]


def test_a_prompt_whose_deadline_fires_is_saved_as_partial_and_its_sandbox_terminated(tmp_path, runner, model_server, standin):
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": "sleepy"}, {"prompt": "quick"}])
    server = model_server(RoutedScript({"sleepy": SLEEPER}, default=FAST))

    started = time.monotonic()
    result = runner.invoke(dataset, "--num_workers", "2", "--prompt_timeout", "6", "--no_filters", server=server)

    assert result.exit_code == 0, result.output
    assert time.monotonic() - started < 28  # the 30 s sleep was cut by the deadline
    by_prompt = {t["conversations"][1]["value"]: t for t in runner.records("trajectories.jsonl")}
    assert by_prompt["sleepy"]["partial"] and by_prompt["sleepy"]["metadata"]["end_reason"] == "timeout"
    assert by_prompt["quick"]["completed"]
    assert standin.running() == []


def test_ctrl_c_in_the_middle_of_a_run_leaves_no_sandbox_running(tmp_path, runner, model_server, standin, procs):
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(8)])
    proc = runner.spawn(dataset, "--num_workers", "4", server=model_server(SLEEPER))
    procs.append(proc)

    def sleeping():
        return sum(running_sleep(standin, s) for s in standin.running(**{leftovers.TAG_RUN: runner.run_name})) >= 3

    wait_for(sleeping, 90, "three prompts in their sandboxes", proc)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=90)

    assert proc.returncode == 130, err[-3000:]
    assert "Interrupted" in err
    assert standin.running(**{leftovers.TAG_RUN: runner.run_name}) == []
    assert_no_token_in(runner.folder(), standin)
    assert standin.token_secret not in err


def leave_sandboxes_behind(tmp_path, runner, model_server, standin, procs, count=3):
    """Start a run and SIGKILL it while its prompts are in their sandboxes."""
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(count)])
    proc = runner.spawn(dataset, "--num_workers", str(count), server=model_server(SLEEPER))
    procs.append(proc)
    wait_for(lambda: len(standin.running(**{leftovers.TAG_RUN: runner.run_name})) == count, 90, "the sandboxes", proc)
    proc.kill()
    proc.communicate(timeout=30)
    assert len(standin.running(**{leftovers.TAG_RUN: runner.run_name})) == count  # nothing cleaned up after SIGKILL
    return dataset


def test_cleanup_command_terminates_a_crashed_runs_sandboxes(tmp_path, runner, model_server, standin, procs):
    leave_sandboxes_behind(tmp_path, runner, model_server, standin, procs)
    other_run = f"{runner.run_name}-other"

    async def make_other():
        client = await modal.Client.from_credentials.aio(standin.token_id, standin.token_secret)
        app = await modal.App.lookup.aio("hermes-batch", client=client)
        tags = {**leftovers.sandbox_tags(other_run, tmp_path, 0, "k", "gone"), leftovers.TAG_PID: DEAD_PID}
        created = await modal.Sandbox.create.aio(app=app, image=modal.Image.from_registry(IMAGE_A), tags=tags, client=client)
        await client.close.aio()
        return created.object_id

    other = asyncio.run(make_other())
    result = runner.cli("modal", "cleanup", "--run", runner.run_name)
    assert result.exit_code == 0, result.output
    assert f"Terminated 3 leftover Modal sandbox(es) of run {runner.run_name!r} in app 'hermes-batch'" in result.output
    assert result.output.count("Terminating sb-") == 3
    assert standin.running(**{leftovers.TAG_RUN: runner.run_name}) == []
    assert [s.id for s in standin.running(**{leftovers.TAG_RUN: other_run})] == [other]

    result = runner.cli("modal", "cleanup", "--run", runner.run_name)
    assert "No leftover Modal sandboxes of run" in result.output
    result = runner.cli("modal", "cleanup")
    assert "Terminated 1 leftover Modal sandbox(es) in app 'hermes-batch'" in result.output
    assert standin.running() == []


def test_resume_terminates_the_sandboxes_a_killed_process_left(tmp_path, runner, model_server, standin):
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(3)])

    async def leave_behind():  # as a SIGKILLed process of this run would have (see the cleanup test above)
        client = await modal.Client.from_credentials.aio(standin.token_id, standin.token_secret)
        app = await modal.App.lookup.aio("hermes-batch", create_if_missing=True, client=client)
        for index in range(3):
            tags = {**leftovers.sandbox_tags(runner.run_name, runner.folder(), index, "k", "killed"), leftovers.TAG_PID: DEAD_PID}
            await modal.Sandbox.create.aio(app=app, image=modal.Image.from_registry(IMAGE_A), tags=tags, client=client)
        await client.close.aio()

    asyncio.run(leave_behind())
    assert len(standin.running(**{leftovers.TAG_RUN: runner.run_name})) == 3
    server = model_server(FAST)
    result = runner.invoke(dataset, server=server)
    assert result.exit_code == 0, result.output
    assert "Terminated 3 Modal sandbox(es) left running by an earlier process" in result.output
    assert [server.calls_for(f"task {i}") for i in range(3)] == [2, 2, 2]
    assert standin.running() == []


def test_cleanup_without_credentials_says_how_to_log_in(tmp_path, monkeypatch):
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    monkeypatch.delenv("MODAL_TOKEN_SECRET", raising=False)
    monkeypatch.setattr(modal.config, "_user_config", {})
    result = Runner(tmp_path).cli("modal", "cleanup")
    assert result.exit_code == 2
    assert "No Modal credentials were found" in result.output and "modal token new" in result.output
