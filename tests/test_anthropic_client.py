"""The native Anthropic client: the Messages API wire format through the real ``anthropic`` SDK.

End to end through the real CLI (``--model_client anthropic``) against the scripted
server's ``/v1/messages``; then the error mapping of one ``send``; then the message
conversion and the small helpers as plain functions.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import socket

import anthropic
import pytest
from click.testing import CliRunner
from hermes_batch.testing import TEST_API_KEY as API_KEY, write_dataset

from hermes_batch.cli import cli
from hermes_batch.run.config import HTTP_BACKENDS, resolve_api_key
from hermes_batch.default_plugins.anthropic_client import (
    AnthropicClient,
    from_wire,
    rate_limit_wait,
    sdk_base_url,
    thinking_limits,
    to_wire,
)
from hermes_batch.errors import FatalModelError, ModelCallError, ModelOutcome, RetryableModelError
from hermes_batch.contract.interfaces import ModelSettings
from hermes_batch.contract.plugins import collect, get_plugin_manager
from hermes_batch.formats.records import Message, ToolCall, Usage
from hermes_batch.run.selection import model_client_class
from hermes_batch.testing import ErrorRule, Reply, RoutedScript, ScriptedModelServer, ToolLoopScript

PROMPT = "Inspect the sandbox twice"


def anthropic_args(server, *extra) -> list:
    return ["--model_client", "anthropic", "--base_url", server.anthropic_base_url, *extra]


def run_anthropic(runner, server, dataset, run_name="run", *extra):
    return runner.invoke(dataset, *anthropic_args(server, *extra), run_name=run_name)


def _hash(prompt: str) -> str:
    """What ToolLoopScript's ``{prompt_hash}`` is for ``prompt``."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:8]


def bodies(server, prompt=PROMPT) -> list:
    """The raw JSON bodies the SDK sent for ``prompt``, in order."""
    return [r.body for r in server.requests if r.prompt == prompt]


# --- end to end through the CLI --------------------------------------------------------------------


@pytest.fixture
def multi_tool(model_server, runner, tmp_path):
    """One prompt, two tool-calling turns of two calls each, with thinking, run through the Anthropic client."""
    server = model_server(ToolLoopScript(tool_calls=2, calls_per_turn=2, command="echo {prompt_hash}-{turn}-{call}"))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": PROMPT}])
    result = run_anthropic(runner, server, dataset, "run", "--reasoning_effort", "medium")
    assert result.exit_code == 0, result.output
    [trajectory] = runner.records("trajectories.jsonl")
    return server, trajectory


def test_tool_calls_of_one_turn_go_back_as_one_user_message_of_tool_results_in_order(multi_tool):
    server, _trajectory = multi_tool
    first, second, third = bodies(server)
    assert first["messages"] == [{"role": "user", "content": PROMPT}]
    assistant, results = second["messages"][1:]
    uses = [b for b in assistant["content"] if b["type"] == "tool_use"]
    assert [u["input"]["command"] for u in uses] == [f"echo {_hash(PROMPT)}-0-0", f"echo {_hash(PROMPT)}-0-1"]
    assert results["role"] == "user"
    assert [b["type"] for b in results["content"]] == ["tool_result", "tool_result"]
    assert [b["tool_use_id"] for b in results["content"]] == [u["id"] for u in uses]
    outputs = [json.loads(b["content"])["output"] for b in results["content"]]
    assert outputs == [f"{_hash(PROMPT)}-0-0\n", f"{_hash(PROMPT)}-0-1\n"]  # the commands really ran
    # the last request carries the whole conversation: 1 prompt + 2 x (assistant, results)
    assert [m["role"] for m in third["messages"]] == ["user", "assistant", "user", "assistant", "user"]


def test_system_prompt_tools_and_max_tokens_use_the_messages_api_fields(multi_tool):
    server, trajectory = multi_tool
    body = bodies(server)[0]
    assert body["system"].startswith("You are a capable assistant")
    assert all(m["role"] in ("user", "assistant") for m in body["messages"])
    terminal = next(t for t in body["tools"] if t["name"] == "terminal")
    assert set(terminal) == {"name", "description", "input_schema"}
    assert terminal["input_schema"]["required"] == ["command"]
    assert sorted(t["name"] for t in body["tools"]) == sorted(trajectory["metadata"]["tools_offered"])
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 8192}
    assert body["max_tokens"] > 8192


