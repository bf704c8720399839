"""A scripted model endpoint on 127.0.0.1 that speaks the OpenAI and Anthropic wire formats.

``ScriptedModelServer`` answers ``POST /v1/chat/completions`` (OpenAI / OpenRouter),
``POST /v1/messages`` (Anthropic) and ``GET /v1/models`` by calling a *script*: any
callable ``(ScriptRequest) -> Reply``, sync or async.  Faults (rate limits, server
errors, bad keys, unknown models, latency, hangs) are injected around the script.

Run it alone for benchmarks::

    python -m hermes_batch.testing.server --port 0 --latency 0.5 --tool-calls 2
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import hashlib
import hmac
import inspect
import json
import random
import signal
import sys
import threading
import time
from typing import Any, Awaitable, Callable, Iterable, Mapping, Optional, Union

import attrs
from aiohttp import web

from ..interfaces import PREFLIGHT_PROMPT
from ..records import Usage

REASONING_FORMATS = ("reasoning", "reasoning_details", "reasoning_content", "think_tags", "scratchpad", "none")


@attrs.frozen
class ScriptRequest:
    """One request as the script sees it, whichever API it came through.

    ``messages`` are normalized to the OpenAI shape (``role``, ``content`` as text,
    ``tool_calls``, ``tool_call_id``); reasoning sent back by the client, in any
    format, is under ``reasoning``.  Anthropic requests become a leading ``system``
    message, ``tool`` messages for ``tool_result`` blocks (``is_error`` kept), and
    assistant messages whose thinking blocks carry ``reasoning_signature_valid``.
    """

    api: str  # "openai" or "anthropic"
    model: str
    messages: tuple  # of dict
    tools: tuple = ()  # names of the tools offered
    body: dict = attrs.field(factory=dict)
    headers: dict = attrs.field(factory=dict)

    @property
    def prompt(self) -> str:
        """Text of the first user message."""
        return next((m["content"] for m in self.messages if m["role"] == "user"), "")

    @property
    def preflight(self) -> bool:
        """True for the probe hermes-batch sends before a run (``ModelClient.preflight``)."""
        return not self.tools and self.prompt == PREFLIGHT_PROMPT

    @property
    def turn(self) -> int:
        """Number of assistant messages already in the conversation."""
        return sum(1 for m in self.messages if m["role"] == "assistant")

    @property
    def tool_results(self) -> list:
        """Contents of the tool results sent after the last assistant message."""
        results = []
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                break
            if m["role"] == "tool":
                results.append(m["content"])
        return results[::-1]


def _to_tuple(calls: Iterable) -> tuple:
    return tuple(tuple(c) for c in calls)


@attrs.frozen
class Reply:
    """What the script answers; rendered in the format of the API that was called.

    ``tool_calls`` holds ``(name, arguments)`` pairs; a string ``arguments`` is sent
    verbatim (to test invalid JSON).  ``usage=None`` estimates tokens from text
    lengths.  A ``status`` other than 200 sends the provider's error body with
    ``error_message``.  With the Anthropic API any ``reasoning_format`` except
    ``"none"`` gives a signed ``thinking`` block.
    """

    content: str = ""
    reasoning: Optional[str] = None
    reasoning_format: str = attrs.field(default="reasoning", validator=attrs.validators.in_(REASONING_FORMATS))
    tool_calls: tuple = attrs.field(default=(), converter=_to_tuple)
    finish_reason: Optional[str] = None  # default: "tool_calls" with calls, else "stop"
    usage: Optional[Usage] = None
    provider: Optional[str] = None  # OpenRouter's top-level "provider" (in error replies: error.metadata.provider_name)
    status: int = 200
    headers: dict = attrs.field(factory=dict)
    error_message: Optional[str] = None
    error_type: Optional[str] = None  # default: the provider's type for ``status``


Script = Callable[[ScriptRequest], Union[Reply, Awaitable[Reply]]]


def _prompt_hash(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:8]


@attrs.frozen
class ToolLoopScript:
    """Call ``tool`` while ``turn < tool_calls``, then give a final answer.

    ``command``, ``reasoning`` and ``final`` are ``str.format`` templates with the
    fields ``prompt``, ``prompt_hash`` (8 hex digits), ``turn``, ``model``,
    ``tool_calls``, ``last_result`` (content of the last tool result, "" if none)
    and, in ``command`` only, ``call`` (index of the call within the turn).  Each
    tool-calling turn makes ``calls_per_turn`` calls with arguments
    ``{"command": command}``.  ``reasoning=None`` sends no reasoning.
    """

    tool_calls: int = 2
    command: str = "echo {prompt_hash}-{turn}"
    tool: str = "terminal"
    reasoning: Optional[str] = "Let me think about step {turn}."
    reasoning_format: str = attrs.field(default="reasoning", validator=attrs.validators.in_(REASONING_FORMATS))
    final: str = "Done: {last_result}"
    calls_per_turn: int = 1

    def __call__(self, request: ScriptRequest) -> Reply:
        results = request.tool_results
        fields = dict(
            prompt=request.prompt,
            prompt_hash=_prompt_hash(request.prompt),
            turn=request.turn,
            model=request.model,
            tool_calls=self.tool_calls,
            last_result=results[-1] if results else "",
        )
        reasoning = self.reasoning.format(**fields) if self.reasoning is not None else None
        if request.turn < self.tool_calls:
            commands = (self.command.format(call=i, **fields) for i in range(self.calls_per_turn))
            calls = [(self.tool, {"command": command}) for command in commands]
            return Reply(reasoning=reasoning, reasoning_format=self.reasoning_format, tool_calls=calls)
        return Reply(content=self.final.format(**fields), reasoning=reasoning, reasoning_format=self.reasoning_format)


@attrs.frozen
class RoutedScript:
    """Dispatch on the prompt: ``routes`` maps prompt text to a script, or is a function returning one (or None)."""

    routes: Union[Mapping[str, Script], Callable[[str], Optional[Script]]]
    default: Optional[Script] = None

    def __call__(self, request: ScriptRequest) -> Union[Reply, Awaitable[Reply]]:
        routes = self.routes
        script = routes.get(request.prompt) if isinstance(routes, Mapping) else routes(request.prompt)
        script = script or self.default
        if script is None:
            raise LookupError(f"RoutedScript has no route for prompt {request.prompt[:80]!r} and no default")
        return script(request)


@attrs.frozen
class ErrorRule:
    """Answer with an error instead of calling the script.

    The rule fires on requests accepted by ``match`` (all when None): on the first
    ``first_attempts`` attempts of each distinct conversation state (model and
    messages), or else with probability ``rate`` drawn from the server's seeded
    generator.  Rules are tried in order; the first that fires answers.
    """

    status: int = 500
    rate: float = 0.0
    first_attempts: int = 0
    retry_after: Optional[float] = None
    match: Optional[Callable[[ScriptRequest], bool]] = None
    message: Optional[str] = None


# (type, code) of the OpenAI error body and type of the Anthropic one, by status.
_OPENAI_ERRORS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", None),
    404: ("invalid_request_error", "model_not_found"),
    429: ("requests", "rate_limit_exceeded"),
}
_ANTHROPIC_ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def _error_body(
    api: str, status: int, message: str, error_type: Optional[str] = None, provider: Optional[str] = None
) -> dict:
    if api == "anthropic":
        default = _ANTHROPIC_ERRORS.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": error_type or default, "message": message}}
    fallback = ("server_error" if status >= 500 else "invalid_request_error", None)
    default_type, code = _OPENAI_ERRORS.get(status, fallback)
    error = {"message": message, "type": error_type or default_type, "param": None, "code": code}
    if provider is not None:
        error["metadata"] = {"provider_name": provider}  # as OpenRouter names the upstream that failed
    return {"error": error}


class _BadRequest(Exception):
    pass


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise _BadRequest(f"content must be a string or a list of parts, got {type(content).__name__}")


def _openai_messages(body: dict) -> list:
    out = []
    for m in body["messages"]:
        msg = {"role": m.get("role"), "content": _text(m.get("content"))}
        if m.get("tool_calls"):
            msg["tool_calls"] = m["tool_calls"]
        if "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("name"):
            msg["name"] = m["name"]
        reasoning = m.get("reasoning") or m.get("reasoning_content")
        if not reasoning and m.get("reasoning_details"):
            reasoning = "".join(d.get("text") or d.get("summary") or "" for d in m["reasoning_details"])
        if reasoning:
            msg["reasoning"] = reasoning
        out.append(msg)
    return out


def _anthropic_messages(body: dict, verify: Callable[[str, str], bool]) -> list:
    out = []
    if body.get("system"):
        out.append({"role": "system", "content": _text(body["system"])})
    for m in body["messages"]:
        role, content = m.get("role"), m.get("content")
        if not isinstance(content, list):
            out.append({"role": role, "content": _text(content)})
            continue
        texts, calls, thinking, signatures_ok = [], [], [], True
        for block in content:
            kind = block.get("type")
            if kind == "text":
                texts.append(block["text"])
            elif kind == "tool_use":
                arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
                calls.append(_function_call(block["id"], block["name"], arguments))
            elif kind == "thinking":
                thinking.append(block.get("thinking", ""))
                signatures_ok = signatures_ok and verify(block.get("thinking", ""), block.get("signature", ""))
            elif kind == "tool_result":
                result = {"role": "tool", "tool_call_id": block.get("tool_use_id")}
                result["content"] = _text(block.get("content"))
                if block.get("is_error"):
                    result["is_error"] = True
                out.append(result)
        if role == "assistant":
            msg = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning"] = "".join(thinking)
                msg["reasoning_signature_valid"] = signatures_ok
            out.append(msg)
        elif texts or not out or out[-1]["role"] != "tool":
            out.append({"role": role, "content": "".join(texts)})
    return out


def _tool_names(api: str, tools: Any) -> tuple:
    if not isinstance(tools, list):
        return ()
    if api == "openai":
        return tuple(t.get("function", {}).get("name") for t in tools if isinstance(t, dict))
    return tuple(t.get("name") for t in tools if isinstance(t, dict))


def _tokens(text: str) -> int:
    return (len(text) + 3) // 4


def _estimate_usage(request: ScriptRequest, reply: Reply) -> Usage:
    prompt = sum(_tokens(m["content"]) + 4 for m in request.messages)
    reasoning = _tokens(reply.reasoning) if reply.reasoning else 0
    calls = sum(_tokens(str(args)) + _tokens(name) for name, args in reply.tool_calls)
    completion = _tokens(reply.content) + reasoning + calls + 1
    return Usage(prompt_tokens=prompt, completion_tokens=completion, reasoning_tokens=reasoning)


def _wrap_reasoning(reply: Reply) -> str:
    tag = {"think_tags": "think", "scratchpad": "REASONING_SCRATCHPAD"}.get(reply.reasoning_format)
    if reply.reasoning is None or tag is None:
        return reply.content
    block = f"<{tag}>\n{reply.reasoning}\n</{tag}>"
    return f"{block}\n\n{reply.content}" if reply.content else block


def _arguments_json(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _function_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _model_info(api: str, model: str) -> dict:
    if api == "anthropic":
        return {"type": "model", "id": model, "display_name": model, "created_at": "2025-01-01T00:00:00Z"}
    return {"id": model, "object": "model", "created": 0, "owned_by": "hermes-batch"}


class ScriptedModelServer:
    """A real HTTP model endpoint that follows ``script``; see the module docstring.

    Use ``with`` to run it in a background thread with its own event loop, or
    ``async with`` inside a running loop.  Sync scripts run on the event loop and
    must not block.  With ``record=False`` requests are counted but not kept.
    The preflight probe of a run (``ScriptRequest.preflight``) is answered with
    ``preflight_reply`` instead of calling the script (``None``: the script
    answers it too); faults, latency and hangs apply to it like to any request.
    """

    def __init__(
        self,
        script: Script,
        *,
        latency: Union[float, Callable[[ScriptRequest], float]] = 0.0,
        errors: Iterable[ErrorRule] = (),
        api_key: Optional[str] = None,
        models: Optional[Iterable[str]] = None,
        hang: Optional[Callable[[ScriptRequest], bool]] = None,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        record: bool = True,
        preflight_reply: Optional[Reply] = Reply(content="ready", finish_reason="stop"),
    ):
        self.script = script
        self.latency = latency
        self.errors = tuple(errors)
        self.api_key = api_key
        self.models = tuple(models) if models is not None else None
        self.hang = hang
        self.preflight_reply = preflight_reply
        self.host = host
        self.port = port
        self.record = record
        self._random = random.Random(seed)
        self._secret = f"hermes-batch-scripted-{seed}".encode()
        self._lock = threading.Lock()
        self._requests: list = []
        self._request_count = 0
        self._statuses: collections.Counter = collections.Counter()
        self._prompts: collections.Counter = collections.Counter()
        self._attempts: collections.Counter = collections.Counter()
        self._thinking: collections.Counter = collections.Counter()
        self._ids = 0
        self.script_errors: list = []  # exceptions raised by the script, answered with a 500
        self._runner: Optional[web.AppRunner] = None
        self._stopping: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None

    # --- observing -------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """Base URL for the ``openai`` SDK."""
        return self.url + "/v1"

    @property
    def anthropic_base_url(self) -> str:
        """Base URL for the ``anthropic`` SDK, which appends ``/v1/messages`` itself."""
        return self.url

    @property
    def requests(self) -> list:
        """A copy of the requests received so far, in arrival order."""
        with self._lock:
            return list(self._requests)

    @property
    def request_count(self) -> int:
        with self._lock:
            return self._request_count

    @property
    def responses_by_status(self) -> collections.Counter:
        with self._lock:
            return collections.Counter(self._statuses)

    @property
    def thinking_signatures(self) -> collections.Counter:
        """Thinking blocks sent back to ``/v1/messages``, counted as ``"valid"`` or ``"invalid"``."""
        with self._lock:
            return collections.Counter(self._thinking)

    def calls_for(self, prompt: str) -> int:
        """Number of requests whose first user message is ``prompt``."""
        with self._lock:
            return self._prompts[prompt]

    # --- lifecycle ---------------------------------------------------------------

    async def astart(self) -> "ScriptedModelServer":
        """Start listening in the running event loop."""
        self._stopping = asyncio.Event()
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._handle_openai)
        app.router.add_post("/v1/messages", self._handle_anthropic)
        app.router.add_get("/v1/models", self._handle_models)
        app.router.add_get("/v1/models/{model:.+}", self._handle_model)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, backlog=1024).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def aclose(self) -> None:
        """Stop listening; hanging requests are released."""
        if self._runner is not None:
            self._stopping.set()
            await self._runner.cleanup()
            self._runner = None

    def start(self) -> "ScriptedModelServer":
        """Start listening in a background thread with its own event loop."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ScriptedModelServer", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.astart(), self._loop).result(timeout=30)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the server started by ``start`` (or ``with``); idempotent."""
        if self._loop is None:
            if self._runner is not None:
                raise RuntimeError("This server runs in your event loop: stop it with `await server.aclose()`.")
            return
        asyncio.run_coroutine_threadsafe(self.aclose(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> "ScriptedModelServer":
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    async def __aenter__(self) -> "ScriptedModelServer":
        return await self.astart()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    # --- handling ---------------------------------------------------------------

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def _sign(self, thinking: str) -> str:
        digest = hmac.new(self._secret, thinking.encode("utf-8"), hashlib.sha256).digest()
        return base64.b64encode(digest).decode("ascii")

    def _verify(self, thinking: str, signature: str) -> bool:
        ok = hmac.compare_digest(self._sign(thinking), signature or "")
        with self._lock:
            self._thinking["valid" if ok else "invalid"] += 1
        return ok

    def _respond(self, status: int, body: dict, headers: Optional[Mapping[str, str]] = None) -> web.Response:
        with self._lock:
            self._statuses[status] += 1
        headers = {"x-request-id": f"req_hb{self._next_id()}", **(headers or {})}
        return web.json_response(body, status=status, headers=headers)

    def _error(
        self,
        api: str,
        status: int,
        message: str,
        headers: Optional[Mapping[str, str]] = None,
        error_type: Optional[str] = None,
        provider: Optional[str] = None,
    ) -> web.Response:
        return self._respond(status, _error_body(api, status, message, error_type, provider), headers)

    async def _handle_openai(self, http: web.Request) -> web.Response:
        return await self._handle(http, "openai")

    async def _handle_anthropic(self, http: web.Request) -> web.Response:
        return await self._handle(http, "anthropic")

    def _authorized(self, http: web.Request) -> bool:
        if self.api_key is None:
            return True
        headers = http.headers
        return headers.get("Authorization") == f"Bearer {self.api_key}" or headers.get("x-api-key") == self.api_key

    def _parse(self, api: str, body: Any, headers: dict) -> ScriptRequest:
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise _BadRequest("messages: a list of messages is required")
        if not isinstance(body.get("model"), str):
            raise _BadRequest("model: a string is required")
        if api == "anthropic":
            if not isinstance(body.get("max_tokens"), int):
                raise _BadRequest("max_tokens: Field required")
            messages = _anthropic_messages(body, self._verify)
        else:
            messages = _openai_messages(body)
        return ScriptRequest(api, body["model"], tuple(messages), _tool_names(api, body.get("tools")), body, headers)

    async def _handle(self, http: web.Request, api: str) -> web.Response:
        try:
            body = await http.json()
            request = self._parse(api, body, {k.lower(): v for k, v in http.headers.items()})
        except (ValueError, _BadRequest, KeyError, TypeError, AttributeError) as exc:
            return self._error(api, 400, f"Invalid request body: {exc}")
        with self._lock:
            self._request_count += 1
            self._prompts[request.prompt] += 1
            if self.record:
                self._requests.append(request)
        if not self._authorized(http):
            message = "invalid x-api-key" if api == "anthropic" else "Incorrect API key provided."
            return self._error(api, 401, message)
        if body.get("stream"):
            message = "stream=true is not supported by ScriptedModelServer; send non-streaming requests."
            return self._error(api, 400, message)
        if self.models is not None and request.model not in self.models:
            message = f"The model `{request.model}` does not exist or you do not have access to it."
            if api == "anthropic":
                message = f"model: {request.model}"
            return self._error(api, 404, message)
        if any(m.get("reasoning_signature_valid") is False for m in request.messages):
            return self._error(api, 400, "Invalid `signature` in `thinking` block")
        if self.hang is not None and self.hang(request):
            # Released by aclose(), so shutting down never waits for the hour.
            try:
                await asyncio.wait_for(self._stopping.wait(), 3600)
            except asyncio.TimeoutError:
                pass
            return self._error(api, 503, "The server is shutting down.")
        latency = self.latency(request) if callable(self.latency) else self.latency
        if latency > 0:
            await asyncio.sleep(latency)
        rule = self._failing_rule(request)
        if rule is not None:
            headers = {"Retry-After": f"{rule.retry_after:g}"} if rule.retry_after is not None else None
            return self._error(api, rule.status, rule.message or f"Scripted error {rule.status}.", headers)
        try:
            if self.preflight_reply is not None and request.preflight:
                reply = self.preflight_reply
            else:
                reply = self.script(request)
            if inspect.isawaitable(reply):
                reply = await reply
            if not isinstance(reply, Reply):
                raise TypeError(f"a script must return a Reply, not {type(reply).__name__}")
        except Exception as exc:  # the script is test code: report its bug to the client and the test
            self.script_errors.append(exc)
            return self._error(api, 500, f"The script raised {type(exc).__name__}: {exc}")
        if reply.status != 200:
            message = reply.error_message or f"Scripted error {reply.status}."
            return self._error(api, reply.status, message, reply.headers, reply.error_type, reply.provider)
        usage = reply.usage or _estimate_usage(request, reply)
        render = self._render_anthropic if api == "anthropic" else self._render_openai
        return self._respond(200, render(request, reply, usage), reply.headers)

    def _failing_rule(self, request: ScriptRequest) -> Optional[ErrorRule]:
        attempt = 0
        if any(rule.first_attempts for rule in self.errors):
            body = request.body
            state = [request.api, request.model, body.get("system"), body["messages"]]
            blob = json.dumps(state, sort_keys=True, default=str)
            key = hashlib.sha256(blob.encode("utf-8")).hexdigest()
            with self._lock:
                self._attempts[key] += 1
                attempt = self._attempts[key]
        for rule in self.errors:
            if rule.match is not None and not rule.match(request):
                continue
            if rule.first_attempts and attempt <= rule.first_attempts:
                return rule
            if rule.rate and self._random.random() < rule.rate:
                return rule
        return None

    def _render_openai(self, request: ScriptRequest, reply: Reply, usage: Usage) -> dict:
        message: dict = {"role": "assistant", "content": None, "refusal": None}
        content = _wrap_reasoning(reply)
        if reply.reasoning is not None:
            if reply.reasoning_format in ("reasoning", "reasoning_content"):
                message[reply.reasoning_format] = reply.reasoning
            elif reply.reasoning_format == "reasoning_details":
                detail = {"type": "reasoning.text", "text": reply.reasoning, "format": "unknown", "index": 0}
                message["reasoning_details"] = [detail]
        if content or not reply.tool_calls:
            message["content"] = content
        if reply.tool_calls:
            message["tool_calls"] = [
                _function_call(f"call_hb{self._next_id()}", name, _arguments_json(args))
                for name, args in reply.tool_calls
            ]
        finish = reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")
        usage_body: dict = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        }
        if usage.cost is not None:
            usage_body["cost"] = usage.cost
        body = {
            "id": f"chatcmpl-hb{self._next_id()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": usage_body,
        }
        if reply.provider is not None:
            body["provider"] = reply.provider
        return body

    def _render_anthropic(self, request: ScriptRequest, reply: Reply, usage: Usage) -> dict:
        blocks: list = []
        if reply.reasoning is not None and reply.reasoning_format != "none":
            blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": self._sign(reply.reasoning)})
        if reply.content:
            blocks.append({"type": "text", "text": reply.content})
        for name, args in reply.tool_calls:
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    pass  # sent verbatim: Anthropic never does this, but a client may want to survive it
            blocks.append({"type": "tool_use", "id": f"toolu_hb{self._next_id()}", "name": name, "input": args})
        finish = reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")
        stop_reason = {"tool_calls": "tool_use", "stop": "end_turn", "length": "max_tokens"}.get(finish, finish)
        usage_body = {
            "input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens,
            "cache_creation_input_tokens": 0,
        }
        if usage.reasoning_tokens:
            usage_body["output_tokens_details"] = {"thinking_tokens": usage.reasoning_tokens}
        return {
            "id": f"msg_hb{self._next_id()}",
            "type": "message",
            "role": "assistant",
            "model": request.model,
            "content": blocks,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": usage_body,
        }

    async def _handle_models(self, http: web.Request) -> web.Response:
        models = self.models or ("scripted-model",)
        if "anthropic-version" in http.headers:
            data = [_model_info("anthropic", m) for m in models]
            return self._respond(200, {"data": data, "has_more": False, "first_id": models[0], "last_id": models[-1]})
        return self._respond(200, {"object": "list", "data": [_model_info("openai", m) for m in models]})

    async def _handle_model(self, http: web.Request) -> web.Response:
        model = http.match_info["model"]
        api = "anthropic" if "anthropic-version" in http.headers else "openai"
        if self.models is not None and model not in self.models:
            return self._error(api, 404, f"The model `{model}` does not exist or you do not have access to it.")
        return self._respond(200, _model_info(api, model))


# --- command line ------------------------------------------------------------------


def _parse_args(argv: Optional[list]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hermes_batch.testing.server",
        description="Run a scripted model endpoint that follows ToolLoopScript.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per call")
    parser.add_argument("--tool-calls", type=int, default=2, help="tool-calling turns before the final answer")
    parser.add_argument("--calls-per-turn", type=int, default=1)
    parser.add_argument("--reasoning-format", choices=REASONING_FORMATS, default="reasoning")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--models", default=None, help="comma-separated known models; others get 404")
    parser.add_argument("--error-rate", type=float, default=0.0, help="probability of an error reply")
    parser.add_argument("--error-status", type=int, default=429)
    parser.add_argument("--retry-after", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


async def _serve(server: ScriptedModelServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        print(f"READY {server.base_url}", flush=True)
        await stop.wait()


def main(argv: Optional[list] = None) -> int:
    """Serve ``ToolLoopScript`` until SIGTERM or SIGINT, then print the request counts."""
    args = _parse_args(argv)
    script = ToolLoopScript(
        tool_calls=args.tool_calls, calls_per_turn=args.calls_per_turn, reasoning_format=args.reasoning_format
    )
    errors = []
    if args.error_rate:
        errors.append(ErrorRule(status=args.error_status, rate=args.error_rate, retry_after=args.retry_after))
    server = ScriptedModelServer(
        script,
        latency=args.latency,
        errors=errors,
        api_key=args.api_key,
        models=args.models.split(",") if args.models else None,
        seed=args.seed,
        host=args.host,
        port=args.port,
        record=False,  # a long benchmark would otherwise keep every conversation in memory
    )
    asyncio.run(_serve(server))
    statuses = {str(k): v for k, v in sorted(server.responses_by_status.items())}
    print(f"REQUESTS {server.request_count} {json.dumps(statuses)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
