"""Rewards after the run (issue 31, items 3 and 4): the verified filter, pass@k and the reward statistics,
and the exports made of a row's samples (dpo pairs, rollouts), from run folders of hand-written records."""

import itertools
from collections import Counter
import json
import random
import re

import datasets
import pytest
from rich.console import Console

from hermes_batch.folder.aggregate import Aggregate
from hermes_batch.folder.runfolder import RunFolder
from hermes_batch.folder.statistics import _row_rewards, build_statistics, pass_at_k, render_statistics, scan_records
from hermes_batch.formats.records import content_key
from hermes_batch.testing import make_filter
from hermes_batch.testing import read_jsonl as lines
from hermes_batch.testing import run_cli as hb
from reward_rig import ROWS, rewarded, rewarded_samples, sample, write  # noqa: F401 (fixture)


# --- pass@k ----------------------------------------------------------------------------------------------------


def brute_force_pass_at_k(outcomes, k):
    """Over every k-subset of a row's samples, the share holding a pass; averaged over the rows."""
    shares = []
    for row in outcomes:
        subsets = list(itertools.combinations(row, k))
        shares.append(sum(any(s) for s in subsets) / len(subsets))
    return sum(shares) / len(shares)


def test_pass_at_k_matches_a_brute_force_count():
    rng = random.Random(31)
    outcomes = [[rng.random() < 0.3 for _ in range(8)] for _ in range(40)]
    result = _row_rewards(Counter((len(row), sum(row)) for row in outcomes))
    for k in range(1, 9):
        assert result["pass_at_k"][str(k)] == pytest.approx(brute_force_pass_at_k(outcomes, k), abs=1e-6)
        assert result["pass_at_k_rows"][str(k)] == 40
    assert result["rows_never_passed"] == sum(not any(row) for row in outcomes)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0 and pass_at_k(4, 1, 1) == 0.25


def test_rows_with_fewer_samples_count_as_passed_within_k_only_when_they_passed():
    # --stop_on_success: a row that passed at its first sample stopped there; one that never passed ran all 4
    result = _row_rewards(Counter([(1, 1), (4, 0), (3, 1)]))
    assert result["pass_at_k"]["1"] == pytest.approx((1 + 0 + 1 / 3) / 3, abs=1e-6)
    assert result["pass_at_k"]["4"] == pytest.approx(2 / 3, abs=1e-6)  # the 1- and 3-sample rows passed within 4
    assert result["pass_at_k_rows"]["4"] == 3
    assert _row_rewards(Counter([(2, 0), (4, 1)]))["pass_at_k_rows"]["4"] == 1  # a 2-sample row without a pass says nothing of 4


# --- statistics --------------------------------------------------------------------------------------------------


def test_reward_statistics_of_a_run(rewarded):
    stats = build_statistics(rewarded)
    rewards = stats["rewards"]
    assert rewards["samples_scored"] == 13
    assert rewards["samples_verified"] == 12 and rewards["samples_unverified"] == 1
    assert rewards["samples_passed"] == 4
    assert rewards["reward_mean"] == pytest.approx(5.0 / 12, abs=1e-6)
    assert rewards["reward_histogram"]["0.0"] == 6
    assert rewards["reward_histogram"]["0.5"] == 2
    assert rewards["reward_histogram"]["0.9"] == 4  # the bucket of 0.9 up to 1.0 inclusive
    assert sum(rewards["reward_histogram"].values()) == 12
    assert rewards["rows"] == 4 and rewards["rows_never_passed"] == 2 and rewards["share_rows_never_passed"] == 0.5
    outcomes = [[r == 1.0 for r in ROWS[i]] for i in ROWS]
    assert rewards["pass_at_k"]["1"] == pytest.approx(brute_force_pass_at_k(outcomes, 1), abs=1e-6)
    # k = 3 and 4: rows 0, 1, 3 have the samples; row 2 (2 samples) passed within them
    assert rewards["pass_at_k_rows"]["3"] == 4 and rewards["pass_at_k_rows"]["4"] == 3
    per = rewards["by_toolsets"]
    assert set(per) == {"terminal", "file"}
    assert per["terminal"]["samples"] == 7 and per["terminal"]["passed"] == 3
    assert per["file"]["samples"] == 6 and per["file"]["passed"] == 1 and per["file"]["rows_never_passed"] == 3


def test_reward_totals_add_up_in_any_order(rewarded):
    whole, _times = scan_records(rewarded)
    parts = []
    for traj in rewarded_samples():
        part = Aggregate()
        part.add(traj)
        parts.append(part)
    random.Random(3).shuffle(parts)
    merged = Aggregate()
    for part in parts:
        merged.merge(Aggregate.from_state(json.loads(json.dumps(part.to_state()))))
    assert merged.rewards.rows and merged.rewards.rows == whole.rewards.rows
    assert merged.rewards.toolset_rows == whole.rewards.toolset_rows
    assert merged.rewards.to_state()["buckets"] == whole.rewards.to_state()["buckets"]
    assert merged.rewards.reward_sum.value == whole.rewards.reward_sum.value


