"""Durability end to end: kills, torn writes, Ctrl-C and ``--resume`` through the real CLI.

Every test drives ``hermes-batch run`` (in-process, or as a subprocess when a signal
is needed) against a real ScriptedModelServer through the real openai SDK, with the
local sandbox.  A resume usually talks to a *fresh* server, so "what the resume sent
to the model" is simply what that server saw.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import uuid
from collections import Counter
from pathlib import Path

import pytest

from hermes_batch.default_plugins.local_executor import LocalExecutor
from hermes_batch.contract.interfaces import NoOptions
from hermes_batch.testing.fixtures import wait_for
from hermes_batch.testing import Reply, RoutedScript, ToolLoopScript

from hermes_batch.testing import write_dataset

BATCH = 5
CALLS_PER_SESSION = 2  # ToolLoopScript(tool_calls=1): one tool-calling turn, then the final answer
FAST = ToolLoopScript(tool_calls=1)
BASE = ("--distribution", "terminal_only", "--seed", "7")


# --- helpers -----------------------------------------------------------------------------


def make_prompts(n: int, tag: str = "task") -> list[str]:
    return [f"{tag} {i}: list the files" for i in range(n)]


def rows(prompts) -> list[dict]:
    return [{"prompt": p} for p in prompts]


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def human(record: dict) -> str:
    """The prompt of a trajectory (or of a discarded record)."""
    record = record.get("trajectory", record)
    return next(turn["value"] for turn in record["conversations"] if turn["from"] == "human")


def finished_prompts(folder: Path) -> Counter:
    """Prompts with a kept or discarded record in the run folder, as resume sees them."""
    done = Counter()
    for path in folder.glob("batch_*.jsonl"):
        done.update(human(r) for r in read_jsonl(path))
    done.update(human(r) for r in read_jsonl(folder / "discarded.jsonl"))
    return done


def batch_line_count(folder: Path) -> int:
    total = 0
    for path in folder.glob("batch_*.jsonl"):
        try:
            total += path.read_bytes().count(b"\n")
        except FileNotFoundError:
            pass
    return total


def assert_folder_parses(folder: Path) -> None:
    """Every line of every .jsonl is whole JSON and every .json file is JSON."""
    checked = 0
    for path in sorted(folder.iterdir()):
        if path.suffix == ".jsonl":
            data = path.read_bytes()
            assert not data or data.endswith(b"\n"), f"{path.name} ends with a torn line"
            for number, line in enumerate(data.splitlines(), 1):
                if line.strip():
                    try:
                        json.loads(line)
                    except ValueError:
                        pytest.fail(f"{path.name}:{number} is not valid JSON: {line[:120]!r}")
            checked += 1
        elif path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
            checked += 1
    assert checked, f"nothing to check in {folder}"


def assert_batches_fixed(folder: Path, batch_size: int = BATCH) -> None:
    """Prompt i is in batch_{i // batch_size}.jsonl and says so in its metadata."""
    for path in folder.glob("batch_*.jsonl"):
        number = int(path.stem.split("_")[1])
        for record in read_jsonl(path):
            assert record["prompt_index"] // batch_size == number, (path.name, record["prompt_index"])
            assert record["metadata"]["batch_num"] == number


def assert_each_once(runner, prompts) -> list[dict]:
    """trajectories.jsonl holds each of ``prompts`` exactly once, in prompt_index order."""
    merged = runner.records("trajectories.jsonl")
    assert Counter(human(t) for t in merged) == Counter(prompts)
    indexes = [t["prompt_index"] for t in merged]
    assert indexes == sorted(set(indexes))
    return merged


def statistics(runner) -> dict:
    return json.loads((runner.folder() / "statistics.json").read_text())


def checkpoint(runner) -> dict:
    return json.loads((runner.folder() / "checkpoint.json").read_text())


def processes_matching(pattern: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return found.stdout.split()


# --- SIGKILL and torn writes ---------------------------------------------------------------


def test_sigkill_mid_run_then_resume_finishes_each_prompt_once_without_paying_twice(
    tmp_path, runner, model_server, procs
):
    prompts = make_prompts(30)
    data = write_dataset(tmp_path / "data.jsonl", rows(prompts))
    first = model_server(FAST, latency=0.1)
    proc = runner.spawn(data, *BASE, "--num_workers", "4", server=first)
    procs.append(proc)
    folder = runner.folder()
    wait_for(lambda: batch_line_count(folder) >= 8, 60, "8 finished prompts", proc)
    proc.kill()
    proc.communicate(timeout=30)

    before = finished_prompts(folder)
    assert 8 <= sum(before.values()) < len(prompts), "the kill must land mid-run"
    assert all(n == 1 for n in before.values())
    assert_folder_parses(folder)
    assert_batches_fixed(folder)
    # a batch the checkpoint calls complete really has every prompt written
    for batch in checkpoint(runner)["completed_batches"]:
        assert set(prompts[batch * BATCH:(batch + 1) * BATCH]) <= set(before)

    second = model_server(FAST)
    result = runner.invoke(data, *BASE, "--resume", server=second)
    assert result.exit_code == 0, result.output

    assert_each_once(runner, prompts)
    for prompt in prompts:
        if prompt in before:
            assert first.calls_for(prompt) == CALLS_PER_SESSION, prompt
            assert second.calls_for(prompt) == 0, f"{prompt!r} was finished before the kill but ran again"
        else:
            assert second.calls_for(prompt) == CALLS_PER_SESSION, prompt
    assert_folder_parses(folder)
    assert_batches_fixed(folder)
    stats = statistics(runner)
    assert stats["prompts"] == {"finished": 30, "kept": 30, "discarded": 0, "failed": 0, "skipped_invalid": 0}
    assert stats["finished"]["model_calls"] == 30 * CALLS_PER_SESSION
    assert len(stats["duration"]["sessions"]) == 2
    assert checkpoint(runner)["completed_batches"] == [0, 1, 2, 3, 4, 5]


def test_a_batch_finished_before_its_checkpoint_was_saved_is_complete_after_the_resume(tmp_path, runner, model_server):
    prompts = make_prompts(12)
    data = write_dataset(tmp_path / "data.jsonl", rows(prompts))
    result = runner.invoke(data, *BASE, "--num_workers", "2", server=model_server(FAST))
    assert result.exit_code == 0, result.output
    # a kill that landed after batch 0's last record and batch 1's, before the checkpoint calling them
    # complete, and while batch 2 (prompts 10 and 11) was still running
    path = runner.folder() / "checkpoint.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "completed_batches": []}))
    last = runner.folder() / "batch_2.jsonl"
    last.write_text("".join(line for line in last.read_text().splitlines(keepends=True) if prompts[11] not in line))

    second = model_server(FAST)
    result = runner.invoke(data, *BASE, "--resume", server=second)
    assert result.exit_code == 0, result.output
    assert {p for p in prompts if second.calls_for(p)} == {prompts[11]}
    assert checkpoint(runner)["completed_batches"] == [0, 1, 2]


def test_torn_last_line_is_repaired_and_its_prompt_runs_again(tmp_path, runner, model_server):
    prompts = make_prompts(10)
    data = write_dataset(tmp_path / "data.jsonl", rows(prompts))
    result = runner.invoke(data, *BASE, server=model_server(FAST))
    assert result.exit_code == 0, result.output

    # a crash in the middle of writing batch 1's last record
    batch_file = runner.folder() / "batch_1.jsonl"
    lines = batch_file.read_text().splitlines(keepends=True)
    torn = lines[-1]
    torn_prompt = human(json.loads(torn))
    batch_file.write_text("".join(lines[:-1]) + torn[: len(torn) // 2])

    # first resume: the torn prompt runs again but fails, so nothing is appended to its batch file
    second = model_server(RoutedScript(lambda p: _always_500 if p == torn_prompt else FAST))
    result = runner.invoke(data, *BASE, "--resume", server=second)
    assert result.exit_code == 3, result.output
    assert {p for p in prompts if second.calls_for(p)} == {torn_prompt}
    assert_folder_parses(runner.folder())
    assert [r["prompt"] for r in runner.records("failed.jsonl")] == [torn_prompt]
    assert_each_once(runner, [p for p in prompts if p != torn_prompt])

    third = model_server(FAST)
    result = runner.invoke(data, *BASE, "--resume", server=third)
    assert result.exit_code == 0, result.output
    assert third.calls_for(torn_prompt) == CALLS_PER_SESSION
    assert third.request_count == 1 + CALLS_PER_SESSION, "the preflight, then only the torn prompt runs again"
    assert_folder_parses(runner.folder())
    assert Counter(human(r) for r in read_jsonl(batch_file)) == Counter(prompts[5:])
    assert_each_once(runner, prompts)
    assert statistics(runner)["prompts"]["failed"] == 0


def test_a_failure_in_a_session_killed_before_any_checkpoint_is_cleared_by_the_resume(
    tmp_path, runner, model_server, procs
):
    failing = "this prompt meets a broken endpoint"
    prompts = [failing] + make_prompts(6)
    data = write_dataset(tmp_path / "data.jsonl", rows(prompts))
    # every other prompt hangs, so no batch completes before the kill
    first = model_server(RoutedScript(lambda p: _always_500 if p == failing else FAST), hang=lambda r: r.prompt != failing and not r.preflight)
    proc = runner.spawn(data, *BASE, "--num_workers", "3", server=first)
    procs.append(proc)
    folder = runner.folder()
    failed_file = folder / "failed.jsonl"
    wait_for(lambda: failed_file.exists() and failed_file.read_bytes().count(b"\n"), 60, "the failure record", proc)
    proc.kill()
    proc.communicate(timeout=30)
    assert finished_prompts(folder) == Counter()

    second = model_server(FAST)
    result = runner.invoke(data, *BASE, "--resume", server=second)
    assert result.exit_code == 0, result.output
    assert second.calls_for(failing) == CALLS_PER_SESSION
    assert_each_once(runner, prompts)
    stats = statistics(runner)
    assert stats["prompts"]["failed"] == 0, stats["failures"]
    assert len(stats["duration"]["sessions"]) == 2, "the killed session is part of the run"


# --- matching the dataset by content ------------------------------------------------------------


def test_duplicated_prompts_run_once_per_row_across_resumes(tmp_path, runner, model_server):
    dup = "the same prompt, three times"
    dataset = [dup, "other 1", dup, "other 2", dup, "other 3"]
    data = write_dataset(tmp_path / "data.jsonl", rows(dataset))

    first = model_server(FAST)
    result = runner.invoke(data, *BASE, "--max_samples", "3", server=first)  # a partial run
    assert result.exit_code == 0, result.output
    assert first.calls_for(dup) == 2 * CALLS_PER_SESSION

    second = model_server(FAST)
    result = runner.invoke(data, *BASE, "--resume", "--max_samples", "all", server=second)
    assert result.exit_code == 0, result.output
    assert second.calls_for(dup) == CALLS_PER_SESSION  # only the third copy
    merged = assert_each_once(runner, dataset)
    assert sorted(t["prompt_index"] for t in merged if human(t) == dup) == [0, 2, 4]

    third = model_server(FAST)
    result = runner.invoke(data, *BASE, "--resume", server=third)
    assert result.exit_code == 0, result.output
    assert third.request_count == 0
    assert_each_once(runner, dataset)


def test_duplicated_prompts_in_one_run_give_one_trajectory_each(tmp_path, runner, model_server):
    dup = "say hello"
    data = write_dataset(tmp_path / "data.jsonl", rows([dup, dup, dup]))
    server = model_server(FAST)
    result = runner.invoke(data, *BASE, server=server)
    assert result.exit_code == 0, result.output
    assert server.calls_for(dup) == 3 * CALLS_PER_SESSION
    assert [t["prompt_index"] for t in assert_each_once(runner, [dup] * 3)] == [0, 1, 2]


def test_reordered_and_extended_dataset_runs_only_the_new_rows(tmp_path, runner, model_server):
    old = make_prompts(10)
    data = write_dataset(tmp_path / "data.jsonl", rows(old))
    result = runner.invoke(data, *BASE, server=model_server(FAST))
    assert result.exit_code == 0, result.output

    shuffled = old[:]
    random.Random(3).shuffle(shuffled)
    assert shuffled != old
    new = make_prompts(5, tag="new task")
    write_dataset(data, rows(shuffled + new))
    second = model_server(FAST)
    result = runner.invoke(data, *BASE, "--resume", server=second)
    assert result.exit_code == 0, result.output

    assert {p for p in old + new if second.calls_for(p)} == set(new)
    assert second.request_count == 1 + len(new) * CALLS_PER_SESSION  # and the preflight
    merged = assert_each_once(runner, old + new)
    # the new rows are rows 10..14 of the new file, so they belong to batch 2
    assert sorted(t["prompt_index"] for t in merged if human(t) in new) == [10, 11, 12, 13, 14]
    assert_batches_fixed(runner.folder())
    assert statistics(runner)["prompts"]["kept"] == 15


# --- discarded and failed prompts ----------------------------------------------------------------


def _always_500(_request):
    # Retry-After: 0 keeps the client's retries (exponential backoff otherwise) fast
    return Reply(status=500, headers={"Retry-After": "0"}, error_message="upstream exploded")


def test_discarded_prompts_stay_finished_and_failed_prompts_run_again(tmp_path, runner, model_server):
    kept = make_prompts(4, tag="good")
    unreasoned = make_prompts(2, tag="no reasoning")
    failing = make_prompts(2, tag="flaky endpoint")
    dataset = [kept[0], unreasoned[0], failing[0], kept[1], kept[2], unreasoned[1], failing[1], kept[3]]
    data = write_dataset(tmp_path / "data.jsonl", rows(dataset))
    no_reasoning = ToolLoopScript(tool_calls=1, reasoning=None)

    def route(prompt):
        if prompt in unreasoned:
            return no_reasoning
        if prompt in failing:
            return _always_500
        return FAST

    first = model_server(RoutedScript(route))
    result = runner.invoke(data, *BASE, server=first)
    assert result.exit_code == 3, result.output
    assert sorted(r["prompt"] for r in runner.records("failed.jsonl")) == sorted(failing)
    assert sorted(human(r) for r in runner.records("discarded.jsonl")) == sorted(unreasoned)
    stats = statistics(runner)
    assert stats["prompts"]["failed"] == 2
    assert stats["prompts"]["discarded"] == 2
    assert stats["discarded_by_filter"]["no-reasoning"] == 2

    # still broken: the failed prompts are tried again and counted once, not once per attempt
    retry = model_server(RoutedScript(route))
    result = runner.invoke(data, *BASE, "--resume", server=retry)
    assert result.exit_code == 3, result.output
    assert {p for p in dataset if retry.calls_for(p)} == set(failing)
    assert statistics(runner)["prompts"]["failed"] == 2

    # the endpoint has recovered; the unreasoned prompts would still be discarded if they ran
    second = model_server(RoutedScript(lambda p: no_reasoning if p in unreasoned else FAST))
    result = runner.invoke(data, *BASE, "--resume", server=second)
    assert result.exit_code == 0, result.output
    assert {p for p in dataset if second.calls_for(p)} == set(failing)
    assert second.request_count == 1 + len(failing) * CALLS_PER_SESSION  # and the preflight

    assert_each_once(runner, kept + failing)
    stats = statistics(runner)
    assert stats["prompts"] == {"finished": 8, "kept": 6, "discarded": 2, "failed": 0, "skipped_invalid": 0}
    assert stats["failures"]["prompts"] == 0
    assert stats["failures"]["by_kind"] == {}
    assert_folder_parses(runner.folder())


# --- batches, checkpoint, statistics -------------------------------------------------------------


def test_batch_numbers_are_fixed_whatever_order_prompts_finish_in(tmp_path, runner, model_server):
    prompts = make_prompts(13)
    data = write_dataset(tmp_path / "data.jsonl", rows(prompts))

    def slow_first(request):  # earlier prompts answer slower, so prompts finish in roughly reverse order
        if request.preflight:
            return 0.0
        return 0.02 * (13 - int(request.prompt.split()[1].rstrip(":")))

    args = (*BASE, "--batch_size", "4", "--num_workers", "8")

    result = runner.invoke(data, *args, "--max_samples", "7", server=model_server(FAST, latency=slow_first))
    assert result.exit_code == 0, result.output
    folder = runner.folder()
    expected = {0: prompts[0:4], 1: prompts[4:7]}
    assert {int(p.stem[6:]): sorted(map(human, read_jsonl(p))) for p in folder.glob("batch_*.jsonl")} == expected

    result = runner.invoke(data, *args, "--resume", "--max_samples", "all", server=model_server(FAST, latency=slow_first))
    assert result.exit_code == 0, result.output
    expected = {n: sorted(prompts[n * 4:(n + 1) * 4]) for n in range(4)}
    assert {int(p.stem[6:]): sorted(map(human, read_jsonl(p))) for p in folder.glob("batch_*.jsonl")} == expected
    assert_batches_fixed(folder, 4)
    assert_each_once(runner, prompts)


def test_checkpoint_records_completed_batches(tmp_path, runner, model_server):
    prompts = make_prompts(12)
    data = write_dataset(tmp_path / "data.jsonl", rows(prompts))
    result = runner.invoke(data, *BASE, server=model_server(FAST))
    assert result.exit_code == 0, result.output
    saved = checkpoint(runner)
    assert saved["completed_batches"] == [0, 1, 2]
    assert saved["batch_size"] == BATCH
    assert saved["prompts_finished"] == 12
    assert len(saved["sessions"]) == 1


def test_a_batch_with_a_failed_prompt_is_not_complete_until_a_resume_finishes_it(tmp_path, runner, model_server):
    prompts = make_prompts(12)
    data = write_dataset(tmp_path / "data.jsonl", rows(prompts))
    batch_1 = set(prompts[5:10])
    broken = model_server(RoutedScript(lambda p: _always_500 if p in batch_1 else FAST))
    result = runner.invoke(data, *BASE, "--max_retries", "0", server=broken)
    assert result.exit_code == 3, result.output
    saved = checkpoint(runner)
    assert saved["completed_batches"] == [0, 2]  # every prompt of batch 1 failed
    assert (saved["prompts_finished"], saved["prompts_failed"]) == (7, 5)
    # the seed's name, with its meaning: no count under a name that meant the list of finished prompts
    assert "completed_prompts" not in saved and saved["last_updated"] == saved["updated_at"]

    # a folder of an earlier version, whose checkpoint.json held completed_prompts as a count, resumes
    (runner.folder() / "checkpoint.json").write_text(json.dumps({**saved, "completed_prompts": 7}) + "\n")
    result = runner.invoke(data, *BASE, "--resume", server=model_server(FAST))
    assert result.exit_code == 0, result.output
    saved = checkpoint(runner)
    assert saved["completed_batches"] == [0, 1, 2] and "completed_prompts" not in saved
    assert len(saved["sessions"]) == 2


def test_resume_of_a_finished_run_calls_no_model_and_rebuilds_outputs(tmp_path, runner, model_server):
    prompts = make_prompts(7)
    data = write_dataset(tmp_path / "data.jsonl", rows(prompts))
    result = runner.invoke(data, *BASE, server=model_server(FAST))
    assert result.exit_code == 0, result.output
    folder = runner.folder()
    (folder / "trajectories.jsonl").unlink()
    (folder / "statistics.json").unlink()

    second = model_server(FAST)
    result = runner.invoke(data, *BASE, "--resume", server=second)
    assert result.exit_code == 0, result.output
    assert second.request_count == 0
    assert_each_once(runner, prompts)
    assert statistics(runner)["prompts"]["kept"] == 7
    assert_folder_parses(folder)


def test_statistics_cover_every_session_of_the_run(tmp_path, runner, model_server):
    prompts = make_prompts(9)
    data = write_dataset(tmp_path / "data.jsonl", rows(prompts))
    result = runner.invoke(data, *BASE, "--max_samples", "4", server=model_server(FAST))
    assert result.exit_code == 0, result.output
    assert statistics(runner)["finished"]["model_calls"] == 4 * CALLS_PER_SESSION

    result = runner.invoke(data, *BASE, "--resume", "--max_samples", "all", server=model_server(FAST))
    assert result.exit_code == 0, result.output
    stats = statistics(runner)
    assert stats["prompts"]["finished"] == stats["finished"]["samples"] == 9
    assert stats["finished"]["model_calls"] == 9 * CALLS_PER_SESSION
    assert stats["kept"]["tool_usage"]["terminal"]["count"] == 9
    merged = runner.records("trajectories.jsonl")
    assert stats["tokens"]["prompt"] == sum(t["metadata"]["usage"]["prompt_tokens"] for t in merged) > 0
    sessions = stats["duration"]["sessions"]
    assert [s["prompts_run"] for s in sessions] == [4, 5]
    assert all(s["duration_s"] > 0 for s in sessions)
    assert stats["duration"]["total_s"] == pytest.approx(sum(s["duration_s"] for s in sessions), abs=0.01)


# --- Ctrl-C ---------------------------------------------------------------------------------------


def test_ctrl_c_shuts_down_cleanly_and_resume_completes(tmp_path, runner, model_server, procs):
    prompts = make_prompts(10)
    data = write_dataset(tmp_path / "data.jsonl", rows(prompts))
    marker = f"29.{uuid.uuid4().int % 10**9:09d}"  # a sleep no other process runs
    slow = ToolLoopScript(tool_calls=1, command=f"sleep {marker}")
    quick = set(prompts[:4])  # the first four workers' prompts finish; the next ones sleep
    first = model_server(RoutedScript(lambda p: FAST if p in quick else slow), latency=0.05)
    proc = runner.spawn(data, *BASE, "--num_workers", "4", server=first)
    procs.append(proc)
    folder = runner.folder()

    wait_for(lambda: batch_line_count(folder) >= 4, 60, "the quick prompts to finish", proc)
    wait_for(lambda: len(processes_matching(f"^sleep {marker}")) >= 4, 60, "four sleeping tool commands", proc)
    assert any((folder / "scratch").iterdir())
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)

    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "--resume" in err
    # SIGKILLed processes may take a moment to vanish; one left after seconds outlived Ctrl-C
    wait_for(lambda: not processes_matching(marker), 5, "the tool commands to be killed")
    scratch = folder / "scratch"
    left = list(scratch.iterdir()) if scratch.exists() else []
    assert left == [], f"sandbox folders left behind: {left}"
    assert_folder_parses(folder)
    assert finished_prompts(folder) == Counter(quick)
    saved = checkpoint(runner)
    assert saved["sessions"][-1]["interrupted"] is True
    assert statistics(runner)["prompts"]["kept"] == 4

    second = model_server(FAST)
    result = runner.invoke(data, *BASE, "--resume", server=second)
    assert result.exit_code == 0, result.output
    assert {p for p in prompts if second.calls_for(p)} == set(prompts) - quick
    assert_each_once(runner, prompts)
    assert_folder_parses(folder)


async def test_ctrl_c_lets_every_prompt_in_flight_finish_closing_its_sandbox():
    """Cancelling the local executor waits for each session's cleanup instead of cutting it short."""
    in_flight, closed = set(), set()

    class SlowToClose:
        async def process(self, job):
            in_flight.add(job)
            try:
                await asyncio.sleep(3600)
            finally:
                await asyncio.sleep(0.02 * (job + 1))  # like removing a sandbox folder in a thread
                closed.add(job)

    async def on_outcome(job, outcome):
        pytest.fail("no prompt ends before the cancel")

    run = asyncio.ensure_future(LocalExecutor(NoOptions()).run(iter(range(6)), SlowToClose(), on_outcome, 4))
    while len(in_flight) < 4:
        await asyncio.sleep(0.01)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert closed == in_flight == {0, 1, 2, 3}


def test_sigterm_shuts_down_cleanly_with_its_own_status(tmp_path, runner, model_server, procs):
    prompts = make_prompts(6)
    data = write_dataset(tmp_path / "data.jsonl", rows(prompts))
    server = model_server(ToolLoopScript(tool_calls=1, command="sleep 30"), latency=0.05)
    proc = runner.spawn(data, *BASE, "--num_workers", "3", server=server)
    procs.append(proc)
    wait_for(lambda: server.request_count >= 1 + 3, 60, "the preflight and the first model calls", proc)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    json.loads((runner.folder() / "checkpoint.json").read_text())


class SwallowsACancel:
    """A prompt whose code loses the cancel it got (Python 3.11's asyncio.wait_for does, when what it waits for
    ends at that moment): it ends normally.  Every later prompt waits for ever."""

    def __init__(self):
        self.started = []
        self.swallowed = asyncio.Event()

    async def process(self, job):
        self.started.append(job)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if job == 0:
                self.swallowed.set()
                return f"out-{job}"  # the cancel is gone
            raise
        return f"out-{job}"

    async def cancel_once_started(self, loop) -> None:
        """Cancel ``loop`` (an executor's, running this processor) once its first prompt started; it must end."""
        task = asyncio.ensure_future(loop)
        while not self.started:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(10):
                await task


async def test_an_executor_stops_after_a_prompt_that_lost_its_cancel():
    processor, outcomes = SwallowsACancel(), []

    async def on_outcome(job, outcome):
        outcomes.append(outcome)

    await processor.cancel_once_started(LocalExecutor(NoOptions()).run(iter(range(6)), processor, on_outcome, 1))
    assert processor.swallowed.is_set() and processor.started == [0] and outcomes == ["out-0"]


async def test_a_worker_stops_after_a_prompt_that_lost_its_cancel():
    from hermes_batch.executors.worker import PromptWorker

    worker = PromptWorker.__new__(PromptWorker)  # its consumers alone, around a processor that loses a cancel
    processor, emitted = SwallowsACancel(), []
    worker.processor, worker.emit, worker.queue, worker.failed = processor, emitted.append, asyncio.Queue(), False
    worker.runtimes = {}
    worker.lease([(i, i) for i in range(6)])
    await processor.cancel_once_started(worker._consume())
    assert processor.started == [0] and emitted == [("outcome", 0, "out-0")]
