"""``--batch_api``: multi-turn sessions through the OpenAI Batch API and Anthropic Message Batches.

The scripted server's batch endpoints are driven first through the real SDKs, then whole runs through
the CLI: trajectories like a synchronous run's, faults (an expired batch, a failing request inside a
batch, an endpoint without batches), Ctrl-C and a SIGKILL between submission and collection.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from hermes_batch.testing import (
    TEST_API_KEY, BatchSettings, ErrorRule, Runner, ScriptedModelServer, ToolLoopScript, ended, tool_outputs,
    wait_for, write_dataset,
)

# Each tool call appends a line only a shell computes to the sandbox's log and prints it: the output
# shows every earlier call of the prompt, so a session resumed on the wrong turn, or in another sandbox, shows.
COMMAND = 'echo "{prompt_hash}-{turn}" >> log.txt && cat log.txt'
FAST = ("--batch_api", "--batch_api_max_wait", "0.3", "--batch_api_poll_interval", "0.1")
CLIENTS = {"openai": (), "anthropic": ("--model_client", "anthropic")}
# the driver submits and collects, the workers run the sessions (hermes_batch/executors/batch_relay.py)
EXECUTORS = {"local": (), "processes": ("--executor", "processes", "-E", "workers=2")}
# (the root conftest.py marks the processes executor's runs of the tests of both slow: its workers take seconds to start)
BOTH = ["local", "processes"]


def WHOLE_TURNS(n: int) -> tuple:  # noqa: N802 (options, like FAST)
    """For n prompts at --num_workers n whose turns go in step: each turn's batch goes out once all n are in,
    without waiting for --batch_api_max_wait."""
    return ("--batch_api_max_requests", str(n), "--batch_api_max_wait", "5")


def script(**options) -> ToolLoopScript:
    return ToolLoopScript(tool_calls=2, command=COMMAND, **options)


def dataset(tmp_path, n: int, prefix: str = "Task"):
    return write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"{prefix} {i}: look around"} for i in range(n)])


def run_options(*extra: str) -> tuple:
    return ("--distribution", "terminal_only", "--sandbox", "local", *extra)


def shapes(trajectories: list) -> dict:
    """prompt -> (the roles of its turns, the outputs of its tools, completed)."""
    return {
        next(turn["value"] for turn in t["conversations"] if turn["from"] == "human"): ([turn["from"] for turn in t["conversations"]], tool_outputs(t), t["completed"])
        for t in trajectories
    }


def no_request_twice(server: ScriptedModelServer) -> None:
    twice = {digest: n for digest, n in server.batches.processed.items() if n > 1}
    assert not twice, f"{len(twice)} request(s) processed more than once"


# --- the scripted server's batch endpoints, through the SDKs ------------------------------------------------


def _openai_lines(n: int, prefix: str = "hi") -> bytes:
    return "\n".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": f"{prefix} {i}"}]},
    }) for i in range(n)).encode()


async def _openai_batch(client, data: bytes):
    upload = await client.files.create(file=("batch.jsonl", data), purpose="batch")
    return await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                       completion_window="24h")


async def _until(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value is not None:
            return value
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_openai_batch_endpoints_through_the_sdk():
    import openai

    rules = [ErrorRule(status=500, rate=1.0, match=lambda request: request.prompt == "hi 1")]
    server = ScriptedModelServer(ToolLoopScript(tool_calls=1), errors=rules, batches=BatchSettings(delay=0.3))
    async with server:
        client = openai.AsyncOpenAI(api_key="k", base_url=server.base_url)
        batch = await _openai_batch(client, _openai_lines(3))
        assert batch.status == "in_progress" and batch.request_counts.total == 3
        assert server.batches.requests_processed == 0  # not before its delay

        async def ended_batch():
            found = await client.batches.retrieve(batch.id)
            return found if found.status == "completed" else None

        done = await _until(ended_batch)
        assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
        output = [json.loads(line) for line in (await client.files.content(done.output_file_id)).text.splitlines()]
        assert sorted(line["custom_id"] for line in output) == ["r0", "r2"]
        assert output[0]["response"]["status_code"] == 200
        assert output[0]["response"]["body"]["choices"][0]["message"]["tool_calls"]
        errors = [json.loads(line) for line in (await client.files.content(done.error_file_id)).text.splitlines()]
        assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("r1", 500)]
        assert server.batches.requests_processed == 3 and server.batches.batch_sizes == [3]
        listed = await client.batches.list(limit=1)
        assert [b.id for b in listed.data] == [batch.id]


async def test_openai_batches_expire_and_cancel():
    import openai

    settings = BatchSettings(delay=lambda number: 0.2 if number == 1 else 30.0, expire=lambda number: number == 1)
    async with ScriptedModelServer(ToolLoopScript(tool_calls=1), batches=settings) as server:
        client = openai.AsyncOpenAI(api_key="k", base_url=server.base_url)
        expiring = await _openai_batch(client, _openai_lines(2))
        slow = await _openai_batch(client, _openai_lines(2, "slow"))

        async def expired():
            found = await client.batches.retrieve(expiring.id)
            return found if found.status == "expired" else None

        gone = await _until(expired)
        assert gone.output_file_id is None
        errors = [json.loads(line) for line in (await client.files.content(gone.error_file_id)).text.splitlines()]
        assert {e["error"]["code"] for e in errors} == {"batch_expired"}
        cancelled = await client.batches.cancel(slow.id)
        assert cancelled.status == "cancelled"
        assert server.batches.requests_processed == 0  # neither processed a request


async def test_anthropic_message_batches_through_the_sdk():
    import anthropic

    rules = [ErrorRule(status=529, rate=1.0, match=lambda request: request.prompt == "b")]
    settings = BatchSettings(delay=0.2, expire=lambda number: number == 2)
    async with ScriptedModelServer(ToolLoopScript(tool_calls=0), errors=rules, batches=settings) as server:
        client = anthropic.AsyncAnthropic(api_key="k", base_url=server.anthropic_base_url)

        def request(custom_id, prompt):
            return {"custom_id": custom_id, "params": {"model": "m", "max_tokens": 100,
                                                       "messages": [{"role": "user", "content": prompt}]}}

        batch = await client.messages.batches.create(requests=[request("a", "a"), request("b", "b")])
        assert batch.processing_status == "in_progress" and batch.request_counts.processing == 2
        expiring = await client.messages.batches.create(requests=[request("c", "c")])

        async def ended_batch(batch_id):
            found = await client.messages.batches.retrieve(batch_id)
            return found if found.processing_status == "ended" else None

        done = await _until(lambda: ended_batch(batch.id))
        assert (done.request_counts.succeeded, done.request_counts.errored) == (1, 1)
        results = {r.custom_id: r.result async for r in await client.messages.batches.results(batch.id)}
        assert results["a"].type == "succeeded" and results["a"].message.content[-1].text
        assert results["b"].type == "errored" and results["b"].error.error.type == "overloaded_error"
        gone = await _until(lambda: ended_batch(expiring.id))
        assert gone.request_counts.expired == 1
        assert [r.result.type async for r in await client.messages.batches.results(expiring.id)] == ["expired"]
        assert sorted(server.batches.processed.values()) == [1, 1]


async def test_an_endpoint_without_batches_answers_404():
    import openai

    async with ScriptedModelServer(ToolLoopScript(), batches=BatchSettings(enabled=False)) as server:
        client = openai.AsyncOpenAI(api_key="k", base_url=server.base_url)
        with pytest.raises(openai.NotFoundError):
            await client.batches.list()


@pytest.mark.parametrize("client", sorted(CLIENTS))
async def test_a_refused_key_at_the_batch_endpoints_is_fatal_and_a_missing_api_says_run_without(client):
    """Every batch route of the server refuses a bad key (401) and answers 404 without batches; the client's
    BatchAPI makes the first a FatalModelError that asks for another key, the second one that asks to run
    without --batch_api (exit status 2 at start)."""
    from hermes_batch.contract.interfaces import ModelSettings
    from hermes_batch.default_plugins.anthropic_client import AnthropicClient
    from hermes_batch.default_plugins.openai_client import OpenAIClient
    from hermes_batch.errors import FatalModelError

    for settings, key, says in ((BatchSettings(), "wrong", "refused the API key"),
                                (BatchSettings(enabled=False), TEST_API_KEY, "run without --batch_api")):
        async with ScriptedModelServer(ToolLoopScript(), api_key=TEST_API_KEY, batches=settings) as server:
            if client == "openai":
                model = OpenAIClient(ModelSettings("m", server.base_url, api_key=key))
            else:
                model = AnthropicClient(ModelSettings("m", server.anthropic_base_url, api_key=key))
            api = model.batch_api()
            try:
                with pytest.raises(FatalModelError, match=says):
                    await api.check()
                if key == "wrong":  # the upload or create of a batch too
                    with pytest.raises(FatalModelError, match=says):
                        await api.submit([("a-1", b'{"model":"m","max_tokens":10,"messages":[]}')])
            finally:
                await api.aclose()
                await model.aclose()


# --- runs ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_batch_run_makes_the_trajectories_of_a_synchronous_run(tmp_path, client, executor):
    """200 prompts of three turns each: the same turns and tool outputs, every prompt kept, no request twice;
    under --executor processes the batches hold the requests of both workers' sessions."""
    data = dataset(tmp_path, 200)
    with ScriptedModelServer(script(), api_key=TEST_API_KEY, record=False,
                             batches=BatchSettings(delay=0.2)) as server:
        runner = Runner(tmp_path, server=server,
                        options=run_options("--num_workers", "100", *CLIENTS[client], *EXECUTORS[executor]))
        sync = runner.invoke(data, run_name="sync")
        assert sync.exit_code == 0, sync.output
        assert server.batches.created == 0
        # under processes a longer wait: the two workers' sessions reach the driver over a wider spread
        wait = ("--batch_api_max_wait", "1") if executor == "processes" else ()
        batched = runner.invoke(data, *FAST, "--batch_api_max_requests", "80", *wait, run_name="batched")
        assert batched.exit_code == 0, batched.output
        no_request_twice(server)
        assert server.batches.requests_processed == 600  # 200 prompts x 3 turns, the preflight synchronous
        assert max(server.batches.batch_sizes) <= 80
        if executor == "processes":  # a worker runs 50 sessions: batches hold both workers' requests
            assert max(server.batches.batch_sizes) > 50
    expected = shapes(runner.records("trajectories.jsonl", run_name="sync"))
    got = shapes(runner.records("trajectories.jsonl", run_name="batched"))
    assert len(expected) == 200 and got == expected
    assert all(roles.count("gpt") == 3 and completed for roles, _outputs, completed in got.values())
    stats = json.loads((runner.folder("batched") / "statistics.json").read_text())
    assert stats["batch_api"]["requests"] == 600 and stats["batch_api"]["batches"] == len(server.batches.batch_sizes)
    assert stats["batch_api"]["requests_per_batch"] > 1 and stats["batch_api"]["wait_s"] > 0
    sync_stats = json.loads((runner.folder("sync") / "statistics.json").read_text())
    assert stats["model_requests"]["requests"] == sync_stats["model_requests"]["requests"] == 600
    assert "batch_api" not in sync_stats


