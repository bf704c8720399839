"""The run's indexes (record_index.py, rowkeys.py) and the merge that does only what changed (merge.py).

Runs go through the real CLI against the scripted model server; the
statistics a session builds from the indexes are compared with the reference
that reads every record (statistics.scan_records), on runs with resumes,
duplicated rows, failures and discards.
"""

from __future__ import annotations

import array
import json
import os
from collections import Counter
from pathlib import Path

import pytest

from hermes_batch.folder import record_index, rowkeys
from hermes_batch.folder.record_index import RecordIndex
from hermes_batch.default_plugins.jsonl_writer import JsonlWriter
from hermes_batch.contract.interfaces import Writer
from hermes_batch.folder.merge import merge_run
from hermes_batch.formats.records import SessionInfo
from hermes_batch.folder.runfolder import RunFolder
from hermes_batch.formats.serialization import from_json
from hermes_batch.folder.statistics import RunInfo, build_statistics
from hermes_batch.testing import Reply, RoutedScript, ToolLoopScript

from hermes_batch.testing import write_dataset

FAST = ToolLoopScript(tool_calls=1)
NO_REASONING = ToolLoopScript(tool_calls=1, reasoning=None)
BASE = ("--distribution", "terminal_only", "--seed", "7")


def _always_500(_request):
    return Reply(status=500, headers={"Retry-After": "0"}, error_message="upstream exploded")


def rows(prompts) -> list[dict]:
    return [{"prompt": p} for p in prompts]


def human(record: dict) -> str:
    record = record.get("trajectory", record)
    return next(turn["value"] for turn in record["conversations"] if turn["from"] == "human")


def stats_both_ways(folder: Path) -> tuple[dict, dict]:
    """statistics.json's content built from the indexes and by reading every record, with the run's own inputs."""
    checkpoint = json.loads((folder / "checkpoint.json").read_text())
    written = json.loads((folder / "statistics.json").read_text())
    # the provider guard's live figures (per provider, this session) are the running engine's, not the records'
    written.pop("provider_guard", None)
    run_folder = RunFolder(folder.parent, folder.name)
    kwargs = dict(
        filters_run=tuple(written["discarded_by_filter"]),
        sessions=tuple(from_json(s, SessionInfo) for s in checkpoint["sessions"]),
        invalid_skipped_total=written["prompts"]["skipped_invalid"],
        now=written["completed_at"],
        run=RunInfo(model=written["model"], distribution=written["distribution"], batch_size=written["batch_size"],
                    total_prompts=written["total_prompts"],
                    total_lines=json.loads((folder / "run.json").read_text())["dataset"]["lines"]),
    )
    index = RecordIndex(run_folder)
    aggregate, finish_times, _batches = index.totals()
    from_index = build_statistics(run_folder, totals=(aggregate, finish_times), journal=index.journal_totals(),
                                  **kwargs)
    reference = build_statistics(run_folder, **kwargs)
    assert from_index == written  # what the session wrote is what its indexes say now
    return from_index, reference


def test_statistics_from_the_indexes_equal_a_full_scan_across_resumes_duplicates_failures_and_discards(
    tmp_path, runner, model_server
):
    good = [f"good {i}: list the files" for i in range(9)]
    unreasoned = [f"no reasoning {i}: list the files" for i in range(3)]
    failing = [f"flaky {i}: list the files" for i in range(2)]
    # duplicates of a kept, a discarded and a failing prompt
    dataset = good[:4] + unreasoned + [good[0], failing[0]] + good[4:] + [failing[1], unreasoned[0], failing[0]]
    data = write_dataset(tmp_path / "data.jsonl", rows(dataset))

    def route(broken: bool):
        def script(prompt):
            if prompt in unreasoned:
                return NO_REASONING
            if prompt in failing and broken:
                return _always_500
            return FAST
        return RoutedScript(script)

    folder = runner.folder()
    result = runner.invoke(data, *BASE, "--max_samples", "9", server=model_server(route(True)))
    assert result.exit_code == 3, result.output
    from_index, reference = stats_both_ways(folder)
    assert from_index == reference
    assert reference["prompts"]["failed"] == 1 and reference["prompts"]["discarded"] == 3

    result = runner.invoke(data, *BASE, "--resume", "--max_samples", "all", server=model_server(route(True)))
    assert result.exit_code == 3, result.output
    from_index, reference = stats_both_ways(folder)
    assert from_index == reference
    assert reference["prompts"]["failed"] == 3

    recovered = model_server(route(False))
    result = runner.invoke(data, *BASE, "--resume", server=recovered)
    assert result.exit_code == 0, result.output
    assert {p for p in set(dataset) if recovered.calls_for(p)} == set(failing)
    from_index, reference = stats_both_ways(folder)
    assert from_index == reference
    assert reference["prompts"] == {"finished": len(dataset), "kept": len(dataset) - 4, "discarded": 4,
                                    "failed": 0, "skipped_invalid": 0}
    assert reference["failures"]["records"] == 4  # 1 + 3: the failing rows, attempt after attempt


