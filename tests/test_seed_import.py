"""``hermes-batch import``: a run folder written by Hermes Agent's batch_runner.py, in its exact record format,
becomes a hermes-batch run folder that ``--resume`` continues without paying for a finished prompt again."""

from __future__ import annotations

import json
from collections import Counter

from hermes_batch.testing import write_dataset
from hermes_batch.testing.runner import TEST_API_KEY

SEED_MODEL = "anthropic/claude-sonnet-4.6"


def seed_record(index, prompt, batch, *, reasoning=True, calls="structured"):
    """A line of batch_runner.py's batch_N.jsonl, in the format its documentation shows."""
    think = "<think>\nI should look first.\n</think>\n" if reasoning else ""
    first = {"from": "gpt", "value": f"{think}I'll check the files first."}
    if calls == "structured":
        first["tool_calls"] = [{"id": "call_1", "type": "function",
                                "function": {"name": "terminal", "arguments": "{\"command\": \"ls\"}"}}]
    else:  # only the Hermes text format
        first["value"] += "\n<tool_call>\n{\"name\": \"terminal\", \"arguments\": {\"command\": \"ls\"}}\n</tool_call>"
    return {
        "prompt_index": index,
        "conversations": [
            {"from": "human", "value": prompt},
            first,
            {"from": "tool", "value": "<tool_response>\n{\"tool_call_id\": \"call_1\", \"name\": \"terminal\", "
                                      "\"content\": {\"output\": \"a.txt\", \"exit_code\": 0, \"error\": null}}\n</tool_response>"},
            {"from": "gpt", "value": f"{think}Here's the completed function..."},
        ],
        "metadata": {"batch_num": batch, "timestamp": "2026-01-15T10:30:00", "model": SEED_MODEL},
        "completed": True,
        "partial": False,
        "api_calls": 2,
        "toolsets_used": ["terminal", "file"],
        "tool_stats": {"terminal": {"count": 1, "success": 1, "failure": 0}, "read_file": {"count": 0, "success": 0, "failure": 0}},
        "tool_error_counts": {"terminal": 0, "read_file": 0},
    }


def lines(*records) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def make_seed_run(folder, prompts):
    """What batch_runner.py left after a run over prompts[:6] with --batch_size 2, interrupted in batch 2."""
    folder.mkdir(parents=True)
    (folder / "batch_0.jsonl").write_text(lines(seed_record(0, prompts[0], 0), seed_record(1, prompts[1], 0, calls="text")))
    (folder / "batch_1.jsonl").write_text(lines(
        seed_record(2, prompts[2], 1),
        seed_record(3, prompts[3], 1, reasoning=False),  # no reasoning: the no-reasoning filter discards it
    ))
    (folder / "batch_2.jsonl").write_text(
        lines(seed_record(4, "a prompt the dataset no longer has", 2))
        + '{"prompt_index": 5, "conversations": [{"from": "human", "val'  # the torn line of a killed write
    )
    (folder / "trajectories.jsonl").write_text(lines(seed_record(0, prompts[0], 0)))
    (folder / "checkpoint.json").write_text(json.dumps({
        "run_name": folder.name, "completed_prompts": [0, 1, 2, 3, 4], "batch_stats": {"0": {"processed": 2}},
        "last_updated": "2026-01-15T10:31:00"}))
    (folder / "statistics.json").write_text(json.dumps({
        "run_name": folder.name, "distribution": "terminal_only", "batch_size": 2, "model": SEED_MODEL,
        "total_prompts": 6}))


