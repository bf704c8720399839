"""--pilot: a stratified share of the rows runs, forecast.json foresees the whole run with 90% intervals, the
--resume after it runs only the other rows, and --max_cost auto takes its budget from the forecast."""

from __future__ import annotations

import json
import re

import pytest

from hermes_batch.run.forecast import wilson
from hermes_batch.run.pilot import stratum
from hermes_batch.formats.records import PromptRow
from hermes_batch.testing import PassRateScript, write_dataset


def rate_of(prompt: str) -> float:
    return float(re.search(r"rate=([0-9.]+)", prompt).group(1))


def dataset_rows(count: int) -> list[dict]:
    # two kinds of task: easy ones, long and hard ones (their prompts cost more tokens)
    out = []
    for i in range(count):
        hard = i % 4 == 0
        prompt = f"Question {i}, rate={0.2 if hard else 0.9}" + (" and more words" * 40 if hard else "")
        out.append({"prompt": prompt, "answer": "42", "kind": "hard" if hard else "easy"})
    return out


BASE = ("--verifier", "answer", "--batch_size", "10", "--num_workers", "4")


def read(runner, name: str) -> dict:
    return json.loads((runner.folder() / name).read_text())


def test_a_pilot_runs_a_stratified_share_forecasts_and_the_resume_runs_the_rest(runner, model_server, tmp_path):
    rows = dataset_rows(40)
    runner.server = model_server(PassRateScript(rate_of))
    dataset = write_dataset(tmp_path / "d.jsonl", rows)
    result = runner.invoke(dataset, *BASE, "--pilot", "0.2", "--pilot_by", "kind")
    assert result.exit_code == 0, result.output
    assert "Forecast of the whole run" in result.output and "--resume instead of --pilot" in result.output
    ran = {r["prompt_index"] for r in runner.records("trajectories.jsonl")}
    ran |= {d["trajectory"]["prompt_index"] for d in runner.records("discarded.jsonl")}
    assert len(ran) == 8  # 20% of 10 hard rows and of 30 easy ones: 2 + 6
    assert sum(rows[i]["kind"] == "hard" for i in ran) == 2
    forecast = read(runner, "forecast.json")
    figures = forecast["figures"]
    assert forecast["pilot"]["rows"] == 8 and forecast["pilot"]["rows_of_dataset"] == 40
    assert forecast["pilot"]["strata"] == 2
    for name in ("cost", "wall_s", "tokens_per_sample", "pass_rate", "keep_rate", "kept_per_dollar",
                 "verified_per_dollar"):
        assert figures[name]["low"] <= figures[name]["estimate"] <= figures[name]["high"], name
    assert set(figures["keep_rate_by_filter"]) == {"no-reasoning", "hallucinated-tools", "empty-answer"}
    assert forecast["max_cost_auto"] == figures["cost"]["high"]
    pilot_calls = runner.server.request_count

    result = runner.invoke(dataset, "--resume")
    assert result.exit_code == 0, result.output
    stats = read(runner, "statistics.json")
    assert stats["prompts"]["finished"] == 40
    assert runner.server.request_count - pilot_calls == 32 + 1  # the other rows and a preflight, nothing twice
    assert figures["cost"]["low"] * 0.5 <= stats["cost"] <= figures["cost"]["high"] * 1.5


def test_max_cost_auto_takes_the_forecast_s_upper_end_and_needs_one(runner, model_server, tmp_path):
    runner.server = model_server(PassRateScript(rate_of))
    dataset = write_dataset(tmp_path / "d.jsonl", dataset_rows(12))
    result = runner.invoke(dataset, *BASE, "--max_cost", "auto")
    assert result.exit_code == 2 and "run a pilot first" in result.output, result.output
    assert runner.server.request_count == 0
    said = runner.invoke(dataset, *BASE, "--pilot", "0.5", "--max_cost", "auto").output
    assert "run the pilot first, then --resume with --max_cost auto" in said
    assert runner.invoke(dataset, *BASE, "--pilot", "0.25", "--overwrite").exit_code == 0
    forecast = read(runner, "forecast.json")
    (runner.folder() / "forecast.json").write_text(json.dumps({**forecast, "max_cost_auto": 0.0}))
    result = runner.invoke(dataset, "--resume", "--max_cost", "auto")
    assert result.exit_code == 0 and "--max_cost 0 was reached" in result.output, result.output
    assert json.loads((runner.folder() / "run.json").read_text())["config"]["max_cost"] == "auto"
    (runner.folder() / "forecast.json").write_text('{"max_cost_auto": "lots"}')
    result = runner.invoke(dataset, "--resume", "--max_cost", "auto")
    assert result.exit_code == 2 and "no usable one" in result.output, result.output


def test_strata_are_toolsets_image_task_and_the_named_field():
    row = PromptRow(0, "p", 1, image="img:1", extra={"task": "swe", "lang": "go"})
    assert stratum(row, ("terminal",), "lang") == 'terminal | img:1 | "swe" | "go"'
    assert stratum(row, (), None) == '(no toolsets) | img:1 | "swe"'


def test_wilson_intervals_hold_the_rate_and_stay_in_range():
    assert wilson(0, 0) is None
    all_passed = wilson(10, 10)
    assert all_passed["estimate"] == 1.0 and all_passed["high"] == 1.0 and 0.7 < all_passed["low"] < 0.9
    half = wilson(50, 100)
    assert half["low"] == pytest.approx(0.5 - 0.0815, abs=0.002) and half["high"] == pytest.approx(0.5 + 0.0815, abs=0.002)