def finished_run(tmp_path, runner, model_server, count=12, *extra):
    prompts = [f"task {i}: list the files" for i in range(count)]
    data = write_dataset(tmp_path / "data.jsonl", rows(prompts))
    result = runner.invoke(data, *BASE, *extra, server=model_server(FAST))
    assert result.exit_code == 0, result.output
    return prompts, data


def assert_merged_once(runner, prompts) -> None:
    merged = runner.records("trajectories.jsonl")
    assert Counter(human(t) for t in merged) == Counter(prompts)
    indexes = [t["prompt_index"] for t in merged]
    assert indexes == sorted(indexes)


@pytest.mark.parametrize("damage", ["missing", "torn", "garbage", "behind", "other file", "no folder"])
def test_a_damaged_or_stale_index_is_built_again_and_nothing_finished_runs_again(
    tmp_path, runner, model_server, damage
):
    prompts, data = finished_run(tmp_path, runner, model_server)
    folder = runner.folder()
    expected, _ = stats_both_ways(folder)
    index_file = folder / "index" / "batch_1.json"
    if damage == "missing":
        index_file.unlink()
    elif damage == "torn":  # an index write cut off (the atomic replace makes this a hand-made case)
        index_file.write_bytes(index_file.read_bytes()[:100])
    elif damage == "garbage":
        index_file.write_bytes(b"\x00" * 64)
    elif damage == "behind":  # a session killed after writing records but before saving their index
        text = json.loads(index_file.read_text())
        batch = (folder / "batch_1.jsonl").read_bytes()
        first = batch.index(b"\n") + 1
        stale = record_index.FileIndex(folder / "batch_1.jsonl", "kept")
        stale.catch_up(first)
        stale.edges = record_index.edges(folder / "batch_1.jsonl", first)
        index_file.write_text(stale.to_json())
        assert json.loads(index_file.read_text())["covered"] < text["covered"]
    elif damage == "other file":
        os.replace(folder / "index" / "batch_0.json", index_file)
    elif damage == "no folder":  # a run folder of a version before the indexes
        for path in (folder / "index").iterdir():
            path.unlink()
        (folder / "index").rmdir()
    second = model_server(FAST)
    result = runner.invoke(data, *BASE, "--resume", server=second)
    assert result.exit_code == 0, result.output
    assert second.request_count == 0
    from_index, reference = stats_both_ways(folder)
    assert from_index == reference
    drop = ("completed_at", "timestamps", "duration", "duration_seconds", "model_requests")
    assert {k: v for k, v in from_index.items() if k not in drop} == {k: v for k, v in expected.items() if k not in drop}
    assert_merged_once(runner, prompts)


