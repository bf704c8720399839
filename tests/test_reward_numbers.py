"""Rewards as numbers (issue 43, item 8): a reward's text read strictly, a verifier's reward checked to lie in
[0, 1], and every reader of run folders unharmed by records whose reward is none (1e308, NaN, strings)."""

from __future__ import annotations

import json
import math

import pytest

import hermes_batch
from hermes_batch.folder.aggregate import Aggregate
from hermes_batch.folder.record_index import RecordIndex
from hermes_batch.folder.runfolder import RunFolder
from hermes_batch.folder.statistics import build_statistics, rewards_section
from hermes_batch.formats.reward_numbers import (
    MAX_REWARD_CHARS, RewardTextError, checked_reward, parse_reward, stored_reward,
)
from hermes_batch.formats.serialization import to_json_line, trajectory_from_dict
from hermes_batch.testing import Reply, read_jsonl, write_dataset
from hermes_batch.testing import run_cli as hb
from hermes_batch.view.index import RunIndex
from hermes_batch.view.query import Query, run_query
from hermes_batch.view.report import write_report
from reward_rig import sample

# --- the text of a reward ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, reward", [
    ("1", 1.0), ("0", 0.0), ("0.75", 0.75), (".5", 0.5), ("1.", 1.0), ("00.250", 0.25), ("1.000", 1.0),
    ("0.3333333333333333", 0.3333333333333333), (" 0.5\n", 0.5), ("\t1\r\n", 1.0), (b"0.5\n", 0.5),
    ("0." + "9" * 30, 1.0),  # rounds to 1.0 as a float, but is not more than 1
])
def test_a_reward_text_is_plain_ascii_decimal(text, reward):
    assert parse_reward(text) == reward


@pytest.mark.parametrize("text, why", [
    ("1_0", "not a plain decimal number"),  # float() reads 10.0
    ("\u0661", "not a plain decimal number"),  # Arabic-Indic one: float() reads 1.0
    ("\uff11", "not a plain decimal number"),  # fullwidth one
    ("1" * 256, "256 characters, more than a reward's 40"),  # float() reads 1.1e255
    ("0." + "1" * MAX_REWARD_CHARS, "more than a reward's"),
    ("1e308", "not a plain decimal number"), ("1e-3", "not a plain decimal number"),
    ("nan", "not a plain decimal number"), ("inf", "not a plain decimal number"),
    ("Infinity", "not a plain decimal number"), ("0x1", "not a plain decimal number"),
    ("-0.5", "written without a sign"), ("+1", "written without a sign"), ("-0", "written without a sign"),
    ("1.5", "more than 1"), ("2", "more than 1"), ("1.00000000000000000001", "more than 1"),
    ("", "nothing"), ("  \n", "nothing"), (".", "not a plain decimal number"), ("1.0.0", "not a plain decimal"),
    ("1 0", "not a plain decimal number"), ("0.5\x1c", "not a plain decimal number"),  # str.strip() drops \x1c
    ("\u20030.5", "not a plain decimal number"), (b"\xd9\xa1", "not ASCII"), (b"1\xff", "not ASCII"),
    (1.0, "a float, not text"),
])
def test_anything_else_is_refused_with_the_reason(text, why):
    with pytest.raises(RewardTextError) as caught:
        parse_reward(text)
    assert why in str(caught.value)
    assert isinstance(caught.value, ValueError) and len(str(caught.value)) < 120


@pytest.mark.parametrize("value, reward", [(0, 0.0), (1, 1.0), (0.5, 0.5), (1.0, 1.0)])
def test_a_returned_reward_is_a_number_in_zero_to_one(value, reward):
    assert checked_reward(value) == reward and type(checked_reward(value)) is float
    assert stored_reward(value) == reward


@pytest.mark.parametrize("value", [1.5, -0.25, 1e308, -1e308, math.inf, math.nan, 10**400, -(10**400), True, False,
                                   "1", None, [1], {"reward": 1}])
def test_anything_else_is_no_reward(value):
    with pytest.raises(ValueError):
        checked_reward(value)
    assert stored_reward(value) is None


# --- a verifier's reward ------------------------------------------------------------------------------------------

GIVES = {"1.5": 1.5, "huge": 1e308, "negative": -0.25, "nan": math.nan, "true": True, "text": "1",
         "big int": 10**400, "half": 0.5}


class Gives(hermes_batch.Verifier):
    """Returns the reward the row's ``gives`` names."""

    name = "gives"

    async def verify(self, ctx):
        return hermes_batch.Verdict(GIVES[ctx.row.extra["gives"]], "as asked")


class GivesPlugin:
    @hermes_batch.hookimpl
    def register_verifiers(self, register):
        register(Gives)


