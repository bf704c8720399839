"""The Parquet writer read by its real consumers: pyarrow's schema, HuggingFace datasets and DuckDB."""

import json
import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hermes_batch.testing import SHAPES, ShapeScript, answer_for, run_shapes, shape_rows
from hermes_batch.testing import read_jsonl as lines
from hermes_batch.testing import run_cli as hb
from hermes_batch_parquet import SCHEMA


@pytest.fixture
def run_dir(tmp_path, model_server):
    server = model_server(script=ShapeScript())
    return run_shapes(tmp_path, server, shape_rows(SHAPES, 2), extra=["--writer", "jsonl", "--writer", "parquet"])


def test_the_run_writes_parquet_with_the_typed_schema(run_dir):
    table = pq.read_table(run_dir / "trajectories.parquet")
    assert table.schema.equals(SCHEMA, check_metadata=False)
    assert table.schema.metadata[b"hermes_batch.format"] == b"trajectories"
    conversations = table.schema.field("conversations").type
    assert pa.types.is_list(conversations) and pa.types.is_struct(conversations.value_type)
    assert table.schema.field("metadata").type.field("usage").type.field("cost").type == pa.float64()
    records = lines(run_dir / "trajectories.jsonl")
    assert table.column("prompt_index").to_pylist() == [r["prompt_index"] for r in records]
    first = table.slice(0, 1).to_pylist()[0]
    assert [t["from"] for t in first["conversations"]] == [t["from"] for t in records[0]["conversations"]]
    assert first["metadata"]["content_key"] == records[0]["metadata"]["content_key"]
    stats = {s["name"]: s for s in first["tool_stats"]}
    assert stats["terminal"]["count"] == records[0]["tool_stats"]["terminal"]["count"]
    assert stats["terminal"]["errors"] == records[0]["tool_error_counts"]["terminal"]


def test_datasets_loads_parquet_splits(run_dir, tmp_path):
    hb("export", run_dir, "--format", "parquet", "--include", "all", "--split", "validation=0.3")
    folder = run_dir / "exports" / "parquet"
    ds = datasets.load_dataset("parquet", data_dir=str(folder), cache_dir=str(tmp_path / "hf"))
    assert set(ds) == {"train", "validation"}
    total = len(lines(run_dir / "trajectories.jsonl")) + len(lines(run_dir / "discarded.jsonl"))
    assert len(ds["train"]) + len(ds["validation"]) == total
    row = ds["train"][0]
    assert row["conversations"][1]["from"] == "human"
    assert isinstance(row["metadata"]["usage"]["prompt_tokens"], int)


def test_duckdb_queries_the_nested_columns(run_dir):
    import duckdb  # installed by scripts/test.sh --all, which runs this test (marked slow)

    path = run_dir / "trajectories.parquet"
    con = duckdb.connect()
    # failed calls per sample, from the list of tool stats
    rows = con.execute(
        "SELECT conversations[2]['value'] AS prompt, sum(s.failure) AS failures "
        f"FROM (SELECT conversations, unnest(tool_stats) AS s FROM read_parquet('{path}')) GROUP BY prompt ORDER BY prompt"
    ).fetchall()
    failures = dict(rows)
    assert failures["[fail] task 0"] == 2 and failures["[ok] task 0"] == 0
    # the final answer of each kept sample, from the last turn
    answers = dict(con.execute(
        f"SELECT conversations[2]['value'], conversations[-1]['value'] FROM read_parquet('{path}') WHERE NOT partial"
    ).fetchall())
    assert answers["[ok] task 1"].endswith(answer_for("[ok] task 1"))
    count, = con.execute(f"SELECT count(*) FROM read_parquet('{path}') WHERE metadata.end_reason = 'max_turns'").fetchone()
    assert count == 2  # the two [cut] samples


def test_parquet_options_and_their_errors(run_dir, tmp_path):
    hb("export", run_dir, "--format", "parquet:compression=snappy,row_group_size=3", "--output", tmp_path / "t.parquet")
    meta = pq.ParquetFile(tmp_path / "t.parquet").metadata
    assert meta.row_group(0).column(0).compression == "SNAPPY"
    assert meta.num_row_groups == -(-meta.num_rows // 3)
    result = hb("export", run_dir, "--format", "parquet:compression=rar", ok=False)
    assert result.exit_code == 2 and "compression" in result.output and "Traceback" not in result.output


def test_an_empty_export_is_a_valid_file(run_dir, tmp_path):
    hb("export", run_dir, "--format", "parquet", "--filter", "length:max_chars=1", "--output", tmp_path / "e.parquet")
    table = pq.read_table(tmp_path / "e.parquet")
    assert table.num_rows == 0 and table.schema.equals(SCHEMA, check_metadata=False)


def test_an_old_record_with_a_lone_surrogate_is_repaired_as_the_run_does(run_dir, tmp_path):
    answer = answer_for("[ok] task 1")
    for path in sorted(run_dir.glob("batch_*.jsonl")):  # an escaped lone surrogate, as older versions wrote
        text = path.read_text(encoding="utf-8")
        path.write_text(text.replace(answer, answer + "\\ud800", 1), encoding="utf-8")
    result = hb("export", run_dir, "--format", "parquet", "--output", tmp_path / "t.parquet")
    assert "repaired: 1" in result.output
    rows = pq.read_table(tmp_path / "t.parquet").to_pylist()
    assert len(rows) == len(lines(run_dir / "trajectories.jsonl"))
    row = next(r for r in rows if r["conversations"][1]["value"] == "[ok] task 1")
    assert row["conversations"][-1]["value"].endswith(answer + "\ufffd")



def test_several_runs_with_different_tools_export_and_load_as_one_parquet_dataset(run_dir, tmp_path, model_server):
    (tmp_path / "dists.toml").write_text('[terminal_alone]\ntoolsets = { terminal = 100 }\n')
    other = run_shapes(tmp_path, model_server(script=ShapeScript()), shape_rows(["ok", "notool"], 2),
                       run_name="other", extra=["--writer", "jsonl", "--writer", "parquet", "--distribution_file", tmp_path / "dists.toml",
                              "--distribution", "terminal_alone"])
    offered = [{tool for r in lines(folder / "trajectories.jsonl") for tool in r["metadata"]["tools_offered"]}
               for folder in (run_dir, other)]
    assert offered[0] != offered[1]  # (their JSON records list the same tools: every installed toolset's)
    # the runs' own trajectories.parquet files share the one schema, so they load together whatever the tools
    both = datasets.load_dataset("parquet", data_files=[str(run_dir / "trajectories.parquet"),
                                                        str(other / "trajectories.parquet")],
                                 split="train", cache_dir=str(tmp_path / "hf"))
    kept = len(lines(run_dir / "trajectories.jsonl")) + len(lines(other / "trajectories.jsonl"))
    assert len(both) == kept
    out = tmp_path / "merged"
    hb("export", run_dir, other, "--format", "parquet", "--split", "validation=0.3", "--output", out)
    ds = datasets.load_dataset("parquet", data_dir=str(out), cache_dir=str(tmp_path / "hf"))
    assert set(ds) == {"train", "validation"} and len(ds["train"]) + len(ds["validation"]) == kept
    # the next export there owns the folder's set: validation.parquet of the first goes
    result = hb("export", run_dir, other, "--format", "parquet", "--output", out)
    assert "removed from the previous export here: validation.parquet" in result.output
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["train.parquet"]
    assert pq.read_table(out / "train.parquet").num_rows == kept
