"""The view index: streamed, incremental, cached, and safe with whatever the record files hold."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hermes_batch.view.index import CACHE_DIR_NAME, RunIndex
from hermes_batch.view.query import Query, run_query
from hermes_batch.view.summary import run_totals
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
    # the first line of the batch file, whichever prompt of the batch finished first in the demo run
    first = json.loads((run_copy / "batch_0.jsonl").read_text().splitlines()[0])
    assert status == "kept" and record == first
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


def _snapshot(index):
    """What an index holds, to compare a loaded one with one built by a full pass (rows in any order)."""
    cols = index.columns

    def where(i):
        return index.files[cols.file[i]], cols.offset[i]

    rows = sorted((where(i), cols.status[i], cols.key[i], cols.turns[i], cols.duration[i], cols.tools[i])
                  for i in range(len(cols)))
    found = {word: sorted(map(where, index.search(word))) for word in ("otters", "6 times 7", "walruses", "zebras")}
    return rows, index.tallies.to_dict(), index.sources, found


def test_each_save_writes_only_the_rows_added_and_a_load_equals_a_full_pass(run_copy, tmp_path):
    cache = run_copy / CACHE_DIR_NAME
    first = RunIndex(run_copy)
    first.refresh()
    first.save()
    [segment] = [p for p in cache.iterdir() if p.name.startswith("snap-")]
    for n, word in enumerate(("otters", "zebras")):
        with open(run_copy / "batch_1.jsonl", "ab") as fh:
            fh.write(_kept_line(run_copy, f"A prompt about {word}.", 40 + n))
        again = RunIndex(run_copy)
        assert again.refresh() == 1
        again.save()
        again.close()
    segments = sorted(p for p in cache.iterdir() if p.name.startswith("snap-"))
    assert len(segments) == 3 and segment in segments  # the first segment was kept as it was, not written again
    assert [(s / "status.bin").stat().st_size for s in segments if s != segment] == [1, 1]
    loaded = RunIndex(run_copy)
    assert loaded.refresh() == 0
    full = RunIndex(run_copy, cache_dir=tmp_path / "elsewhere", persist=False)
    full.refresh()
    assert _snapshot(loaded) == _snapshot(full)
    assert list(loaded.search("zebras")) == [len(loaded) - 1]


def test_a_cache_of_too_many_segments_or_one_removed_is_written_again_as_one(run_copy, monkeypatch):
    from hermes_batch.view import cache as cache_module

    cache = run_copy / CACHE_DIR_NAME
    built = RunIndex(run_copy)
    built.refresh()
    built.save()
    monkeypatch.setattr(cache_module, "_MAX_SEGMENTS", 3)
    for n in range(3):
        with open(run_copy / "batch_2.jsonl", "ab") as fh:
            fh.write(_kept_line(run_copy, f"Prompt about otters number {n}.", 50 + n))
        index = RunIndex(run_copy)
        index.refresh()
        index.save()
    assert len(list(cache.glob("snap-*"))) == 1  # the third save found three segments: one again
    assert len(RunIndex(run_copy)) == len(built) + 3
    # another process rebuilt the cache and removed the segments this index was loaded from
    index = RunIndex(run_copy)
    for segment in cache.glob("snap-*"):
        shutil.rmtree(segment)
    assert len(list(index.search("otters"))) == 3  # its own open files still serve a search
    with open(run_copy / "batch_2.jsonl", "ab") as fh:
        fh.write(_kept_line(run_copy, "One more about otters.", 60))
    index.refresh()
    index.save()
    loaded = RunIndex(run_copy)
    assert len(loaded) == len(built) + 4 and len(list(loaded.search("otters"))) == 4


def test_an_old_or_damaged_cache_is_rebuilt(run_copy):
    index = RunIndex(run_copy)
    index.refresh()
    index.save()
    count = len(index)
    manifest = run_copy / CACHE_DIR_NAME / "manifest.json"
    data = json.loads(manifest.read_text())
    for damage in ({"version": 1}, {"count": count + 1}, {"tallies": None}):
        manifest.write_text(json.dumps({**data, **damage}))
        again = RunIndex(run_copy)
        assert len(again) == 0  # not loaded: the next refresh reads the records again
        assert again.refresh() == count


def test_samples_spread_over_many_records_as_over_a_list_of_them(run_copy, monkeypatch, tmp_path):
    from hermes_batch.view import sampling

    with open(run_copy / "batch_2.jsonl", "ab") as fh:
        for n in range(40):
            fh.write(_kept_line(run_copy, f"Filler {n}.", 100 + n))
    index = RunIndex(run_copy, cache_dir=tmp_path / "c", persist=False)
    index.refresh()
    listed = {k: index.spread(0, k, 1 << 30) for k in (1, 2, 5, 7)}
    too_long = index.spread(0, 5, 0)
    monkeypatch.setattr(sampling, "_FEW", 0)  # now found from the counts by blocks
    assert {k: index.spread(0, k, 1 << 30) for k in (1, 2, 5, 7)} == listed
    assert index.spread(0, 5, 0) == too_long == []
    longest = max(index.rows_of(0), key=lambda i: index.columns.length[i])
    chosen = index.spread(0, 5, index.columns.length[longest] - 1)
    assert longest not in chosen and len(chosen) == 5 and chosen == sorted(set(chosen))


def _poisoned_line(run_dir, prompt: str, prompt_index: int) -> bytes:
    """A kept record as an old run or a hand edit may have left it: numbers that are no finite number."""
    record = read_jsonl(run_dir / "batch_0.jsonl")[0]
    record["prompt_index"] = prompt_index
    for turn in record["conversations"]:
        if turn["from"] == "human":
            turn["value"] = prompt
    record["api_calls"] = "API_CALLS"
    usage = record["metadata"]["usage"]
    usage.update(prompt_tokens="TOKENS", cost="COST")
    record["metadata"]["duration_s"] = "DURATION"
    for call in record["metadata"]["calls"]:
        call["latency_s"] = "LATENCY"
    for stat in record["tool_stats"].values():
        stat["count"] = "TOOL_CALLS"
    text = json.dumps(record)
    for name, value in (("API_CALLS", "1e999"), ("TOKENS", "1e999"), ("COST", "Infinity"), ("DURATION", "NaN"),
                        ("LATENCY", "-Infinity"), ("TOOL_CALLS", "1e999")):
        text = text.replace(f'"{name}"', value)
    return (text + "\n").encode()


def test_lines_that_are_no_record_are_skipped_and_counted_once_and_odd_numbers_count_as_unknown(run_copy):
    with open(run_copy / "batch_0.jsonl", "ab") as fh:
        fh.write(_poisoned_line(run_copy, "A record whose numbers overflow.", 40))
    with open(run_copy / "discarded.jsonl", "ab") as fh:
        fh.write(b"[1,2,3]\n")
        fh.write(b'{"trajectory": [1], "filters": ["f"], "reasons": ["r"]}\n')
        fh.write(b"42\n")
    index = RunIndex(run_copy)
    assert index.refresh() == 12  # the 11 records and the poisoned one; the three lines that are no record are not
    assert index.tallies.unreadable == 3
    row = next(i for i in range(len(index)) if index.columns.prompt[i] == 40)
    completion = read_jsonl(run_copy / "batch_0.jsonl")[0]["metadata"]["usage"]["completion_tokens"]
    # unknown where the record says 1e999 or NaN: no model calls, only the completion tokens, no duration
    assert (index.columns.turns[row], index.columns.tokens[row], index.columns.duration[row]) == (0, completion, 0.0)
    assert list(index.search("numbers overflow")) == [row]
    totals = run_totals(run_copy)
    assert totals.cost.value is None or totals.cost.value < 1e6  # the Infinity counted as not reported
    # a live viewer refreshes every second: nothing is counted again
    for _ in range(3):
        assert index.refresh() == 0
    assert len(index) == 12 and index.tallies.unreadable == 3
    with open(run_copy / "discarded.jsonl", "ab") as fh:
        fh.write((run_copy / "discarded.jsonl").read_bytes().splitlines(keepends=True)[0])
    assert index.refresh() == 1 and len(index) == 13
    index.save()
    again = RunIndex(run_copy)
    assert again.refresh() == 0 and len(again) == 13 and again.tallies.unreadable == 3


def test_a_refresh_cut_short_goes_on_where_it_stopped_and_counts_nothing_twice(run_copy, monkeypatch):
    """A pass that fails part way (a full disk under the search file) keeps what it indexed; the next one goes on."""
    with open(run_copy / "batch_2.jsonl", "ab") as fh:
        for k in range(6):
            fh.write(_kept_line(run_copy, f"Appended prompt number {k}.", 100 + k))
    index = RunIndex(run_copy)
    real_add, calls = RunIndex._add, []

    def add_until_the_disk_fills(self, file_id, status, offset, line):
        calls.append(offset)
        if len(calls) == 9:
            raise OSError(28, "No space left on device")
        return real_add(self, file_id, status, offset, line)

    monkeypatch.setattr(RunIndex, "_add", add_until_the_disk_fills)
    with pytest.raises(OSError):
        index.refresh()
    assert len(index) == 8
    monkeypatch.setattr(RunIndex, "_add", real_add)
    assert index.refresh() == 17 - 8
    assert len(index) == 17
    assert sorted(index.columns.prompt[i] for i in range(len(index)) if index.columns.prompt[i] >= 100) == list(range(100, 106))
    for k in range(6):
        assert len(list(index.search(f"prompt number {k}."))) == 1


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_lines_across_chunks_are_indexed_as_in_one_read(run_copy, monkeypatch, chunk):
    from hermes_batch.view import index as index_module

    with open(run_copy / "batch_2.jsonl", "ab") as fh:
        fh.write(_kept_line(run_copy, "A long prompt " + "x" * 20_000 + " that ends here.", 77))
    whole = RunIndex(run_copy, cache_dir=run_copy / "whole", persist=False)
    whole.refresh()
    monkeypatch.setattr(index_module, "_CHUNK", chunk)
    pieces = RunIndex(run_copy, cache_dir=run_copy / "pieces", persist=False)
    pieces.refresh()
    assert len(pieces) == len(whole) == 12
    for name in ("offset", "length", "prompt", "status", "turns", "tokens", "text"):
        assert getattr(pieces.columns, name) == getattr(whole.columns, name), name
    row = list(whole.columns.prompt).index(77)
    assert list(pieces.search("a long prompt")) == list(whole.search("a long prompt")) == [row]


def test_a_long_line_is_indexed_in_time_linear_in_its_length(run_copy, monkeypatch):
    """A chunk of a line that spans many is not copied with all of the line before it (which is quadratic)."""
    import time

    from hermes_batch.view import index as index_module

    monkeypatch.setattr(index_module, "_CHUNK", 1024)  # 8,000 chunks for one 8 MB line, as 100 chunks of 4 MB for 400 MB
    with open(run_copy / "batch_2.jsonl", "ab") as fh:
        fh.write(_kept_line(run_copy, "A huge prompt " + "y" * 8_000_000, 78))
    index = RunIndex(run_copy, persist=False)
    started = time.process_time()
    assert index.refresh() == 12
    # linear: well under a second of CPU; copying the line again per chunk is 32 GB of copies, a minute or more
    assert time.process_time() - started < 5


def test_the_viewer_names_a_prompt_by_the_digest_the_run_folder_index_keeps(run_copy):
    from hermes_batch.folder.record_index import RecordIndex as FolderIndex
    from hermes_batch.folder.runfolder import RunFolder

    record = json.loads(_kept_line(run_copy, "A prompt of a hand-made record.", 98))
    record["metadata"]["content_key"] = "not a hash"  # no content key the run made: hashed, by the same digest
    with open(run_copy / "batch_2.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")
    index = RunIndex(run_copy)
    index.refresh()
    viewer = sorted(index.columns.key[i] for i in range(len(index)) if index.columns.status[i] != 2)
    folder_index = FolderIndex(RunFolder(run_copy.parent, run_copy.name))
    folder = sorted(folder_index.finished_digests())
    assert viewer == folder and len(folder) == 11