def test_each_turn_goes_out_once_every_session_waits_not_after_max_wait(tmp_path):
    """6 prompts of 3 turns at a 30 s --batch_api_max_wait took 2 minutes against a 3 s batch: every round waited
    the full 30 s although every session of the run waited on the batch already."""
    data = dataset(tmp_path, 6)
    with ScriptedModelServer(script(), api_key=TEST_API_KEY, batches=BatchSettings(delay=0.1)) as server:
        runner = Runner(tmp_path, server=server, options=run_options("--num_workers", "6"))
        started = time.monotonic()
        result = runner.invoke(data, "--batch_api", "--batch_api_max_wait", "30", "--batch_api_poll_interval", "0.05")
        took = time.monotonic() - started
        assert result.exit_code == 0, result.output
        assert server.batches.batch_sizes == [6, 6, 6]  # each turn of every prompt in one batch
        assert took < 20, f"{took:.1f} s: a turn waited for --batch_api_max_wait"
    assert len(runner.records("trajectories.jsonl")) == 6


def test_an_expired_batch_sends_its_requests_again(tmp_path):
    data = dataset(tmp_path, 6)
    settings = BatchSettings(delay=0.2, expire=lambda number: number == 1)
    with ScriptedModelServer(script(), api_key=TEST_API_KEY, batches=settings) as server:
        runner = Runner(tmp_path, server=server, options=run_options("--num_workers", "6"))
        result = runner.invoke(data, *FAST)
        assert result.exit_code == 0, result.output
        no_request_twice(server)
        assert server.batches.batch_sizes[0] == 6  # the first turn of every prompt, which expired
        assert server.batches.requests_processed == 18
    stats = json.loads((runner.folder() / "statistics.json").read_text())["batch_api"]
    assert (stats["expired"], stats["requeued"]) == (1, 6)
    assert len(runner.records("trajectories.jsonl")) == 6