def test_runs_without_verifiers_have_no_reward_section(tmp_path):
    folder = RunFolder(tmp_path, "plain")
    folder.create()
    write(folder.batch_path(0), sample(0, "a", 0), sample(1, "b", 0))
    stats = build_statistics(folder)
    assert stats["rewards"] is None
    assert scan_records(folder)[0].to_state()["rewards"] is None  # nothing of rewards in the indexes either
    console = Console(record=True, width=160)
    render_statistics(stats, console)
    assert "pass@" not in console.export_text() and "Reward" not in console.export_text()


def test_the_summary_shows_pass_at_k_and_the_reward_distribution(rewarded):
    console = Console(record=True, width=200)
    render_statistics(build_statistics(rewarded), console)
    text = console.export_text()
    assert "pass@1" in text and "pass@4" in text
    assert "Reward distribution" in text and "0.9-1.0" in text
    assert "2 (50.0%)" in text  # rows that never passed
    assert "1 sample(s) whose verifier failed" in text
    # per toolsets: "file" was offered to samples 1 and 3 of each row; of its 6, one (row 2's) passed
    assert re.search(r"file\s+6\s+1\s+4\s+3 \(75\.0%\)", text)
    assert re.search(r"terminal\s+7\s+3\s+4\s+2 \(50\.0%\)", text)


def test_the_pass_at_k_table_fits_an_80_column_terminal(rewarded):
    """`hermes-batch stats | less` renders 80 columns wide: no header or number of pass@1..4 is cut short."""
    console = Console(record=True, width=80)
    render_statistics(build_statistics(rewarded), console)
    text = console.export_text()
    assert "…" not in text.split("Verified samples")[1].split("Reward distribution")[0]
    assert "2 (50.0%)" in text and "Toolsets" in text and "Samples" in text


# --- the verified filter ------------------------------------------------------------------------------------------


def test_verified_filter_keeps_what_passed_by_the_runs_mark_or_a_given_one():
    plain = make_filter("verified")
    half = make_filter("verified:0.5")
    passed, failed = sample(0, "a", 0, 1.0), sample(0, "a", 1, 0.0)
    partial = sample(0, "a", 2, 0.5)  # the run's --min_reward was 1.0: not passed
    lenient = sample(0, "a", 3, 0.5, passed=True)  # a run with --min_reward 0.5
    broken = sample(0, "a", 4, 0.0, error="timed out after 60 s")
    unverified = sample(0, "a", 5)
    assert plain.check(passed) is None and plain.check(lenient) is None
    assert "below the run's --min_reward" in plain.check(failed)
    assert "below the run's --min_reward" in plain.check(partial)
    assert "command failed" in plain.check(broken)
    assert plain.check(unverified) == "no verifier ran on it"
    assert half.check(partial) is None and half.check(passed) is None
    assert "below 0.5" in half.check(failed)
    assert half.check(broken) is not None and half.check(unverified) is not None


def test_refilter_with_verified_moves_the_failing_samples(tmp_path):
    folder = RunFolder(tmp_path / "out", "all-kept")
    folder.create()
    write(folder.batch_path(0), *rewarded_samples())
    result = hb("refilter", folder.dir, "--filter", "verified", "--json")
    data = json.loads(result.output)
    assert data["kept"] == 4 and data["discarded"] == 9
    kept = lines(folder.batch_path(0))
    assert all(r["metadata"]["passed"] for r in kept)
    data = json.loads(hb("refilter", folder.dir, "--filter", "verified:0.5", "--json").output)
    assert data["kept"] == 6  # the two 0.5 samples of row 3 come back


# --- exports ------------------------------------------------------------------------------------------------------


def load(path, tmp_path):
    return datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))


