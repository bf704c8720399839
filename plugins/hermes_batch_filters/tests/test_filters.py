"""The filters of hermes-batch-filters on real runs against the scripted model server, and near-duplicates."""

import json
import random

import pytest

import hermes_batch
from hermes_batch import RunFilter, trajectory_from_dict
from hermes_batch.testing import SHAPES, ShapeScript, answer_for, make_filter, run_shapes, shape_rows
from hermes_batch.testing import read_jsonl as lines
from hermes_batch.testing import run_cli as hb
from hermes_batch_filters.minhash import MinHasher, band_layout


@pytest.fixture
def shapes_run(tmp_path, model_server):
    server = model_server(script=ShapeScript())
    return run_shapes(tmp_path, server, shape_rows(SHAPES, 1), extra=["--no_filters"])


def verdicts(run_dir, *specs):
    """prompt text -> the reasons the filters give, for every record of the run."""
    pm = hermes_batch.get_plugin_manager()
    chosen = [make_filter(spec, pm) for spec in specs]
    out = {}
    for record in lines(run_dir / "trajectories.jsonl"):
        traj = trajectory_from_dict(record)
        out[traj.conversations[1].value] = [r for f in chosen if (r := f.check(traj)) is not None]
    return out


def test_the_plugin_registers_every_filter():
    names = hermes_batch.get_plugin_manager().registry().names("filters")
    for name in ("max-tool-errors", "min-tool-calls", "final-answer", "repetition", "length", "near-duplicates"):
        assert name in names


def test_max_tool_errors(shapes_run):
    found = verdicts(shapes_run, "max-tool-errors")
    assert found["[fail] task 0"] == ["2 of 3 tool calls failed (67%, above 50%)"]
    assert found["[unknown] task 0"] == ["1 of 1 tool calls failed (100%, above 50%)"]
    assert [p for p, r in found.items() if r] == ["[fail] task 0", "[unknown] task 0"]
    assert verdicts(shapes_run, "max-tool-errors:0.7")["[fail] task 0"] == []


def test_min_tool_calls(shapes_run):
    found = verdicts(shapes_run, "min-tool-calls:2")
    assert found["[notool] task 0"] == ["0 tool call(s), fewer than 2"]
    assert found["[unknown] task 0"] == ["1 tool call(s), fewer than 2"]
    assert found["[ok] task 0"] == [] and found["[loop] task 0"] == []


def test_final_answer(shapes_run):
    found = verdicts(shapes_run, "final-answer")
    assert found["[cut] task 0"] == ["ended by max_turns, not by a final answer"]
    assert found["[empty] task 0"] == ["the final answer is empty"]
    assert [p for p, r in found.items() if r] == ["[cut] task 0", "[empty] task 0"]
    assert verdicts(shapes_run, "final-answer:min_chars=30")["[ok] task 0"] == [
        f"the final answer has {len(answer_for('[ok] task 0'))} characters, fewer than 30"
    ]


def test_repetition(shapes_run):
    found = verdicts(shapes_run, "repetition")
    assert found["[loop] task 0"] == ["called terminal with the same arguments 4 times in a row"]
    assert [p for p, r in found.items() if r] == ["[loop] task 0"]
    assert verdicts(shapes_run, "repetition:5")["[loop] task 0"] == []


def test_length(shapes_run):
    found = verdicts(shapes_run, "length:max_chars=600")
    long = {p for p, r in found.items() if r}
    assert "[long] task 0" in long and "[dup] task 0" in long and "[notool] task 0" not in long
    assert found["[long] task 0"][0].endswith("characters, more than 600")
    found = verdicts(shapes_run, "length:min_tokens=1000000")
    assert all(r and r[0].endswith("completion tokens, fewer than 1000000") for r in found.values())


def test_whole_run_filters_are_refused_by_run(tmp_path, model_server):
    server = model_server(script=ShapeScript())
    result = hb(
        "run", "--dataset_file", tmp_path / "x.jsonl", "--batch_size", "2", "--run_name", "r",
        "--output_dir", tmp_path / "out", "--api_key", "k", "--base_url", server.base_url,
        "--filter", "near-duplicates", ok=False,
    )
    assert result.exit_code == 2
    assert "apply it afterwards with 'hermes-batch refilter'" in result.output
    assert server.request_count == 0


# --- near-duplicates -----------------------------------------------------------------------------------------


def test_minhash_estimates_jaccard():
    hasher = MinHasher(num_perm=256)
    rng = random.Random(7)
    words = [f"w{rng.randrange(10**6)}" for _ in range(400)]
    edited = list(words)
    for i in range(0, 400, 40):
        edited[i] = "changed"
    a, b = hasher.shingles(" ".join(words)), hasher.shingles(" ".join(edited))
    true = len(a & b) / len(a | b)
    estimate = float((hasher.signature(" ".join(words)) == hasher.signature(" ".join(edited))).mean())
    assert abs(estimate - true) < 0.08
    assert hasher.signature("...") is None


