"""hermes-batch refilter: round trips, the audit, statistics, resume afterwards, and SIGKILL at every stage."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from hermes_batch.cli import cli
from hermes_batch.formats.records import Trajectory
from hermes_batch.offline.refilter import AUDIT, STAGING
from hermes_batch.folder.statistics import iter_finished
from hermes_batch.folder.runfolder import RunFolder
from hermes_batch.formats.serialization import from_json
from hermes_batch.testing.fixtures import TEST_API_KEY
from hermes_batch.testing import SHAPES, ShapeScript, run_shapes, shape_rows
from hermes_batch.testing import read_jsonl as lines
from hermes_batch.testing import run_cli as hb
from hermes_batch.testing.run_folders import run_args
from hermes_batch_filters import FinalAnswerFilter

from hermes_batch.run.selection import DEFAULT_FILTERS

SEED_FILTERS = [word for name in DEFAULT_FILTERS for word in ("--filter", name)]  # those the run applied
STRICTER = SEED_FILTERS + ["--filter", "final-answer"]


def kept_set(run_dir):
    return {r["prompt_index"] for p in sorted(run_dir.glob("batch_*.jsonl")) for r in lines(p)}


def discarded_map(run_dir):
    return {r["trajectory"]["prompt_index"]: (tuple(r["filters"]), tuple(r["reasons"])) for r in lines(run_dir / "discarded.jsonl")}


def snapshot(run_dir):
    names = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("batch_")) + ["discarded.jsonl", "trajectories.jsonl"]
    return {name: (run_dir / name).read_bytes() for name in names}


def check_consistent(run_dir, kept, discarded):
    """Every finished prompt exactly once, in the set expected, and the merged file and statistics agree."""
    assert kept_set(run_dir) == kept
    assert set(discarded_map(run_dir)) == discarded
    batch_lines = sum(len(lines(p)) for p in run_dir.glob("batch_*.jsonl"))
    assert batch_lines == len(kept)  # no record doubled
    assert len(lines(run_dir / "discarded.jsonl")) == len(discarded)
    assert [r["prompt_index"] for r in lines(run_dir / "trajectories.jsonl")] == sorted(kept)
    stats = json.loads((run_dir / "statistics.json").read_text())
    assert stats["prompts"]["kept"] == len(kept) and stats["prompts"]["discarded"] == len(discarded)
    assert not (run_dir / STAGING).exists()


@pytest.fixture
def run_dir(shapes_run_dir):
    """A copy of the module's finished run of every shape (conftest), which the test may change."""
    return shapes_run_dir


def test_the_same_filters_change_nothing(run_dir):
    before = snapshot(run_dir)
    result = hb("refilter", run_dir, *SEED_FILTERS)
    assert "moved 0 kept -> discarded and 0 discarded -> kept" in result.output
    assert snapshot(run_dir) == before
    audit = lines(run_dir / AUDIT)
    assert [a["type"] for a in audit] == ["refilter"]
    assert audit[0]["filters"] == list(DEFAULT_FILTERS)


def test_a_stricter_filter_moves_exactly_what_it_rejects(run_dir):
    kept_before, discarded_before = kept_set(run_dir), discarded_map(run_dir)
    rejects = {
        traj.prompt_index
        for p in run_dir.glob("batch_*.jsonl")
        for traj in (from_json(r, Trajectory) for r in lines(p))
        if FinalAnswerFilter().check(traj) is not None
    }
    assert rejects and rejects < kept_before  # the cut samples (the empty answers are discarded by default)
    result = hb("refilter", run_dir, *STRICTER)
    assert f"moved {len(rejects)} kept -> discarded and 0 discarded -> kept" in result.output
    check_consistent(run_dir, kept_before - rejects, set(discarded_before) | rejects)
    now = discarded_map(run_dir)
    for index in rejects:
        assert now[index][0] == ("final-answer",)
    for index, (names, reasons) in discarded_before.items():
        # what stays discarded keeps its reasons (an empty answer is also no final answer: both filters say so)
        assert now[index][0][:len(names)] == names and now[index][1][:len(reasons)] == reasons
    moves = [a for a in lines(run_dir / AUDIT) if a["type"] == "move"]
    assert {m["prompt_index"] for m in moves} == rejects
    assert all(m["from"] == "kept" and m["to"] == "discarded" and m["reasons"] for m in moves)
    stats = json.loads((run_dir / "statistics.json").read_text())
    empty = {i for i, (names, _r) in discarded_before.items() if names == ("empty-answer",)}
    assert empty and stats["discarded_by_filter"]["final-answer"] == len(rejects) + len(empty)  # both filters say so

    # and back: the seed filters alone restore the run as it was
    hb("refilter", run_dir, *SEED_FILTERS)
    check_consistent(run_dir, kept_before, set(discarded_before))
    assert discarded_map(run_dir) == discarded_before