def test_a_verifier_s_reward_outside_zero_to_one_is_an_error_and_the_sample_is_not_verified(
        runner, model_server, tmp_path):
    runner.plugins = (GivesPlugin(),)
    runner.server = model_server(lambda request: Reply(content="Done."))
    rows = [{"prompt": f"Task {name}", "gives": name} for name in GIVES]
    result = runner.invoke(write_dataset(tmp_path / "d.jsonl", rows), "--verifier", "gives", "--min_reward", "0")
    assert result.exit_code == 0, result.output
    records = runner.records("trajectories.jsonl") + [d["trajectory"] for d in runner.records("discarded.jsonl")]
    by_name = {json.loads(r["metadata"]["row"])["gives"]: r["metadata"] for r in records}
    assert set(by_name) == set(GIVES)
    for name, meta in by_name.items():
        (entry,) = json.loads(meta["verifiers"])
        if name == "half":
            assert (meta["reward"], meta["verified"], meta["passed"], entry["error"]) == (0.5, True, True, "")
            continue
        assert (meta["reward"], meta["verified"], meta["passed"]) == (0.0, False, False), name
        assert entry["reward"] == 0.0 and entry["error"].startswith("ValueError: it returned the reward "), entry
        assert "not a number" in entry["error"], entry
    assert "1.5, not a number in [0, 1]" in json.loads(by_name["1.5"]["verifiers"])[0]["error"]
    assert "a bool, not a number" in json.loads(by_name["true"]["verifiers"])[0]["error"]
    stats = json.loads((runner.folder() / "statistics.json").read_text())["rewards"]
    assert (stats["samples_scored"], stats["samples_verified"], stats["samples_passed"]) == (8, 1, 1)
    assert stats["reward_mean"] == 0.5


# --- records whose reward is none -------------------------------------------------------------------------------

# what a record's metadata.reward may hold, as JSON text: each but the last two claims a pass with no reward
HOSTILE = ["1e308", "1e308", "-1e308", '"NaN"', "NaN", "Infinity", "1" + "0" * 400, '"1"', "true", "5", "null",
           '{"a": 1}']


def hostile_line(index: int, sample_index: int, reward_json: str) -> str:
    """A record of row ``index`` claiming verified and passed, its reward the JSON text ``reward_json``."""
    line = to_json_line(sample(index, f"task {index}", sample_index, 1.0))
    data = json.loads(line)
    data["metadata"]["reward"] = "@REWARD@"
    return json.dumps(data, separators=(",", ":")).replace('"@REWARD@"', reward_json) + "\n"


@pytest.fixture
def hostile(tmp_path) -> RunFolder:
    """Row 0: twelve samples claiming a pass with no reward in [0, 1]; row 1: a pass at 1.0 and a fail at 0.0."""
    folder = RunFolder(tmp_path / "out", "hostile")
    folder.create()
    lines = [hostile_line(0, i, text) for i, text in enumerate(HOSTILE)]
    lines += [to_json_line(sample(1, "task 1", 0, 1.0)), to_json_line(sample(1, "task 1", 1, 0.0))]
    folder.batch_path(0).write_text("".join(lines))
    return folder


def test_a_record_whose_reward_is_no_number_in_zero_to_one_reads_as_not_verified():
    for text in HOSTILE:
        meta = trajectory_from_dict(json.loads(hostile_line(0, 0, text))).metadata
        assert (meta.reward, meta.verified, meta.passed) == (0.0, False, False), text
        # and is written so again: a refilter or an export does not carry the claim on
        assert '"reward":0.0,"verified":false,"passed":false' in to_json_line(trajectory_from_dict(
            json.loads(hostile_line(0, 0, text))))
    meta = trajectory_from_dict(json.loads(hostile_line(0, 0, "0.5"))).metadata
    assert (meta.reward, meta.verified, meta.passed) == (0.5, True, True)
    data = json.loads(hostile_line(0, 0, "1.0"))
    data["metadata"]["verified"] = False  # passed without being verified is no pass either
    assert trajectory_from_dict(data).metadata.passed is False


def test_statistics_of_hostile_records_count_them_as_not_verified(hostile):
    rewards = build_statistics(hostile)["rewards"]
    assert rewards["samples_scored"] == 14
    assert (rewards["samples_verified"], rewards["samples_unverified"], rewards["samples_passed"]) == (2, 12, 1)
    assert rewards["reward_mean"] == 0.5 and sum(rewards["reward_histogram"].values()) == 2
    assert set(rewards["reward_histogram"]) == {f"0.{i}" for i in range(10)}  # no "<0" or ">1"
    assert rewards["pass_at_k"]["1"] == pytest.approx((0 / 12 + 1 / 2) / 2)
    result = hb("stats", hostile.dir)
    assert "12 sample(s) whose verifier failed" in result.output