def test_thinking_blocks_go_back_with_their_signatures_unchanged(multi_tool):
    server, _trajectory = multi_tool
    # turn 2 sends back one thinking block, turn 3 two; the server checks each HMAC signature
    assert server.thinking_signatures == {"valid": 3}
    last = bodies(server)[-1]["messages"]
    thinking = [m["content"][0] for m in last if m["role"] == "assistant"]
    assert [t["type"] for t in thinking] == ["thinking", "thinking"]
    assert all(t["signature"] for t in thinking)


def test_the_trajectory_holds_reasoning_in_think_and_calls_in_tool_call_without_signatures(multi_tool, runner):
    _server, trajectory = multi_tool
    turns = trajectory["conversations"]
    assert [t["from"] for t in turns] == ["system", "human", "gpt", "tool", "gpt", "tool", "gpt"]
    assert turns[2]["value"].startswith("<think>\nLet me think about step 0.\n</think>\n<tool_call>\n")
    assert len(turns[2]["tool_calls"]) == 2 and turns[2]["value"].count("<tool_call>") == 2
    assert turns[3]["value"].count("<tool_response>") == 2
    assert turns[6]["value"].startswith("<think>\nLet me think about step 2.\n</think>\nDone: ")
    assert (trajectory["completed"], trajectory["metadata"]["end_reason"]) == (True, "final_answer")
    assert trajectory["tool_stats"]["terminal"] == {"count": 4, "success": 4, "failure": 0}
    assert "signature" not in (runner.folder() / "trajectories.jsonl").read_text()


def test_trajectories_have_the_same_shape_as_from_the_openai_client(model_server, runner, tmp_path):
    server = runner.server = model_server(ToolLoopScript(tool_calls=2, calls_per_turn=2))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": PROMPT}, {"prompt": "Another task"}])
    # the same seed samples the same toolsets, so the system turns match too
    assert runner.invoke(dataset, "--reasoning_effort", "low", "--seed", "7", run_name="openai").exit_code == 0
    result = run_anthropic(runner, server, dataset, "anthropic", "--reasoning_effort", "low", "--seed", "7")
    assert result.exit_code == 0, result.output

    def comparable(trajectory):
        numbers: dict = {}  # each call id -> its order of appearance
        text = re.sub(r"\b(?:call|toolu)_hb\d+\b", lambda m: f"id{numbers.setdefault(m[0], len(numbers))}",
                      json.dumps(trajectory["conversations"]))
        fields = ("completed", "partial", "api_calls", "tool_stats", "tool_error_counts", "toolsets_used")
        return json.loads(text), {k: trajectory[k] for k in fields}

    openai_run = runner.records("trajectories.jsonl", "openai")
    anthropic_run = runner.records("trajectories.jsonl", "anthropic")
    assert len(openai_run) == len(anthropic_run) == 2
    for a, b in zip(openai_run, anthropic_run):
        assert comparable(a) == comparable(b)
    assert json.loads((runner.folder("anthropic") / "run.json").read_text())["model_client"] == "anthropic"


@pytest.mark.parametrize(
    "options, thinking, max_tokens",
    [
        ((), {"type": "enabled", "budget_tokens": 8192}, 8192 + 8192),
        (("--reasoning_effort", "high"), {"type": "enabled", "budget_tokens": 16384}, 16384 + 8192),
        (("--reasoning_effort", "minimal", "--max_tokens", "3000"), {"type": "enabled", "budget_tokens": 1024}, 3000),
        (("--reasoning_effort", "high", "--reasoning_disabled"), None, 8192),
        (("--reasoning_effort", "none", "--max_tokens", "500"), None, 500),
    ],
)
def test_reasoning_options_become_the_thinking_parameter(model_server, runner, tmp_path, options, thinking, max_tokens):
    server = model_server(ToolLoopScript(tool_calls=0))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": PROMPT}])
    assert run_anthropic(runner, server, dataset, "run", "--no_filters", *options).exit_code == 0
    [body] = bodies(server)
    assert body.get("thinking") == thinking
    assert body["max_tokens"] == max_tokens


