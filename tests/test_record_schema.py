"""Every record has one type, whatever the run holds: pyarrow in small blocks and HuggingFace datasets agree.

Arrow readers fix each column's type from the first block they read and cannot
change it later; a field that is null, an empty list, an object keyed by data,
or a string in one record and an object in the next breaks them.  These tests
run a varied run through the real pipeline (scripted server, both model
clients) and read its records the way those tools do.
"""

from __future__ import annotations

import io
import json
import random
import re
from pathlib import Path

import pytest

from hermes_batch.testing import write_dataset

from hermes_batch.formats.records import Trajectory, Usage
from hermes_batch.formats.serialization import from_json, to_json_line
from hermes_batch.testing import Reply

pa_json = pytest.importorskip("pyarrow.json")

RECORD_DOC = Path(__file__).resolve().parent.parent / "docs" / "run-folder.md"
PROMPT_TIMEOUT = 2.0

# --- a model that does everything a real one does, decided by the prompt ---------------------------------

REASONING_FORMATS = ("reasoning", "reasoning_content", "reasoning_details", "think_tags", "scratchpad")
KINDS = (
    "terminal", "files", "unknown-tool", "bad-arguments", "no-reasoning", "endless", "length", "context",
    "content-filter", "direct", "fail-500", "fail-400", "hang-first", "hang-later", "sandbox",
)


def _kind(prompt: str) -> tuple[str, int]:
    kind, number = prompt.split(" #", 1)[0].split(":")
    return kind, int(number)


def _usage(number: int, api: str):
    if number % 3 == 0:
        return None  # estimated by the server, no cost
    cost = 0.0001 * (number % 7 + 1) if api == "openai" and number % 2 else None
    return Usage(prompt_tokens=100 + number, completion_tokens=20, reasoning_tokens=number % 4, cached_tokens=number % 5,
                 cost=cost)


def varied(request) -> Reply:
    kind, number = _kind(request.prompt)
    fmt = REASONING_FORMATS[number % len(REASONING_FORMATS)]
    if request.api == "anthropic":
        fmt = "reasoning"
    extra = dict(usage=_usage(number, request.api), provider=("ProvA", "ProvB", None)[number % 3] if request.api == "openai" else None)
    think = f"Thinking about {kind} {number}, step {request.turn}."
    final = Reply(content=f"Done with {number}.", reasoning=think, reasoning_format=fmt, **extra)
    turn = request.turn
    if kind == "terminal":
        if turn == 0:
            return Reply(reasoning=think, reasoning_format=fmt, tool_calls=[("terminal", {"command": f"echo {number}"})], **extra)
        return final
    if kind == "files":
        if turn == 0:
            calls = [("write_file", {"path": f"f{number}.txt", "content": "x" * (number % 50)}), ("read_file", {"path": f"f{number}.txt"})]
            return Reply(reasoning=think, reasoning_format=fmt, tool_calls=calls, **extra)
        if turn == 1:
            return Reply(reasoning=think, reasoning_format=fmt, tool_calls=[("search_files", {"pattern": "x", "path": "."})], **extra)
        return final
    if kind == "unknown-tool":
        if turn == 0:
            return Reply(reasoning=think, reasoning_format=fmt, tool_calls=[("teleport", {"to": "mars", "n": number})], **extra)
        return final
    if kind == "bad-arguments":
        if turn == 0:
            calls = [("write_file", '{"path": "a", "content": '), ("terminal", {"cmd": [number]}), ("read_file", "[1, 2]")]
            return Reply(reasoning=think, reasoning_format=fmt, tool_calls=calls, **extra)
        return final
    if kind == "no-reasoning":
        if turn == 0:
            return Reply(tool_calls=[("terminal", {"command": "true"})], **extra)
        return Reply(content="No thoughts.", **extra)
    if kind == "endless":
        return Reply(reasoning=think, reasoning_format=fmt, tool_calls=[("read_file", {"path": "missing.txt"})], **extra)
    if kind == "length":
        return Reply(content="The answer is cut", reasoning=think, reasoning_format=fmt, finish_reason="length", **extra)
    if kind == "context":
        if turn < number % 2:
            return Reply(reasoning=think, reasoning_format=fmt, tool_calls=[("terminal", {"command": "true"})], **extra)
        message = "prompt is too long: 300000 tokens > 200000 maximum" if request.api == "anthropic" else (
            "This model's maximum context length is 8192 tokens.")
        return Reply(status=400, error_message=message)
    if kind == "content-filter":
        return Reply(content="", reasoning=think, reasoning_format=fmt,
                     finish_reason="refusal" if request.api == "anthropic" else "content_filter", **extra)
    if kind == "direct":
        return final
    if kind == "fail-500":
        return Reply(status=500, error_message="Upstream exploded.")
    if kind == "fail-400":
        return Reply(status=400, error_message="Your request was malformed in a way nobody can fix.")
    if kind in ("hang-first", "hang-later"):  # hangs are decided by the server's hang predicate
        if turn == 0:
            return Reply(reasoning=think, reasoning_format=fmt, tool_calls=[("terminal", {"command": "true"})], **extra)
        return final
    if kind == "sandbox":  # its sandbox cannot open, which fails the prompt at its first tool call
        return Reply(reasoning=think, reasoning_format=fmt, tool_calls=[("terminal", {"command": "true"})], **extra)
    raise AssertionError(kind)


