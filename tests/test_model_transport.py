"""How the model clients talk HTTP: the aiohttp and httpx transports, bodies we build, connections.

The bodies the clients assemble from cached fragments are compared byte for
byte with what the SDKs' own ``create()`` sends, and whole runs with the way
the clients sent before (``create()`` on httpx).  Faults a transport must turn
into retries (dropped connections, a response cut short, a hung request, 429s
and 5xx with their headers) run through both transports.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import re
import socket
import ssl
import subprocess
import sys
import threading
from typing import Optional

import anthropic
import attrs
import openai
import pytest
from aiohttp import web
from hermes_batch.testing import write_dataset

from hermes_batch.run.config import HTTP_BACKENDS, RunConfig
from hermes_batch.default_plugins import anthropic_client, openai_client
from hermes_batch.default_plugins.anthropic_client import AnthropicClient
from hermes_batch.default_plugins.openai_client import OpenAIClient
from hermes_batch.errors import FatalModelError, ModelCallError, ModelOutcome, RetryableModelError, UsageError
from hermes_batch.contract.interfaces import ModelSettings
from hermes_batch.model import model_http
from hermes_batch.model.model_http import WireCache, json_object
from hermes_batch.formats.records import Message, ToolCall, ToolSpec, Usage
from hermes_batch.testing import ErrorRule, Reply, ScriptedModelServer, ToolLoopScript
from hermes_batch.testing import TEST_API_KEY

TOOLS = (
    ToolSpec("terminal", "Run a command ☃.", {"type": "object", "properties": {"command": {"type": "string"}},
                                               "required": ["command"]}),
    ToolSpec("read_file", "Read a file.", {"type": "object", "properties": {"path": {"type": "string"}}}),
)
CALLS = (
    ToolCall("c1", "terminal", {"command": "printf 'a\\tb' | wc -c"}, '{"command": "printf \'a\\\\tb\' | wc -c"}'),
    ToolCall("c2", "read_file", None, '{"path": '),  # not valid JSON: sent back as it came
)
CONVERSATION = (
    Message("system", "Be brief. Ünïcode, \u2028 line separator, \x00 NUL."),
    Message("user", "Count the bytes 🙂 of a\tb"),
    Message("assistant", "", reasoning="Let me think.", tool_calls=CALLS,
            provider_data=[{"type": "reasoning.text", "text": "Let me think.", "signature": "sig=="}]),
    Message("tool", json.dumps({"output": "3\n", "exit_code": 0}), tool_call_id="c1", name="terminal"),
    Message("tool", json.dumps({"error": "Invalid arguments"}), tool_call_id="c2", name="read_file"),
    Message("assistant", "It is 3 bytes.", reasoning="Done."),
    Message("user", "Thanks"),
)


@pytest.fixture(params=HTTP_BACKENDS)
def backend(request) -> str:
    return request.param


# --- the body we build is the body create() sends ----------------------------------------------------------


class CaptureServer:
    """A bare HTTP endpoint that keeps each raw request body and answers with a fixed response."""

    def __init__(self, answers: dict, tls: Optional[ssl.SSLContext] = None):
        self._tls = tls
        self.bodies: list[bytes] = []
        self.headers: list[dict] = []  # of each request, names in lower case
        self._answers = answers

    async def __aenter__(self) -> "CaptureServer":
        app = web.Application()
        for path, answer in self._answers.items():
            app.router.add_post(path, self._handler(answer))
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._tls).start()
        self.url = f"{'https' if self._tls else 'http'}://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    def _handler(self, answer):
        async def handle(request):
            self.bodies.append(await request.read())
            self.headers.append({name.lower(): value for name, value in request.headers.items()})
            return web.json_response(answer) if isinstance(answer, dict) else web.Response(body=answer)

        return handle

    async def __aexit__(self, *exc_info) -> None:
        await self._runner.cleanup()


OPENAI_ANSWER = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "usage": None, "choices": [
    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]}
ANTHROPIC_ANSWER = {"id": "m", "type": "message", "role": "assistant", "model": "m", "stop_reason": "end_turn",
                    "content": [{"type": "text", "text": "ok"}], "usage": {"input_tokens": 1, "output_tokens": 1}}


@pytest.mark.parametrize("openrouter, settings", [
    (False, dict(max_tokens=100, reasoning_effort="high", providers_order=("a", "b"))),
    (True, dict(reasoning_disabled=True, providers_allowed=("a",), provider_sort="price")),
    (False, dict()),
])
async def test_openai_bodies_are_byte_for_byte_what_create_sends(openrouter, settings):
    # OpenRouter URLs get routing and accounting fields; --routing openrouter sends them to this one too
    routing = "openrouter" if openrouter else "auto"
    async with CaptureServer({"/v1/chat/completions": OPENAI_ANSWER}) as server:
        client = OpenAIClient(ModelSettings("some/model", server.url + "/v1", api_key="k", routing=routing, **settings))
        # on aiohttp the SDK's client only builds requests: create() goes through one that also sends them
        reference = OpenAIClient(ModelSettings("some/model", server.url + "/v1", api_key="k", http_backend="httpx"))
        assert ("usage" in client._extra_body) is openrouter
        try:
            for conversation, tools in ((CONVERSATION[:2], TOOLS), (CONVERSATION, TOOLS), (CONVERSATION, ())):
                await client.send(conversation, tools)
                create = {"model": "some/model", "messages": [openai_client._to_wire(m) for m in conversation]}
                if settings.get("max_tokens"):
                    create["max_tokens"] = settings["max_tokens"]
                if tools:
                    create["tools"] = [openai_client._tool_to_wire(t) for t in tools]
                await reference._client.chat.completions.create(**create, extra_body=client._extra_body)
                ours, sdks = server.bodies[-2:]
                assert ours == sdks
        finally:
            await client.aclose()
            await reference.aclose()


@pytest.mark.parametrize("settings", [dict(max_tokens=20000, reasoning_effort="low"), dict(reasoning_disabled=True)])
async def test_anthropic_bodies_are_byte_for_byte_what_create_sends(settings):
    thinking_turn = Message("assistant", "", tool_calls=CALLS[:1], provider_data={"anthropic_content": [
        {"type": "thinking", "thinking": "Hmm.", "signature": "c2lnbmF0dXJl"},
        {"type": "tool_use", "id": "c1", "name": "terminal", "input": {"command": "ls", "n": [1, 2.5, None, True]}},
    ]})
    conversation = CONVERSATION[:2] + (thinking_turn,) + CONVERSATION[3:]
    async with CaptureServer({"/v1/messages": ANTHROPIC_ANSWER}) as server:
        client = AnthropicClient(ModelSettings("claude-x", server.url, api_key="k", **settings))
        reference = AnthropicClient(ModelSettings("claude-x", server.url, api_key="k", http_backend="httpx"))
        try:
            for messages, tools in ((conversation[:2], TOOLS), (conversation, TOOLS), (conversation[1:], ())):
                await client.send(messages, tools)
                system, wire = anthropic_client.to_wire(messages)
                create = {"model": "claude-x", "messages": wire, "max_tokens": client._max_tokens,
                          "timeout": client.settings.request_timeout}
                if system:
                    create["system"] = system
                if tools:
                    create["tools"] = [{"name": t.name, "description": t.description, "input_schema": t.parameters}
                                       for t in tools]
                if client._budget is not None:
                    create["thinking"] = {"type": "enabled", "budget_tokens": client._budget}
                await reference._client.messages.create(**create)
                ours, sdks = server.bodies[-2:]
                assert ours == sdks
        finally:
            await client.aclose()
            await reference.aclose()


def test_each_message_is_serialized_once_across_the_turns_of_a_session(monkeypatch):
    converted = []
    to_wire = openai_client._to_wire
    monkeypatch.setattr(openai_client, "_to_wire", lambda m: converted.append(m) or to_wire(m))
    client = OpenAIClient(ModelSettings("m", "http://127.0.0.1:9/v1"))
    for turn in range(2, len(CONVERSATION) + 1):
        body = json.loads(client._request(CONVERSATION[:turn], TOOLS))
        assert body["messages"] == [to_wire(m) for m in CONVERSATION[:turn]]
    assert converted == list(CONVERSATION)


def test_the_cache_forgets_a_message_once_nothing_else_holds_it():
    cache = WireCache(lambda m: m.content.encode())
    kept = Message("user", "kept")
    session = [Message("user", f"turn {i}") for i in range(50)]
    assert [cache(m) for m in (kept, *session)] == [b"kept"] + [f"turn {i}".encode() for i in range(50)]
    del session
    gc.collect()
    assert len(cache) == 1
    # a new object that happens to get a freed id is converted afresh, never given another's form
    assert [cache(Message("user", f"new {i}")) for i in range(50)] == [f"new {i}".encode() for i in range(50)]
    assert cache(kept) == b"kept"


# --- whole runs: the same requests and records as before ------------------------------------------------------

_VARIES = re.compile(r'"(timestamp|duration_s|latency_s)":("[^"]*"|[0-9.e+-]+)')


def _masked(runner, run_name) -> list[str]:
    lines = (runner.folder(run_name) / "trajectories.jsonl").read_text().splitlines()
    return [_VARIES.sub(r'"\1":0', line) for line in lines]


async def _openai_send_through_create(self, messages, tools):
    """How OpenAIClient sent before it built its own bodies (with --http_backend httpx: the old transport)."""
    kwargs = {"model": self.settings.model, "messages": [openai_client._to_wire(m) for m in messages]}
    if tools:
        kwargs["tools"] = [openai_client._tool_to_wire(t) for t in tools]
    if self.settings.max_tokens:
        kwargs["max_tokens"] = self.settings.max_tokens
    try:
        response = await self._client.chat.completions.create(**kwargs, extra_body=self._extra_body or None)
    except openai.APIStatusError as exc:
        raise self._classify(exc) from exc
    return openai_client._from_wire(response.to_dict())  # the JSON as the SDK received it


async def _anthropic_send_through_create(self, messages, tools):
    """How AnthropicClient sent before it built its own bodies."""
    system, wire = anthropic_client.to_wire(messages)
    kwargs = {"model": self.settings.model, "messages": wire, "max_tokens": self._max_tokens,
              "timeout": self.settings.request_timeout}
    if system:
        kwargs["system"] = system
    if tools:
        kwargs["tools"] = [{"name": t.name, "description": t.description, "input_schema": t.parameters} for t in tools]
    if self._budget is not None:
        kwargs["thinking"] = {"type": "enabled", "budget_tokens": self._budget}
    try:
        response = await self._client.messages.create(**kwargs)
    except anthropic.APIStatusError as exc:
        raise self._classify(exc) from exc
    return anthropic_client.from_wire(response, self._provider)


@pytest.mark.parametrize("client_name", ["openai", "anthropic"])
def test_a_run_sends_the_same_requests_and_writes_the_same_records_as_through_create(
    client_name, model_server, runner, tmp_path, monkeypatch
):
    prompts = [{"prompt": f"Task {i}: count to {i} ✓"} for i in range(4)]
    dataset = write_dataset(tmp_path / "prompts.jsonl", prompts)
    script = dict(tool_calls=2, calls_per_turn=2, command="echo {prompt_hash}-{turn}-{call}")
    options = ["--num_workers", "1", "--seed", "7", "--reasoning_effort", "low", "--max_tokens", "4000"]

    def run(run_name, *extra):
        server = model_server(ToolLoopScript(**script))
        url = server.anthropic_base_url if client_name == "anthropic" else server.base_url
        result = runner.invoke(dataset, *options, "--model_client", client_name, "--base_url", url, *extra, run_name=run_name)
        assert result.exit_code == 0, result.output
        return server

    new = run("new")
    with monkeypatch.context() as patched:
        cls, send = {"openai": (OpenAIClient, _openai_send_through_create),
                     "anthropic": (AnthropicClient, _anthropic_send_through_create)}[client_name]
        patched.setattr(cls, "send", send)
        old = run("old", "--http_backend", "httpx")
    assert [r.body for r in new.requests] == [r.body for r in old.requests]
    assert len(new.requests) == 1 + 4 * 3
    assert _masked(runner, "new") == _masked(runner, "old")


# --- an OpenAI-compatible server is not trusted: answers of the wrong shape ------------------------------------

_CALL = {"id": "c1", "type": "function", "function": {"name": "terminal", "arguments": '{"command": "ls"}'}}


@pytest.mark.parametrize("answer", [b"<html>Bad gateway</html>", b"[1, 2]", b"null", b'{"choices": ', b"[" * 100000])
def test_an_answer_that_is_not_a_json_object_is_a_retryable_error(answer):
    with pytest.raises(RetryableModelError, match="not a JSON object"):
        json_object(answer)


@pytest.mark.parametrize("data", [{}, {"choices": []}, {"choices": "many"}, {"choices": None}])
def test_an_answer_without_choices_is_a_retryable_error(data):
    with pytest.raises(RetryableModelError, match="without choices"):
        openai_client._from_wire(data)


@pytest.mark.parametrize("message, content, calls", [
    ({"content": "hi"}, "hi", ()),
    ({"content": ["parts"], "tool_calls": "x"}, "", ()),
    ({"content": None, "tool_calls": [None, 3, {"function": "ls"}, _CALL]}, "",
     (ToolCall("c1", "terminal", {"command": "ls"}, '{"command": "ls"}'),)),
    # a server that sends the arguments as an object, and one that leaves out the id and the name
    ({"tool_calls": [{"function": {"name": "terminal", "arguments": {"command": "ls"}}}]}, "",
     (ToolCall("call_0", "terminal", {"command": "ls"}, '{"command": "ls"}'),)),
    ({"tool_calls": [{"id": 7, "function": {"name": None, "arguments": 5}}]}, "", (ToolCall("call_0", "", {}, ""),)),
])
def test_message_fields_of_the_wrong_type_are_read_as_absent(message, content, calls):
    response = openai_client._from_wire({"choices": [{"message": message, "finish_reason": 3}], "model": ["m"]})
    assert (response.message.content, response.message.tool_calls) == (content, calls)
    assert response.finish_reason is None and response.model is None


def test_usage_fields_of_the_wrong_type_count_as_zero():
    usage = {"prompt_tokens": "12", "completion_tokens": 5, "cost": True,
             "completion_tokens_details": {"reasoning_tokens": -3}, "prompt_tokens_details": [1]}
    response = openai_client._from_wire({"choices": [{"message": {"content": "x"}}], "usage": usage})
    assert response.usage == Usage(prompt_tokens=0, completion_tokens=5, reasoning_tokens=0, cached_tokens=0, cost=None)


# --- faults through both transports ---------------------------------------------------------------------------


class CuttingProxy:
    """A TCP proxy in front of a model server: counts connections and cuts the ones ``cut`` names.

    ``cut(n)`` for the n-th connection (from 0): None to pass it through,
    ``"before_response"`` to read the request and close, ``"mid_response"`` to
    pass the request on and close after the first bytes of the answer.
    """

    def __init__(self, port: int, cut=lambda n: None):
        self.port = port
        self.cut = cut
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> "CuttingProxy":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop
        ).result(10)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc_info) -> None:
        async def stop():
            self._server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _handle(self, reader, writer) -> None:
        n = self.connections
        self.connections += 1
        how = self.cut(n)
        try:
            if how == "before_response":
                await reader.read(1024)
                return
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
            try:
                if how == "mid_response":
                    sending = asyncio.ensure_future(self._pipe(reader, up_writer))
                    try:
                        writer.write(await up_reader.readexactly(20))  # "HTTP/1.1 200 OK\r\nCo"
                        await writer.drain()
                    finally:
                        sending.cancel()
                    return
                await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
            finally:
                up_writer.close()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _pipe(reader, writer) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()


@pytest.mark.parametrize("client_name, backend", [("openai", "aiohttp"), ("openai", "httpx"), ("anthropic", "aiohttp")])
def test_dropped_connections_and_cut_responses_are_retried(client_name, backend, model_server, runner, tmp_path):
    server = model_server(ToolLoopScript(tool_calls=1))
    cuts = {0: "before_response", 1: "mid_response"}
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "First"}, {"prompt": "Second"}])
    with CuttingProxy(server.port, cuts.get) as proxy:
        url = proxy.url if client_name == "anthropic" else proxy.url + "/v1"
        result = runner.invoke(dataset, "--base_url", url, "--model_client", client_name, "--num_workers", "1",
                               "--no_preflight", "--no_filters", "--request_timeout", "30", "--http_backend", backend)
    assert result.exit_code == 0, result.output
    first, second = runner.records("trajectories.jsonl")
    assert first["completed"] and second["completed"]
    assert [c["status"] for c in first["metadata"]["calls"]] == [0, 0, 200, 200]  # 0: no answer (records hold no nulls)
    assert [c["status"] for c in second["metadata"]["calls"]] == [200, 200]
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert stats["model_requests"]["errors"] == 2


def test_one_kept_alive_connection_carries_a_sequential_run(backend, model_server, runner, tmp_path):
    server = model_server(ToolLoopScript(tool_calls=2))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt {i}"} for i in range(4)])
    with CuttingProxy(server.port) as proxy:
        result = runner.invoke(dataset, "--base_url", proxy.url + "/v1", "--num_workers", "1",
                               "--no_preflight", "--http_backend", backend)
    assert result.exit_code == 0, result.output
    assert server.request_count == 12
    # one connection for twelve calls (two if the machine stalls past the 5 s keep-alive once)
    assert proxy.connections <= 2


def test_a_hung_request_times_out_and_is_retried(backend, model_server, runner, tmp_path):
    hung = []

    def hang(request):
        if request.preflight or hung:
            return False
        hung.append(request.prompt)
        return True

    server = model_server(ToolLoopScript(tool_calls=1), hang=hang)
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "Hangs once"}])
    result = runner.invoke(dataset, "--base_url", server.base_url, "--request_timeout", "1",
                           "--http_backend", backend)
    assert result.exit_code == 0, result.output
    [kept] = runner.records("trajectories.jsonl")
    cut, *answered = kept["metadata"]["calls"]
    assert cut["status"] == 0 and cut["latency_s"] >= 0.9
    assert [c["status"] for c in answered] == [200, 200]


def test_429s_and_500s_with_retry_after_are_retried_on_each_transport(backend, model_server, runner, tmp_path):
    server = model_server(ToolLoopScript(tool_calls=1), errors=[
        ErrorRule(status=429, first_attempts=1, retry_after=0.1, match=lambda r: not r.preflight and r.turn == 0),
        ErrorRule(status=503, first_attempts=1, retry_after=0, match=lambda r: not r.preflight and r.turn == 1),
    ])
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt {i}"} for i in range(3)])
    result = runner.invoke(dataset, "--base_url", server.base_url, "--num_workers", "3", "--http_backend", backend)
    assert result.exit_code == 0, result.output
    for record in runner.records("trajectories.jsonl"):
        assert [c["status"] for c in record["metadata"]["calls"]] == [429, 200, 503, 200]


# Runs the command given and writes its own peak memory: a child forked by pytest, then exec'd, inherits
# pytest's resident size as its starting peak (Linux keeps it across exec), which a long suite makes large;
# a child of this small process starts from this process's size instead.
_PEAK_OF_CHILD = (
    "import os, subprocess, sys\n"
    "child = subprocess.Popen(sys.argv[2:])\n"
    "_pid, status, usage = os.wait4(child.pid, 0)\n"
    "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)


def _spawn(runner, data, server, *extra) -> tuple:
    """(exit status, stderr, peak memory in MB, seconds) of a run in a child process; fails after 90 s."""
    import os
    import signal
    import time

    started = time.monotonic()
    peak = runner.tmp_path / "peak_kb.txt"
    command = [sys.executable, "-m", "hermes_batch", *runner.args(data, *extra, server=server)]
    with open(runner.tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", _PEAK_OF_CHILD, str(peak), *command],
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"the run was still going after 90 s: {(runner.tmp_path / 'stderr.txt').read_text()[-2000:]}")
    return proc.returncode, (runner.tmp_path / "stderr.txt").read_text(), int(peak.read_text()) / 1024, \
        time.monotonic() - started


def test_request_timeout_bounds_the_whole_answer_of_an_endpoint_that_trickles(backend, model_server, runner, tmp_path):
    # headers at once, then a byte every half second: a timer between bytes never fires
    script = ToolLoopScript(tool_calls=1)
    server = model_server(lambda request: attrs.evolve(script(request), trickle=0.5))
    data = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "Drips"}])
    status, err, _memory, seconds = _spawn(runner, data, server, "--request_timeout", "3", "--max_retries", "0",
                                           "--http_backend", backend)
    assert status == 3, err
    [failure] = runner.records("failed.jsonl")
    assert "within --request_timeout (3 s)" in failure["message"], failure["message"]
    [call] = failure["calls"]
    assert call["status"] == 0 and 2.9 <= call["latency_s"] < 6


def test_a_gzip_answer_is_capped_once_decompressed(backend, model_server, runner, tmp_path):
    # half a megabyte on the wire, 500 MB once decompressed: the run stops reading at the cap
    server = model_server(lambda request: Reply("ok", gzip=True, padding=500_000_000))
    data = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "Expands"}])
    status, err, memory, _seconds = _spawn(runner, data, server, "--max_retries", "0", "--http_backend", backend)
    assert status == 3, err
    [failure] = runner.records("failed.jsonl")
    assert f"larger than {model_http.MAX_ANSWER_BYTES // 2**20} MB once decompressed" in failure["message"]
    assert memory < 400, f"peak {memory:.0f} MB"


async def _calls(client_class, base_url, calls=1, prepare=lambda sdk_client: None, **settings) -> list:
    """The answers to ``calls`` one-message conversations sent by a new client of ``client_class``, then closed."""
    options = dict(model="scripted-model", base_url=base_url, api_key="k")
    client = client_class(ModelSettings(**{**options, **settings}))
    prepare(client._client)
    try:
        return [await client.send((Message("user", f"q{i}"),), ()) for i in range(calls)]
    finally:
        await client.aclose()


async def _send(server, backend, **settings):
    [answer] = await _calls(OpenAIClient, server.base_url, http_backend=backend, **settings)
    return answer


@pytest.mark.parametrize("reply, error, check", [
    (Reply(status=401, error_message="bad key"), FatalModelError, lambda e: "--api_key" in str(e)),
    (Reply(status=404, error_message="no such model"), FatalModelError, lambda e: "--model" in str(e)),
    (Reply(status=429, headers={"retry-after-ms": "1500"}), RetryableModelError,
     lambda e: e.retry_after == 1.5 and e.rate_limited),
    (Reply(status=429, headers={"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "6m0.5s"}),
     RetryableModelError, lambda e: e.retry_after == 360.5),
    (Reply(status=502, error_message="Upstream error.", provider="ProvB"), RetryableModelError,
     lambda e: (e.status, e.provider) == (502, "ProvB")),
    (Reply(status=400, error_message="This model's maximum context length is 8192 tokens"), ModelOutcome,
     lambda e: e.reason == "context_length"),
    (Reply(status=400, error_message="Unsupported parameter: tools."), ModelCallError,
     lambda e: type(e) is ModelCallError and e.status == 400),
])
async def test_errors_and_their_headers_are_read_the_same_on_each_transport(backend, reply, error, check):
    async with ScriptedModelServer(lambda r: reply) as server:
        with pytest.raises(error) as caught:
            await _send(server, backend)
    assert check(caught.value)


async def test_an_endpoint_that_is_not_listening_is_retryable_on_each_transport(backend):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = OpenAIClient(ModelSettings("m", f"http://127.0.0.1:{port}/v1", http_backend=backend))
    try:
        # the cause underneath the SDK's error, named
        with pytest.raises(RetryableModelError, match=r"could not be reached: \w+Error: \S"):
            await client.send((Message("user", "q"),), ())
    finally:
        await client.aclose()


# --- the request the SDK builds, on each transport ----------------------------------------------------------


async def _captured_headers(backend, client_class=OpenAIClient, userinfo="", **options) -> list:
    """The headers of each request a client of ``client_class`` sends on ``backend`` (see ``_calls``)."""
    openai_ = client_class is OpenAIClient
    async with CaptureServer({"/v1/chat/completions" if openai_ else "/v1/messages":
                              OPENAI_ANSWER if openai_ else ANTHROPIC_ANSWER}) as server:
        url = server.url.replace("http://", f"http://{userinfo}") + ("/v1" if openai_ else "")
        await _calls(client_class, url, api_key="sk-captured", http_backend=backend, **options)
    return server.headers


@pytest.mark.parametrize("client_class", [OpenAIClient, AnthropicClient])
async def test_the_sdks_headers_go_out_the_same_on_each_transport(client_class):
    aiohttp_headers, httpx_headers = [
        (await _captured_headers(backend, client_class))[0] for backend in ("aiohttp", "httpx")
    ]
    # each transport asks for the encodings it can decode itself; each server had a port of its own
    for headers in (aiohttp_headers, httpx_headers):
        headers.pop("accept-encoding"), headers.pop("host")
    assert aiohttp_headers == httpx_headers
    assert aiohttp_headers["user-agent"].startswith("Async")  # the SDK's, not aiohttp's
    auth = aiohttp_headers.get("authorization") or aiohttp_headers["x-api-key"]
    assert "sk-captured" in auth


async def test_credentials_in_the_base_url_become_basic_auth_on_each_transport(backend):
    [headers] = await _captured_headers(backend, userinfo="us%40er:pa:ss@")
    assert headers["authorization"] == "Basic " + base64.b64encode(b"us@er:pa:ss").decode()


async def test_an_idempotency_key_the_sdk_sets_is_new_for_each_call(backend):
    def with_key(sdk_client):
        sdk_client._idempotency_header = "Idempotency-Key"

    first, second = await _captured_headers(backend, calls=2, prepare=with_key)
    assert first["idempotency-key"] and second["idempotency-key"]
    assert first["idempotency-key"] != second["idempotency-key"]


async def test_an_sdk_without_the_request_building_it_expects_is_sent_through_post(caplog, monkeypatch):
    monkeypatch.delattr(openai._models, "FinalRequestOptions")  # where DirectPost looks; the SDK holds its own
    model_http._warn_post_only.cache_clear()  # said once per process
    with caplog.at_level("WARNING", logger="hermes_batch.model.model_http"):
        [headers] = await _captured_headers("aiohttp")
    assert "go through its post()" in caplog.text
    assert headers["authorization"] == "Bearer sk-captured"


_MAKE_CLIENTS = """
import asyncio, sys
from hermes_batch.default_plugins.{module} import {cls} as Client
from hermes_batch.errors import RetryableModelError
from hermes_batch.contract.interfaces import ModelSettings
from hermes_batch.formats.records import Message

