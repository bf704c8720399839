"""The model layer end to end: preflight, adaptive concurrency and budgets, deadlines, typed failures, accounting.

Runs go through the real CLI and the real ``openai`` SDK against a ScriptedModelServer;
the limiter's own rules (AIMD, cancellation) are also tested on it directly.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import zlib

import pytest

from hermes_batch.testing import TEST_API_KEY, write_dataset

from hermes_batch.session import agent
from hermes_batch.run.config import HTTP_BACKENDS
from hermes_batch.local_sandbox.backend import LocalSandboxBackend
from hermes_batch.default_plugins.openai_client import OpenAIClient
from hermes_batch.errors import ModelEndpointError, RetryableModelError, SandboxError
from hermes_batch.contract.interfaces import ModelSettings, ToolContext
from hermes_batch.run.progress import Progress
from hermes_batch.model.ratelimit import CallLimiter
from hermes_batch.formats.records import Message, ModelResponse, ToolCall, Usage
from hermes_batch.model.retry import rate_limit_reset_seconds
from hermes_batch.testing import ErrorRule, Reply, RoutedScript, ToolLoopScript


def stats_of(runner, run_name="run") -> dict:
    return json.loads((runner.folder(run_name) / "statistics.json").read_text())


def by_prompt(records) -> dict:
    return {(r.get("trajectory") or r)["conversations"][1]["value"]: r for r in records}


# --- preflight ---------------------------------------------------------------------------------------


@pytest.fixture
def sandbox_starts(monkeypatch):
    """Every start() and open() of the local sandbox backend, recorded."""
    seen = []
    start, open_ = LocalSandboxBackend.start, LocalSandboxBackend.open

    async def spy_start(self):
        seen.append("start")
        await start(self)

    async def spy_open(self, spec):
        seen.append("open")
        return await open_(self, spec)

    monkeypatch.setattr(LocalSandboxBackend, "start", spy_start)
    monkeypatch.setattr(LocalSandboxBackend, "open", spy_open)
    return seen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openrouter_unknown_model(request):
    return Reply(status=400, error_message="anthropic/claude-nope is not a valid model ID")


PREFLIGHT_FAILURES = {
    # name: (server options or None for nothing listening, what the sentence names)
    "wrong key": (dict(api_key="sk-the-right-key"), ["API key", "--api_key"]),
    "unknown model": (dict(models=("some-other-model",)), ["scripted-model", "--model"]),
    "unknown model, OpenRouter style": (dict(script=_openrouter_unknown_model, preflight_reply=None), ["--model"]),
    "endpoint keeps failing": (dict(errors=[ErrorRule(status=503, rate=1.0, retry_after=0)]), ["503", "--no_preflight"]),
    "nothing listening": (None, ["could not be reached", "--base_url"]),
}


@pytest.mark.parametrize("http_backend", HTTP_BACKENDS)
@pytest.mark.parametrize("case", PREFLIGHT_FAILURES)
def test_preflight_failures_exit_2_before_any_sandbox_or_run_folder(
    case, http_backend, model_server, runner, tmp_path, sandbox_starts
):
    options, words = PREFLIGHT_FAILURES[case]
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt {i}"} for i in range(20)])
    server = model_server(**options) if options is not None else None
    base_url = server.base_url if server else f"http://127.0.0.1:{_free_port()}/v1"
    result = runner.invoke(dataset, "--base_url", base_url, "--num_workers", "4", "--max_retries", "1",
                           "--http_backend", http_backend)
    assert result.exit_code == 2, result.output
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("Error: ")
    for word in words:
        assert word in message
    assert "Traceback" not in result.output
    assert sandbox_starts == []
    assert not runner.folder().exists()
    if server is not None:
        # one probe; a failing endpoint gets it again once per --max_retries, never one request per prompt
        assert server.request_count == (2 if case == "endpoint keeps failing" else 1)
        assert all(r.preflight for r in server.requests)


def test_preflight_is_one_small_request_and_resume_of_a_finished_run_sends_none(model_server, runner, tmp_path):
    server = runner.server = model_server(ToolLoopScript(tool_calls=1))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "One prompt"}])
    assert runner.invoke(dataset, "--max_tokens", "500").exit_code == 0
    probe, *rest = server.requests
    assert probe.preflight and probe.body["max_tokens"] == 16 and "tools" not in probe.body
    assert [r.body["max_tokens"] for r in rest] == [500, 500]
    again = model_server(ToolLoopScript(tool_calls=1))
    assert runner.invoke(dataset, "--resume", server=again).exit_code == 0
    assert again.request_count == 0


# --- rate limits and budgets ------------------------------------------------------------------------


def _first_attempt_429(request) -> bool:
    # a stable 30% of conversation states; first_attempts=1 answers only their first attempt with 429
    return not request.preflight and zlib.crc32(f"{request.prompt}|{request.turn}".encode()) % 100 < 30


def test_429s_and_500s_shrink_the_limit_and_every_prompt_still_finishes(model_server, runner, tmp_path):
    server = runner.server = model_server(
        ToolLoopScript(tool_calls=2),
        latency=0.02,
        errors=[
            ErrorRule(status=429, first_attempts=1, retry_after=0.2, match=_first_attempt_429),
            ErrorRule(status=500, rate=0.05, retry_after=0, match=lambda r: not r.preflight),
        ],
        seed=3,
    )
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt {i}"} for i in range(30)])
    result = runner.invoke(dataset, "--num_workers", "8")
    assert result.exit_code == 0, result.output
    assert [t["prompt_index"] for t in runner.records("trajectories.jsonl")] == list(range(30))

    stats = stats_of(runner)
    calls = stats["model_requests"]
    sent = [r for r in server.requests if not r.preflight]
    statuses = server.responses_by_status
    assert calls["requests"] == len(sent)
    assert calls["errors"] == statuses[429] + statuses[500]  # the preflight is never failed here
    assert statuses[429] >= 15 and statuses[500] >= 1
    assert calls["rate_limited"] == statuses[429]
    limit = calls["concurrency_limit"]
    assert limit["start"] == 8
    assert 1 <= limit["min"] < 8, limit
    session = json.loads((runner.folder() / "checkpoint.json").read_text())["sessions"][-1]
    assert session["rate_limited_calls"] == statuses[429] and session["concurrency_min"] == limit["min"]
    recorded = [c for t in runner.records("trajectories.jsonl") for c in t["metadata"]["calls"]]
    assert sum(c["status"] == 429 for c in recorded) == statuses[429]
    assert sum(c["status"] == 200 for c in recorded) == 30 * 3


def test_requests_per_minute_spaces_the_calls(model_server, runner, tmp_path):
    arrivals = []
    loop_script = ToolLoopScript(tool_calls=1)

    def script(request):
        arrivals.append(time.monotonic())
        return loop_script(request)

    runner.server = model_server(script)
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt {i}"} for i in range(10)])
    result = runner.invoke(dataset, "--num_workers", "8", "--max_requests_per_minute", "1200")
    assert result.exit_code == 0, result.output
    assert len(arrivals) == 20
    # 1200 per minute: one call every 50 ms, where 8 workers alone would send all 20 within a few ms
    assert arrivals[-1] - arrivals[0] >= 19 * 0.05 * 0.9
    for start in arrivals:  # 5 per 250 ms, a few more when a busy machine delays some and bunches them
        assert sum(start <= t < start + 0.25 for t in arrivals) <= 8


async def test_tokens_per_minute_holds_calls_until_the_budget_refills():
    limiter = CallLimiter(limit=8, tokens_per_minute=240_000)  # 4000 tokens/s, 10 s (40 000 tokens) at once

    async def send(messages, tools):
        return ModelResponse(Message("assistant", "ok"), usage=Usage(prompt_tokens=900, completion_tokens=100))

    started = time.monotonic()
    for _ in range(43):  # 43 000 tokens: the last two calls wait for a quarter of a second of refill each
        await limiter.call(send, (Message("user", "hi"),), ())
    assert 0.4 <= time.monotonic() - started < 4


async def test_aimd_halves_once_per_round_and_grows_back_by_one_per_round():
    limiter = CallLimiter(limit=8, max_retries=3, backoff_base=0.001)
    gate = asyncio.Event()
    rate_limited = {str(i) for i in range(8)}  # the first attempt of each of the first 8 calls

    async def send(messages, tools):
        key = messages[0].content
        await gate.wait()
        if key in rate_limited:
            rate_limited.discard(key)
            raise RetryableModelError("429", status=429, retry_after=0)
        return ModelResponse(Message("assistant", "ok"))

    calls = [asyncio.create_task(limiter.call(send, (Message("user", str(i)),), ())) for i in range(8)]
    await asyncio.sleep(0.01)
    assert limiter.in_flight == 8
    gate.set()
    await asyncio.gather(*calls)
    # eight 429s from one overload: one decrease, not eight; then the 8 retries succeed at limit 4
    assert (limiter.rate_limited, limiter.min_limit) == (8, 4)
    assert limiter.limit == 5  # +1 after 4 successes, 4 of the next 5 done

    progress = Progress(total=1, enabled=False)
    progress.watch(limiter.summary)
    assert "limit 5" in progress.summary() and "rate-limited 8" in progress.summary()
    for expected in (6, 7):
        while limiter.limit < expected:
            await limiter.call(send, (Message("user", "again"),), ())
    for _ in range(100):
        await limiter.call(send, (Message("user", "again"),), ())
    assert limiter.limit == 8, "never above the starting limit"


async def test_calls_waiting_for_a_slot_can_be_cancelled_without_leaking_it():
    limiter = CallLimiter(limit=1)
    release = asyncio.Event()

    async def send(messages, tools):
        await release.wait()
        return ModelResponse(Message("assistant", "ok"))

    first = asyncio.create_task(limiter.call(send, (Message("user", "a"),), ()))
    waiting = [asyncio.create_task(limiter.call(send, (Message("user", "b"),), ())) for _ in range(3)]
    await asyncio.sleep(0.01)
    for task in waiting[:2]:
        task.cancel()
    release.set()
    await first
    await waiting[2]
    assert limiter.in_flight == 0 and not limiter._waiters


async def test_retries_give_up_with_an_endpoint_error_and_record_each_attempt():
    limiter = CallLimiter(limit=2, max_retries=2, backoff_base=0.001)

    async def send(messages, tools):
        raise RetryableModelError("The model endpoint answered 502: bad gateway", status=502, provider="ProvX")

    calls = []
    with pytest.raises(ModelEndpointError, match="gave up after 3 attempts"):
        await limiter.call(send, (Message("user", "x"),), (), calls=calls)
    assert [(c.provider, c.status) for c in calls] == [("ProvX", 502)] * 3
    assert limiter.in_flight == 0 and limiter.errors == 3


def test_a_429_without_retry_after_waits_for_the_exhausted_limit_to_reset():
    headers = {"x-ratelimit-remaining-requests": "12", "x-ratelimit-reset-requests": "1s",
               "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "6m0.5s"}
    assert rate_limit_reset_seconds(headers) == 360.5
    assert rate_limit_reset_seconds({"x-ratelimit-reset-requests": "20ms", "x-ratelimit-reset-tokens": "2s"}) == 0.02
    reset_at_ms = str(int((time.time() + 30) * 1000))  # OpenRouter: epoch milliseconds
    assert 28 < rate_limit_reset_seconds({"x-ratelimit-reset": reset_at_ms}) <= 30
    assert rate_limit_reset_seconds({"x-ratelimit-reset-requests": "soon"}) is None


def test_openrouter_requests_ask_for_usage_accounting():
    openrouter = OpenAIClient._routing_body(ModelSettings("m", "https://openrouter.ai/api/v1"))
    local = OpenAIClient._routing_body(ModelSettings("m", "http://localhost:8000/v1"))
    assert openrouter["usage"] == {"include": True} and "usage" not in local


# --- deadlines ----------------------------------------------------------------------------------------


def test_a_hung_endpoint_is_cut_by_the_prompt_timeout_and_saved_as_partial(model_server, runner, tmp_path):
    def hang(request):
        return request.prompt == "Hang at once" or (request.prompt == "Hang here" and request.turn == 1)

    runner.server = model_server(ToolLoopScript(tool_calls=1), hang=hang)
    rows = [{"prompt": "Hang here"}, {"prompt": "Fine 1"}, {"prompt": "Hang at once"}, {"prompt": "Fine 2"}]
    dataset = write_dataset(tmp_path / "prompts.jsonl", rows)
    started = time.monotonic()
    result = runner.invoke(dataset, "--prompt_timeout", "1.5")
    assert result.exit_code == 3, result.output
    assert time.monotonic() - started < 10
    kept = by_prompt(runner.records("trajectories.jsonl"))
    assert set(kept) == {"Hang here", "Fine 1", "Fine 2"}
    hung = kept["Hang here"]
    assert (hung["completed"], hung["partial"], hung["api_calls"]) == (False, True, 1)
    assert hung["metadata"]["end_reason"] == "timeout"
    assert 1.4 <= hung["metadata"]["duration_s"] < 5
    # the turn done before the hang is kept: the tool call and its result
    assert [t["from"] for t in hung["conversations"]] == ["system", "human", "gpt", "tool"]
    assert hung["tool_stats"]["terminal"]["success"] == 1
    first, cut = hung["metadata"]["calls"]
    # 499: cut off by the run itself (its deadline) without an answer, which is no error of the endpoint
    assert first["status"] == 200 and cut["status"] == 499 and cut["latency_s"] > 1.0
    assert stats_of(runner)["model_requests"]["errors"] == 0
    assert kept["Fine 1"]["metadata"]["end_reason"] == "final_answer"
    scratch = runner.folder() / "scratch"
    assert not scratch.exists() or list(scratch.iterdir()) == [], "the sandbox was closed"
    assert stats_of(runner)["finished"]["partial_by_reason"] == {"timeout": 1}

    # cut before the model answered once: nothing worth keeping, so it fails and --resume runs it again
    [failed] = runner.records("failed.jsonl")
    assert (failed["prompt"], failed["error_kind"], failed["api_calls"]) == ("Hang at once", "timeout", 0)
    assert [c["status"] for c in failed["calls"]] == [499]  # cut off by the run's deadline
    result = runner.invoke(dataset, "--resume", "--prompt_timeout", "1.5", server=model_server(ToolLoopScript(tool_calls=1)))
    assert result.exit_code == 0, result.output
    assert by_prompt(runner.records("trajectories.jsonl"))["Hang at once"]["completed"] is True


async def test_a_tool_that_never_returns_is_abandoned_after_its_timeout(monkeypatch):
    class Stuck:
        name = "stuck"
        description = "Never returns."
        parameters = {"type": "object", "properties": {}}

        async def call(self, arguments, ctx):
            await asyncio.sleep(3600)

    monkeypatch.setattr(agent, "TOOL_GRACE_S", 0.1)
    tallies = {"stuck": agent._Tally()}
    ctx = ToolContext(sandbox=None, command_timeout=0.1)
    result = await agent._call_tool(ToolCall("c1", "stuck", {}, "{}"), {"stuck": Stuck()}, tallies, [], ctx)
    assert "did not finish within 0.2 s" in result["error"]
    assert tallies["stuck"].failure == 1


# --- typed failures ------------------------------------------------------------------------------------


def test_model_outcomes_end_as_partial_and_infrastructure_errors_fail(model_server, runner, tmp_path, monkeypatch):
    filtered_by_error = "The response was filtered due to the prompt triggering Azure OpenAI's content management policy."
    routes = {
        "Filtered": lambda r: Reply(content="", reasoning="Hmm.", finish_reason="content_filter"),
        "Filtered by an error": lambda r: Reply(status=400, error_message=filtered_by_error),
        "Truncated": lambda r: Reply(content="The answer is cut", reasoning="Long.", finish_reason="length"),
        "Refused": lambda r: Reply(status=400, error_message="Unsupported parameter: tools."),
        "Endpoint down": lambda r: Reply(status=503, error_message="No capacity.", headers={"Retry-After": "0"}),
    }
    runner.server = model_server(RoutedScript(routes, default=ToolLoopScript(tool_calls=1)))
    rows = [{"prompt": p} for p in routes] + [{"prompt": "Sandbox dies"}]

    open_ = LocalSandboxBackend.open

    async def open_or_die(self, spec):
        if spec.prompt_index == len(routes):
            raise SandboxError("The sandbox died.")
        return await open_(self, spec)

    monkeypatch.setattr(LocalSandboxBackend, "open", open_or_die)
    result = runner.invoke(write_dataset(tmp_path / "prompts.jsonl", rows), "--max_retries", "1", "--no_filters")
    assert result.exit_code == 3, result.output
    kept = by_prompt(runner.records("trajectories.jsonl"))
    assert {p: t["metadata"]["end_reason"] for p, t in kept.items()} == {
        "Filtered": "content_filter", "Filtered by an error": "content_filter", "Truncated": "length",
    }
    assert all(t["partial"] and not t["completed"] for t in kept.values())
    failed = {f["prompt"]: f["error_kind"] for f in runner.records("failed.jsonl")}
    assert failed == {"Refused": "model_request", "Endpoint down": "model_endpoint", "Sandbox dies": "sandbox"}
    stats = stats_of(runner)
    assert stats["finished"]["partial_by_reason"] == {"content_filter": 2, "length": 1}
    assert stats["failures"]["by_kind"] == {"model_endpoint": 1, "model_request": 1, "sandbox": 1}
    # the failed attempts are counted too: two 503s and two 400s
    assert stats["model_requests"]["errors"] == 2 + 1 + 1


# --- accounting and the cost budget -------------------------------------------------------------------------


def _provider_of(prompt: str) -> str:
    return "ProvA" if int(prompt.split()[-1]) % 2 == 0 else "ProvB"


def _priced_script(cost: float, tool_calls: int = 1):
    loop_script = ToolLoopScript(tool_calls=tool_calls)
    usage = Usage(prompt_tokens=100, completion_tokens=20, reasoning_tokens=5, cached_tokens=10, cost=cost)
    failed_once = set()
    lock = threading.Lock()

    def script(request):
        provider = _provider_of(request.prompt)
        with lock:
            first = (request.prompt, request.turn) not in failed_once
            failed_once.add((request.prompt, request.turn))
        if provider == "ProvB" and request.turn == 0 and first:
            return Reply(status=502, error_message="Upstream error.", provider="ProvB", headers={"Retry-After": "0"})
        reply = loop_script(request)
        return Reply(content=reply.content, reasoning=reply.reasoning, tool_calls=reply.tool_calls,
                     usage=usage, provider=provider)

    return script


def test_usage_cost_and_providers_are_summed_into_statistics(model_server, runner, tmp_path, monkeypatch):
    latency = lambda r: 0.0 if r.preflight else (0.01 if _provider_of(r.prompt) == "ProvA" else 0.15)  # noqa: E731
    runner.server = model_server(_priced_script(0.001), latency=latency)
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Task {i}"} for i in range(6)])
    result = runner.invoke(dataset, "--num_workers", "3")
    assert result.exit_code == 0, result.output

    trajectories = runner.records("trajectories.jsonl")
    for t in trajectories:
        assert t["metadata"]["usage"] == {"prompt_tokens": 200, "completion_tokens": 40, "reasoning_tokens": 10,
                                          "cached_tokens": 20, "cost": pytest.approx(0.002), "cost_reported": True}
        provider = _provider_of(t["conversations"][1]["value"])
        assert [c["provider"] for c in t["metadata"]["calls"] if c["status"] == 200] == [provider] * 2
    stats = stats_of(runner)
    assert stats["tokens"] == {"prompt": 1200, "completion": 240, "reasoning": 60, "cached": 120, "total": 1440,
                               "samples_reporting_usage": 6}
    assert stats["cost"] == pytest.approx(0.012)
    providers = stats["model_requests"]["by_provider"]
    assert {name: (p["requests"], p["errors"]) for name, p in providers.items()} == {"ProvA": (6, 0), "ProvB": (9, 3)}
    assert 0.01 <= providers["ProvA"]["median_latency_s"] < 0.1
    assert 0.15 <= providers["ProvB"]["median_latency_s"] < 0.5
    assert "Model requests by provider" in result.output and "ProvB" in result.output
    assert "$0.0120" in result.output

    # one schema on every line: HuggingFace datasets loads the file as it is
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    loaded = datasets.load_dataset("json", data_files=str(runner.folder() / "trajectories.jsonl"),
                                   split="train", cache_dir=str(tmp_path / "hf"))
    assert loaded.num_rows == 6


def test_max_cost_stops_dispatching_lets_in_flight_prompts_finish_and_resume_continues(model_server, runner, tmp_path):
    server = runner.server = model_server(_priced_script(0.01), latency=0.02)
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Task {i}"} for i in range(20)])
    result = runner.invoke(dataset, "--num_workers", "2", "--max_cost", "0.05")
    assert result.exit_code == 0, result.output
    assert "--max_cost" in result.stderr and "--resume" in result.stderr
    first = runner.records("trajectories.jsonl")
    assert 3 <= len(first) <= 5 < 20
    assert all(t["completed"] for t in first), "prompts in flight when the budget ran out finished"
    checkpoint = json.loads((runner.folder() / "checkpoint.json").read_text())
    assert checkpoint["sessions"][-1]["budget_reached"] is True

    # the budget counts the earlier sessions too: a resume with the same budget starts nothing
    requests = server.request_count
    again = runner.invoke(dataset, "--resume", "--max_cost", "0.05")
    assert again.exit_code == 0, again.output
    assert server.request_count == requests
    assert "--max_cost" in again.stderr

    done = runner.invoke(dataset, "--resume", "--max_cost", "1")
    assert done.exit_code == 0, done.output
    assert [t["prompt_index"] for t in runner.records("trajectories.jsonl")] == list(range(20))
    assert stats_of(runner)["cost"] == pytest.approx(0.01 * 2 * 20)


def test_the_api_key_never_reaches_the_new_records(model_server, runner, tmp_path):
    runner.server = model_server(_priced_script(0.001))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Task {i}"} for i in range(2)])
    assert runner.invoke(dataset, "--max_cost", "5", "--max_requests_per_minute", "6000").exit_code == 0
    for path in runner.folder().rglob("*"):
        if path.is_file():
            assert TEST_API_KEY not in path.read_text(errors="replace"), path