def hangs(request) -> bool:
    if request.preflight:
        return False
    kind, _number = _kind(request.prompt)
    return (kind == "hang-first" and request.turn == 0) or (kind == "hang-later" and request.turn == 1)


def varied_rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    extras = ({}, {"topic": "strings"}, {"n": 3}, {"tags": ["a", 2]}, {"nested": {"k": [1, {"z": None}]}},
              {"topic": 7}, {"score": 0.5})
    rows = []
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        row = {"prompt": f"{kind}:{i} #{rng.random():.6f}", **rng.choice(extras)}
        if i % 3 == 1:
            row["id"] = f"q{i}"
        elif i % 3 == 2:
            row["id"] = i
        if kind == "sandbox":
            row["cwd"] = "d" * 300  # a folder name no file system takes
        elif i % 4 == 0:
            row["cwd"] = f"/work/{i % 3}"
        rows.append(row)
    rng.shuffle(rows)
    return rows


def run_varied(runner, model_server, tmp_path, *, client: str, count: int, seed: int) -> list[dict]:
    server = model_server(varied, hang=hangs)
    dataset = write_dataset(tmp_path / f"{client}.jsonl", varied_rows(count, seed))
    extra = ["--num_workers", "64", "--max_turns", "3", "--max_retries", "0", "--prompt_timeout", str(PROMPT_TIMEOUT),
             "--batch_size", "50", "--seed", "7"]
    if client == "anthropic":
        extra += ["--model_client", "anthropic", "--base_url", server.anthropic_base_url]
    result = runner.invoke(dataset, *extra, server=server, run_name=client)
    assert result.exit_code == 3, result.output  # some prompts fail, by design
    records = runner.records("trajectories.jsonl", client)
    records += [d["trajectory"] for d in runner.records("discarded.jsonl", client)]
    failed = runner.records("failed.jsonl", client)
    assert {f["error_kind"] for f in failed} == {"model_endpoint", "model_request", "timeout", "sandbox"}
    assert len(records) + len(failed) == count
    return records


@pytest.fixture(scope="module")
def varied_runs(tmp_path_factory):
    """Over two thousand records of both clients: kept and discarded, complete and partial, with and without cost."""
    from hermes_batch.testing import TEST_API_KEY, Runner
    from hermes_batch.testing.server import ScriptedModelServer

    tmp_path = tmp_path_factory.mktemp("varied")
    servers = []

    def model_server(script, **options):
        server = ScriptedModelServer(script, api_key=TEST_API_KEY, **options).start()
        servers.append(server)
        return server

    runner = Runner(tmp_path)
    try:
        return {
            "openai": run_varied(runner, model_server, tmp_path, client="openai", count=2000, seed=1),
            "anthropic": run_varied(runner, model_server, tmp_path, client="anthropic", count=900, seed=2),
        }
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def varied_records(varied_runs):
    records = varied_runs["openai"] + varied_runs["anthropic"]
    random.Random(3).shuffle(records)
    return records


def _lines(records) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def arrow_schema(records, block_size=None):
    """The schema pyarrow infers for ``records`` as JSON lines, reading ``block_size`` bytes at a time."""
    data = _lines(records)
    if block_size is None:
        # a few records per block, so each block is typed on its own before the blocks are combined
        block_size = 3 * max(len(line) for line in data.splitlines(keepends=True))
    options = pa_json.ReadOptions(block_size=block_size)
    return pa_json.read_json(io.BytesIO(data), read_options=options).schema


def _calls_tools(record) -> bool:
    return any("tool_calls" in turn for turn in record["conversations"])


