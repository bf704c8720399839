"""--allocation adaptive: rows stop at --target_passes passes or --max_failures failures in a row, the
uncertain rows get samples first, statistics.json says how the data is skewed, and a resume reaches the same
decisions from the records without paying for a sample twice."""

from __future__ import annotations

import collections
import json
import re

import pytest

from hermes_batch.run.adaptive import FAILURES, SPENT, TARGET, Allocation, Rule, uncertainty
from hermes_batch.testing import PassRateScript, write_dataset
from hermes_batch.testing.fixtures import wait_for

ADAPTIVE = ("--verifier", "answer", "--samples_per_prompt", "8", "--allocation", "adaptive",
            "--target_passes", "2", "--max_failures", "3", "--batch_size", "2")


def rate_of(prompt: str) -> float:
    return float(re.search(r"rate=([0-9.]+)", prompt).group(1))


def rows(rates) -> list[dict]:
    return [{"prompt": f"Question {i}, rate={rate}", "answer": "42"} for i, rate in enumerate(rates)]


def samples_by_row(runner, run_name=None) -> dict:
    records = runner.records("trajectories.jsonl", run_name)
    records += [d["trajectory"] for d in runner.records("discarded.jsonl", run_name)]
    out = collections.defaultdict(list)
    for record in sorted(records, key=lambda r: (r["prompt_index"], r["metadata"]["sample_index"])):
        out[record["prompt_index"]].append((record["metadata"]["sample_index"], record["metadata"]["passed"]))
    return dict(out)


def test_the_rule_stops_at_the_target_or_after_failures_in_a_row():
    rule = Rule(target_passes=2, max_failures=3)
    assert rule.settled([True, False, True], more=True) == TARGET
    assert rule.settled([True, False, False, False], more=True) == FAILURES
    assert rule.settled([False, False, True, False, False], more=True) is None  # the failures are not in a row
    assert rule.settled([False, True], more=False) == SPENT
    assert Rule(1, None).settled([False] * 20, more=True) is None
    # a fresh row is the least certain; a mixed row more than a uniform one of as many samples
    assert uncertainty([]) > uncertainty([True, False]) > uncertainty([True, True])


def test_open_rows_waiting_are_served_most_uncertain_first():
    class Row:
        def __init__(self, index):
            self.prompt_index = index

    allocation = Allocation(Rule(3, None), iter([Row(0), Row(1), Row(2)]), lambda i: (), lambda i: range(5), window=2)
    assert [allocation.take()[:2] for _ in range(2)] == [(allocation.open[0].row, 0), (allocation.open[1].row, 0)]
    allocation.ended(0, 0, True), allocation.wait(0)
    allocation.ended(1, 0, True), allocation.wait(1)
    row, sample, opened = allocation.take()  # the window is full: an open row before a fresh one
    assert (row.prompt_index, sample, opened) == (0, 1, False)
    allocation.ended(0, 1, False), allocation.wait(0)  # row 0: pass, fail; row 1: pass
    assert allocation.take()[:2] == (allocation.open[1].row, 1)  # fewer samples: the less certain
    allocation.ended(1, 1, True), allocation.wait(1)  # row 1: pass, pass
    assert allocation.take()[:2] == (allocation.open[0].row, 2)  # as many samples, mixed: the less certain


def test_adaptive_rows_stop_at_their_target_or_after_failures_and_statistics_say_so(runner, model_server, tmp_path):
    runner.server = model_server(PassRateScript(rate_of))
    dataset = write_dataset(tmp_path / "d.jsonl", rows([1.0, 0.0, 1.0, 0.0, 0.5]))
    result = runner.invoke(dataset, *ADAPTIVE)
    assert result.exit_code == 0, result.output
    by_row = samples_by_row(runner)
    assert [s for s, _p in by_row[0]] == [0, 1] and all(p for _s, p in by_row[0])  # two passes: capped
    assert [s for s, _p in by_row[1]] == [0, 1, 2] and not any(p for _s, p in by_row[1])  # three failures
    assert len(by_row[2]) == 2 and len(by_row[3]) == 3
    assert 2 <= len(by_row[4]) <= 8
    allocation = json.loads((runner.folder() / "statistics.json").read_text())["allocation"]
    assert allocation["rows"] == 5 and allocation["rows_never_passed"] == 2
    assert allocation["rows_capped"] >= 2 and allocation["rows_stopped_early"] >= 2
    assert allocation["samples"] == sum(len(v) for v in by_row.values())
    assert allocation["samples_saved"] == 5 * 8 - allocation["samples"]
    assert allocation["samples_per_row"]["2"] >= 2 and allocation["samples_per_row"]["3"] >= 2
    assert runner.server.sessions_for(rows([1.0])[0]["prompt"]) == 2


