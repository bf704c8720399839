import json

import pytest
from rich.console import Console

from hermes_batch.formats.records import (
    Discarded,
    Failure,
    Metadata,
    SessionInfo,
    ToolStat,
    Trajectory,
    Turn,
    Usage,
    content_key,
)
from hermes_batch.folder.durable import AppendLog
from hermes_batch.folder.runfolder import RunFolder
from hermes_batch.formats.serialization import to_json_line
from hermes_batch.formats.conversation import reasoning_counts
from hermes_batch.folder.statistics import RunInfo, build_statistics, render_statistics

DAY1 = "2026-01-01T10:00:00"
DAY2 = "2026-01-02T10:00:00"
SESSIONS = (
    SessionInfo("2026-01-01T09:00:00", duration_s=100.0, prompts_run=6),
    SessionInfo("2026-01-02T09:00:00", duration_s=50.5, prompts_run=3, invalid_skipped=7),
)


def key(prompt: str) -> str:
    return content_key(prompt, None, None)


def traj(index, prompt, *, gpt=("<think>r</think>ok",), tools=None, ts=DAY1, usage=None, api_calls=1,
         completed=True, partial=False) -> Trajectory:
    tools = tools or {}
    conv = (Turn("system", "sys"), Turn("human", prompt)) + tuple(Turn("gpt", v) for v in gpt)
    meta = Metadata(index // 10, ts, "m", key(prompt), usage=usage)
    errors = {name: stat.failure for name, stat in tools.items()}
    return Trajectory(index, conv, meta, completed, partial, api_calls, (), tools, errors)


def fail(index, prompt, kind, ts) -> Failure:
    return Failure(index, key(prompt), index // 10, "Error", kind, "it broke", ts)


def write(path, *records) -> None:
    log = AppendLog(path)
    for record in records:
        log.append_sync(to_json_line(record))
    log.close()


@pytest.fixture
def folder(tmp_path) -> RunFolder:
    folder = RunFolder(tmp_path, "stats-run")
    folder.create()
    # session 1: a and dup(#1) kept, c and e discarded; b, x and dup(#2) failed
    # session 2: b finished, x failed again
    write(folder.batch_path(0),
          traj(0, "a", gpt=("<think>1</think>", "<think>2</think>done"), api_calls=2,
               tools={"terminal": ToolStat(2, 1, 1), "read_file": ToolStat(1, 1, 0)},
               usage=Usage(100, 20, reasoning_tokens=5, cost=0.01)),
          traj(5, "dup"))
    write(folder.batch_path(1),
          traj(11, "b", gpt=("<think>t</think>", "no think"), ts=DAY2, api_calls=3, completed=False, partial=True,
               tools={"terminal": ToolStat(1, 1, 0)}, usage=Usage(50, 10)))
    write(folder.discarded,
          Discarded(traj(2, "c", gpt=("plain",), tools={"terminal": ToolStat(1, 0, 1)}), ("no-reasoning",),
                    ("no reasoning",)),
          Discarded(traj(3, "e", gpt=(" <think>late</think>",), tools={"made_up": ToolStat(1, 0, 1)}),
                    ("no-reasoning", "hallucinated-tools"), ("no reasoning", "called made_up")))
    write(folder.failed,
          fail(11, "b", "model_endpoint", DAY1),
          fail(12, "x", "model_endpoint", DAY1),
          fail(6, "dup", "model_endpoint", DAY1),
          fail(12, "x", "sandbox", DAY2))
    return folder


def build(folder, **kwargs):
    kwargs.setdefault("filters_run", ("no-reasoning", "hallucinated-tools", "other"))
    return build_statistics(folder, sessions=SESSIONS, invalid_skipped_total=7, **kwargs)


def test_reasoning_counts():
    assert reasoning_counts(traj(0, "p", gpt=("<think>a</think>x", "x", "<think>", " <think>")).conversations) == (2, 2)
    assert reasoning_counts(traj(0, "p", gpt=()).conversations) == (0, 0)


def test_prompt_counts_and_failures_across_sessions(folder):
    stats = build(folder)
    assert stats["schema_version"] == 1
    assert stats["run_name"] == "stats-run"
    # b failed then finished: not failed; x failed twice: one prompt; dup: one copy still failed
    assert stats["prompts"] == {"finished": 5, "kept": 3, "discarded": 2, "failed": 2, "skipped_invalid": 7}
    assert stats["failures"] == {"prompts": 2, "by_kind": {"model_endpoint": 1, "sandbox": 1}, "records": 4}
    assert stats["discarded_by_filter"] == {"hallucinated-tools": 1, "no-reasoning": 2, "other": 0}


def test_tool_usage_kept_and_all_finished(folder):
    stats = build(folder)
    kept = stats["kept"]["tool_usage"]
    assert kept == {
        "made_up": {"count": 0, "success": 0, "failure": 0, "success_rate": None, "failure_rate": None},
        "read_file": {"count": 1, "success": 1, "failure": 0, "success_rate": 1.0, "failure_rate": 0.0},
        "terminal": {"count": 3, "success": 2, "failure": 1, "success_rate": 0.6667, "failure_rate": 0.3333},
    }
    every = stats["finished"]["tool_usage"]
    assert every["terminal"] == {"count": 4, "success": 2, "failure": 2, "success_rate": 0.5, "failure_rate": 0.5}
    assert every["made_up"] == {"count": 1, "success": 0, "failure": 1, "success_rate": 0.0, "failure_rate": 1.0}


def test_the_seed_tools_run_level_fields_are_there(folder):
    """Scripts written for the seed's statistics.json read the same names, with its percent rates."""
    run = RunInfo(model="m/x", distribution="default", batch_size=10, total_prompts=23, total_lines=25)
    stats = build(folder, run=run, now="2026-01-03T00:00:00")
    assert {k: stats[k] for k in ("run_name", "distribution", "total_prompts", "total_batches", "batch_size", "model",
                                  "completed_at", "duration_seconds")} == {
        "run_name": "stats-run", "distribution": "default", "total_prompts": 23, "total_batches": 3, "batch_size": 10,
        "model": "m/x", "completed_at": "2026-01-03T00:00:00", "duration_seconds": 150.5,
    }
    assert stats["tool_statistics"]["terminal"] == {
        "count": 4, "success": 2, "failure": 2, "success_rate": 50.0, "failure_rate": 50.0,
    }
    assert stats["tool_statistics"]["made_up"] == {
        "count": 1, "success": 0, "failure": 1, "success_rate": 0.0, "failure_rate": 100.0,
    }
    assert stats["reasoning_statistics"] == {
        "total_assistant_turns": 7, "turns_with_reasoning": 4, "turns_without_reasoning": 3,
    }


def test_reasoning_coverage(folder):
    stats = build(folder)
    assert stats["finished"]["reasoning"] == {
        "assistant_turns": 7, "with_reasoning": 4, "without_reasoning": 3,
        "share_with_reasoning": 0.5714, "samples_without_reasoning": 2,
    }
    assert stats["kept"]["reasoning"] == {
        "assistant_turns": 5, "with_reasoning": 4, "without_reasoning": 1,
        "share_with_reasoning": 0.8, "samples_without_reasoning": 0,
    }


def test_completion_calls_tokens_cost_and_duration(folder):
    stats = build(folder, now="2026-01-03T00:00:00")
    assert (stats["finished"]["completed"], stats["finished"]["partial"]) == (4, 1)
    assert (stats["kept"]["completed"], stats["kept"]["partial"]) == (2, 1)
    assert stats["finished"]["model_calls"] == 8
    assert stats["kept"]["model_calls"] == 6
    assert stats["tokens"] == {"prompt": 150, "completion": 30, "reasoning": 5, "cached": 0, "total": 180,
                               "samples_reporting_usage": 2}
    assert stats["cost"] == 0.01
    assert stats["duration"]["total_s"] == 150.5
    assert [s["started_at"] for s in stats["duration"]["sessions"]] == [s.started_at for s in SESSIONS]
    assert stats["duration"]["sessions"][1]["invalid_skipped"] == 7
    assert stats["timestamps"] == {"generated_at": "2026-01-03T00:00:00", "started_at": SESSIONS[0].started_at,
                                   "first_sample_at": DAY1, "last_sample_at": DAY2}
    json.dumps(stats)  # statistics.json must be plain JSON


def test_cost_is_null_when_never_reported(tmp_path):
    folder = RunFolder(tmp_path, "r")
    folder.create()
    write(folder.batch_path(0), traj(0, "a", usage=Usage(10, 5)), traj(1, "b"))
    stats = build_statistics(folder)
    assert stats["cost"] is None
    assert stats["tokens"]["total"] == 15


def test_one_session_counts_every_failed_row(tmp_path):
    folder = RunFolder(tmp_path, "r")
    folder.create()
    write(folder.failed, fail(0, "a", "sandbox", DAY1), fail(1, "a", "sandbox", DAY1))
    stats = build_statistics(folder, sessions=SESSIONS[:1])
    assert stats["prompts"]["failed"] == 2


def test_empty_run(tmp_path):
    stats = build_statistics(RunFolder(tmp_path, "empty"), tool_names=("terminal",))
    assert stats["prompts"] == {"finished": 0, "kept": 0, "discarded": 0, "failed": 0, "skipped_invalid": 0}
    assert stats["kept"]["tool_usage"]["terminal"]["success_rate"] is None
    assert stats["finished"]["reasoning"]["share_with_reasoning"] is None
    console = Console(record=True, width=120)
    render_statistics(stats, console)
    assert "Prompts finished" in console.export_text()


def test_render_shows_the_tables(folder):
    console = Console(record=True, width=140)
    render_statistics(build(folder), console)
    text = console.export_text()
    for expected in ("Tool usage", "terminal", "66.7%", "Reasoning coverage", "57.1%", "no-reasoning",
                     "Failed prompts by kind", "sandbox", "$0.0100", "2m 30s over 2 session(s)"):
        assert expected in text


def test_the_tables_fit_80_columns_without_cutting_a_name_or_a_number(folder):
    """A pipe is 80 columns wide: `56.…` and `browser_c…` said nothing."""
    stats = build(folder)
    long_tools = {"browser_get_images": (123456, 70000, 53456), "mixture_of_agents": (9, 5, 4),
                  "vision_analyze": (0, 0, 0)}
    for scope in ("finished", "kept"):
        for name, (count, success, failure) in long_tools.items():
            stats[scope]["tool_usage"][name] = {"count": count, "success": success, "failure": failure,
                                                "success_rate": success / count if count else None,
                                                "failure_rate": failure / count if count else None}
    stats["discarded_by_filter"]["hermes-batch-filters:near-duplicates"] = 12
    stats["model_requests"]["by_provider"] = {"Google Vertex (europe-west1)": {
        "requests": 1000000, "errors": 3, "median_latency_s": 12.345}}
    console = Console(record=True, width=80)
    render_statistics(stats, console)
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for whole in ("browser_get_images", "mixture_of_agents", "56.7%", "123456", "Google Vertex (europe-west1)",
                  "hermes-batch-filters:near-duplicates", "1000000"):
        assert whole in text, whole
    assert "vision_analyze" not in text and "not called" in text  # listed in statistics.json, not in the table
