"""The view index: streamed, incremental, cached, and safe with whatever the record files hold."""

from __future__ import annotations

import json
import os

import pytest

from hermes_batch.view.index import CACHE_DIR_NAME, RunIndex
from hermes_batch.view.query import Query, run_query
from view_rig import demo_run_dir, read_jsonl, run_copy  # noqa: F401 (fixtures)


def _kept_line(run_dir, prompt: str, prompt_index: int) -> bytes:
    record = read_jsonl(run_dir / "batch_0.jsonl")[0]
    record["prompt_index"] = prompt_index
    for turn in record["conversations"]:
        if turn["from"] == "human":
            turn["value"] = prompt
    return (json.dumps(record) + "\n").encode()


def test_index_counts_every_record_of_the_run(run_copy):
    index = RunIndex(run_copy)
    assert index.refresh() == 11
    stats = json.loads((run_copy / "statistics.json").read_text())
    statuses = [index.columns.status[i] for i in range(len(index))]
    assert statuses.count(0) == stats["prompts"]["kept"]
    assert statuses.count(1) == stats["prompts"]["discarded"]
    assert len(index.still_failed()) == stats["prompts"]["failed"] == 1


def test_refresh_reads_only_what_was_appended_and_waits_for_a_whole_line(run_copy):
    index = RunIndex(run_copy)
    index.refresh()
    line = _kept_line(run_copy, "An appended prompt about zebras.", 99)
    with open(run_copy / "batch_2.jsonl", "ab") as fh:
        fh.write(line[:50])  # a record still being written is not indexed
    assert index.refresh() == 0
    with open(run_copy / "batch_2.jsonl", "ab") as fh:
        fh.write(line[50:])
    assert index.refresh() == 1
    assert list(index.search("ZEBRAS")) == [11]
    assert index.columns.prompt[11] == 99


def test_the_cache_is_reused_and_extended(run_copy):
    first = RunIndex(run_copy)
    first.refresh()
    first.save()
    assert (run_copy / CACHE_DIR_NAME / "manifest.json").exists()
    with open(run_copy / "batch_1.jsonl", "ab") as fh:
        fh.write(_kept_line(run_copy, "A prompt about otters.", 42))
    second = RunIndex(run_copy)
    assert len(second) == 11  # loaded, not rebuilt
    assert second.refresh() == 1  # only the new line is read
    assert list(second.search("otters")) == [11]
    assert list(second.search("6 times 7")) == list(first.search("6 times 7"))


def test_two_viewers_of_one_run_share_the_cache_without_mixing_their_indexes(run_copy):
    one, two = RunIndex(run_copy), RunIndex(run_copy)
    one.refresh()
    one.save()
    with open(run_copy / "discarded.jsonl", "ab") as fh:
        fh.write((json.dumps({"trajectory": read_jsonl(run_copy / "batch_0.jsonl")[0], "filters": ["x"],
                              "reasons": ["a reason about walruses"]}) + "\n").encode())
    two.refresh()
    two.save()
    one.refresh()  # its own search file: two's appends are not in it twice

    def found(index):
        return [(index.files[index.columns.file[i]], index.columns.offset[i]) for i in index.search("walruses")]

    three = RunIndex(run_copy)
    assert len(one) == len(two) == len(three) == 12
    assert found(one) == found(two) == found(three) == [("discarded.jsonl", (run_copy / "discarded.jsonl").stat().st_size
                                                        - len((run_copy / "discarded.jsonl").read_bytes().splitlines(True)[-1]))]
    for index in (one, two, three):
        index.close()
    assert sorted(p.name for p in (run_copy / CACHE_DIR_NAME).iterdir() if not p.name.startswith("snap-")) == ["manifest.json"]


def test_a_replaced_file_rebuilds_the_index(run_copy):
    index = RunIndex(run_copy)
    index.refresh()
    index.save()
    path = run_copy / "batch_0.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(b"".join(lines[1:]))  # as an --overwrite or a reindex would: a new file in its place
    os.replace(tmp, path)
    again = RunIndex(run_copy)
    again.refresh()
    assert len(again) == 10


def test_hostile_lines_are_skipped_or_listed_never_fatal(run_copy):
    with open(run_copy / "batch_0.jsonl", "ab") as fh:
        fh.write(b"not json at all\n")
        fh.write(b"[" * 100_000 + b"\n")  # absurd nesting
        fh.write(json.dumps({"prompt_index": "x", "metadata": [], "conversations": "no", "tool_stats": 5}).encode() + b"\n")
        fh.write(json.dumps({"prompt_index": 7, "conversations": [{"from": "human", "value": "\ud800 half"}]}).encode() + b"\n")
    index = RunIndex(run_copy)
    index.refresh()
    assert len(index) == 13  # the two odd-shaped objects are listed; the two non-records are not
    page = run_query(index, Query(q="half"))
    assert page["total"] == 1


def test_read_ref_reads_only_records_of_the_run(run_copy):
    index = RunIndex(run_copy)
    index.refresh()
    status, record = index.read_ref("batch_0.jsonl:0")
    assert status == "kept" and record["prompt_index"] == 0
    for ref in ("../../etc/passwd:0", "run.json:0", "batch_0.jsonl:5", "batch_0.jsonl:-1", "batch_0.jsonl"):
        with pytest.raises(LookupError):
            index.read_ref(ref)


def test_query_filters_sorts_and_pages(run_copy):
    index = RunIndex(run_copy)
    index.refresh()
    assert run_query(index, Query(status="discarded"))["total"] == 2
    assert run_query(index, Query(filter="no-reasoning"))["total"] == 1
    assert run_query(index, Query(end="max_turns"))["rows"][0]["preview"] == "Keep listing files forever."
    assert run_query(index, Query(error="model_endpoint"))["total"] == 1
    # filter reasons and error messages are searched too
    assert run_query(index, Query(q="not offered: teleport"))["rows"][0]["status"] == "discarded"
    assert run_query(index, Query(q="answered 503"))["rows"][0]["status"] == "failed"
    by_turns = run_query(index, Query(sort="turns", desc=True, limit=3))["rows"]
    assert [r["turns"] for r in by_turns] == sorted((r["turns"] for r in by_turns), reverse=True)
    assert by_turns[0]["turns"] == max(index.columns.turns)
    second_page = run_query(index, Query(offset=10, limit=5))
    assert second_page["total"] == 11 and len(second_page["rows"]) == 1


def test_a_run_folder_where_the_cache_cannot_go_is_indexed_in_a_temporary_folder(run_copy):
    (run_copy / CACHE_DIR_NAME).write_text("not a folder")  # as unwritable as a read-only folder, also for root
    index = RunIndex(run_copy)
    index.refresh()
    index.save()
    assert len(index) == 11 and list(index.search("6 times 7"))
    assert not index.cache_dir.is_relative_to(run_copy)
    index.close()
    assert not index.cache_dir.exists()