def test_a_looser_filter_brings_discarded_records_back(run_dir):
    kept_before, discarded_before = kept_set(run_dir), discarded_map(run_dir)
    back = {i for i, (names, _r) in discarded_before.items() if "hallucinated-tools" not in names}
    assert {names for i, (names, _r) in discarded_before.items() if i in back} == {("no-reasoning",), ("empty-answer",)}
    hb("refilter", run_dir, "--filter", "hallucinated-tools")
    check_consistent(run_dir, kept_before | back, set(discarded_before) - back)
    hb("refilter", run_dir, "--no_filters")
    check_consistent(run_dir, kept_before | set(discarded_before), set())


def test_dry_run_changes_nothing_and_says_what_would_move(run_dir):
    before = snapshot(run_dir)
    result = hb("refilter", run_dir, *STRICTER, "--dry_run", "--json")
    data = json.loads(result.output)
    assert data["dry_run"] and data["moved_to_discarded"] > 0
    assert all(m["to"] == "discarded" and m["filters"] == ["final-answer"] for m in data["moves"])
    assert snapshot(run_dir) == before
    assert not (run_dir / AUDIT).exists()


def test_bad_refilter_input_is_one_sentence(run_dir, tmp_path):
    for args, message in [
        ([], "Give the filters"),
        (["--filter", "nope"], "Unknown --filter 'nope'"),
        (["--filter", "max-tool-errors:2"], "max_share must be between 0 and 1"),
        (["--filter", "max-tool-errors:0.5,0.6"], "only the first option may be a bare value"),
        (["--filter", "length:@" + str(tmp_path / "missing.toml")], "cannot read the options file"),
    ]:
        result = hb("refilter", run_dir, *args, ok=False)
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output


def test_options_file_and_named_options(run_dir, tmp_path):
    (tmp_path / "length.toml").write_text("max_chars = 1\n")
    result = hb("refilter", run_dir, "--filter", f"length:@{tmp_path / 'length.toml'}", "--dry_run")
    assert f"would move {len(kept_set(run_dir))} kept -> discarded" in result.output
    result = hb("refilter", run_dir, "--filter", "length:max_chars=1,min_chars=0", "--dry_run")
    assert f"would move {len(kept_set(run_dir))} kept -> discarded" in result.output