def test_the_cost_a_batch_reports_is_counted(tmp_path):
    """An endpoint that reports each batch request's cost (at its batch price): statistics.json counts it."""
    import attrs
    from hermes_batch.formats.records import Usage

    loop = script()

    def priced(request):
        return attrs.evolve(loop(request), usage=Usage(prompt_tokens=100, completion_tokens=10, cost=0.0005))

    data = dataset(tmp_path, 4)
    with ScriptedModelServer(priced, api_key=TEST_API_KEY, batches=BatchSettings(delay=0.05)) as server:
        runner = Runner(tmp_path, server=server, options=run_options("--num_workers", "4"))
        result = runner.invoke(data, *FAST, *WHOLE_TURNS(4))
        assert result.exit_code == 0, result.output
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert stats["cost"] == pytest.approx(12 * 0.0005)
    assert stats["batch_api"]["requests"] == 12


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_request_failing_inside_a_batch_is_retried_in_a_later_one(tmp_path, client):
    data = dataset(tmp_path, 4)
    # the second turn of one prompt fails once with a 500 inside its batch
    rules = [ErrorRule(status=500, first_attempts=1,
                       match=lambda request: request.prompt.startswith("Task 2") and request.turn == 1)]
    with ScriptedModelServer(script(), api_key=TEST_API_KEY, errors=rules, batches=BatchSettings(delay=0.1)) as server:
        runner = Runner(tmp_path, server=server, options=run_options("--num_workers", "4", *CLIENTS[client]))
        result = runner.invoke(data, *FAST)
        assert result.exit_code == 0, result.output
        assert server.batches.requests_processed == 13  # 12 turns, one of them twice: it failed the first time
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert stats["batch_api"]["failed"] == 1
    assert len(runner.records("trajectories.jsonl")) == 4