def test_an_index_write_cut_off_leaves_the_old_index_and_the_resume_catches_up(tmp_path, runner, model_server,
                                                                               monkeypatch):
    prompts, data = finished_run(tmp_path, runner, model_server, 10, "--max_samples", "7")
    folder = runner.folder()

    class Crash(BaseException):
        pass

    real = record_index.atomic_write_text

    def crash_on_batch_index(path, text):
        if Path(path).name == "batch_1.json":
            # what a kill in the middle of the write leaves: a temporary file, the old index in place
            (Path(path).parent / ".batch_1.json.partial.tmp").write_text(text[: len(text) // 2])
            raise Crash()
        real(path, text)

    monkeypatch.setattr(record_index, "atomic_write_text", crash_on_batch_index)
    with pytest.raises(Crash):
        runner.invoke(data, *BASE, "--resume", "--max_samples", "all", server=model_server(FAST))
    monkeypatch.setattr(record_index, "atomic_write_text", real)
    third = model_server(FAST)
    result = runner.invoke(data, *BASE, "--resume", server=third)
    assert result.exit_code == 0, result.output
    assert third.request_count == 0  # the three prompts of the cut-off session are found in batch_1.jsonl
    from_index, reference = stats_both_ways(folder)
    assert from_index == reference
    assert reference["prompts"]["kept"] == 10
    assert_merged_once(runner, prompts)


def test_a_resume_that_adds_batches_appends_them_to_the_merged_output(tmp_path, runner, model_server):
    prompts = [f"task {i}: list the files" for i in range(15)]
    data = write_dataset(tmp_path / "data.jsonl", rows(prompts))
    result = runner.invoke(data, *BASE, "--max_samples", "10", server=model_server(FAST))
    assert result.exit_code == 0, result.output
    merged = runner.folder() / "trajectories.jsonl"
    before = merged.read_bytes()
    inode = merged.stat().st_ino
    result = runner.invoke(data, *BASE, "--resume", "--max_samples", "all", server=model_server(FAST))
    assert result.exit_code == 0, result.output
    assert merged.stat().st_ino == inode  # extended in place, not written again
    assert merged.read_bytes().startswith(before)
    assert_merged_once(runner, prompts)


def test_a_merge_cut_off_is_completed_by_the_next_resume(tmp_path, runner, model_server, monkeypatch):
    prompts = [f"task {i}: list the files" for i in range(20)]
    data = write_dataset(tmp_path / "data.jsonl", rows(prompts))
    result = runner.invoke(data, *BASE, "--max_samples", "7", server=model_server(FAST))
    assert result.exit_code == 0, result.output

    class Crash(BaseException):
        pass

    real = JsonlWriter.append
    calls = []

    def append_then_crash(self, path, trajectories):
        calls.append(path)
        if len(calls) == 2:  # the second new batch: half a line written, then the process dies
            with open(path, "a") as handle:
                handle.write('{"prompt_index": 1')
            raise Crash()
        real(self, path, trajectories)

    monkeypatch.setattr(JsonlWriter, "append", append_then_crash)
    with pytest.raises(Crash):
        runner.invoke(data, *BASE, "--resume", "--max_samples", "all", server=model_server(FAST))
    monkeypatch.setattr(JsonlWriter, "append", real)
    assert not (runner.folder() / "trajectories.jsonl").read_bytes().endswith(b"\n")
    last = model_server(FAST)
    result = runner.invoke(data, *BASE, "--resume", server=last)
    assert result.exit_code == 0, result.output
    assert last.request_count == 0
    assert_merged_once(runner, prompts)


def test_a_changed_earlier_batch_rewrites_from_that_batch_on(tmp_path):
    folder = RunFolder(tmp_path, "run")
    folder.create()
    records = _copies()

    def add(batch: int, line: bytes) -> None:
        with open(folder.batch_path(batch), "ab") as handle:
            handle.write(line)

    for batch in range(3):
        add(batch, records[batch])
    first = merge_run(folder, [JsonlWriter()])
    assert (first.appended, first.rewritten) == (0, 3)
    unchanged = merge_run(folder, [JsonlWriter()])
    assert (unchanged.appended, unchanged.rewritten) == (0, 0)
    add(1, records[3])  # a retried prompt lands in batch 1
    changed = merge_run(folder, [JsonlWriter()])
    assert changed.appended == 2  # batches 1 and 2 again, batch 0 kept as it was
    merged = [json.loads(line) for line in (folder.trajectories).read_bytes().splitlines()]
    assert [t["prompt_index"] for t in merged] == [0, 5, 6, 10]


def test_a_writer_that_cannot_append_writes_everything_only_when_something_changed(tmp_path):
    folder = RunFolder(tmp_path, "run")
    folder.create()
    records = _copies()

    class Counting(Writer):
        name = "counting"
        writes = 0

        def write(self, run_dir, trajectories):
            Counting.writes += 1
            Path(run_dir, "counted.txt").write_text(str(sum(1 for _ in trajectories)))
            return "counted.txt"

    with open(folder.batch_path(0), "ab") as handle:
        handle.write(records[0])
    merge_run(folder, [Counting()])
    merge_run(folder, [Counting()])
    assert Counting.writes == 1
    with open(folder.batch_path(1), "ab") as handle:
        handle.write(records[1])
    merge_run(folder, [Counting()])
    assert Counting.writes == 2
    assert (folder.dir / "counted.txt").read_text() == "2"


def _copies() -> list[bytes]:
    """Lines of kept records at prompt indexes 0, 5, 10, 6 (batch size 5) with distinct prompts and keys."""
    from hermes_batch.formats.records import Metadata, ToolStat, Trajectory, Turn, content_key
    from hermes_batch.formats.serialization import to_json_line

    lines = []
    for index in (0, 5, 10, 6):
        prompt = f"prompt {index}"
        meta = Metadata(index // 5, "2026-01-01T00:00:00", "m", content_key(prompt, None, None))
        traj = Trajectory(index, (Turn("human", prompt), Turn("gpt", "<think>x</think>done")), meta, True, False, 1,
                          ("terminal",), {"terminal": ToolStat(1, 1, 0)}, {"terminal": 0})
        lines.append(to_json_line(traj).encode())
    return lines


def test_the_row_plan_counts_duplicates_and_keeps_the_multiset_at_8_bytes_a_prompt():
    keys = rowkeys.RowKeys()
    for index, prompt in enumerate(["a", "b", "a", "a", "c"]):
        keys.add(index, {"prompt": prompt})
    finished = array.array("Q", sorted([keys.digests[0], keys.digests[0], keys.digests[4]]))
    plan = rowkeys.match_finished(keys, finished)
    assert list(plan.left) == [1, 3]  # the third "a" and "b" still run
    assert (plan.finished, plan.skipped, plan.unmatched) == (3, 3, 0)
    assert finished.itemsize == 8


def test_once_final_the_batch_files_can_go_and_a_resume_runs_only_new_prompts(tmp_path, runner, model_server):
    prompts, data = finished_run(tmp_path, runner, model_server, 10)
    folder = runner.folder()
    for path in folder.glob("batch_*.jsonl"):
        path.unlink()
    more = prompts + [f"task {i}: list the files" for i in range(10, 15)]
    data = write_dataset(tmp_path / "data.jsonl", rows(more))
    second = model_server(FAST)
    result = runner.invoke(data, *BASE, "--resume", server=second)
    assert result.exit_code == 0, result.output
    assert {p for p in more if second.calls_for(p)} == set(more[10:])  # the deleted batches' prompts stay done
    assert_merged_once(runner, more)  # the new batch appended to what the output held
    assert json.loads((folder / "statistics.json").read_text())["prompts"]["kept"] == 15


@pytest.mark.parametrize("client", ["openai", "anthropic"])
def test_a_resume_with_nothing_left_imports_no_model_sdk(tmp_path, runner, model_server, client):
    # importing an SDK takes one to three seconds, a large share of a finished million-prompt run's resume
    extra = ("--model_client", client)
    _prompts, data = finished_run(tmp_path, runner, model_server, 10, *extra)
    server = model_server(FAST)
    child = runner.spawn(data, *BASE, *extra, "--resume", server=server, env={"PYTHONPROFILEIMPORTTIME": "1"})
    _out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
    assert "hermes_batch.run.runner" in imported  # the profile is there
    assert not imported & {"openai", "anthropic"}
    assert server.request_count == 0
