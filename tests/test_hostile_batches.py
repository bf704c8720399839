"""``--batch_api`` against faulty batch servers: results of any shape and size, limits on a batch's size,
a listing that is refused, and a kill while requests wait for their batch.

Nothing an endpoint sends back may make a run pay twice for an answer it received, or crash it; a batch
too large for the endpoint goes out in pieces; what a killed run never sent is never counted as sent.
"""

from __future__ import annotations

import asyncio
import json
import signal
import tracemalloc
import zlib

import pytest

from hermes_batch.testing import (
    TEST_API_KEY, BatchSettings, Runner, ScriptedModelServer, ToolLoopScript, wait_for, write_dataset,
)

COMMAND = 'echo "{prompt_hash}-{turn}" >> log.txt && cat log.txt'
FAST = ("--batch_api", "--batch_api_max_wait", "0.3", "--batch_api_poll_interval", "0.1")
CLIENTS = {"openai": (), "anthropic": ("--model_client", "anthropic")}
OPTIONS = ("--distribution", "terminal_only", "--sandbox", "local")


def dataset(tmp_path, n: int, size: int = 0):
    pad = " " + "x" * size if size else ""
    return write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Task {i}: look around{pad}"} for i in range(n)])


def run(tmp_path, n: int, client: str = "openai", *extra: str, size: int = 0, **settings):
    data = dataset(tmp_path, n, size)
    with ScriptedModelServer(ToolLoopScript(tool_calls=2, command=COMMAND), api_key=TEST_API_KEY,
                             batches=BatchSettings(delay=0.1, **settings)) as server:
        runner = Runner(tmp_path, server=server, options=(*OPTIONS, "--num_workers", str(n), *CLIENTS[client]))
        result = runner.invoke(data, *FAST, "--batch_api_max_requests", str(n), "--batch_api_max_wait", "2", *extra)
    return result, server, runner


def assert_each_answer_paid_once(server, runner, n: int) -> None:
    twice = {digest: k for digest, k in server.batches.processed.items() if k > 1}
    assert not twice, f"{len(twice)} request(s) processed more than once"
    assert server.batches.requests_processed == 3 * n
    kept = runner.records("trajectories.jsonl")
    assert len(kept) == n and all(t["completed"] for t in kept)


def lines_of(data: bytes) -> list:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def dump(lines: list) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_line_that_is_not_json_in_the_results_costs_only_itself(tmp_path, client):
    """One line of garbage among the results (Anthropic's SDK failed the whole batch on it, and the resume paid
    for every request again): the other results are used."""

    def garbage(kind, data):
        lines = data.split(b"\n")
        return b"\n".join(lines[:2] + [b"<html>502 Bad Gateway</html>", b"[" * 100_000] + lines[2:])

    result, server, runner = run(tmp_path, 6, client, results=garbage)
    assert result.exit_code == 0, result.output
    assert_each_answer_paid_once(server, runner, 6)


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_request_listed_twice_keeps_its_answer_over_the_error(tmp_path, client):
    """Two results for one custom_id, the answer then a 500: the answer was paid for and is used; the error
    must not send the request again."""

    def twice(kind, data):
        out = []
        for line in lines_of(data):
            out.append(line)
            if client == "openai":
                out.append({**line, "response": {"status_code": 500, "body": {"error": {"message": "boom"}}}})
            else:
                out.append({**line, "result": {"type": "errored",
                                               "error": {"type": "error", "error": {"type": "api_error",
                                                                                   "message": "boom"}}}})
        return dump(out)

    result, server, runner = run(tmp_path, 4, client, results=twice)
    assert result.exit_code == 0, result.output
    assert_each_answer_paid_once(server, runner, 4)
    stats = json.loads((runner.folder() / "statistics.json").read_text())["batch_api"]
    assert stats["failed"] == 0


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_batch_the_endpoint_refuses_as_too_large_goes_out_in_pieces(tmp_path, client):
    """40 prompts of 100 KB in one 4 MB batch, which the endpoint refuses with 413 beyond 1 MB: every prompt
    still runs, once (they all failed, where a synchronous run succeeds)."""
    result, server, runner = run(tmp_path, 40, client, size=100_000, max_bytes=1_000_000)
    assert result.exit_code == 0, result.output
    assert_each_answer_paid_once(server, runner, 40)
    assert server.batches.too_large >= 1 and max(server.batches.batch_sizes) < 40


def test_a_batch_is_cut_to_the_providers_byte_limit_before_it_is_sent(tmp_path, monkeypatch):
    from hermes_batch.default_plugins.openai_client import OpenAIBatches

    monkeypatch.setattr(OpenAIBatches, "max_bytes", 1_000_000)  # as its 200 MB, for 100 KB prompts
    result, server, runner = run(tmp_path, 40, "openai", size=100_000, max_bytes=1_000_000)
    assert result.exit_code == 0, result.output
    assert server.batches.too_large == 0  # never refused: each batch fitted
    assert_each_answer_paid_once(server, runner, 40)
    assert all(size <= 9 for size in server.batches.batch_sizes), server.batches.batch_sizes


def test_a_request_larger_than_any_batch_fails_its_prompt_with_one_sentence(tmp_path, monkeypatch):
    from hermes_batch.default_plugins.openai_client import OpenAIBatches

    monkeypatch.setattr(OpenAIBatches, "max_bytes", 50_000)
    result, server, runner = run(tmp_path, 2, "openai", "--no_preflight", size=100_000)
    assert result.exit_code == 3, result.output
    failed = runner.records("failed.jsonl")
    assert len(failed) == 2 and "more than one batch of the endpoint may hold (0.05 MB)" in failed[0]["message"]
    assert server.batches.created == 0
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert stats["model_requests"]["requests"] == 0  # nothing was sent