def test_a_request_failing_every_time_fails_its_prompt_after_the_retries(tmp_path):
    data = dataset(tmp_path, 2)
    rules = [ErrorRule(status=500, rate=1.0, match=lambda request: request.prompt.startswith("Task 1"))]
    with ScriptedModelServer(script(), api_key=TEST_API_KEY, errors=rules, batches=BatchSettings(delay=0.05)) as server:
        runner = Runner(tmp_path, server=server, options=run_options("--num_workers", "2"))
        result = runner.invoke(data, *FAST, "--max_retries", "1", "--no_preflight")
        assert result.exit_code != 0
        assert server.calls_for("Task 1: look around") == 2  # one retry, in a later batch
    assert [r["prompt"] for r in runner.records("failed.jsonl")] == ["Task 1: look around"]
    assert len(runner.records("trajectories.jsonl")) == 1


def test_an_endpoint_without_batches_stops_the_run_at_start(tmp_path):
    data = dataset(tmp_path, 2)
    with ScriptedModelServer(script(), api_key=TEST_API_KEY, batches=BatchSettings(enabled=False)) as server:
        runner = Runner(tmp_path, server=server, options=run_options())
        result = runner.invoke(data, *FAST)
        assert result.exit_code == 2, result.output
        assert "has no batch API" in result.output and "--batch_api" in result.output
        assert server.request_count == 1  # the preflight, nothing else
    assert not runner.folder().exists()


def test_batch_api_refuses_a_model_client_without_a_batch_api():
    from hermes_batch.contract.interfaces import ModelClient
    from hermes_batch.default_plugins.openai_client import OpenAIClient
    from hermes_batch.errors import UsageError
    from hermes_batch.run.plan import _check_batch_api

    class Plain(ModelClient):
        name = "plain"

        async def send(self, messages, tools):
            raise AssertionError("not called")

    _check_batch_api(OpenAIClient)
    with pytest.raises(UsageError, match="'plain' has no batch API; run without --batch_api"):
        _check_batch_api(Plain)


@pytest.mark.parametrize("executor", BOTH)
def test_prompt_timeout_applies_to_a_session_waiting_for_its_batch(tmp_path, executor):
    data = dataset(tmp_path, 4)
    # the first turn's batch ends at once, the second's never within the test
    settings = BatchSettings(delay=lambda number: 0.1 if number == 1 else 60)
    with ScriptedModelServer(script(), api_key=TEST_API_KEY, batches=settings) as server:
        runner = Runner(tmp_path, server=server, options=run_options("--num_workers", "4", *EXECUTORS[executor]))
        started = time.monotonic()
        result = runner.invoke(data, *FAST, "--batch_api_max_requests", "4", "--prompt_timeout", "4")
        assert time.monotonic() - started < 30, result.output
        assert server.batches.batch_sizes == [4, 4] and server.batches.requests_processed == 4
    ended = runner.records("trajectories.jsonl") + runner.records("discarded.jsonl")
    assert len(ended) == 4
    assert {(r["partial"], r["metadata"]["end_reason"]) for r in ended} == {(True, "timeout")}


