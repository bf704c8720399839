"""The scripted model endpoint, driven through the real openai and anthropic SDKs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import anthropic
import openai
import pytest

from hermes_batch.formats.records import Usage
from hermes_batch.testing import ErrorRule, Reply, RoutedScript, ScriptedModelServer, ToolLoopScript, write_dataset

SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}}
TERMINAL = [{"type": "function", "function": {"name": "terminal", "parameters": SCHEMA}}]
ANTHROPIC_TERMINAL = [{"name": "terminal", "input_schema": SCHEMA}]


_clients: list = []


@pytest.fixture(autouse=True)
async def close_clients():
    """Close the SDK clients a test made while its event loop still runs."""
    yield
    while _clients:
        await _clients.pop().close()


def openai_client(server: ScriptedModelServer, **kwargs) -> openai.AsyncOpenAI:
    kwargs = {"api_key": "test", "max_retries": 0, **kwargs}
    _clients.append(openai.AsyncOpenAI(base_url=server.base_url, **kwargs))
    return _clients[-1]


def anthropic_client(server: ScriptedModelServer, **kwargs) -> anthropic.AsyncAnthropic:
    kwargs = {"api_key": "test", "max_retries": 0, **kwargs}
    _clients.append(anthropic.AsyncAnthropic(base_url=server.anthropic_base_url, **kwargs))
    return _clients[-1]


def user(text: str) -> list:
    return [{"role": "user", "content": text}]


async def test_openai_tool_loop_carries_tool_results_back():
    async with ScriptedModelServer(ToolLoopScript(tool_calls=2)) as server:
        client = openai_client(server)
        messages = [{"role": "system", "content": "sys"}, *user("list files")]
        call_ids = []
        for turn in range(3):
            response = await client.chat.completions.create(model="m", messages=messages, tools=TERMINAL)
            message = response.choices[0].message
            if turn < 2:
                assert response.choices[0].finish_reason == "tool_calls"
                assert message.content is None
                (call,) = message.tool_calls
                assert call.function.name == "terminal"
                assert json.loads(call.function.arguments)["command"].endswith(f"-{turn}")
                call_ids.append(call.id)
                messages.append(message.model_dump(exclude_none=True))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"output of turn {turn}"})
        assert response.choices[0].finish_reason == "stop"
        assert message.content == "Done: output of turn 1"
        assert len(set(call_ids)) == 2
        last = server.requests[-1]
        assert (last.api, last.model, last.tools) == ("openai", "m", ("terminal",))
        assert (last.prompt, last.turn) == ("list files", 2)
        assert last.tool_results == ["output of turn 1"]
        assert last.messages[2]["reasoning"] == "Let me think about step 0."
        assert server.calls_for("list files") == 3
        assert server.responses_by_status == {200: 3}


@pytest.mark.parametrize(
    "fmt, where",
    [
        ("reasoning", lambda m: m.model_extra["reasoning"]),
        ("reasoning_details", lambda m: m.model_extra["reasoning_details"][0]["text"]),
        ("reasoning_content", lambda m: m.model_extra["reasoning_content"]),
        ("think_tags", lambda m: m.content.split("<think>\n")[1].split("\n</think>")[0]),
        ("scratchpad", lambda m: m.content.split("<REASONING_SCRATCHPAD>\n")[1].split("\n</REASONING_SCRATCHPAD>")[0]),
    ],
)
async def test_openai_reasoning_formats_reach_the_sdk(fmt, where):
    script = lambda request: Reply(content="answer", reasoning="deep thought", reasoning_format=fmt)  # noqa: E731
    async with ScriptedModelServer(script) as server:
        response = await openai_client(server).chat.completions.create(model="m", messages=user("q"))
    message = response.choices[0].message
    assert where(message) == "deep thought"
    assert message.content.endswith("answer")
    assert response.usage.completion_tokens_details.reasoning_tokens > 0


async def test_openai_hidden_reasoning_is_only_counted():
    script = lambda request: Reply(content="answer", reasoning="secret", reasoning_format="none")  # noqa: E731
    async with ScriptedModelServer(script) as server:
        response = await openai_client(server).chat.completions.create(model="m", messages=user("q"))
    message = response.choices[0].message
    assert message.content == "answer" and not message.model_extra
    assert response.usage.completion_tokens_details.reasoning_tokens > 0


def test_sync_client_against_threaded_server_sees_provider_usage_and_raw_arguments():
    script = lambda request: Reply(  # noqa: E731
        tool_calls=[("terminal", '{"command": "ls"'), ("read_file", {"path": "a"})],
        finish_reason="length",
        usage=Usage(prompt_tokens=100, completion_tokens=20, reasoning_tokens=5, cached_tokens=40, cost=0.0125),
        provider="DeepInfra",
        headers={"x-scripted": "yes"},
    )
    with ScriptedModelServer(script) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model="m", messages=user("q"))
        response = raw.parse()
    assert raw.headers["x-scripted"] == "yes"
    assert response.model_extra["provider"] == "DeepInfra"
    assert response.choices[0].finish_reason == "length"
    calls = response.choices[0].message.tool_calls
    assert [c.function.arguments for c in calls] == ['{"command": "ls"', '{"path": "a"}']
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (100, 20, 120)
    assert usage.prompt_tokens_details.cached_tokens == 40
    assert usage.completion_tokens_details.reasoning_tokens == 5
    assert usage.model_extra["cost"] == 0.0125
    assert server.url.startswith("http://127.0.0.1:")
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="m", messages=user("q"))  # stopped


async def test_anthropic_thinking_signatures_and_parallel_tool_use():
    script = ToolLoopScript(tool_calls=1, calls_per_turn=2, command="echo {call}")
    async with ScriptedModelServer(script) as server:
        client = anthropic_client(server)
        messages = user("do two things")
        options = dict(model="claude", max_tokens=100, system="sys", tools=ANTHROPIC_TERMINAL)
        first = await client.messages.create(messages=messages, **options)
        assert first.stop_reason == "tool_use"
        thinking, *uses = first.content
        assert thinking.type == "thinking" and thinking.thinking == "Let me think about step 0." and thinking.signature
        assert [(u.type, u.name, u.input) for u in uses] == [
            ("tool_use", "terminal", {"command": "echo 0"}),
            ("tool_use", "terminal", {"command": "echo 1"}),
        ]
        assert uses[0].id != uses[1].id
        assert first.usage.output_tokens_details.thinking_tokens > 0
        results = [{"type": "tool_result", "tool_use_id": u.id, "content": f"out {i}"} for i, u in enumerate(uses)]
        messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": results}]
        final = await client.messages.create(messages=messages, **options)
        assert final.stop_reason == "end_turn"
        assert [b.type for b in final.content] == ["thinking", "text"]
        assert final.content[1].text == "Done: out 1"
        request = server.requests[-1]
        assert (request.api, request.tools, request.turn) == ("anthropic", ("terminal",), 1)
        assert request.tool_results == ["out 0", "out 1"]
        assert request.messages[0] == {"role": "system", "content": "sys"}
        assert request.messages[2]["reasoning_signature_valid"] is True
        assert [c["id"] for c in request.messages[2]["tool_calls"]] == [u.id for u in uses]
        assert server.thinking_signatures == {"valid": 1}

        forged = {"type": "thinking", "thinking": "edited", "signature": thinking.signature}
        messages[1] = {"role": "assistant", "content": [forged, *[u.model_dump() for u in uses]]}
        with pytest.raises(anthropic.BadRequestError, match="signature"):
            await client.messages.create(messages=messages, **options)
        assert server.thinking_signatures == {"valid": 1, "invalid": 1}


async def test_rate_limit_with_retry_after_is_seen_and_honoured_by_the_sdk():
    rule = ErrorRule(status=429, first_attempts=1, retry_after=0.2)
    async with ScriptedModelServer(lambda r: Reply("ok"), errors=[rule]) as server:
        with pytest.raises(openai.RateLimitError) as caught:
            await openai_client(server).chat.completions.create(model="m", messages=user("a"))
        assert caught.value.response.headers["retry-after"] == "0.2"
        assert caught.value.body["code"] == "rate_limit_exceeded"

        started = time.monotonic()
        response = await openai_client(server, max_retries=1).chat.completions.create(model="m", messages=user("b"))
        assert response.choices[0].message.content == "ok"
        assert time.monotonic() - started >= 0.2
        assert server.calls_for("b") == 2
        assert server.responses_by_status == {429: 2, 200: 1}

        with pytest.raises(anthropic.RateLimitError) as caught:
            await anthropic_client(server).messages.create(model="m", max_tokens=10, messages=user("c"))
        assert caught.value.body == {
            "type": "error",
            "error": {"type": "rate_limit_error", "message": "Scripted error 429."},
        }


async def test_random_errors_are_reproducible_from_the_seed():
    async def statuses(seed: int) -> list:
        rule = ErrorRule(status=503, rate=0.5, match=lambda r: r.prompt != "never")
        async with ScriptedModelServer(lambda r: Reply("ok"), errors=[rule], seed=seed) as server:
            client = openai_client(server)
            for i in range(12):
                try:
                    await client.chat.completions.create(model="m", messages=user(str(i)))
                except openai.InternalServerError:
                    pass
            await client.chat.completions.create(model="m", messages=user("never"))
            return [server.responses_by_status[503], server.responses_by_status[200]]

    first = await statuses(7)
    assert first == await statuses(7)
    assert first[0] > 0 and first[1] > 1


async def test_api_key_is_required_in_each_provider_format():
    async with ScriptedModelServer(lambda r: Reply("ok"), api_key="right") as server:
        with pytest.raises(openai.AuthenticationError) as caught:
            await openai_client(server, api_key="wrong").chat.completions.create(model="m", messages=user("q"))
        assert caught.value.body["code"] == "invalid_api_key"
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await anthropic_client(server, api_key="wrong").messages.create(model="m", max_tokens=9, messages=user("q"))
        assert caught.value.body["error"]["type"] == "authentication_error"
        ok = await openai_client(server, api_key="right").chat.completions.create(model="m", messages=user("q"))
        assert ok.choices[0].message.content == "ok"
        client = anthropic_client(server, api_key="right")
        ok = await client.messages.create(model="m", max_tokens=9, messages=user("x"))
        assert ok.content[0].text == "ok"


async def test_unknown_model_is_not_found():
    async with ScriptedModelServer(lambda r: Reply("ok"), models=("known",)) as server:
        with pytest.raises(openai.NotFoundError) as caught:
            await openai_client(server).chat.completions.create(model="nope", messages=user("q"))
        assert caught.value.body["code"] == "model_not_found"
        with pytest.raises(anthropic.NotFoundError):
            await anthropic_client(server).messages.create(model="nope", max_tokens=10, messages=user("q"))
        assert [m.id for m in (await openai_client(server).models.list()).data] == ["known"]
        assert (await openai_client(server).chat.completions.create(model="known", messages=user("q"))).model == "known"


async def test_latency_is_per_call_and_concurrent():
    latency = lambda request: 0.3 if request.prompt == "slow" else 0.05  # noqa: E731
    async with ScriptedModelServer(lambda r: Reply("ok"), latency=latency) as server:
        client = openai_client(server)
        started = time.monotonic()
        await client.chat.completions.create(model="m", messages=user("slow"))
        assert time.monotonic() - started >= 0.3
        started = time.monotonic()
        await asyncio.gather(*(client.chat.completions.create(model="m", messages=user(str(i))) for i in range(64)))
        assert time.monotonic() - started < 1.5  # 64 calls of 50 ms overlap rather than queue


async def test_hanging_request_times_out_and_does_not_block_shutdown():
    server = ScriptedModelServer(lambda r: Reply("ok"), hang=lambda r: r.prompt == "stuck")
    async with server:
        client = openai_client(server, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            await client.chat.completions.create(model="m", messages=user("stuck"))
        response = await client.chat.completions.create(model="m", messages=user("fine"))
        assert response.choices[0].message.content == "ok"
        started = time.monotonic()
    assert time.monotonic() - started < 2.5


async def test_usage_goes_out_as_an_endpoint_spells_it_through_both_sdks():
    raw = '{"prompt_tokens": 1000000000000000000000000000000, "completion_tokens": NaN, "cost": 1e999}'
    async with ScriptedModelServer(lambda r: Reply("ok", raw_usage=raw)) as server:
        answer = await openai_client(server).chat.completions.with_raw_response.create(model="m", messages=user("q"))
        assert f'"usage": {raw}' in answer.http_response.text
        assert json.loads(answer.http_response.text)["usage"]["cost"] == float("inf")
    nan = Usage(prompt_tokens=5, completion_tokens=-3, cost=float("nan"))
    async with ScriptedModelServer(lambda r: Reply("ok", usage=nan)) as server:
        text = (await openai_client(server).chat.completions.with_raw_response.create(
            model="m", messages=user("q"))).http_response.text
        assert '"completion_tokens": -3' in text and '"cost": NaN' in text
        answer = await anthropic_client(server).messages.with_raw_response.create(
            model="m", max_tokens=10, messages=user("q"))
        assert '"output_tokens": -3' in answer.http_response.text


async def test_an_answer_can_trickle_and_come_gzipped_with_padding():
    async with ScriptedModelServer(lambda r: Reply("ok", trickle=0.002)) as server:
        started = time.monotonic()
        response = await openai_client(server).chat.completions.create(model="m", messages=user("slow"))
        assert response.choices[0].message.content == "ok"
        assert time.monotonic() - started > 0.4  # some 300 bytes, one every 2 ms at least
    async with ScriptedModelServer(lambda r: Reply("ok", gzip=True, padding=20_000_000)) as server:
        answer = await openai_client(server).chat.completions.with_raw_response.create(model="m", messages=user("q"))
        assert answer.http_response.headers["content-encoding"] == "gzip"
        assert answer.http_response.num_bytes_downloaded < 200_000  # 20 MB of whitespace, compressed
        assert len(answer.http_response.content) > 20_000_000
        assert answer.parse().choices[0].message.content == "ok"


async def test_streaming_is_refused_with_a_clear_error():
    async with ScriptedModelServer(lambda r: Reply("ok")) as server:
        with pytest.raises(openai.BadRequestError, match="stream=true is not supported"):
            await openai_client(server).chat.completions.create(model="m", messages=user("q"), stream=True)


async def test_routed_script_and_script_errors():
    script = RoutedScript({"hello": lambda r: Reply("hi there"), "tools": ToolLoopScript(tool_calls=1)})
    async with ScriptedModelServer(script) as server:
        client = openai_client(server)
        response = await client.chat.completions.create(model="m", messages=user("hello"))
        assert response.choices[0].message.content == "hi there"
        assert (await client.chat.completions.create(model="m", messages=user("tools"))).choices[0].message.tool_calls
        with pytest.raises(openai.BadRequestError, match="The test's script raised LookupError: .*no route for prompt 'other'"):
            await client.chat.completions.create(model="m", messages=user("other"))
        assert isinstance(server.script_errors[0], LookupError)

        error = lambda r: Reply(status=400, error_message="too long", error_type="context_length")  # noqa: E731
        route = lambda prompt: error if prompt.startswith("long") else None  # noqa: E731
        server.script = RoutedScript(route, default=lambda r: Reply("x"))
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="m", messages=user("long prompt"))
        assert caught.value.body == {"message": "too long", "type": "context_length", "param": None, "code": None}
        response = await client.chat.completions.create(model="m", messages=user("short"))
        assert response.choices[0].message.content == "x"


def test_command_line_serves_until_sigterm():
    process = subprocess.Popen(
        [sys.executable, "-m", "hermes_batch.testing.server", "--latency", "0.05", "--tool-calls", "1", "--api-key=k",
         "--command", "echo hello > hello.txt"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        ready = process.stdout.readline().split()
        assert ready[0] == "READY", process.stderr.read()
        client = openai.OpenAI(base_url=ready[1], api_key="k", max_retries=0)
        response = client.chat.completions.create(model="any", messages=user("q"), tools=TERMINAL)
        assert response.choices[0].message.tool_calls[0].function.name == "terminal"
        # --command: what each tool call runs (bench/common.py's model_server passes a benchmark's own)
        assert json.loads(response.choices[0].message.tool_calls[0].function.arguments)["command"] == \
            "echo hello > hello.txt"
    finally:
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=10)
    assert process.returncode == 0, err
    assert out.strip() == 'REQUESTS 1 {"200": 1}'
    assert "Warning" not in err


def test_a_run_does_not_retry_what_the_tests_own_script_raised(tmp_path, runner, model_server):
    def script(request):
        if request.prompt == "buggy":
            raise KeyError("a bug in the test")
        return Reply("fine")

    server = model_server(script)
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "buggy"}, {"prompt": "fine"}])
    result = runner.invoke(dataset, "--no_filters", server=server)
    assert result.exit_code == 3, result.output
    assert server.calls_for("buggy") == 1  # one attempt: a 400 is not retried
    [failure] = runner.records("failed.jsonl")
    assert "The test's script raised KeyError" in failure["message"]
    assert [type(e) for e in server.script_errors] == [KeyError]