def test_the_preflight_probe_asks_for_no_thinking(model_server, runner, tmp_path):
    server = model_server(ToolLoopScript(tool_calls=0))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": PROMPT}])
    result = run_anthropic(runner, server, dataset, "run", "--reasoning_effort", "high")
    assert result.exit_code == 0, result.output
    [probe] = [r.body for r in server.requests if r.preflight]
    assert "thinking" not in probe and probe["max_tokens"] < 1024
    assert bodies(server)[0]["thinking"] == {"type": "enabled", "budget_tokens": 16384}
    assert "no room for thinking" not in result.stderr


def test_a_wrong_key_stops_the_run_with_exit_2_and_one_sentence(model_server, runner, tmp_path):
    server = model_server(api_key="sk-ant-the-right-key")
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt {i}"} for i in range(6)])
    result = run_anthropic(runner, server, dataset)
    assert result.exit_code == 2, result.output
    [error] = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert "API key" in error and "--api_key" in error and "ANTHROPIC_API_KEY" in error
    assert error.count(". ") == 0 and error.endswith(".")
    assert "Traceback" not in result.output
    assert runner.records("trajectories.jsonl") == [] and runner.records("failed.jsonl") == []


def test_an_unknown_model_stops_the_run_with_exit_2(model_server, runner, tmp_path):
    server = model_server(models=("claude-known",))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt {i}"} for i in range(6)])
    result = run_anthropic(runner, server, dataset)
    assert result.exit_code == 2, result.output
    assert "scripted-model" in result.stderr and "--model" in result.stderr
    assert runner.records("failed.jsonl") == []


def test_429_and_529_with_retry_after_are_retried_until_every_prompt_finishes(model_server, runner, tmp_path):
    errors = [
        ErrorRule(status=429, first_attempts=1, retry_after=0, match=lambda r: r.turn == 0),
        ErrorRule(status=529, first_attempts=1, retry_after=0, match=lambda r: r.turn == 1),
    ]
    server = model_server(ToolLoopScript(tool_calls=1), errors=errors)
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt {i}"} for i in range(4)])
    result = run_anthropic(runner, server, dataset, "run", "--reasoning_effort", "low")
    assert result.exit_code == 0, result.output
    assert len(runner.records("trajectories.jsonl")) == 4
    statuses = server.responses_by_status
    assert statuses[429] >= 4 and statuses[529] >= 4 and statuses[200] >= 8


def test_prompt_too_long_ends_the_prompt_as_partial_with_context_length(model_server, runner, tmp_path):
    def script(request):
        if request.turn == 1:
            return Reply(status=400, error_message="prompt is too long: 204312 tokens > 200000 maximum")
        return ToolLoopScript(tool_calls=1)(request)

    server = model_server(script)
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": PROMPT}])
    result = run_anthropic(runner, server, dataset, "run", "--no_filters")
    assert result.exit_code == 0, result.output
    [kept] = runner.records("trajectories.jsonl")
    assert (kept["completed"], kept["partial"], kept["api_calls"]) == (False, True, 1)
    assert kept["metadata"]["end_reason"] == "context_length"


def test_usage_counts_cache_reads_as_prompt_tokens_and_thinking_tokens_as_reasoning(model_server, runner, tmp_path):
    usage = Usage(prompt_tokens=100, completion_tokens=20, reasoning_tokens=5, cached_tokens=30)
    server = model_server(RoutedScript({}, default=lambda r: Reply(content="Done.", reasoning="Easy.", usage=usage)))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": PROMPT}])
    assert run_anthropic(runner, server, dataset).exit_code == 0
    [kept] = runner.records("trajectories.jsonl")
    assert kept["metadata"]["usage"] == {
        "prompt_tokens": 100, "completion_tokens": 20, "reasoning_tokens": 5, "cached_tokens": 30,
        "cost": 0.0, "cost_reported": False,
    }
    # only api.anthropic.com is known to be Anthropic
    assert [c["provider"] for c in kept["metadata"]["calls"]] == [""]