def test_the_varied_run_holds_every_kind_of_record(varied_records):
    meta = [r["metadata"] for r in varied_records]
    assert len(varied_records) > 2000  # of 2900 prompts; the rest failed, by design
    assert {m["end_reason"] for m in meta} == {"final_answer", "max_turns", "length", "context_length", "content_filter", "timeout"}
    assert any(json.loads(m["invalid_tool_calls"]) for m in meta) and any(not json.loads(m["invalid_tool_calls"]) for m in meta)
    assert {m["usage"]["cost_reported"] for m in meta} == {True, False}
    assert {c["provider"] for m in meta for c in m["calls"]} == {"ProvA", "ProvB", ""}
    assert {m["cwd"] for m in meta} == {"", "/work/0", "/work/1", "/work/2"}
    assert any(not _calls_tools(r) for r in varied_records) and any(_calls_tools(r) for r in varied_records)


def test_pyarrow_reads_the_run_in_small_blocks_with_one_schema(varied_records):
    schema = arrow_schema(varied_records)
    assert schema == arrow_schema(varied_records, block_size=1 << 24)  # one block: the same types
    meta = schema.field("metadata").type
    # the fields whose type could otherwise come from the data
    for name in ("invalid_tool_calls", "row", "id", "image", "cwd", "end_reason"):
        assert str(meta.field(name).type) == "string", name
    assert str(meta.field("usage").type) == (
        "struct<prompt_tokens: int64, completion_tokens: int64, reasoning_tokens: int64, cached_tokens: int64, "
        "cost: double, cost_reported: bool>"
    )
    assert str(meta.field("calls").type) == "list<item: struct<provider: string, latency_s: double, status: int64>>"
    turn = schema.field("conversations").type.value_type
    assert str(turn.field("tool_calls").type) == "list<item: struct<id: string, name: string, arguments: string>>"


def test_the_schema_is_the_same_whatever_the_run_holds(varied_records, varied_runs):
    """Any part of the run, down to one record, reads with the schema of the whole."""
    expected = arrow_schema(varied_records)

    def without_tool_calls(schema):
        # the seed's format: a turn has "tool_calls" only when it calls tools, so a record in which no
        # assistant turn calls one has no such field (absent, never an untyped empty list)
        conversations = schema.field("conversations")
        turn = conversations.type.value_type
        kept = [turn.field(i) for i in range(turn.num_fields) if turn.field(i).name != "tool_calls"]
        import pyarrow as pa

        return schema.set(schema.get_field_index("conversations"), conversations.with_type(pa.list_(pa.struct(kept))))

    for record in varied_records:
        alone = arrow_schema([record], block_size=1 << 24)
        assert alone == (expected if _calls_tools(record) else without_tool_calls(expected)), record["conversations"][1]

    def subset(condition):
        part = [r for r in varied_records if condition(r)]
        assert part
        return arrow_schema(part)

    assert subset(lambda r: not json.loads(r["metadata"]["invalid_tool_calls"])) == expected
    assert subset(lambda r: not r["metadata"]["usage"]["cost_reported"]) == expected
    assert subset(lambda r: r["metadata"]["calls"][0]["provider"] == "") == expected
    assert subset(lambda r: r["partial"] and _calls_tools(r)) == expected
    assert subset(lambda r: r["metadata"]["row"] == "{}") == expected
    assert arrow_schema(varied_runs["anthropic"]) == arrow_schema(varied_runs["openai"]) == expected