@pytest.mark.parametrize("executor", ["processes"])
def test_a_request_cut_off_by_prompt_timeout_leaves_the_batch_being_filled(tmp_path, executor):
    """One session at a time: the first prompt's request waits for its batch (due at 3 s) past its --prompt_timeout
    (2 s): the driver of worker processes counts the prompts its workers hold, the second one too, so the batch
    waits.  The batch then goes out with the second prompt's request alone, at once (nothing more can come), and so
    does each of its next turns; the cut request is never sent.  (The local executor sends a lone session's request
    at once: test_a_batch_goes_out_when_no_more_requests_can_come.)"""
    data = dataset(tmp_path, 2)
    with ScriptedModelServer(script(), api_key=TEST_API_KEY, batches=BatchSettings(delay=0.1)) as server:
        runner = Runner(tmp_path, server=server, options=run_options("--num_workers", "1", *EXECUTORS[executor]))
        result = runner.invoke(data, *FAST, "--batch_api_max_wait", "3", "--prompt_timeout", "2")
        assert result.exit_code == 3, result.output
        assert server.batches.batch_sizes == [1, 1, 1] and server.batches.requests_processed == 3
    assert [r["prompt"] for r in runner.records("failed.jsonl")] == ["Task 0: look around"]
    pending = [line["requests"] for line in runner.records("batches.jsonl") if line["event"] == "pending"]
    assert [[prompt for _id, prompt, _turn in requests] for requests in pending] == [[1], [1], [1]]


def test_prompt_timeout_before_the_first_answer_fails_the_prompt(tmp_path):
    data = dataset(tmp_path, 2)
    with ScriptedModelServer(script(), api_key=TEST_API_KEY, batches=BatchSettings(delay=60)) as server:
        runner = Runner(tmp_path, server=server, options=run_options("--num_workers", "2"))
        result = runner.invoke(data, *FAST, "--prompt_timeout", "2")
        assert result.exit_code == 3, result.output
        assert server.batches.requests_processed == 0
    failed = runner.records("failed.jsonl")
    assert len(failed) == 2 and all("--prompt_timeout" in json.dumps(r) for r in failed)


def test_response_cache_answers_before_a_batch_is_made(tmp_path):
    """--response_cache with --batch_api: a cached answer is taken before the batch layer, so a second run folder
    of the same prompts puts nothing in a batch."""
    data = dataset(tmp_path, 3)
    cache = ("--response_cache", str(tmp_path / "cache"))
    with ScriptedModelServer(script(), api_key=TEST_API_KEY, batches=BatchSettings(delay=0.05)) as server:
        runner = Runner(tmp_path, server=server, options=run_options("--num_workers", "3"))
        result = runner.invoke(data, *FAST, *WHOLE_TURNS(3), *cache)
        assert result.exit_code == 0, result.output
        paid, created = server.batches.requests_processed, server.batches.created
        assert paid == 9
        result = runner.invoke(data, *FAST, *cache, run_name="second")
        assert result.exit_code == 0, result.output
        assert (server.batches.requests_processed, server.batches.created) == (paid, created)
    stats = json.loads((runner.folder("second") / "statistics.json").read_text())
    assert stats["batch_api"]["batches"] == 0 and stats["model_requests"]["requests"] == 0
    second = runner.records("trajectories.jsonl", run_name="second")
    assert len(second) == 3 and all(r["metadata"]["replayed_turns"] == 3 for r in second)
    assert shapes(second) == shapes(runner.records("trajectories.jsonl"))


# --- stopping and resuming -------------------------------------------------------------------------------------


def _submitted(runner: Runner) -> int:
    return sum(1 for line in runner.records("batches.jsonl") if line["event"] == "submitted")


@pytest.mark.parametrize("how, executor", [("SIGKILL", "local"), ("SIGINT", "local"), ("SIGKILL", "processes"),
                                           ("SIGINT", "processes")])
def test_a_resume_collects_the_batches_in_flight_instead_of_sending_them_again(tmp_path, procs, how, executor):
    """The driver is stopped while its batches are processed; --resume collects them and pays nothing twice.
    Under --executor processes the SIGKILLed driver's workers end with it (their pipes close)."""
    data = dataset(tmp_path, 8)
    # batches end 3 s after creation: time to stop the driver between submission and collection
    with ScriptedModelServer(script(), api_key=TEST_API_KEY, batches=BatchSettings(delay=3.0)) as server:
        runner = Runner(tmp_path, server=server, options=run_options("--num_workers", "8", *EXECUTORS[executor]))
        proc = runner.spawn(data, *FAST)
        procs.append(proc)
        wait_for(lambda: runner.folder().joinpath("batches.jsonl").exists() and _submitted(runner) >= 1, 60,
                 "a batch submitted", proc)
        assert server.batches.requests_processed == 0  # submitted, not yet processed
        proc.send_signal(getattr(signal, how))
        _out, err = ended(proc)
        assert proc.returncode == (-signal.SIGKILL if how == "SIGKILL" else 130), err
        if how == "SIGINT":
            assert "left in flight at the provider; --resume collects them" in err
        first = server.batches.created
        result = runner.invoke(data, *FAST, "--resume")
        assert result.exit_code == 0, result.output
        no_request_twice(server)
        assert server.batches.requests_processed == 24  # 8 prompts x 3 turns, each once
        full = json.loads((runner.folder() / "statistics.json").read_text())
        stats = full["batch_api"]
        assert stats["replayed"] >= 8  # the first turns, from the batch of the stopped session
        assert server.batches.created - first == stats["batches"]
    # each request counted once: the stopped session's requests left in its batch ended with the resume's collection
    assert full["model_requests"]["requests"] == 24 and full["model_requests"]["errors"] == 0, full["model_requests"]
    got = shapes(runner.records("trajectories.jsonl"))
    assert len(got) == 8
    for _roles, outputs, completed in got.values():
        # each turn's command ran once in the resumed session's sandbox, in order
        tag = outputs[0].split("-")[0]
        assert completed and outputs == [f"{tag}-0\n", f"{tag}-0\n{tag}-1\n"]