def test_anthropic_api_key_is_read_from_the_environment(model_server, runner, tmp_path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", API_KEY)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-not-this-one")
    server = model_server(ToolLoopScript(tool_calls=0))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": PROMPT}])
    args = runner.args(dataset) + anthropic_args(server, "--no_filters")
    i = args.index("--api_key")
    del args[i : i + 2]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    headers = server.requests[0].headers  # the SDK sends the key as x-api-key or as a bearer token
    assert API_KEY in (headers.get("x-api-key"), headers.get("authorization", "").removeprefix("Bearer "))


# --- one send: the typed errors -----------------------------------------------------------------------


def _client(server, **settings) -> AnthropicClient:
    options = dict(model="claude-test", base_url=server.anthropic_base_url, api_key="k", max_retries=0)
    return AnthropicClient(ModelSettings(**{**options, **settings}))


async def _send(server, **settings):
    client = _client(server, **settings)
    try:
        return await client.send((Message("system", "Be brief."), Message("user", "q")), ())
    finally:
        await client.aclose()


def _rfc3339(seconds_from_now: float) -> str:
    moment = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds_from_now)
    return moment.isoformat().replace("+00:00", "Z")


@pytest.mark.parametrize("http_backend", HTTP_BACKENDS)
@pytest.mark.parametrize(
    "reply, error, check",
    [
        (Reply(status=403, error_message="no access"), FatalModelError, "ANTHROPIC_API_KEY"),
        (Reply(status=429, headers={"retry-after": "7"}), RetryableModelError, lambda e: e.retry_after == 7 and e.rate_limited),
        (Reply(status=529, error_message="Overloaded"), RetryableModelError, lambda e: e.status == 529 and not e.rate_limited),
        (Reply(status=500), RetryableModelError, lambda e: e.status == 500),
        (Reply(status=400, error_message="prompt is too long: 201000 tokens > 200000 maximum"), ModelOutcome,
         lambda e: e.reason == "context_length"),
        (Reply(status=400, error_message="tools.0: input_schema is invalid"), ModelCallError,
         lambda e: type(e) is ModelCallError and "input_schema is invalid" in str(e)),
    ],
)
async def test_send_raises_the_typed_error_of_each_status(reply, error, check, http_backend):
    async with ScriptedModelServer(lambda r: reply) as server:
        with pytest.raises(error) as caught:
            await _send(server, http_backend=http_backend)
    assert check(caught.value) if callable(check) else check in str(caught.value)


async def test_wrong_key_and_unknown_model_are_fatal():
    async with ScriptedModelServer(ToolLoopScript(), api_key="right", models=("claude-test",)) as server:
        with pytest.raises(FatalModelError, match="refused the API key.*--api_key or set ANTHROPIC_API_KEY"):
            await _send(server, api_key="wrong")
        with pytest.raises(FatalModelError, match="'claude-nope'.*--model"):
            await _send(server, api_key="right", model="claude-nope")
        assert (await _send(server, api_key="right")).message.reasoning == "Let me think about step 0."


async def test_rate_limit_reset_headers_give_the_wait_when_there_is_no_retry_after():
    headers = {
        "anthropic-ratelimit-input-tokens-remaining": "0",
        "anthropic-ratelimit-input-tokens-reset": _rfc3339(30),
        "anthropic-ratelimit-requests-remaining": "40",
        "anthropic-ratelimit-requests-reset": _rfc3339(1),
    }
    async with ScriptedModelServer(lambda r: Reply(status=429, headers=headers)) as server:
        with pytest.raises(RetryableModelError) as caught:
            await _send(server)
    assert 25 < caught.value.retry_after <= 30


@pytest.mark.parametrize("http_backend", HTTP_BACKENDS)
async def test_nothing_listening_is_retryable(http_backend):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = ModelSettings(model="m", base_url=f"http://127.0.0.1:{port}", api_key="k", http_backend=http_backend)
    client = AnthropicClient(settings)
    try:
        with pytest.raises(RetryableModelError, match="could not be reached"):
            await client.send((Message("user", "q"),), ())
    finally:
        await client.aclose()