async def call(backend):
    client = Client(ModelSettings("m", "http://127.0.0.1:{port}/v1", api_key="k", http_backend=backend))
    try:
        await client.send((Message("user", "q"),), ())
    except RetryableModelError:  # nothing listens there: the whole way to the socket, and back
        pass
    finally:
        await client.aclose()

for backend in sys.argv[1:]:
    asyncio.run(call(backend))
print(" ".join(name for name in ("httpcore", "httpcore2") if name in sys.modules))
"""


@pytest.mark.parametrize("module, cls", [("openai_client", "OpenAIClient"), ("anthropic_client", "AnthropicClient")])
def test_on_aiohttp_a_call_to_a_plain_http_endpoint_loads_no_transport_of_the_sdks(module, cls):
    # the SDK's default client imports httpcore (HTTP/2 tables and all) and loads a certificate store
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        program = _MAKE_CLIENTS.format(module=module, cls=cls, port=sock.getsockname()[1])

        def transport_modules(*backends):
            done = subprocess.run([sys.executable, "-c", program, *backends], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
            return done.stdout.split()

        assert transport_modules("aiohttp", "aiohttp") == []
        assert transport_modules("httpx") != []


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and its key."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


async def test_a_certificate_in_ssl_cert_file_is_trusted_on_each_transport(backend, certificate, monkeypatch):
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(*certificate)
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)
    async with CaptureServer({"/v1/chat/completions": OPENAI_ANSWER}, tls=tls) as server:
        with pytest.raises(RetryableModelError, match="could not be reached"):
            await _calls(OpenAIClient, server.url + "/v1", http_backend=backend)
        monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))
        [answer] = await _calls(OpenAIClient, server.url + "/v1", http_backend=backend)
    assert answer.message.content == "ok"


@pytest.mark.parametrize("bypass", [False, True])
def test_a_proxy_from_the_environment_carries_the_calls_on_each_transport(
        backend, bypass, model_server, runner, tmp_path, monkeypatch):
    server = model_server(ToolLoopScript(tool_calls=1))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "Through the proxy"}])
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    # a TCP forwarder is enough for plain HTTP: the server reads the proxy's absolute request line
    with CuttingProxy(server.port) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        if bypass:
            monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        result = runner.invoke(dataset, "--base_url", server.base_url, "--num_workers", "1", "--http_backend", backend)
    assert result.exit_code == 0, result.output
    assert server.request_count == 3  # the preflight and two turns
    assert (proxy.connections == 0) is bypass


async def test_an_anthropic_answer_that_is_not_a_json_object_is_a_retryable_error():
    async with CaptureServer({"/v1/messages": b"[1, 2]"}) as server:
        with pytest.raises(RetryableModelError, match="not a JSON object"):
            await _calls(AnthropicClient, server.url)


async def test_an_anthropic_answer_may_hold_any_field_name():
    async with CaptureServer({"/v1/messages": {**ANTHROPIC_ANSWER, "_fields_set": 5, "class": 1}}) as server:
        [response] = await _calls(AnthropicClient, server.url)
    assert response.message.content == "ok"


# --- the option ------------------------------------------------------------------------------------------------


async def test_the_connection_pool_opens_one_connection_per_call_the_run_allows_in_flight(backend, model_server):
    server = model_server(lambda r: Reply(content="ok"), latency=0.15)
    with CuttingProxy(server.port) as proxy:
        settings = ModelSettings("scripted-model", proxy.url + "/v1", api_key=TEST_API_KEY,
                                 max_concurrent_requests=3, http_backend=backend)
        client = OpenAIClient(settings)
        try:
            # the limiter is bypassed: ten calls at once wait for the pool's three connections, then reuse them
            answers = await asyncio.gather(*(client.send((Message("user", f"q{i}"),), ()) for i in range(10)))
        finally:
            await client.aclose()
    assert [a.message.content for a in answers] == ["ok"] * 10
    assert proxy.connections == 3


def test_an_unknown_http_backend_is_a_usage_error(runner, tmp_path):
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "p"}])
    result = runner.invoke(dataset, "--http_backend", "curl")
    assert result.exit_code == 2 and "--http_backend" in result.output and "aiohttp" in result.output
    with pytest.raises(UsageError, match="--http_backend must be one of aiohttp, httpx"):
        RunConfig(dataset_file=dataset, batch_size=1, run_name="r", http_backend="curl")
