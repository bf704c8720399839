"""What a run paid for is what its totals say, also after SIGKILL and Ctrl-C.

The scripted server counts every request it receives; statistics.json, the
``--max_cost`` budget and the session counts must agree with it whatever
interrupted the run.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import attrs
import pytest

from hermes_batch.testing import write_dataset

from hermes_batch.contract.interfaces import PREFLIGHT_PROMPT
from hermes_batch.folder.journal import read_journal
from hermes_batch.formats.records import Usage
from hermes_batch.folder.durable import AppendLog
from hermes_batch.testing import ToolLoopScript
from hermes_batch.testing.fixtures import wait_for

BASE = ("--distribution", "terminal_only", "--seed", "7")
COST = 0.001  # per answered call


def priced(script):
    def answer(request):
        return attrs.evolve(script(request), usage=Usage(prompt_tokens=100, completion_tokens=10, cost=COST))

    return answer


def json_file(path):
    return json.loads(path.read_text())


def records_saved(folder) -> int:
    lines = 0
    for path in [*folder.glob("batch_*.jsonl"), folder / "discarded.jsonl", folder / "failed.jsonl"]:
        if path.exists():
            lines += path.read_bytes().count(b"\n")
    return lines


def test_sigkill_then_resume_counts_every_request_the_endpoint_served(tmp_path, runner, model_server):
    prompts = [f"task {i}: count the files" for i in range(40)]
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    stuck = set(prompts[20:28])  # eight prompts whose second request hangs: all eight workers end up waiting there
    hanging = threading.Event()
    hanging.set()
    server = model_server(
        priced(ToolLoopScript(tool_calls=2)),
        hang=lambda r: hanging.is_set() and r.prompt in stuck and r.turn == 1,
    )
    proc = runner.spawn(data, *BASE, "--num_workers", "8", server=server)
    try:
        # every worker waits on a hung request, so no request is on its way: the server saw all that was sent
        wait_for(lambda: sum(r.prompt in stuck and r.turn == 1 for r in server.requests) == 8, 120,
                 "eight requests hanging", proc)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
        hanging.clear()
    folder = runner.folder()

    def served():
        return server.request_count - server.calls_for(PREFLIGHT_PROMPT)

    def answered():
        return server.responses_by_status[200] - server.calls_for(PREFLIGHT_PROMPT)

    # The killed session's calls are in no record: 20 prompts finished (3 calls each), the eight stuck ones
    # were answered once and left one request hanging.  The journal has them all.
    journal = read_journal(folder / "calls.jsonl")
    assert (journal.requests, journal.unanswered) == (served(), 8) == (20 * 3 + 8 * 2, 8)
    assert journal.cost == pytest.approx(COST * answered())

    # the budget counts what the killed session paid for: at this --max_cost nothing more may start
    before = server.request_count
    result = runner.invoke(data, *BASE, "--resume", "--max_cost", f"{COST * answered() - COST / 2}", server=server)
    assert result.exit_code == 0, result.output
    assert "--max_cost" in result.output and server.request_count == before

    result = runner.invoke(data, *BASE, "--resume", "--max_cost", "none", server=server)  # the budget lifted
    assert result.exit_code == 0, result.output
    stats = json_file(folder / "statistics.json")
    assert stats["prompts"]["kept"] == 40
    requests = stats["model_requests"]
    # the stuck prompts' first answers were replayed from responses.jsonl: only their hung requests went out again
    assert requests["requests"] == served() == 40 * 3 + 8
    assert requests["unanswered"] == 8 and requests["errors"] == 8
    assert stats["cost"] == pytest.approx(COST * answered())
    assert stats["tokens"]["prompt"] == 100 * answered()
    assert stats["finished"]["model_calls"] == 40 * 3  # what the kept records hold


def test_ctrl_c_counts_every_prompt_it_saved_and_every_request_it_sent(tmp_path, runner, model_server, monkeypatch):
    """A Ctrl-C that lands while finished prompts are being written: each one written is counted."""
    quick = [f"quick {i}: count the files" for i in range(12)]
    stuck = [f"stuck {i}: count the files" for i in range(12)]
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for pair in zip(quick, stuck) for p in pair])
    hanging = threading.Event()
    hanging.set()
    server = runner.server = model_server(
        priced(ToolLoopScript(tool_calls=1)), latency=0.1,
        hang=lambda r: hanging.is_set() and r.prompt in stuck and r.turn == 1,
    )
    folder = runner.folder()
    slow = AppendLog.write_sync

    def slow_disk(self, records):
        time.sleep(0.3)  # so that several records are on their way to the disk when Ctrl-C comes
        slow(self, records)

    monkeypatch.setattr(AppendLog, "write_sync", slow_disk)

    def interrupt():
        # no request on its way (the quick prompts made all theirs, the stuck ones hang), records being written
        wait_for(lambda: all(server.calls_for(p) == 2 for p in [*quick, *stuck]), 120, "every request sent")
        wait_for(lambda: any(p.stat().st_size for p in folder.glob("batch_*.jsonl")), 120, "a first saved prompt")
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt)
    thread.start()
    try:
        result = runner.invoke(data, *BASE, "--num_workers", "24")
    finally:
        thread.join()
        hanging.clear()
    assert result.exit_code == 130, result.output

    saved = records_saved(folder)
    assert 0 < saved <= len(quick)
    session = json_file(folder / "checkpoint.json")["sessions"][-1]
    assert session["interrupted"] is True
    assert session["prompts_run"] == saved
    stats = json_file(folder / "statistics.json")
    assert stats["prompts"]["finished"] == saved
    requests = stats["model_requests"]
    assert requests["requests"] == server.request_count - server.calls_for(PREFLIGHT_PROMPT) == 48
    # cut off by Ctrl-C without an answer: requests the run cut itself, none an error of the endpoint
    assert requests["errors"] == 0