async def test_a_base_url_ending_in_v1_still_reaches_the_messages_endpoint():
    async with ScriptedModelServer(ToolLoopScript(tool_calls=0)) as server:
        response = await _send(server, base_url=server.base_url)  # .../v1, as for the openai SDK
    assert response.finish_reason == "stop" and response.message.content.startswith("Done")


# --- conversion and helpers --------------------------------------------------------------------------


def test_to_wire_puts_system_aside_and_groups_tool_results():
    calls = (ToolCall("t1", "terminal", {"command": "ls"}, '{"command": "ls"}'), ToolCall("t2", "read_file", None, "{bad"))
    messages = (
        Message("system", "Agent prompt."),
        Message("system", "Ephemeral part."),
        Message("user", "Do it."),
        Message("assistant", "Looking.", tool_calls=calls),
        Message("tool", '{"output": "a\\n", "exit_code": 0, "error": null}', tool_call_id="t1", name="terminal"),
        Message("tool", '{"error": "Invalid arguments"}', tool_call_id="t2", name="read_file"),
        Message("assistant", "Done."),
    )
    system, wire = to_wire(messages)
    assert system == "Agent prompt.\n\nEphemeral part."
    assert wire == [
        {"role": "user", "content": "Do it."},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "t1", "name": "terminal", "input": {"command": "ls"}},
            {"type": "tool_use", "id": "t2", "name": "read_file", "input": {}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": '{"output": "a\\n", "exit_code": 0, "error": null}'},
            {"type": "tool_result", "tool_use_id": "t2", "content": '{"error": "Invalid arguments"}', "is_error": True},
        ]},
        {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
    ]


def _response(content, stop_reason="tool_use", **usage):
    usage = {"input_tokens": 10, "output_tokens": 5, **usage}
    return anthropic.types.Message.model_validate({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
        "content": content, "stop_reason": stop_reason, "stop_sequence": None, "usage": usage,
    })


def test_from_wire_keeps_thinking_and_redacted_blocks_for_the_next_turn():
    content = [
        {"type": "thinking", "thinking": "First idea.", "signature": "sig-1"},
        {"type": "redacted_thinking", "data": "opaque=="},
        {"type": "thinking", "thinking": "Second idea.", "signature": "sig-2"},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "terminal", "input": {"command": "ls"}},
        {"type": "tool_use", "id": "toolu_2", "name": "terminal", "input": {"command": "pwd"}},
    ]
    response = from_wire(_response(content), provider="Anthropic")
    message = response.message
    assert message.reasoning == "First idea.\n\nSecond idea."
    assert message.content == "Let me look."
    assert message.tool_calls == (
        ToolCall("toolu_1", "terminal", {"command": "ls"}, '{"command": "ls"}'),
        ToolCall("toolu_2", "terminal", {"command": "pwd"}, '{"command": "pwd"}'),
    )
    assert (response.finish_reason, response.provider, response.model) == ("tool_calls", "Anthropic", "claude-test")
    # sent back exactly as received: same blocks, same order, same signatures
    _system, wire = to_wire((Message("user", "q"), message))
    assert wire[1] == {"role": "assistant", "content": content}


def test_from_wire_takes_inline_think_tags_out_of_the_text():
    response = from_wire(_response([{"type": "text", "text": "<think>hidden plan</think>\nThe answer."}], "end_turn"))
    assert (response.message.reasoning, response.message.content) == ("hidden plan", "The answer.")


@pytest.mark.parametrize(
    "stop_reason, finish_reason",
    [("end_turn", "stop"), ("stop_sequence", "stop"), ("tool_use", "tool_calls"), ("max_tokens", "length"),
     ("refusal", "content_filter"), ("model_context_window_exceeded", "length")],
)
def test_stop_reasons_become_openai_finish_reasons(stop_reason, finish_reason):
    assert from_wire(_response([{"type": "text", "text": "x"}], stop_reason)).finish_reason == finish_reason