def test_huggingface_datasets_loads_the_run(varied_records, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets

    path = tmp_path / "trajectories.jsonl"
    path.write_bytes(_lines(varied_records))
    ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == len(varied_records)
    invalid = [json.loads(m["invalid_tool_calls"]) for m in ds["metadata"]]
    assert sum(map(len, invalid)) == sum(len(json.loads(r["metadata"]["invalid_tool_calls"])) for r in varied_records)
    assert all(set(call) == {"id", "name", "reason"} for calls in invalid for call in calls)


def test_the_records_read_back_as_they_were_written(varied_records):
    for record in varied_records[:300]:
        assert json.loads(to_json_line(from_json(record, Trajectory))) == record


# --- the example in docs/run-folder.md is a real record ---------------------------------------------------


def _documented_record() -> dict:
    text = RECORD_DOC.read_text(encoding="utf-8")
    section = text.split("### Trajectory record", 1)[1]
    block = re.search(r"```json\n(.*?)\n```", section, re.DOTALL).group(1)
    return json.loads(block)


def _shape(value):
    """The JSON type of ``value``, recursively: what an Arrow reader would infer."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in value.items()}
    if isinstance(value, list):
        shapes = {json.dumps(_shape(item), sort_keys=True) for item in value}
        return ["list", sorted(shapes)]
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    return type(value).__name__


def test_the_documented_record_example_has_the_shape_of_a_real_record(varied_records):
    example = _documented_record()
    real = next(r for r in varied_records if _calls_tools(r) and r["metadata"]["usage"]["cost_reported"])
    example_meta, real_meta = example.pop("metadata"), real["metadata"]
    assert list(example_meta) == list(real_meta), "metadata fields differ in name or order"
    for key, value in example_meta.items():
        if key in ("calls",):
            assert _shape(value[:1]) == _shape(real_meta[key][:1]), key
        elif key != "row":
            assert _shape(value) == _shape(real_meta[key]), key
    assert json.loads(example_meta["invalid_tool_calls"]) == [] or all(
        set(c) == {"id", "name", "reason"} for c in json.loads(example_meta["invalid_tool_calls"]))
    real = {k: v for k, v in real.items() if k != "metadata"}
    assert list(example) == list(real)
    for key in ("prompt_index", "completed", "partial", "api_calls", "toolsets_used"):
        assert _shape(example[key]) == _shape(real[key]), key
    gpt_with_calls = next(t for t in example["conversations"] if "tool_calls" in t)
    real_with_calls = next(t for t in real["conversations"] if "tool_calls" in t)
    assert _shape(gpt_with_calls["tool_calls"][:1]) == _shape(real_with_calls["tool_calls"][:1])
    for stats in example["tool_stats"].values():
        assert set(stats) == {"count", "success", "failure"}


# --- records written by versions before schema 2 still resume --------------------------------------------


def test_records_of_older_versions_resume_and_merge_in_the_new_shape(runner, model_server, tmp_path):
    from hermes_batch.formats.records import content_key

    runner.server = model_server()
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "Old one", "topic": "t"}, {"prompt": "New one"}])
    folder = runner.folder()
    folder.mkdir(parents=True)
    old = {
        "prompt_index": 0,
        "conversations": [
            {"from": "system", "value": "s"}, {"from": "human", "value": "Old one"},
            {"from": "gpt", "value": "<think>\nhm\n</think>\nx", "tool_calls": [{"id": "c1", "name": "teleport", "arguments": {"to": "mars"}}]},
            {"from": "tool", "value": "..."}, {"from": "gpt", "value": "<think>\nok\n</think>\ndone"},
        ],
        "metadata": {"batch_num": 0, "timestamp": "2025-01-01T00:00:00.250", "model": "m", "schema_version": 1,
                     "content_key": content_key("Old one", None, None), "row": {"topic": "t"},
                     "invalid_tool_calls": {"c1": {"name": "teleport", "reason": "unknown tool"}},
                     "usage": None, "providers": ["X"], "calls": [{"provider": None, "latency_s": 1, "status": None}],
                     "tools_offered": ["terminal"], "end_reason": "final_answer", "duration_s": 2},
        "completed": True, "partial": False, "api_calls": 2, "toolsets_used": ["terminal"],
        "tool_stats": {"terminal": {"count": 0, "success": 0, "failure": 0}}, "tool_error_counts": {"terminal": 0},
    }
    (folder / "batch_0.jsonl").write_text(json.dumps(old) + "\n")
    result = runner.invoke(dataset, "--resume")
    assert result.exit_code == 0, result.output
    assert runner.server.calls_for("Old one") == 0, "the old record counts as finished"
    merged = {r["conversations"][1]["value"]: r for r in runner.records("trajectories.jsonl")}
    meta = merged["Old one"]["metadata"]
    assert json.loads(meta["invalid_tool_calls"]) == [{"id": "c1", "name": "teleport", "reason": "unknown tool"}]
    assert json.loads(meta["row"]) == {"topic": "t"} and "providers" not in meta
    assert meta["usage"]["cost_reported"] is False and meta["calls"] == [{"provider": "", "latency_s": 1.0, "status": 0}]
    assert json.loads(merged["Old one"]["conversations"][2]["tool_calls"][0]["arguments"]) == {"to": "mars"}
    old_schema, new_schema = arrow_schema([merged["Old one"]]), arrow_schema([merged["New one"]])
    assert old_schema == new_schema, set(map(str, old_schema)) ^ set(map(str, new_schema))