def test_a_batch_runner_folder_is_imported_and_resumed_without_paying_again(tmp_path, runner, model_server):
    prompts = [f"task {i}: list the files" for i in range(6)]
    out = tmp_path / "out"
    folder = out / "seedrun"
    make_seed_run(folder, prompts)
    originals = {p.name: p.read_bytes() for p in folder.iterdir()}
    # the dataset gained a row at the top since: records are matched by their prompt, not their old index
    rows = [{"prompt": "a new first row"}] + [{"prompt": p, "id": f"q{i}", "topic": "files"} for i, p in enumerate(prompts)]
    data = write_dataset(tmp_path / "data.jsonl", rows)

    result = runner.cli("import", str(folder), "--dataset_file", str(data))
    assert result.exit_code == 0, result.output
    assert "Imported 5 record(s)" in result.output and "3 kept, 1 discarded" in result.output
    assert "1 whose prompt the dataset does not hold and 0 unreadable" in result.output
    assert {p.name: p.read_bytes() for p in (folder / "batch_runner").iterdir()} == originals  # kept, unchanged

    kept = [json.loads(line) for name in ("batch_0.jsonl", "batch_1.jsonl") for line in (folder / name).read_text().splitlines()]
    assert sorted(r["prompt_index"] for r in kept) == [1, 2, 3]  # the rows' indexes in the current file
    for record in kept:
        assert record["metadata"]["batch_num"] == record["prompt_index"] // 2
        assert record["metadata"]["model"] == SEED_MODEL and record["metadata"]["timestamp"] == "2026-01-15T10:30:00"
        assert (record["metadata"]["sandbox"], record["metadata"]["end_reason"]) == ("unknown", "unknown")
        assert record["metadata"]["id"] == f"q{record['prompt_index'] - 1}"
        assert json.loads(record["metadata"]["row"]) == {"topic": "files"}
        assert "terminal" in record["metadata"]["tools_offered"] and len(record["metadata"]["content_key"]) == 32
        calls = [c for turn in record["conversations"] for c in turn.get("tool_calls") or ()]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("terminal", {"command": "ls"})]
    [discarded] = [json.loads(line) for line in (folder / "discarded.jsonl").read_text().splitlines()]
    assert discarded["trajectory"]["prompt_index"] == 4 and discarded["filters"] == ["no-reasoning"]
    [aside] = [json.loads(line) for line in (folder / "unmatched.jsonl").read_text().splitlines()]
    assert aside["kind"] == "kept"
    run_json = json.loads((folder / "run.json").read_text())
    assert run_json["imported"]["from"] == "batch_runner.py"
    assert (run_json["config"]["model"], run_json["config"]["distribution"], run_json["config"]["batch_size"]) == (
        SEED_MODEL, "terminal_only", 2)
    assert "completed_prompts" not in json.loads((folder / "checkpoint.json").read_text())

    # the resume, as the seed document writes it (no --model, no --distribution): only the rest is paid for
    server = model_server()
    resumed = runner.cli(
        "run", "--dataset_file", str(data), "--batch_size", "2", "--run_name", "seedrun", "--output_dir", str(out),
        "--resume", "--base_url", server.base_url, "--api_key", TEST_API_KEY, "--no-progress",
    )
    assert resumed.exit_code == 0, resumed.output
    paid = Counter(r.prompt for r in server.requests if not r.preflight)
    assert set(paid) == {"a new first row", prompts[4], prompts[5]}
    assert {r.model for r in server.requests} == {SEED_MODEL}
    merged = [json.loads(line) for line in (folder / "trajectories.jsonl").read_text().splitlines()]
    assert [r["prompt_index"] for r in merged] == [0, 1, 2, 3, 5, 6]
    assert [r["metadata"]["sandbox"] for r in merged] == ["local", "unknown", "unknown", "unknown", "local", "local"]
    stats = json.loads((folder / "statistics.json").read_text())
    assert (stats["prompts"]["kept"], stats["prompts"]["discarded"], stats["model"]) == (6, 1, SEED_MODEL)

    again = runner.cli("import", str(folder), "--dataset_file", str(data))
    assert again.exit_code == 2 and "hermes-batch run folder already" in again.output


def test_records_of_toolsets_not_installed_are_refused_unless_no_filters(tmp_path, runner):
    prompts = ["task 0: browse"]
    folder = tmp_path / "out" / "seedrun"
    folder.mkdir(parents=True)
    record = seed_record(0, prompts[0], 0)
    record["toolsets_used"] = ["terminal", "teleport"]
    (folder / "batch_0.jsonl").write_text(lines(record))
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])

    refused = runner.cli("import", str(folder), "--dataset_file", str(data), "--batch_size", "2")
    assert refused.exit_code == 2 and "teleport" in refused.output and "--no_filters" in refused.output
    assert sorted(p.name for p in folder.iterdir()) == ["batch_0.jsonl"]  # nothing changed
    assert runner.cli("import", str(folder), "--dataset_file", str(data), "--batch_size", "2", "--no_filters").exit_code == 0


def test_a_resume_over_a_batch_runner_folder_points_to_the_import_and_pays_nothing(tmp_path, runner, model_server):
    prompts = [f"task {i}: list the files" for i in range(6)]
    folder = tmp_path / "out" / "run"
    make_seed_run(folder, prompts)
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    server = model_server()
    result = runner.invoke(data, "--resume", server=server)
    assert result.exit_code == 2, result.output
    assert f"'hermes-batch import {folder} --dataset_file {data}'" in result.output
    assert server.request_count == 0 and not (folder / "run.json").exists()