def test_the_commands_over_hostile_records_neither_crash_nor_overflow(hostile, tmp_path):
    html = write_report(hostile.dir).read_text()
    assert "1 / 14" in html and "inf" not in html.lower().replace("info", "")
    out = tmp_path / "rollouts.jsonl"
    hb("export", hostile.dir, "--format", "rollouts", "--output", out)
    groups = read_jsonl(out)
    assert groups[0]["rewards"] == [0.0] * 12 and groups[0]["mean_reward"] == 0.0 and groups[0]["passed"] == 0
    assert groups[1]["rewards"] == [1.0, 0.0]
    hb("export", hostile.dir, "--format", "dpo", "--output", tmp_path / "dpo.jsonl")
    assert [(p["prompt_index"], p["chosen_reward"]) for p in read_jsonl(tmp_path / "dpo.jsonl")] == [(1, 1.0)]
    hb("export", hostile.dir, "--format", "openai:reward=keep", "--output", tmp_path / "o.jsonl")
    assert {o["reward"] for o in read_jsonl(tmp_path / "o.jsonl")} == {0.0, 1.0}
    data = json.loads(hb("refilter", hostile.dir, "--filter", "verified", "--json").output)
    assert (data["kept"], data["discarded"]) == (1, 13)


def test_the_viewer_lists_hostile_records_as_not_verified(hostile):
    index = RunIndex(hostile.dir)
    try:
        index.refresh()
        assert run_query(index, Query(verdict="unverified"))["total"] == 12
        assert run_query(index, Query(verdict="passed"))["total"] == 1
        assert run_query(index, Query(min_reward=0.0))["total"] == 2
        best = run_query(index, Query(sort="reward", desc=True, limit=3))["rows"]
        assert [r["reward"] for r in best] == [1.0, 0.0, 0.0]
    finally:
        index.close()


def test_an_index_whose_rewards_no_records_could_give_is_built_again(hostile):
    RecordIndex(hostile).totals()  # builds and saves index/batch_0.json
    saved = hostile.dir / "index" / "batch_0.json"
    state = json.loads(saved.read_text())
    rewards = state["aggregate"]["rewards"]
    assert rewards["verified"] == 2
    # as an older version saved it: two rewards of 1e308 summed, a bucket above 1
    bad = Aggregate()
    bad.rewards.reward_sum.add(1e308)
    bad.rewards.reward_sum.add(1e308)
    rewards["reward_sum"] = [str(bad.rewards.reward_sum.scaled), True]
    rewards["buckets"][">1"] = 2
    saved.write_text(json.dumps(state))
    again = RecordIndex(hostile)
    stats = rewards_section(again.totals()[0].rewards)
    assert again.rebuilt == 1
    assert stats["reward_mean"] == 0.5 and ">1" not in stats["reward_histogram"]
    bad.rewards.scored = bad.rewards.verified = 2
    assert not bad.rewards.plausible()
    assert bad.rewards.mean() is None  # computed exactly: never a float overflow
    bad.rewards.forget_reward_sum()
    assert bad.rewards.mean() is None and rewards_section(bad.rewards)["reward_mean"] is None


def test_a_resume_under_stop_on_success_does_not_take_a_pass_without_a_reward(runner, model_server, tmp_path):
    """Both rows' only sample claims a pass at 1e308 (two such rewards overflowed the sum in every resume)."""
    runner.server = model_server(lambda request: Reply(content="The answer is 42.", reasoning="Six times seven."))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": f"Say 42 #{i}", "answer": 42} for i in range(2)])
    options = ("--verifier", "answer", "--samples_per_prompt", "3", "--stop_on_success")
    result = runner.invoke(dataset, *options)
    assert result.exit_code == 0, result.output
    tampered = 0
    for path in runner.folder().glob("*.jsonl"):  # the batch files and the merged output
        text = path.read_text()
        tampered += text.count('"reward":1.0')
        path.write_text(text.replace('"reward":1.0', '"reward":1e308'))
    assert tampered >= 2
    result = runner.invoke(dataset, *options, "--resume")
    assert result.exit_code == 0, result.output
    samples = sorted((r["prompt_index"], r["metadata"]["sample_index"], r["metadata"]["passed"])
                     for r in runner.records("trajectories.jsonl"))
    # each row's tampered sample reads as not verified, so its second sample ran and passed
    assert samples == [(0, 0, False), (0, 1, True), (1, 0, False), (1, 1, True)], samples
    stats = json.loads((runner.folder() / "statistics.json").read_text())["rewards"]
    assert (stats["samples_verified"], stats["samples_passed"], stats["reward_mean"]) == (2, 2, 1.0)
    assert hb("stats", runner.folder()).exit_code == 0