def test_dpo_pairs_come_from_one_row_and_load_in_datasets(rewarded, tmp_path):
    out = tmp_path / "dpo.jsonl"
    result = hb("export", rewarded.dir, "--format", "dpo:pairs_per_row=0", "--output", out)
    pairs = lines(out)
    assert len(pairs) == 2  # row 0: two passes, two fails; rows 1 and 3 have no pass, row 2 no fail
    assert "2 pairs" in result.output
    assert "rows with no passing sample: 2" in result.output and "rows with no failing sample: 1" in result.output
    samples = {(t.prompt_index, t.metadata.sample_index): t for t in rewarded_samples()}
    used = set()
    for pair in pairs:
        assert pair["prompt_index"] == 0 and pair["content_key"] == content_key("task 0", None, None)
        assert pair["prompt"][-1] == {"role": "user", "content": "task 0"}
        good = samples[(0, pair["chosen_sample_index"])]
        bad = samples[(0, pair["rejected_sample_index"])]
        assert good.metadata.passed and not bad.metadata.passed
        assert pair["chosen"][-1]["content"].endswith(f"answer 0.{pair['chosen_sample_index']}")
        assert pair["rejected"][-1]["content"].endswith(f"answer 0.{pair['rejected_sample_index']}")
        assert pair["chosen_reward"] == 1.0 and pair["rejected_reward"] == 0.0
        used |= {pair["chosen_sample_index"], pair["rejected_sample_index"]}
    assert used == {0, 1, 2, 3}  # each sample in one pair at most
    ds = load(out, tmp_path)
    assert ds.column_names[:3] == ["prompt", "chosen", "rejected"]
    assert ds[0]["chosen"][0]["role"] == "assistant"


def test_dpo_pairing_is_seeded(rewarded, tmp_path):
    def pairs(*args):
        hb("export", rewarded.dir, "--format", "dpo", "--output", tmp_path / "p.jsonl", *args)
        return [(p["chosen_sample_index"], p["rejected_sample_index"]) for p in lines(tmp_path / "p.jsonl")]

    first = pairs()
    assert len(first) == 1  # one pair a row by default
    assert pairs() == first and pairs("--seed", "0") == first
    seen = {tuple(pairs("--seed", str(seed))) for seed in range(12)}
    assert len(seen) > 1  # the seed chooses among the four possible pairs
    assert hb("export", rewarded.dir, "--format", "sharegpt", "--seed", "1", ok=False).exit_code != 0


def test_dpo_pairs_only_samples_offered_the_same_prompt(tmp_path):
    folder = RunFolder(tmp_path / "out", "two-prompts")
    folder.create()
    write(folder.batch_path(0),
          sample(0, "task", 0, 1.0, system="tools: terminal"), sample(0, "task", 1, 0.0, system="tools: file"),
          sample(1, "other", 0, 1.0, system="tools: file"), sample(1, "other", 1, 0.0, system="tools: terminal"),
          sample(1, "other", 2, 0.0, system="tools: file"))
    result = hb("export", folder.dir, "--format", "dpo", "--output", tmp_path / "d.jsonl")
    pairs = lines(tmp_path / "d.jsonl")
    assert [(p["prompt_index"], p["chosen_sample_index"], p["rejected_sample_index"]) for p in pairs] == [(1, 0, 2)]
    assert pairs[0]["prompt"][0]["content"].startswith("tools: file")
    assert pairs[0]["prompt"][1] == {"role": "user", "content": "other"}
    assert "different prompts (tools offered): 1" in result.output


def test_rollouts_group_each_rows_samples_with_their_rewards(rewarded, tmp_path):
    out = tmp_path / "rollouts.jsonl"
    result = hb("export", rewarded.dir, "--format", "rollouts", "--output", out)
    groups = lines(out)
    assert "4 rows" in result.output
    assert [g["prompt_index"] for g in groups] == [0, 1, 2, 3]
    for group in groups:
        expected = [0.0 if r == "error" else r for r in ROWS[group["prompt_index"]]]
        assert group["prompt"] == f"task {group['prompt_index']}"
        assert [s["sample_index"] for s in group["samples"]] == list(range(len(expected)))
        assert group["rewards"] == expected == [s["reward"] for s in group["samples"]]
        assert group["passed"] == sum(r == 1.0 for r in expected)
        for s in group["samples"]:
            assert s["messages"][1] == {"role": "user", "content": group["prompt"]}
            assert s["messages"][-1]["content"].endswith(f"answer {group['prompt_index']}.{s['sample_index']}")
    assert groups[3]["samples"][2]["verified"] is False
    ds = load(out, tmp_path)
    assert ds.num_rows == 4 and ds[0]["samples"][0]["messages"][0]["role"] == "system"
    # kept only: what --include kept asks for
    hb("export", rewarded.dir, "--format", "rollouts", "--include", "kept", "--output", tmp_path / "kept.jsonl")
    assert [len(g["samples"]) for g in lines(tmp_path / "kept.jsonl")] == [2, 2]