def _journaled(runner: Runner) -> int:
    """The answers responses.jsonl (the replay journal) holds."""
    path = runner.folder() / "responses.jsonl"
    return path.read_text().count('"h":') if path.exists() else 0


@pytest.mark.parametrize("executor", sorted(EXECUTORS))
def test_a_resume_replays_the_journaled_turns_and_collects_the_batch_in_flight(tmp_path, procs, executor):
    """Killed while the second turns' batch is out, the first turns' answers already in responses.jsonl:
    --resume replays the first turns, collects the second from that batch, and pays and counts each answer once."""
    import attrs
    from hermes_batch.formats.records import Usage

    n, cost = 6, 0.0005
    loop = script()

    def priced(request):
        return attrs.evolve(loop(request), usage=Usage(prompt_tokens=100, completion_tokens=10, cost=cost))

    data = dataset(tmp_path, n)
    options = (*FAST, *WHOLE_TURNS(n))  # one full batch per turn
    # the second batch (the second turns) ends 6 s after creation: time to kill the driver while it is out
    settings = BatchSettings(delay=lambda number: 6.0 if number == 2 else 0.2)
    with ScriptedModelServer(priced, api_key=TEST_API_KEY, batches=settings) as server:
        runner = Runner(tmp_path, server=server, options=run_options("--num_workers", str(n), *EXECUTORS[executor]))
        proc = runner.spawn(data, *options)
        procs.append(proc)
        wait_for(lambda: runner.folder().joinpath("batches.jsonl").exists() and _submitted(runner) >= 2
                 and _journaled(runner) == n, 60, "the first answers journaled, the second batch out", proc)
        proc.send_signal(signal.SIGKILL)
        _out, err = ended(proc)
        assert proc.returncode == -signal.SIGKILL, err
        assert server.batches.requests_processed == n  # the first turns; the second turns' batch still out
        first = server.batches.created
        result = runner.invoke(data, *options, "--resume")
        assert result.exit_code == 0, result.output
        no_request_twice(server)
        assert server.batches.requests_processed == 3 * n  # each turn of each prompt once
        stats = json.loads((runner.folder() / "statistics.json").read_text())
        assert stats["batch_api"]["replayed"] == n  # the second turns, from the killed session's batch
        assert stats["batch_api"]["requests"] == n  # the third turns, the only ones sent again
        assert server.batches.created - first == stats["batch_api"]["batches"]
    # statistics count each answer once, and no request the killed session's batch answered as unanswered
    assert stats["model_requests"]["requests"] == 3 * n
    assert stats["model_requests"]["errors"] == 0
    assert stats["cost"] == pytest.approx(3 * n * cost)
    assert stats["tokens"]["prompt"] == 3 * n * 100
    saved = runner.records("trajectories.jsonl")
    assert len(saved) == n
    assert [r["metadata"]["replayed_turns"] for r in saved] == [1] * n  # the first turns, from responses.jsonl
    for _roles, outputs, completed in shapes(saved).values():
        tag = outputs[0].split("-")[0]
        assert completed and outputs == [f"{tag}-0\n", f"{tag}-0\n{tag}-1\n"]
    assert not runner.folder().joinpath("responses.jsonl").exists()


# --- the Batcher alone -----------------------------------------------------------------------------------------


from hermes_batch.model.batching import BatchAPI  # noqa: E402