def bombed(data: bytes, megabytes: int) -> bytes:
    """``data`` and a line of ``megabytes`` MB after it, as one gzip stream of a few hundred kilobytes."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = b"x" * (1 << 20)
    parts = [packer.compress(data + b'{"custom_id": "')] + [packer.compress(chunk) for _ in range(megabytes)]
    parts.append(packer.compress(b'"}\n') + packer.flush())
    return b"".join(parts)


def test_a_results_file_that_decompresses_to_hundreds_of_megabytes_is_read_a_line_at_a_time(tmp_path):
    """The output file holds the answers and a gzip bomb (300 MB of one line, 300 KB on the wire): the answers are
    used and the bomb is skipped, never held (downloaded and decoded whole, such a file took 3.1 GB)."""
    assert len(bombed(b"", 300)) < 1_000_000

    def bomb(kind, data):
        return bombed(data, 300), {"Content-Encoding": "gzip"}

    tracemalloc.start()
    try:
        result, server, runner = run(tmp_path, 3, "openai", results=bomb)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.exit_code == 0, result.output
    assert_each_answer_paid_once(server, runner, 3)
    assert peak < 150 * 2**20, f"{peak / 2**20:.0f} MB"


@pytest.mark.parametrize("status, says", [
    (405, "has no batch API (405"),
    (400, "Checking the endpoint's batch API failed"),
])
def test_a_refused_check_of_the_batch_api_is_one_sentence_and_exit_2(tmp_path, status, says):
    data = dataset(tmp_path, 2)
    with ScriptedModelServer(ToolLoopScript(tool_calls=2), api_key=TEST_API_KEY,
                             batches=BatchSettings(list_status=status)) as server:
        runner = Runner(tmp_path, server=server, options=OPTIONS)
        result = runner.invoke(data, *FAST)
        assert result.exit_code == 2, result.output
        message = result.output.strip().splitlines()[-1]
        assert says in message and "run without --batch_api" in message and "internal error" not in message
        assert server.batches.created == 0
    assert not runner.folder().exists()


# --- what is counted as sent ---------------------------------------------------------------------------------


async def test_requests_still_waiting_for_their_batch_are_not_journaled_as_sent(tmp_path):
    """Queued for a batch that never went out (the run stopped first): no ``sent`` line, no end line; the
    requests whose batch went out have both."""
    from hermes_batch.contract.interfaces import ModelSettings
    from hermes_batch.folder.journal import CallJournal, read_journal
    from hermes_batch.formats.records import Message
    from hermes_batch.model.batching import BatchOptions
    from hermes_batch.model.ratelimit import CallLimiter
    from hermes_batch.run.batch_client import BatchingClient

    from test_batch_api import FakeBatches

    class Inner:  # a model client's parts a BatchingClient uses
        name, packages = "fake", ()
        settings = ModelSettings("m", "http://127.0.0.1/v1", max_retries=0)

        def __init__(self):
            self.limiter = CallLimiter.from_settings(self.settings)

        def batch_api(self):
            return FakeBatches()

    client = BatchingClient(Inner(), BatchOptions(max_requests=2, max_wait=3600, poll_interval=0.01))
    journal = client.journal = CallJournal(tmp_path / "calls.jsonl", 0)
    client.batcher.on_sent = journal.sent  # as BatchingClient.open_journal sets it
    sessions = [asyncio.ensure_future(client.complete((Message("user", f"q{i}"),), ())) for i in range(3)]
    done, waiting = await asyncio.wait(sessions, timeout=1)
    assert len(done) == 2 and len(waiting) == 1  # a full batch of two went out; the third waits an hour
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    await client.batcher.aclose()
    journal.close()
    totals = read_journal(tmp_path / "calls.jsonl")
    assert (totals.sent, totals.done, totals.requests, totals.unanswered, totals.errors) == (2, 2, 2, 0, 0)


def test_a_run_killed_while_requests_wait_for_their_batch_counts_only_what_the_endpoint_received(tmp_path, procs):
    """Five sessions, batches of four and an hour's --batch_api_max_wait: one request always waits in the queue.
    Killed there and resumed, the statistics count the requests the endpoint received, none unanswered (the
    waiting ones were counted as sent, and never answered)."""
    data = dataset(tmp_path, 5)
    with ScriptedModelServer(ToolLoopScript(tool_calls=2, command=COMMAND), api_key=TEST_API_KEY,
                             batches=BatchSettings(delay=0.2)) as server:
        runner = Runner(tmp_path, server=server, options=(*OPTIONS, "--num_workers", "5"))
        proc = runner.spawn(data, "--batch_api", "--batch_api_max_requests", "4", "--batch_api_max_wait", "3600",
                            "--batch_api_poll_interval", "0.1", start_new_session=True)
        procs.append(proc)
        wait_for(lambda: server.batches.requests_processed >= 8, 120, "two batches processed", proc)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        result = runner.invoke(data, *FAST, "--resume")
        assert result.exit_code == 0, result.output
        received = server.batches.requests_processed
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert (stats["model_requests"]["requests"], stats["model_requests"]["unanswered"]) == (received, 0)
    assert len(runner.records("trajectories.jsonl")) == 5