def test_the_reward_is_in_the_sharegpt_openai_and_parquet_exports(rewarded, tmp_path):
    hb("export", rewarded.dir, "--format", "sharegpt", "--include", "all", "--output", tmp_path / "s.jsonl")
    records = lines(tmp_path / "s.jsonl")
    assert sorted(r["metadata"]["reward"] for r in records) == sorted(
        0.0 if r == "error" else r for rewards in ROWS.values() for r in rewards)
    ds = load(tmp_path / "s.jsonl", tmp_path)
    assert ds.features["metadata"]["reward"].dtype == "float64"
    hb("export", rewarded.dir, "--format", "openai:reward=keep", "--include", "all", "--output", tmp_path / "o.jsonl")
    openai = lines(tmp_path / "o.jsonl")
    assert len(openai) == 13 and {type(o["reward"]) for o in openai} == {float}
    assert sum(o["passed"] for o in openai) == 4
    hb("export", rewarded.dir, "--format", "openai", "--output", tmp_path / "plain.jsonl")
    assert "reward" not in lines(tmp_path / "plain.jsonl")[0]  # OpenAI's fine-tuning takes no other key
    pq = pytest.importorskip("pyarrow.parquet")
    hb("export", rewarded.dir, "--format", "parquet", "--include", "all", "--output", tmp_path / "p.parquet")
    table = pq.read_table(tmp_path / "p.parquet").to_pylist()
    assert sorted(r["metadata"]["reward"] for r in table) == sorted(r["metadata"]["reward"] for r in records)
    assert {v["name"] for r in table for v in json.loads(r["metadata"]["verifiers"])} == {"command"}


def test_a_rows_samples_keep_together_in_one_split_though_each_has_a_key_of_its_own(rewarded, tmp_path):
    assert len({t.metadata.content_key for t in rewarded_samples()}) == 13  # as a run keys samples
    hb("export", rewarded.dir, "--format", "sharegpt", "--include", "all", "--split", "validation=0.5",
       "--output", tmp_path / "split")
    train, validation = lines(tmp_path / "split" / "train.jsonl"), lines(tmp_path / "split" / "validation.jsonl")
    assert train and validation
    assert not {r["prompt_index"] for r in train} & {r["prompt_index"] for r in validation}
    hb("export", rewarded.dir, "--format", "rollouts", "--split", "validation=0.5", "--output", tmp_path / "groups")
    groups = lines(tmp_path / "groups" / "train.jsonl") + lines(tmp_path / "groups" / "validation.jsonl")
    assert sorted(len(g["samples"]) for g in groups) == [2, 3, 4, 4]
    assert {g["content_key"] for g in groups} == {content_key(f"task {i}", None, None) for i in ROWS}


# --- through a real run -------------------------------------------------------------------------------------------


def test_a_run_with_a_verifier_keeps_what_passed_and_its_statistics_pairs_and_groups_follow(tmp_path, model_server):
    from hermes_batch.testing import Reply, RoutedScript, run_shapes

    # every row: samples 0 and 2 answer right, 1 and 3 wrong
    right = lambda request: Reply(content="The answer is 4", reasoning="2 + 2.")  # noqa: E731
    wrong = lambda request: Reply(content="The answer is 5", reasoning="2 + 3?")  # noqa: E731
    server = model_server(RoutedScript(lambda sample: right if sample % 2 == 0 else wrong, by="sample"))
    rows = [{"prompt": f"What is 2 + 2? (task {n})", "answer": 4} for n in range(3)]
    folder = run_shapes(tmp_path, server, rows, extra=["--verifier", "answer", "--samples_per_prompt", "4",
                                                       "--filter", "verified"])
    kept = lines(folder / "batch_0.jsonl")
    assert len(kept) == 6 and all(r["metadata"]["passed"] and r["metadata"]["sample_index"] % 2 == 0 for r in kept)
    assert len(lines(folder / "discarded.jsonl")) == 6
    stats = json.loads((folder / "statistics.json").read_text())
    rewards = stats["rewards"]
    assert rewards["samples_passed"] == 6 and rewards["rows"] == 3 and rewards["rows_never_passed"] == 0
    assert rewards["pass_at_k"]["1"] == 0.5 and rewards["pass_at_k"]["2"] == pytest.approx(5 / 6, abs=1e-6)
    assert "pass@4" in hb("stats", folder).output

    hb("export", folder, "--format", "dpo", "--output", tmp_path / "dpo.jsonl")
    pairs = lines(tmp_path / "dpo.jsonl")
    assert len(pairs) == 3 and len({p["prompt_index"] for p in pairs}) == 3
    for pair in pairs:
        assert pair["chosen"][-1]["content"].endswith("The answer is 4")
        assert pair["rejected"][-1]["content"].endswith("The answer is 5")
        assert pair["prompt"][-1]["content"] == rows[pair["prompt_index"]]["prompt"]
    hb("export", folder, "--format", "rollouts", "--output", tmp_path / "rollouts.jsonl")
    groups = lines(tmp_path / "rollouts.jsonl")
    assert [g["rewards"] for g in groups] == [[1.0, 0.0, 1.0, 0.0]] * 3
    hb("refilter", folder, "--filter", "verified:0.0")
    assert len(lines(folder / "batch_0.jsonl")) == 12