class FakeBatches(BatchAPI):
    """A BatchAPI in memory: each batch ends at its first poll, every request answered with its own body."""

    def __init__(self):
        self.submitted: list = []  # the request bodies of each batch, in order
        self._requests: dict = {}  # batch id -> [(custom_id, body), ...]

    async def check(self):
        pass

    def body(self, messages, tools) -> bytes:
        return messages[-1].content.encode()

    async def submit(self, requests):
        self.submitted.append([body for _id, body in requests])
        batch_id = f"b{len(self.submitted)}"
        self._requests[batch_id] = requests
        return batch_id

    async def poll(self, batch_id):
        return "completed"

    async def results(self, batch_id, wanted=None):
        from hermes_batch.formats.records import Message, ModelResponse

        return {custom_id: ModelResponse(message=Message("assistant", body.decode()))
                for custom_id, body in self._requests[batch_id]}

    async def aclose(self):
        pass


async def test_a_batch_goes_out_when_full_or_after_the_wait():
    from hermes_batch.formats.records import Message
    from hermes_batch.model.batching import Batcher, BatchOptions

    api = FakeBatches()
    batcher = Batcher(api, BatchOptions(max_requests=2, max_wait=0.5, poll_interval=0.01))
    loop = asyncio.get_running_loop()
    started = loop.time()
    answers = await asyncio.gather(*(batcher.send((Message("user", f"q{i}"),), ()) for i in range(5)))
    assert [a.message.content for a in answers] == [f"q{i}" for i in range(5)]
    assert api.submitted == [[b"q0", b"q1"], [b"q2", b"q3"], [b"q4"]]  # two full ones at once, the rest after the wait
    assert loop.time() - started >= 0.5
    assert batcher.counts.batches == 3 and batcher.counts.largest == 2
    assert "0 in flight, 3 submitted, 0 request(s) queued" in batcher.summary()["batches"]
    await batcher.aclose()


async def test_a_batch_goes_out_when_no_more_requests_can_come():
    """Every session that may still send a request waits on the batch: it goes out at once, not after max_wait; a
    request cut off meanwhile (its session ended) is not sent."""
    from hermes_batch.formats.records import Message
    from hermes_batch.model.batching import Batcher, BatchOptions

    api = FakeBatches()
    batcher = Batcher(api, BatchOptions(max_requests=100, max_wait=30, poll_interval=0.01))
    sessions = {"may_send": 3}
    batcher.senders = lambda: sessions["may_send"]
    loop = asyncio.get_running_loop()
    started = loop.time()
    answers = await asyncio.gather(*(batcher.send((Message("user", f"q{i}"),), ()) for i in range(3)))
    assert [a.message.content for a in answers] == ["q0", "q1", "q2"] and api.submitted == [[b"q0", b"q1", b"q2"]]
    assert loop.time() - started < 5  # not max_wait's 30 s

    cut = loop.create_task(batcher.send((Message("user", "cut"),), ()))
    await asyncio.sleep(0.05)
    assert len(api.submitted) == 1  # one of the three sessions waits, two may still send
    cut.cancel()  # --prompt_timeout: its session ends, so one session less may send
    await asyncio.gather(cut, return_exceptions=True)
    sessions["may_send"] = 2
    later = loop.create_task(batcher.send((Message("user", "later"),), ()))
    await asyncio.sleep(0.05)
    assert len(api.submitted) == 1  # one waits, the other may still send
    sessions["may_send"] = 1
    batcher.wake()  # the run: a session ended
    assert (await later).message.content == "later"
    assert api.submitted[1] == [b"later"]  # the cut request was not sent
    await batcher.aclose()


async def test_an_answer_the_replay_journal_gave_is_not_collected_for_another_session():
    """Two samples of one prompt send the same first request. The first sample's answer, in a batch of the stopped
    session, is also in responses.jsonl: replayed from there, the batch's copy must not go to the second sample
    (it would get the first one's answer), which sends its own request."""
    import types

    from hermes_batch.folder.replay_journal import encode_response
    from hermes_batch.formats.records import Message, ModelResponse
    from hermes_batch.model.batching import Batcher, BatchOptions, digest
    from hermes_batch.session.replay import Replayer

    api = FakeBatches()
    batcher = Batcher(api, BatchOptions(max_requests=1, max_wait=0.01, poll_interval=0.01))
    messages = (Message("user", "q0"),)
    api._requests["b0"] = [(f"{digest(b'q0')}-1", b"q0")]  # the stopped session's batch, with sample 0's request
    batcher.expect("b0", [f"{digest(b'q0')}-1"])
    client = types.SimpleNamespace(name="openai", settings=None, replayed=batcher.forget)
    replayer = Replayer(types.SimpleNamespace(write=lambda *a: None), client)
    recorded = {replayer.hasher.digest(messages, ()): encode_response(ModelResponse(Message("assistant", "q0")))}
    assert replayer.session("sample0", recorded).lookup(messages, ()) is not None  # from the journal
    await batcher.send(messages, (), 0)  # sample 1
    assert api.submitted == [[b"q0"]] and batcher.counts.replayed == 0
    await batcher.aclose()


