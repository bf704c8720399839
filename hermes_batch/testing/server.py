"""A scripted model endpoint on 127.0.0.1 that speaks the OpenAI and Anthropic wire formats.

``ScriptedModelServer`` answers ``POST /v1/chat/completions`` (OpenAI / OpenRouter),
``POST /v1/messages`` (Anthropic) and ``GET /v1/models`` by calling a *script*: any
callable ``(ScriptRequest) -> Reply``, sync or async.  Multimodal messages reach
the script with their image URLs (``ScriptRequest.images``), and ``POST
/v1/images/generations`` is answered by an *images script* (``ImageRequest ->
ImageReply``), by default with a small PNG made from the prompt.  The batch
endpoints of both (OpenAI Files + Batches, Anthropic Message Batches) answer
each request of a batch through the same script (``hermes_batch.testing.batches``).  Faults (rate limits, server
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
import inspect
import json
import random
import signal
import sys
import threading
import zlib
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import attrs
from aiohttp import web

from .batches import BatchEndpoints, BatchSettings
from .images import png_for
from .tokens import LOGPROBS_FORMATS, TOKENIZER_AGREE, TOKENIZER_DRIFT, completion_logprobs, tokenize_answer
from .scripts import REASONING_FORMATS, ImageReply, ImageRequest, Reply, RoutedScript, Script, ScriptRequest, ToolLoopScript
from .wire import (
    BadRequest,
    error_body,
    estimate_usage,
    model_info,
    model_list,
    parse_request,
    render_anthropic,
    render_openai,
    sign_thinking,
    signature_valid,
)

# The scripts and records are defined in .scripts and re-exported here, where users import them.
__all__ = [
    "BatchSettings",
    "ErrorRule",
    "ImageReply",
    "ImageRequest",
    "REASONING_FORMATS",
    "Reply",
    "RoutedScript",
    "Script",
    "ScriptRequest",
    "ScriptedModelServer",
    "ScriptedProvider",
    "ToolLoopScript",
    "main",
]


SCRIPT_ERROR_STATUS = 400  # the answer to a request whose script raised (see ScriptedModelServer.script_errors)
_RAW_USAGE = "hermes-batch-scripted-raw-usage"  # where Reply.raw_usage goes in the rendered JSON


@attrs.frozen
class ScriptedProvider:
    """One upstream provider the server plays, as OpenRouter routes a model to several.

    A request is served by one of the providers its body's ``provider`` routing object allows (``only``,
    ``ignore``), drawn by ``weight`` from the server's seeded generator; the answer names it in its
    ``provider`` field.  Its faults spoil the script's reply, each with its probability: ``invalid_tool_calls``
    sends the reply's tool calls with arguments that are not JSON, ``empty_answers`` sends no text and no tool
    call, ``cut_answers`` sends the reply cut at ``finish_reason: length``.
    """

    name: str
    weight: float = 1.0
    invalid_tool_calls: float = 0.0
    empty_answers: float = 0.0
    cut_answers: float = 0.0


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


class ScriptedModelServer:
    """A real HTTP model endpoint that follows ``script``; see the module docstring.

    Use ``with`` to run it in a background thread with its own event loop, or
    ``async with`` inside a running loop.  Sync scripts run on the event loop and
    must not block.  With ``record=False`` requests are counted but not kept.
    ``batches`` says how its batch endpoints process batches (see
    :mod:`hermes_batch.testing.batches`; ``server.batches`` counts what they processed).
    The preflight probe of a run (``ScriptRequest.preflight``) is answered with
    ``preflight_reply`` instead of calling the script (``None``: the script
    answers it too); faults, latency and hangs apply to it like to any request.
    A request asking ``logprobs`` gets its answer's token ids and logprobs as ``logprobs`` spells them
    (``"vllm"``, ``"llama.cpp"``, ``"openai"``; None: no logprobs); ``tokenizer`` (``"agree"`` or ``"drift"``)
    adds ``POST /tokenize`` (see :mod:`hermes_batch.testing.tokens`).
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
        images: Optional[Callable[[ImageRequest], ImageReply]] = None,
        batches: Optional[BatchSettings] = None,
        providers: Iterable[ScriptedProvider] = (),
        logprobs: Optional[str] = "vllm",
        tokenizer: Optional[str] = None,
    ):
        if logprobs is not None and logprobs not in LOGPROBS_FORMATS:
            raise ValueError(f"logprobs must be one of {', '.join(LOGPROBS_FORMATS)} or None")
        if tokenizer not in (None, TOKENIZER_AGREE, TOKENIZER_DRIFT):
            raise ValueError("tokenizer must be 'agree', 'drift' or None")
        self.logprobs = logprobs
        self.tokenizer = tokenizer
        self.tokenize_requests = 0
        self.script = script
        self.providers = tuple(providers)
        self._provider_calls: collections.Counter = collections.Counter()
        self.images_script = images or (lambda _request: ImageReply())
        self.image_requests: list = []  # every ImageRequest received
        self._files: dict = {}  # name -> (content type, bytes) of images served by URL
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
        self._sessions: collections.Counter = collections.Counter()  # prompt -> sessions started (ScriptRequest.sample)
        self._session_of_call: dict = {}  # the first tool call id of a session's first reply -> its sample
        self.script_errors: list = []  # exceptions raised by the script, each answered with a 400 (not retried)
        self._runner: Optional[web.AppRunner] = None
        self._stopping: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self.batches = BatchEndpoints(self, batches or BatchSettings())

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

    @property
    def provider_calls(self) -> collections.Counter:
        """Requests each ScriptedProvider served (the preflight probe not counted)."""
        with self._lock:
            return collections.Counter(self._provider_calls)

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
        app.router.add_post("/v1/images/generations", self._handle_images)
        self.batches.add_routes(app.router)
        app.router.add_get("/v1/files/{name}", self._handle_file)
        app.router.add_get("/v1/models", self._handle_models)
        app.router.add_get("/v1/models/{model:.+}", self._handle_model)
        if self.tokenizer is not None:  # at the root, as vLLM and llama.cpp's server have it
            app.router.add_post("/tokenize", self._handle_tokenize)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, backlog=1024).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def aclose(self) -> None:
        """Stop listening; hanging requests are released."""
        if self._runner is not None:
            self._stopping.set()
            await self.batches.aclose()
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
        return sign_thinking(self._secret, thinking)

    def _verify(self, thinking: str, signature: str) -> bool:
        ok = signature_valid(self._secret, thinking, signature)
        with self._lock:
            self._thinking["valid" if ok else "invalid"] += 1
        return ok

    def _respond(
        self, status: int, body: dict, headers: Optional[Mapping[str, str]] = None, raw_usage: Optional[str] = None,
    ) -> web.Response:
        with self._lock:
            self._statuses[status] += 1
        headers = {"x-request-id": f"req_hb{self._next_id()}", **(headers or {})}
        if raw_usage is None:
            return web.json_response(body, status=status, headers=headers)
        text = json.dumps({**body, "usage": _RAW_USAGE}).replace(json.dumps(_RAW_USAGE), raw_usage, 1)
        return web.Response(text=text, status=status, headers=headers, content_type="application/json")

    async def _deliver(self, http: web.Request, answer: web.Response, reply: Reply) -> web.StreamResponse:
        """``answer`` as ``reply`` says it travels: gzip-compressed, padded, a byte at a time."""
        if not (reply.trickle or reply.gzip or reply.padding):
            return answer
        body = answer.body
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in ("content-length", "content-type")}
        stream = web.StreamResponse(status=answer.status, headers=headers)
        stream.content_type = "application/json"
        compress = zlib.compressobj(wbits=31) if reply.gzip else None  # wbits 31: the gzip format
        if compress is not None:
            stream.headers["Content-Encoding"] = "gzip"
        await stream.prepare(http)

        def pieces():
            yield body
            left = reply.padding
            while left > 0:
                yield b" " * min(left, 1 << 20)
                left -= 1 << 20

        async def send(data: bytes) -> None:
            if not reply.trickle:
                await stream.write(data)
                return
            for i in range(len(data)):
                await stream.write(data[i:i + 1])
                await asyncio.sleep(reply.trickle)

        try:
            for piece in pieces():
                data = compress.compress(piece) if compress is not None else piece
                if data:
                    await send(data)
            if compress is not None:
                await send(compress.flush())
            await stream.write_eof()
        except (ConnectionError, RuntimeError):  # the client gave up on it, as a client should
            pass
        return stream

    def _error(
        self,
        api: str,
        status: int,
        message: str,
        headers: Optional[Mapping[str, str]] = None,
        error_type: Optional[str] = None,
        provider: Optional[str] = None,
    ) -> web.Response:
        return self._respond(status, error_body(api, status, message, error_type, provider), headers)

    async def _handle_openai(self, http: web.Request) -> web.Response:
        return await self._handle(http, "openai")

    async def _handle_tokenize(self, http: web.Request) -> web.Response:
        """``POST /tokenize``: the toy tokenizer and chat template of :mod:`hermes_batch.testing.tokens`."""
        try:
            body = await http.json()
        except ValueError:
            body = None
        with self._lock:
            self.tokenize_requests += 1
        answer = tokenize_answer(body, self.tokenizer == TOKENIZER_DRIFT)
        if answer is None:
            return self._error("openai", 400, "Give messages or content to tokenize.")
        return self._respond(200, answer)

    async def _handle_anthropic(self, http: web.Request) -> web.Response:
        return await self._handle(http, "anthropic")

    def _authorized(self, http: web.Request) -> bool:
        if self.api_key is None:
            return True
        headers = http.headers
        return headers.get("Authorization") == f"Bearer {self.api_key}" or headers.get("x-api-key") == self.api_key

    async def _handle(self, http: web.Request, api: str) -> web.Response:
        try:
            body = await http.json()
        except ValueError as exc:
            return self._error(api, 400, f"Invalid request body: {exc}")
        response, reply = await self.answer(api, body, http.headers, authorized=self._authorized(http))
        return response if reply is None else await self._deliver(http, response, reply)

    async def answer(
        self, api: str, body: Any, headers: Mapping[str, str], *, authorized: bool = True, in_batch: bool = False,
    ) -> "tuple[web.Response, Optional[Reply]]":
        """The answer to one request body of ``api``, and the script's Reply when it made one (to deliver it).

        Requests of a batch (``in_batch``) come here one by one when their batch is processed: they are
        counted, recorded and answered like any other, faults included, but without latency or hangs
        (the batch's processing delay stands for them).
        """
        try:
            request = parse_request(api, body, {k.lower(): v for k, v in headers.items()}, self._verify)
        except (ValueError, BadRequest, KeyError, TypeError, AttributeError) as exc:
            return self._error(api, 400, f"Invalid request body: {exc}"), None
        with self._lock:
            self._request_count += 1
            self._prompts[request.prompt] += 1
            if self.record:
                self._requests.append(request)
        if not authorized:
            message = "invalid x-api-key" if api == "anthropic" else "Incorrect API key provided."
            return self._error(api, 401, message), None
        if body.get("stream"):
            message = "stream=true is not supported by ScriptedModelServer; send non-streaming requests."
            return self._error(api, 400, message), None
        if self.models is not None and request.model not in self.models:
            message = f"The model `{request.model}` does not exist or you do not have access to it."
            if api == "anthropic":
                message = f"model: {request.model}"
            return self._error(api, 404, message), None
        if any(m.get("reasoning_signature_valid") is False for m in request.messages):
            return self._error(api, 400, "Invalid `signature` in `thinking` block"), None
        if not in_batch and self.hang is not None and self.hang(request):
            # Released by aclose(), so shutting down never waits for the hour.
            try:
                await asyncio.wait_for(self._stopping.wait(), 3600)
            except asyncio.TimeoutError:
                pass
            return self._error(api, 503, "The server is shutting down."), None
        latency = 0.0 if in_batch else self.latency(request) if callable(self.latency) else self.latency
        if latency > 0:
            await asyncio.sleep(latency)
        rule = self._failing_rule(request)
        if rule is not None:
            headers = {"Retry-After": f"{rule.retry_after:g}"} if rule.retry_after is not None else None
            return self._error(api, rule.status, rule.message or f"Scripted error {rule.status}.", headers), None
        starts = False
        try:
            if self.preflight_reply is not None and request.preflight:
                reply = self.preflight_reply
            else:
                request, starts = self._with_sample(request)
                reply = self.script(request)
            if inspect.isawaitable(reply):
                reply = await reply
            if not isinstance(reply, Reply):
                raise TypeError(f"a script must return a Reply, not {type(reply).__name__}")
        except Exception as exc:  # the script is test code: report its bug to the client and the test
            self.script_errors.append(exc)
            # 400, not 500: a client must not retry the test's own bug as if the endpoint had failed
            return self._error(api, SCRIPT_ERROR_STATUS, f"The test's script raised {type(exc).__name__}: {exc}",
                               error_type="script_error"), None
        if self.providers and not request.preflight:
            provider = self._provider_for(body)
            if provider is None:
                return self._error(api, 404, "No endpoints found matching your data policy (provider.ignore)."), None
            reply = self._played_by(provider, reply)
        if reply.status != 200:
            message = reply.error_message or f"Scripted error {reply.status}."
            return self._error(api, reply.status, message, reply.headers, reply.error_type, reply.provider), reply
        usage = reply.usage or estimate_usage(request, reply)
        if api == "anthropic":
            response = render_anthropic(request, reply, usage, self._next_id, self._sign)
        else:
            response = render_openai(request, reply, usage, self._next_id)
            if body.get("logprobs") is True and self.logprobs is not None:
                top = body.get("top_logprobs") if isinstance(body.get("top_logprobs"), int) else 0
                as_ids = body.get("return_tokens_as_token_ids") is True
                choice = response["choices"][0]
                choice["logprobs"] = completion_logprobs(choice["message"], self.logprobs, top, as_ids)
        if reply.tool_calls and starts:
            self._remember_session(api, response, request.sample)
        return self._respond(200, response, reply.headers, reply.raw_usage), reply

    def _provider_for(self, body: dict) -> Optional[ScriptedProvider]:
        """The provider that serves a request, among those its routing object allows (None: none is left)."""
        routing = body.get("provider")
        routing = routing if isinstance(routing, dict) else {}
        only, ignore = routing.get("only"), routing.get("ignore")
        allowed = [p for p in self.providers if (not isinstance(only, list) or p.name in only)
                   and not (isinstance(ignore, list) and p.name in ignore)]
        if not allowed:
            return None
        with self._lock:
            provider = self._random.choices(allowed, weights=[p.weight for p in allowed])[0]
            self._provider_calls[provider.name] += 1
        return provider

    def _played_by(self, provider: ScriptedProvider, reply: Reply) -> Reply:
        """``reply`` as ``provider`` sends it: named, and spoilt by its faults."""
        with self._lock:
            draws = [self._random.random() for _ in range(3)]
        reply = attrs.evolve(reply, provider=provider.name)
        if reply.status != 200:
            return reply
        if reply.tool_calls and draws[0] < provider.invalid_tool_calls:
            return attrs.evolve(reply, tool_calls=[(name, '{"truncated": ') for name, _ in reply.tool_calls])
        if draws[1] < provider.empty_answers:
            return attrs.evolve(reply, content="", reasoning=None, tool_calls=(), finish_reason="stop")
        if draws[2] < provider.cut_answers:
            return attrs.evolve(reply, content=reply.content[: len(reply.content) // 2], tool_calls=(),
                                finish_reason="length")
        return reply

    def _with_sample(self, request: ScriptRequest) -> tuple:
        """``request`` with its ``sample``, and whether it starts a session (see ScriptRequest.sample)."""
        first = next((m.get("tool_call_id") for m in request.messages if m["role"] == "tool"), None)
        with self._lock:
            if first is not None:
                return attrs.evolve(request, sample=self._session_of_call.get(first, 0)), False
            sample = self._sessions[request.prompt]
            self._sessions[request.prompt] += 1
        return attrs.evolve(request, sample=sample), True

    def _remember_session(self, api: str, response: dict, sample: int) -> None:
        if api == "anthropic":
            ids = [b["id"] for b in response.get("content", ()) if b.get("type") == "tool_use"]
        else:
            ids = [c["id"] for c in response["choices"][0]["message"].get("tool_calls") or ()]
        if ids:
            with self._lock:
                self._session_of_call[ids[0]] = sample

    def sessions_for(self, prompt: str) -> int:
        """Sessions of ``prompt`` the server saw start (its samples, see ScriptRequest.sample)."""
        with self._lock:
            return self._sessions[prompt]

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

    async def _handle_images(self, http: web.Request) -> web.Response:
        try:
            body = await http.json()
            request = ImageRequest(
                model=body["model"], prompt=body["prompt"], size=body.get("size"), n=int(body.get("n") or 1),
                response_format=body.get("response_format"), body=body,
            )
            if not isinstance(request.model, str) or not isinstance(request.prompt, str):
                raise TypeError("model and prompt must be strings")
        except (ValueError, KeyError, TypeError) as exc:
            return self._error("openai", 400, f"Invalid request body: {exc}")
        with self._lock:
            self.image_requests.append(request)
        if not self._authorized(http):
            return self._error("openai", 401, "Incorrect API key provided.")
        if self.models is not None and request.model not in self.models:
            return self._error("openai", 404, f"The model `{request.model}` does not exist or you do not have access to it.")
        reply = self.images_script(request)
        if inspect.isawaitable(reply):
            reply = await reply
        if reply.status != 200:
            return self._error("openai", reply.status, reply.error_message or f"Scripted error {reply.status}.")
        data = []
        for i in range(request.n):
            image = reply.image if reply.image is not None else png_for(f"{request.prompt}\x00{i}")
            if request.response_format == "b64_json" or request.model.startswith("gpt-image"):
                data.append({"b64_json": base64.b64encode(image).decode("ascii")})
            else:
                name = f"img_hb{self._next_id()}.png"
                self._files[name] = image
                data.append({"url": f"{self.base_url}/files/{name}"})
        answer: dict = {"created": 0, "data": data}
        if reply.raw_usage is not None:
            return self._respond(200, answer, raw_usage=reply.raw_usage)
        if reply.usage is not None:
            answer["usage"] = {
                "input_tokens": reply.usage.prompt_tokens,
                "output_tokens": reply.usage.completion_tokens,
                "total_tokens": reply.usage.prompt_tokens + reply.usage.completion_tokens,
            }
            if reply.usage.cost is not None:
                answer["usage"]["cost"] = reply.usage.cost
        return self._respond(200, answer)

    async def _handle_file(self, http: web.Request) -> web.Response:
        image = self._files.get(http.match_info["name"])
        if image is None:
            return web.Response(status=404, text="no such file")
        return web.Response(body=image, content_type="image/png")

    async def _handle_models(self, http: web.Request) -> web.Response:
        api = "anthropic" if "anthropic-version" in http.headers else "openai"
        return self._respond(200, model_list(api, self.models or ("scripted-model",)))

    async def _handle_model(self, http: web.Request) -> web.Response:
        model = http.match_info["model"]
        api = "anthropic" if "anthropic-version" in http.headers else "openai"
        if self.models is not None and model not in self.models:
            return self._error(api, 404, f"The model `{model}` does not exist or you do not have access to it.")
        return self._respond(200, model_info(api, model))


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
    parser.add_argument("--command", default=None, help="the command each tool call runs (a ToolLoopScript template)")
    parser.add_argument("--reasoning-format", choices=REASONING_FORMATS, default="reasoning")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--models", default=None, help="comma-separated known models; others get 404")
    parser.add_argument("--error-rate", type=float, default=0.0, help="probability of an error reply")
    parser.add_argument("--error-status", type=int, default=429)
    parser.add_argument("--retry-after", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-delay", type=float, default=0.0, help="seconds from a batch's creation to its end")
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
        tool_calls=args.tool_calls, calls_per_turn=args.calls_per_turn, reasoning_format=args.reasoning_format,
        **({"command": args.command} if args.command is not None else {}),
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
        batches=BatchSettings(delay=args.batch_delay),
    )
    asyncio.run(_serve(server))
    statuses = {str(k): v for k, v in sorted(server.responses_by_status.items())}
    print(f"REQUESTS {server.request_count} {json.dumps(statuses)}", flush=True)
    if server.batches.created:
        print(f"BATCHES {json.dumps(server.batches.batch_sizes)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