def test_a_fixed_allocation_runs_every_sample(runner, model_server, tmp_path):
    runner.server = model_server(PassRateScript(rate_of))
    dataset = write_dataset(tmp_path / "d.jsonl", rows([1.0, 0.0]))
    result = runner.invoke(dataset, "--verifier", "answer", "--samples_per_prompt", "4")
    assert result.exit_code == 0, result.output
    assert [len(v) for v in samples_by_row(runner).values()] == [4, 4]
    assert "allocation" not in json.loads((runner.folder() / "statistics.json").read_text())


def test_a_run_the_budget_stopped_resumes_to_the_same_decisions_without_paying_twice(runner, model_server, tmp_path):
    rates = [1.0, 0.0, 0.5, 0.7, 0.2, 1.0]
    dataset = write_dataset(tmp_path / "d.jsonl", rows(rates))
    whole = model_server(PassRateScript(rate_of, seed=3))
    assert runner.invoke(dataset, *ADAPTIVE, server=whole, run_name="whole").exit_code == 0
    cut = model_server(PassRateScript(rate_of, seed=3))  # the same answers, one server for both sessions
    first = runner.invoke(dataset, *ADAPTIVE, "--max_cost", "0.004", "--num_workers", "2", server=cut,
                          run_name="cut")
    assert first.exit_code == 0 and "was reached" in first.output, first.output
    before = samples_by_row(runner, "cut")
    assert sum(map(len, before.values())) < sum(map(len, samples_by_row(runner, "whole").values()))
    sessions_before = cut.request_count
    result = runner.invoke(dataset, "--resume", "--max_cost", "none", server=cut, run_name="cut")
    assert result.exit_code == 0, result.output
    assert samples_by_row(runner, "cut") == samples_by_row(runner, "whole")
    # every sample's one model call, once: the resume paid only for the samples the first session had not run
    assert cut.request_count - 2 == whole.request_count - 1  # less one preflight each
    assert sessions_before < cut.request_count


def test_a_killed_adaptive_run_resumes_without_running_a_finished_sample_again(runner, model_server, tmp_path, procs):
    prompts = rows([1.0, 0.0] * 10)
    dataset = write_dataset(tmp_path / "d.jsonl", prompts)
    first = model_server(PassRateScript(rate_of, delay=0.05))
    proc = runner.spawn(dataset, *ADAPTIVE, "--num_workers", "4", server=first)
    procs.append(proc)
    folder = runner.folder()

    def finished() -> int:
        return sum(len(p.read_text().splitlines()) for p in folder.glob("batch_*.jsonl"))

    wait_for(lambda: finished() >= 12, 60, "12 finished samples", proc)
    proc.kill()
    proc.communicate(timeout=30)
    before = samples_by_row(runner)
    second = model_server(PassRateScript(rate_of))
    result = runner.invoke(dataset, "--resume", server=second)
    assert result.exit_code == 0, result.output
    after = samples_by_row(runner)
    for index, prompt in enumerate(prompts):
        assert [s for s, _p in after[index]] == list(range(2 if rate_of(prompt["prompt"]) else 3)), index
        settled = len(before.get(index, ())) == len(after[index])
        if settled:
            assert second.calls_for(prompt["prompt"]) == 0, f"row {index} was settled before the kill but ran again"


def test_adaptive_needs_samples_a_verifier_and_not_stop_on_success(runner, model_server, tmp_path):
    runner.server = model_server(PassRateScript(rate_of))
    dataset = write_dataset(tmp_path / "d.jsonl", rows([1.0]))
    said = runner.invoke(dataset, "--verifier", "answer", "--allocation", "adaptive").output
    assert "add --samples_per_prompt K" in said
    said = runner.invoke(dataset, "--samples_per_prompt", "3", "--allocation", "adaptive").output
    assert "--allocation adaptive needs a verifier" in said
    said = runner.invoke(dataset, "--verifier", "answer", "--samples_per_prompt", "3", "--allocation", "adaptive",
                         "--stop_on_success").output
    assert "use --target_passes 1 instead" in said
    said = runner.invoke(dataset, "--verifier", "answer", "--samples_per_prompt", "3", "--allocation", "adaptive",
                         "--target_passes", "4").output
    assert "--target_passes 4 is more than the 3 samples" in said
    assert runner.server.request_count == 0