def test_band_layout_separates_around_the_threshold():
    bands, rows = band_layout(0.9, 128)
    assert bands * rows <= 128
    hit = lambda s: 1 - (1 - s**rows) ** bands  # noqa: E731
    assert hit(0.95) > 0.999 and hit(0.9) > 0.95 and hit(0.5) < 0.01


def test_planted_near_duplicates_are_found_and_nothing_else(tmp_path, model_server):
    server = model_server(script=ShapeScript())
    groups = {f"g{group}": [f"[dup] g{group} {variant}" for variant in range(1 + group % 3)] for group in range(6)}
    prompts = [p for members in groups.values() for p in members] + [f"[long] distinct {n}" for n in range(12)]
    random.Random(3).shuffle(prompts)
    folder = run_shapes(tmp_path, server, prompts, extra=["--no_filters"])
    index_of = {r["conversations"][1]["value"]: r["prompt_index"] for r in lines(folder / "trajectories.jsonl")}
    # in each group the first by prompt_index is the original; the others (one word of 200 changed) are planted
    planted = {p for members in groups.values() for p in sorted(members, key=index_of.get)[1:]}
    assert len(planted) == 6

    # threshold 0.8: the planted pairs are 95% alike, seven standard deviations of the 128-hash estimate above it
    result = hb("refilter", folder, "--filter", "near-duplicates:0.8", "--json")
    moved = json.loads(result.output)["moves"]
    by_index = {v: k for k, v in index_of.items()}
    assert {by_index[m["prompt_index"]] for m in moved} == planted
    for move in moved:
        prompt = by_index[move["prompt_index"]]
        original = prompt.rsplit(" ", 1)[0]
        first = min(index_of[p] for p in index_of if p.rsplit(" ", 1)[0] == original)
        assert move["reasons"][0].startswith(f"near-duplicate of prompt {first} (")
    kept = {r["conversations"][1]["value"] for r in lines(folder / "trajectories.jsonl")}
    assert kept == set(prompts) - planted

    # the same at export time, without touching the run, over the whole trajectory: the prompt and the
    # commands (which name it) differ too, so the pairs are less alike than their answers: a lower threshold
    hb("refilter", folder, "--no_filters")
    result = hb("export", folder, "--format", "sharegpt", "--filter", "near-duplicates:over=trajectory,threshold=0.6",
                "--output", tmp_path / "dedup.jsonl")
    assert f"left out by near-duplicates: {len(planted)}" in result.output
    assert {r["conversations"][1]["value"] for r in lines(tmp_path / "dedup.jsonl")} == set(prompts) - planted


def test_trajectories_alike_but_for_their_tool_call_ids_are_duplicates(tmp_path, model_server):
    # the same prompt five times: the same commands, results and answer; only the ids the endpoint made up
    # for each call (call_hb1, call_hb2, ...) differ, and they say nothing about what the agent did
    server = model_server(script=ShapeScript())
    folder = run_shapes(tmp_path, server, ["[ok] task 0"] * 5 + ["[long] distinct 1"], extra=["--no_filters"])
    records = lines(folder / "trajectories.jsonl")
    ids = {json.loads(t["value"].split("\n")[1])["tool_call_id"] for r in records[:5] for t in r["conversations"]
           if t["from"] == "tool"}
    assert len(ids) == 10  # two calls each, every id different
    result = hb("export", folder, "--format", "sharegpt", "--filter", "near-duplicates:over=trajectory,threshold=0.8",
                "--output", tmp_path / "dedup.jsonl")
    assert "left out by near-duplicates: 4" in result.output
    assert [r["prompt_index"] for r in lines(tmp_path / "dedup.jsonl")] == [0, 5]


def test_near_duplicates_is_a_run_filter():
    registry = hermes_batch.get_plugin_manager().registry()
    assert issubclass(registry.get("filters", "near-duplicates"), RunFilter)


def test_a_run_applies_the_filters_with_their_options(tmp_path, model_server):
    server = model_server(script=ShapeScript())
    folder = run_shapes(tmp_path, server, shape_rows(["ok", "fail", "cut", "loop"], 1),
                        extra=["--filter", "final-answer", "--filter", "max-tool-errors:0.6", "--filter", "repetition:times=4"])
    discarded = {r["trajectory"]["conversations"][1]["value"]: dict(zip(r["filters"], r["reasons"]))
                 for r in lines(folder / "discarded.jsonl")}
    assert discarded == {
        "[fail] task 0": {"max-tool-errors": "2 of 3 tool calls failed (67%, above 60%)"},
        "[cut] task 0": {"final-answer": "ended by max_turns, not by a final answer"},
        "[loop] task 0": {"repetition": "called terminal with the same arguments 4 times in a row"},
    }
    stats = json.loads((folder / "statistics.json").read_text())
    assert stats["discarded_by_filter"] == {"final-answer": 1, "max-tool-errors": 1, "repetition": 1}
    assert json.loads((folder / "run.json").read_text())["config"]["filters"][1] == "max-tool-errors:0.6"