async def test_an_earlier_batch_whose_first_check_fails_is_checked_again_not_paid_again():
    """At a resume, the first check of the stopped session's batch fails for now (a 503): it is checked again at
    the next poll and its answer used; the request is not sent (paid) again."""
    from hermes_batch.errors import RetryableModelError
    from hermes_batch.formats.records import Message
    from hermes_batch.model.batching import Batcher, BatchOptions, digest

    class Flaky(FakeBatches):
        polls = 0

        async def poll(self, batch_id):
            self.polls += 1
            if self.polls == 1:
                raise RetryableModelError("The endpoint answered 503 for the state of a batch: busy")
            return "completed"

    api = Flaky()
    batcher = Batcher(api, BatchOptions(max_requests=1, max_wait=0.01, poll_interval=0.01))
    api._requests["b0"] = [(f"{digest(b'q0')}-1", b"q0")]  # the stopped session's batch
    batcher.expect("b0", [f"{digest(b'q0')}-1"])
    answer = await batcher.send((Message("user", "q0"),), (), 0)
    assert answer.message.content == "q0" and api.polls == 2
    assert api.submitted == [] and batcher.counts.replayed == 1
    await batcher.aclose()


async def test_the_relay_gives_each_worker_session_its_answer_or_error_and_a_cancelled_request_leaves_the_batch():
    """A worker's BatchRelay and the driver's BatchService, every message pickled on its way as the executors'
    channels do: answers and errors (with their fields) reach the session that asked; a request whose session
    stopped waiting is not in the batch."""
    import pickle

    from hermes_batch.errors import ModelOutcome
    from hermes_batch.executors.batch_relay import BatchRelay, BatchService
    from hermes_batch.formats.records import Message
    from hermes_batch.model.batching import Batcher, BatchOptions

    class TooLong(FakeBatches):
        async def results(self, batch_id, wanted=None):
            found = await super().results(batch_id, wanted)
            return {custom_id: ModelOutcome("context too long", reason="context_length", status=400)
                    if answer.message.content == "long" else answer for custom_id, answer in found.items()}

    api = TooLong()
    service = BatchService(Batcher(api, BatchOptions(max_requests=10, max_wait=0.3, poll_interval=0.01)))

    class Link:  # the driver's end of the worker's channel
        async def send(self, message):
            _kind, key, outcome = pickle.loads(pickle.dumps(message))
            relay.answer(key, outcome)

    link = Link()
    relay = BatchRelay(lambda message: service.handle(link, pickle.loads(pickle.dumps(message))))
    answer = asyncio.ensure_future(relay.send((Message("user", "q0"),), (), 0))
    refused = asyncio.ensure_future(relay.send((Message("user", "long"),), (), 1))
    gone = asyncio.ensure_future(relay.send((Message("user", "q2"),), (), 2))
    await asyncio.sleep(0.05)
    gone.cancel()
    assert (await asyncio.wait_for(answer, 10)).message.content == "q0"
    with pytest.raises(ModelOutcome) as raised:  # a TimeoutError: the error did not survive the trip
        await asyncio.wait_for(refused, 10)
    assert (raised.value.reason, raised.value.status) == ("context_length", 400)
    assert api.submitted == [[b"q0", b"long"]]  # not the cancelled one
    await service.aclose()
    await service.batcher.aclose()


def test_the_batch_journal_names_the_batches_to_collect_and_warns_of_requests_without_one(tmp_path, caplog):
    """batches.jsonl: a torn last line is cut off before a session appends; a resume reads each submitted batch with
    its custom ids and prompts, and says how many requests were being submitted without a batch id on record."""
    from hermes_batch.folder.batch_journal import BatchJournal, Submitted, batch_journal_path, read_batches

    path = batch_journal_path(tmp_path)
    first = BatchJournal(path, 1)
    first.pending([("d1-1", 0, 0), ("d2-2", 3, 1)])
    first.submitted("batch_a", ["d1-1", "d2-2"])
    first.collected("batch_a")
    first.pending([("d3-3", 5, 2)])  # killed before the provider named the batch
    first.close()
    with open(path, "ab") as torn:
        torn.write(b'{"event":"submitted","session":1,"batch":"batch_b","custom')
    second = BatchJournal(path, 2)
    second.close()
    assert path.read_bytes().endswith(b'"d3-3",5,2]]}\n')  # the torn line cut off
    with caplog.at_level("WARNING"):
        assert read_batches(path) == [Submitted("batch_a", ("d1-1", "d2-2"), frozenset({0, 3}))]
    assert "1 request(s) were being submitted when the run stopped" in caplog.text
    assert read_batches(tmp_path / "none.jsonl") == []