def test_resume_after_refilter_runs_no_finished_prompt(tmp_path, model_server):
    server = model_server(script=ShapeScript())
    rows = shape_rows(SHAPES, 2)
    folder = run_shapes(tmp_path, server, rows)
    calls = server.request_count
    hb("refilter", folder, *STRICTER)
    kept, discarded = kept_set(folder), set(discarded_map(folder))
    result = CliRunner().invoke(cli, run_args(tmp_path / "run.jsonl", tmp_path / "out", "run", server.base_url,
                                              TEST_API_KEY, ["--resume"] + STRICTER), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert server.request_count == calls  # not even the preflight: nothing was left to run
    check_consistent(folder, kept, discarded)


def test_stats_prints_the_table_again_and_json(run_dir):
    result = hb("stats", run_dir)
    assert "Prompts finished" in result.output and "Discarded by filter" in result.output
    data = json.loads(hb("stats", run_dir, "--json").output)
    assert data == json.loads((run_dir / "statistics.json").read_text())


def test_stats_rebuilds_when_statistics_json_is_missing(run_dir):
    expected = json.loads((run_dir / "statistics.json").read_text())
    (run_dir / "statistics.json").unlink()
    result = hb("stats", run_dir)
    assert "rebuilt from the run folder" in result.output
    data = json.loads(hb("stats", run_dir, "--json").output)
    assert data["prompts"] == expected["prompts"] and data["kept"] == expected["kept"]
    assert data["discarded_by_filter"] == expected["discarded_by_filter"]
    assert not (run_dir / "statistics.json").exists()  # stats never writes


# --- SIGKILL at each stage of a refilter, then a re-run finishes the job ----------------------------------------

KILLER = r"""
import os, signal, sys, types
import hermes_batch.offline.refilter as r

def die(*_a, **_k):
    os.kill(os.getpid(), signal.SIGKILL)

point = sys.argv[1]
if point == "staging":  # the staged files are written, the plan (commit point) is not
    close = r._Writers.close
    r._Writers.close = lambda self: (close(self), die())
elif point == "committed":
    r._switch = die
elif point == "mid-switch":  # one file of several moved in
    real = os.replace
    def replace(a, b):
        real(a, b)
        die()
    import hermes_batch.folder.unfinished as u  # moves a committed refilter's files in, for a resume too
    u.os = types.SimpleNamespace(**{**vars(os), "replace": replace})
elif point == "before-rebuild":
    r._rebuild = die
from hermes_batch.cli import main
main(sys.argv[2:])
"""


def kill_refilter(point, run_dir, *args):
    proc = subprocess.run([sys.executable, "-c", KILLER, point, "refilter", str(run_dir), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr


@pytest.mark.parametrize("point", ["staging", "committed", "mid-switch", "before-rebuild"])
def test_refilter_killed_at_any_stage_is_finished_by_running_it_again(run_dir, point):
    kept_before, discarded_before = kept_set(run_dir), set(discarded_map(run_dir))
    expected = hb("refilter", run_dir, *STRICTER, "--dry_run", "--json")
    rejects = {m["prompt_index"] for m in json.loads(expected.output)["moves"]}
    kill_refilter(point, run_dir, *STRICTER)
    for path in [*run_dir.glob("batch_*.jsonl"), run_dir / "discarded.jsonl"]:
        lines(path)  # every file still parses
    hb("refilter", run_dir, *STRICTER)
    check_consistent(run_dir, kept_before - rejects, discarded_before | rejects)
    moves = [a for a in lines(run_dir / AUDIT) if a["type"] == "move"]
    assert sorted(m["prompt_index"] for m in moves) == sorted(rejects)  # each move audited once


def test_a_resume_finishes_a_killed_refilter_and_pays_for_nothing(tmp_path, model_server):
    server = model_server(script=ShapeScript())
    folder = run_shapes(tmp_path, server, shape_rows(SHAPES, 2))
    kept_before, discarded_before = kept_set(folder), set(discarded_map(folder))
    rejects = {m["prompt_index"] for m in json.loads(hb("refilter", folder, *STRICTER, "--dry_run", "--json").output)["moves"]}
    kill_refilter("mid-switch", folder, *STRICTER)
    calls = server.request_count
    result = CliRunner().invoke(cli, run_args(tmp_path / "run.jsonl", tmp_path / "out", "run", server.base_url,
                                              TEST_API_KEY, ["--resume"] + STRICTER), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert server.request_count == calls
    check_consistent(folder, kept_before - rejects, discarded_before | rejects)
    assert sum(1 for _ in iter_finished(RunFolder(folder.parent, folder.name))) == len(kept_before | discarded_before)


def test_export_refuses_a_folder_with_an_unfinished_refilter(run_dir):
    kill_refilter("committed", run_dir, *STRICTER)
    result = hb("export", run_dir, "--format", "sharegpt", ok=False)
    assert result.exit_code == 2 and "run 'hermes-batch refilter' on it again" in result.output


def test_refilter_waits_for_no_run_it_takes_the_run_folders_lock(run_dir):
    lock_module = pytest.importorskip("hermes_batch.folder.lock", reason="the run-folder lock of issue 7 is not on this branch")
    before = snapshot(run_dir)
    lock = lock_module.RunFolderLock(run_dir)
    lock.acquire()
    try:
        result = hb("refilter", run_dir, *STRICTER, ok=False)
    finally:
        lock.release()
    assert result.exit_code == 2 and "in use by another run" in result.output
    assert snapshot(run_dir) == before
    hb("refilter", run_dir, *STRICTER)


def test_a_refilter_drops_the_indexes_of_the_files_it_rewrote_and_a_resume_counts_from_them(
        tmp_path, model_server, monkeypatch):
    import hermes_batch.folder.merge
    from hermes_batch.folder import record_index

    server = model_server(script=ShapeScript())
    folder = run_shapes(tmp_path, server, shape_rows(SHAPES, 2))
    index_dir = folder / record_index.INDEX_DIR
    indexed = {p.name for p in index_dir.iterdir()}
    assert {"batch_0.json", "discarded.json", "merged.json"} <= indexed  # as the run left them
    seen = []
    merge_run = hermes_batch.folder.merge.merge_run

    def merge_after_the_switch(run_folder, writers, *args, **kwargs):
        # the files are switched: no index may still describe the records as they were
        seen.append({p.name for p in index_dir.iterdir()})
        return merge_run(run_folder, writers, *args, **kwargs)

    monkeypatch.setattr(hermes_batch.folder.merge, "merge_run", merge_after_the_switch)
    hb("refilter", folder, *STRICTER)
    [left] = seen
    assert not {name for name in left if name.startswith(("batch_", "discarded", "merged"))}, left
    kept, discarded = kept_set(folder), set(discarded_map(folder))
    calls = server.request_count
    result = CliRunner().invoke(cli, run_args(tmp_path / "run.jsonl", tmp_path / "out", "run", server.base_url,
                                              TEST_API_KEY, ["--resume"] + STRICTER), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert server.request_count == calls
    check_consistent(folder, kept, discarded)  # statistics.json of the resume came from the indexes built again
    index = record_index.RecordIndex(RunFolder(folder.parent, folder.name))
    total, _times, _batches = index.totals()
    assert total.kept.samples == len(kept) and total.discarded == len(discarded)
