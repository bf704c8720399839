"""hermes-batch export: each format read by its real consumer, stable splits, what is included, bad input."""

import json

import datasets
import pytest

from hermes_batch.export import parse_splits, split_of
from hermes_batch.testing.openai_finetune import check_line
from hermes_batch.testing import SHAPES, ShapeScript, answer_for, run_shapes, shape_rows
from hermes_batch.testing import read_jsonl as lines
from hermes_batch.testing import run_cli as hb


@pytest.fixture
def run_dir(shapes_run_dir):
    """A copy of the module's finished run of every shape (conftest), which the test may change."""
    return shapes_run_dir


def test_sharegpt_export_is_the_merged_records_and_loads_in_datasets(run_dir, tmp_path):
    hb("export", run_dir, "--format", "sharegpt")
    out = run_dir / "exports" / "sharegpt" / "train.jsonl"
    assert out.read_text() == (run_dir / "trajectories.jsonl").read_text()
    ds = datasets.load_dataset("json", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf"))
    assert len(ds) == len(lines(run_dir / "trajectories.jsonl"))
    assert ds[0]["conversations"][0]["from"] == "system"


def test_include_discarded_and_all_in_prompt_index_order(run_dir, tmp_path):
    kept = [r["prompt_index"] for r in lines(run_dir / "trajectories.jsonl")]
    discarded = sorted(r["trajectory"]["prompt_index"] for r in lines(run_dir / "discarded.jsonl"))
    assert kept and discarded
    hb("export", run_dir, "--format", "sharegpt", "--include", "discarded", "--output", tmp_path / "d.jsonl")
    hb("export", run_dir, "--format", "sharegpt", "--include", "all", "--output", tmp_path / "a.jsonl")
    assert [r["prompt_index"] for r in lines(tmp_path / "d.jsonl")] == discarded
    every = [r["prompt_index"] for r in lines(tmp_path / "a.jsonl")]
    assert every == sorted(kept + discarded)
    # kept and discarded records of one export share one schema (tool columns with zeros), so datasets loads it
    ds = datasets.load_dataset("json", data_files=str(tmp_path / "a.jsonl"), split="train", cache_dir=str(tmp_path / "hf"))
    assert len(ds) == len(every)
    assert len({tuple(sorted(r["tool_stats"])) for r in lines(tmp_path / "a.jsonl")}) == 1


def test_openai_lines_follow_the_fine_tuning_rules(run_dir, tmp_path):
    result = hb("export", run_dir, "--format", "openai", "--include", "all", "--output", tmp_path / "o.jsonl")
    rows = lines(tmp_path / "o.jsonl")
    for row in rows:
        assert check_line(row) == []
    # the hallucinated-tool samples cannot be valid lines: left out and said so
    unknown = sum(1 for r in lines(run_dir / "discarded.jsonl") if r["trajectory"]["conversations"][1]["value"].startswith("[unknown]"))
    assert unknown == 3
    assert "left out as the format cannot hold them: 3" in result.output
    by_prompt = {r["messages"][1]["content"]: r for r in rows}
    ok = by_prompt["[ok] task 0"]
    assert [m["role"] for m in ok["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert ok["messages"][-1]["content"] == "<think>\nThinking about step 2.\n</think>\n" + answer_for("[ok] task 0")
    assert {t["function"]["name"] for t in ok["tools"]} >= {"terminal", "read_file"}
    assert "<tools>" not in ok["messages"][0]["content"]
    call = ok["messages"][2]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"])["command"].startswith("echo ")
    assert ok["messages"][3]["tool_call_id"] == call["id"]
    ds = datasets.load_dataset("json", data_files=str(tmp_path / "o.jsonl"), split="train", cache_dir=str(tmp_path / "hf"))
    assert len(ds) == len(rows)


def test_openai_reasoning_dropped_by_option(run_dir, tmp_path):
    hb("export", run_dir, "--format", "openai:reasoning=drop", "--output", tmp_path / "o.jsonl")
    rows = lines(tmp_path / "o.jsonl")
    assert rows and all(check_line(r) == [] for r in rows)
    texts = [m.get("content") or "" for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert not any("<think>" in t for t in texts)
    assert answer_for("[ok] task 1") in texts


def test_openai_checker_catches_broken_lines():
    good = {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
        {"role": "assistant", "content": "done"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    assert check_line(good) == []
    bad_args = json.loads(json.dumps(good))
    bad_args["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    assert any("not valid JSON" in p for p in check_line(bad_args))
    bad_id = json.loads(json.dumps(good))
    bad_id["messages"][2]["tool_call_id"] = "c2"
    assert any("answers no call" in p for p in check_line(bad_id))
    unanswered = json.loads(json.dumps(good))
    del unanswered["messages"][2]
    assert any("never answered" in p for p in check_line(unanswered))
    undefined = json.loads(json.dumps(good))
    undefined["tools"][0]["function"]["name"] = "g"
    assert any("does not define" in p for p in check_line(undefined))
    assert any("unknown role" in p for p in check_line({"messages": [{"role": "bot", "content": "x"}]}))


def test_splits_are_stable_and_keep_copies_of_a_prompt_together(run_dir, tmp_path):
    hb("export", run_dir, "--format", "sharegpt", "--split", "validation=0.3", "--split", "test=0.2",
       "--output", tmp_path / "first")
    hb("export", run_dir, "--format", "sharegpt", "--split", "test=0.2", "--split", "validation=0.3",
       "--output", tmp_path / "second")
    for name in ("train", "validation", "test"):
        assert (tmp_path / "first" / f"{name}.jsonl").read_bytes() == (tmp_path / "second" / f"{name}.jsonl").read_bytes()
    splits = {name: lines(tmp_path / "first" / f"{name}.jsonl") for name in ("train", "validation", "test")}
    assert sum(map(len, splits.values())) == len(lines(run_dir / "trajectories.jsonl"))
    where = {}
    for name, rows in splits.items():
        for row in rows:
            assert where.setdefault(row["metadata"]["content_key"], name) == name
    ds = datasets.load_dataset("json", data_dir=str(tmp_path / "first"), cache_dir=str(tmp_path / "hf"))
    assert set(ds) == {"train", "validation", "test"}


def test_split_shares_hold_over_many_keys():
    splits = parse_splits(["validation=0.05"])
    names = [split_of(f"{i:032x}", splits) for i in range(20000)]
    assert 0.04 < names.count("validation") / len(names) < 0.06


def test_file_output_with_splits_names_each_file(run_dir, tmp_path):
    result = hb("export", run_dir, "--format", "openai", "--split", "validation=0.5", "--output", tmp_path / "data.jsonl")
    assert (tmp_path / "data.train.jsonl").exists() and (tmp_path / "data.validation.jsonl").exists()
    assert "validation:" in result.output


@pytest.mark.parametrize("args, message", [
    (["--format", "nope"], "Unknown --format 'nope'"),
    (["--format", "openai:reasoning=maybe"], "reasoning"),
    (["--format", "sharegpt:x=1"], "takes no options"),
    (["--format", "sharegpt", "--split", "validation=1.5"], "between 0 and 1"),
    (["--format", "sharegpt", "--split", "a=0.6", "--split", "b=0.5"], "nothing for train"),
    (["--format", "sharegpt", "--split", "train=0.1"], "train is what the other splits leave"),
    (["--format", "sharegpt", "--filter", "nope"], "Unknown --filter 'nope'"),
])
def test_bad_export_options_are_one_sentence(run_dir, args, message):
    result = hb("export", run_dir, *args, ok=False)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_a_folder_that_is_no_run_is_refused(tmp_path):
    result = hb("export", tmp_path, "--format", "sharegpt", ok=False)
    assert result.exit_code == 2 and "holds no run" in result.output


def test_writer_formats_also_run_as_writers(tmp_path, model_server):
    server = model_server(script=ShapeScript())
    folder = run_shapes(tmp_path, server, shape_rows(["ok", "fail"], 2),
                        extra=["--writer", "jsonl", "--writer", "openai:reasoning=drop", "--writer", "sharegpt"])
    openai_lines = lines(folder / "trajectories.openai.jsonl")
    assert len(openai_lines) == len(lines(folder / "trajectories.jsonl")) == 4
    assert all(check_line(r) == [] for r in openai_lines)
    assert (folder / "trajectories.sharegpt.jsonl").read_text() == (folder / "trajectories.jsonl").read_text()


def test_an_interrupted_export_leaves_the_previous_file(run_dir, tmp_path, monkeypatch):
    out = tmp_path / "o.jsonl"
    hb("export", run_dir, "--format", "sharegpt", "--output", out)
    before = out.read_bytes()
    from hermes_batch.default_plugins import jsonl_writer

    def boom(_traj):
        raise KeyboardInterrupt

    monkeypatch.setattr(jsonl_writer, "to_json_line", boom)
    result = hb("export", run_dir, "--format", "sharegpt", "--output", out, ok=False)
    assert result.exit_code == 1 and "Aborted" in result.output  # click's answer to Ctrl-C
    assert out.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".o.jsonl")] == []


def plant_lone_surrogate(run_dir, prompt):
    """Give ``prompt``'s kept record an escaped lone surrogate after its answer, as versions before the repair wrote."""
    answer = answer_for(prompt)
    for path in sorted(run_dir.glob("batch_*.jsonl")):
        text = path.read_text(encoding="utf-8")
        if answer in text:
            path.write_text(text.replace(answer, answer + "\\ud800", 1), encoding="utf-8")
            return answer
    raise AssertionError(f"no batch file holds the answer of {prompt!r}")


def test_an_old_record_with_a_lone_surrogate_is_repaired_as_the_run_does(run_dir, tmp_path):
    answer = plant_lone_surrogate(run_dir, "[ok] task 1")
    result = hb("export", run_dir, "--format", "openai", "--output", tmp_path / "o.jsonl")
    assert "repaired: 1" in result.output  # text that is not Unicode, written with U+FFFD as the run writes it
    rows = lines(tmp_path / "o.jsonl")
    assert len(rows) == len(lines(run_dir / "trajectories.jsonl"))
    row = next(r for r in rows if r["messages"][1]["content"] == "[ok] task 1")
    assert row["messages"][-1]["content"].endswith(answer + "\ufffd")
    hb("export", run_dir, "--format", "sharegpt", "--output", tmp_path / "s.jsonl")
    assert answer + "\ufffd" in (tmp_path / "s.jsonl").read_text(encoding="utf-8")