def test_usage_sums_cache_reads_and_writes_into_prompt_tokens():
    response = from_wire(_response(
        [{"type": "text", "text": "x"}], "end_turn",
        input_tokens=12, cache_read_input_tokens=1000, cache_creation_input_tokens=300, output_tokens=40,
        output_tokens_details={"thinking_tokens": 25},
    ))
    assert response.usage == Usage(prompt_tokens=1312, completion_tokens=40, reasoning_tokens=25, cached_tokens=1000)


@pytest.mark.parametrize(
    "effort, disabled, max_tokens, expected",
    [
        (None, False, None, (8192, 8192 + 8192)),  # thinking is on by default, at medium
        ("none", False, 1000, (None, 1000)),
        ("high", True, None, (None, 8192)),
        ("minimal", False, None, (1024, 1024 + 8192)),
        ("low", False, None, (2048, 2048 + 8192)),
        ("medium", False, None, (8192, 8192 + 8192)),
        ("high", False, 20000, (16384, 20000)),
        ("xhigh", False, None, (32000, 32000 + 8192)),
        ("high", False, 10000, (5000, 10000)),  # the budget must stay below max_tokens
        ("low", False, 1500, (None, 1500)),  # no room for the API's minimum budget of 1024
    ],
)
def test_thinking_budget_and_max_tokens(effort, disabled, max_tokens, expected):
    settings = ModelSettings(model="m", base_url="https://api.anthropic.com", max_tokens=max_tokens,
                             reasoning_effort=effort, reasoning_disabled=disabled)
    assert thinking_limits(settings) == expected


def test_rate_limit_wait_prefers_retry_after_then_the_exhausted_limits_reset():
    now = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.timezone.utc).timestamp()
    resets = {
        "anthropic-ratelimit-requests-remaining": "3",
        "anthropic-ratelimit-requests-reset": "2026-01-01T12:00:02Z",
        "anthropic-ratelimit-output-tokens-remaining": "0",
        "anthropic-ratelimit-output-tokens-reset": "2026-01-01T12:00:20Z",
    }
    assert rate_limit_wait({"retry-after": "4", **resets}, now) == 4
    assert rate_limit_wait(resets, now) == 20
    no_zero = {**resets, "anthropic-ratelimit-output-tokens-remaining": "9"}
    assert rate_limit_wait(no_zero, now) == 2
    assert rate_limit_wait({"anthropic-ratelimit-requests-reset": "garbage"}, now) is None
    assert rate_limit_wait({}, now) is None


def test_anthropic_urls_select_the_anthropic_client():
    registry = collect(get_plugin_manager(load_entry_points=False))
    assert model_client_class(registry, None, "https://api.anthropic.com").name == "anthropic"
    assert model_client_class(registry, None, "https://api.anthropic.com/v1/").name == "anthropic"
    assert model_client_class(registry, None, "https://openrouter.ai/api/v1").name == "openai"
    assert model_client_class(registry, None, "http://127.0.0.1:8000/v1").name == "openai"
    assert model_client_class(registry, "anthropic", "http://127.0.0.1:8000").name == "anthropic"


def test_sdk_base_url_drops_a_trailing_v1():
    assert sdk_base_url("https://api.anthropic.com") == "https://api.anthropic.com"
    assert sdk_base_url("https://api.anthropic.com/v1/") == "https://api.anthropic.com"
    assert sdk_base_url("http://proxy:8080/anthropic") == "http://proxy:8080/anthropic"


def test_resolve_api_key_reads_anthropic_api_key_for_anthropic():
    env = {"ANTHROPIC_API_KEY": "sk-ant", "OPENAI_API_KEY": "sk-oai", "OPENROUTER_API_KEY": "sk-or"}
    assert resolve_api_key(None, "https://api.anthropic.com", env) == "sk-ant"
    assert resolve_api_key(None, "http://127.0.0.1:9/", env, model_client="anthropic") == "sk-ant"
    assert resolve_api_key("explicit", "https://api.anthropic.com", env) == "explicit"
    assert resolve_api_key(None, "https://api.anthropic.com", {"OPENAI_API_KEY": "sk-oai"}) is None
    assert resolve_api_key(None, "https://openrouter.ai/api/v1", env) == "sk-or"
    assert resolve_api_key(None, "http://localhost:8000/v1", env) == "sk-oai"
