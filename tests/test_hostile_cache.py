"""``--response_cache`` under faults: a folder that cannot be used, a damaged database, a lock held elsewhere.

The cache is shared by every run that names it, so it is checked before the preflight (a cache that
cannot be used costs nothing to fix and leaves no run folder), damage found later turns it off instead
of failing prompts, and another process holding its write lock never holds up the run.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time

import pytest

from hermes_batch.folder.response_cache import ResponseCache
from hermes_batch.formats.records import Message, ModelResponse
from hermes_batch.testing import ToolLoopScript, write_dataset

BASE = ("--distribution", "terminal_only", "--seed", "5")


def dataset(tmp_path, n: int = 3):
    return write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {k}: look"} for k in range(n)])


def cached_run(tmp_path, runner, model_server):
    data = dataset(tmp_path)
    server = model_server(ToolLoopScript(tool_calls=2))
    cache = tmp_path / "cache"
    result = runner.invoke(data, *BASE, "--response_cache", str(cache), server=server, run_name="first")
    assert result.exit_code == 0, result.output
    return data, server, cache


@pytest.mark.parametrize("kind", ["a FIFO", "a read-only folder", "not a database", "a symbolic link"])
def test_a_cache_that_cannot_be_used_stops_the_run_before_the_preflight_and_leaves_nothing(
        tmp_path, runner, model_server, kind):
    data = dataset(tmp_path)
    server = model_server(ToolLoopScript(tool_calls=2))
    cache = tmp_path / "cache"
    if kind == "a FIFO":
        cache.mkdir()
        os.mkfifo(cache / "responses.sqlite")
    elif kind == "a read-only folder":
        cache.mkdir()
        cache.chmod(0o500)
    elif kind == "not a database":
        cache.mkdir()
        (cache / "responses.sqlite").write_bytes(b"this is no SQLite file, just text " * 200)
    else:
        cache.mkdir()
        (tmp_path / "elsewhere.sqlite").write_bytes(b"")
        (cache / "responses.sqlite").symlink_to(tmp_path / "elsewhere.sqlite")
    try:
        if kind == "a read-only folder" and os.access(cache, os.W_OK):
            pytest.skip("the test runs as a user every folder is writable to (root)")
        result = runner.invoke(data, *BASE, "--response_cache", str(cache), server=server)
        assert result.exit_code == 2, result.output
        message = result.output.strip().splitlines()[-1]
        assert message.startswith(f"Error: --response_cache {cache}: ") and "leave the option out" in message
        assert server.request_count == 0  # not even the preflight
        assert not runner.folder().exists()  # so the corrected command runs as typed
    finally:
        if cache.is_dir():
            cache.chmod(0o700)
    result = runner.invoke(data, *BASE, "--response_cache", str(tmp_path / "good"), server=server)
    assert result.exit_code == 0, result.output


def test_a_cache_overwritten_past_its_first_page_is_one_sentence_before_anything_is_paid(
        tmp_path, runner, model_server):
    data, server, cache = cached_run(tmp_path, runner, model_server)
    path = cache / "responses.sqlite"
    size = path.stat().st_size
    assert size > 4096
    with open(path, "r+b") as handle:
        handle.seek(4096)
        handle.write(b"\xa5" * (size - 4096))
    before = server.request_count
    result = runner.invoke(data, *BASE, "--response_cache", str(cache), server=server, run_name="second")
    assert result.exit_code == 2, result.output
    message = result.output.strip().splitlines()[-1]
    assert message.startswith(f"Error: --response_cache {cache}: damaged database {path}")
    assert "move the file away (a new cache is made)" in message
    assert server.request_count == before
    path.rename(cache / "damaged.sqlite")  # as the sentence says: the next run starts a new cache
    result = runner.invoke(data, *BASE, "--response_cache", str(cache), server=server, run_name="second")
    assert result.exit_code == 0, result.output


def answer(text: str) -> ModelResponse:
    return ModelResponse(Message("assistant", text))


def test_damage_found_during_a_run_turns_the_cache_off_instead_of_failing_prompts(tmp_path, caplog):
    cache = ResponseCache(tmp_path)
    cache.put("r1", answer("one"))
    cache.close()
    cache = ResponseCache(tmp_path)
    assert cache.get("r1") == answer("one")

    class Damaged:
        def execute(self, *args):
            raise sqlite3.DatabaseError("database disk image is malformed")

        def close(self):
            pass

    cache._db = Damaged()
    assert cache.get("r1") is None and cache.get("r2") is None
    cache.put("r3", answer("three"))  # not tried: the cache is off
    assert caplog.text.count("the run goes on without it") == 1
    cache.close()


@pytest.mark.parametrize("row", [
    "[" * 100_000 + "]" * 100_000,
    json.dumps({"m": ["user", "hi", None, [], None, None, None], "u": [0, 0, 0, 0, None]}),
    json.dumps({"m": ["assistant", 5, None, [], None, None, None], "u": [0, 0, 0, 0, None]}),
    "NaN",
    "x" * 100,
])
def test_a_cached_row_that_is_no_answer_is_a_miss(tmp_path, row):
    cache = ResponseCache(tmp_path)
    cache.close()
    with sqlite3.connect(tmp_path / "responses.sqlite") as db:
        db.execute("INSERT INTO answers VALUES (?, ?)", ("r", row))
    cache = ResponseCache(tmp_path)
    assert cache.get("r") is None and cache.hits == 0
    cache.close()


def test_a_write_lock_held_by_another_process_does_not_hold_up_the_run(tmp_path, runner, model_server, caplog):
    """Another process holds the cache's write lock for the whole run: every answer the run adds waits for it,
    in the cache's own thread, never on the run's event loop (each put took 30 s there, one after another)."""
    cache = tmp_path / "cache"
    ResponseCache(cache).close()
    holder = sqlite3.connect(cache / "responses.sqlite", isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO answers VALUES ('held', 'x')")
    data = dataset(tmp_path, 4)
    server = model_server(ToolLoopScript(tool_calls=2))
    started = time.monotonic()
    try:
        result = runner.invoke(data, *BASE, "--response_cache", str(cache), "--num_workers", "4", server=server)
        took = time.monotonic() - started
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert result.exit_code == 0, result.output
    assert len(runner.records("trajectories.jsonl")) == 4
    assert took < 25, took  # 12 answers, none of them waited for on the event loop (5 s at the end at most)


def test_answers_a_run_adds_are_there_for_the_next_once_it_ends(tmp_path):
    cache = ResponseCache(tmp_path)
    for n in range(50):
        cache.put(f"r{n}", answer(str(n)))
    cache.close()
    again = ResponseCache(tmp_path)
    assert len(again) == 50 and again.get("r49") == answer("49")
    again.close()


def test_the_cache_is_read_while_another_process_writes(tmp_path):
    cache = ResponseCache(tmp_path)
    cache.put("r", answer("kept"))
    cache.close()
    holder = sqlite3.connect(tmp_path / "responses.sqlite", isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    try:
        cache = ResponseCache(tmp_path)
        started = time.monotonic()
        assert cache.get("r") == answer("kept")
        cache.put("s", answer("later"))
        assert time.monotonic() - started < 1
        done = threading.Event()
        threading.Timer(0.5, lambda: (holder.execute("ROLLBACK"), done.set())).start()
        cache.close()  # the answer waiting goes in once the lock is released
        assert done.is_set()
    finally:
        holder.close()
    assert ResponseCache(tmp_path).get("s") == answer("later")
