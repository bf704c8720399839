"""The OpenAI-compatible model client: OpenRouter, OpenAI, vLLM, llama.cpp, Ollama."""

from __future__ import annotations

import functools
import json
import logging
import re
from typing import TYPE_CHECKING, Any, Optional

import hermes_batch
from hermes_batch.formats.endpoint_numbers import call_cost, token_count
from hermes_batch.errors import FatalModelError, ModelCallError, ModelOutcome, RetryableModelError
from hermes_batch.contract.interfaces import SAMPLING_SETTINGS, ModelClient, ModelSettings
from hermes_batch.model.model_http import (
    WireCache, http_client, is_openrouter, json_array, json_bytes, json_fields, json_object, poster, sends_routing,
    speaks_openrouter, transport_error_text,
)
from hermes_batch.formats.reasoning import extract_reasoning
from hermes_batch.formats.token_ids import TurnTokens, from_openai_logprobs, token_ids
from hermes_batch.formats.records import Message, ModelResponse, ToolCall, ToolSpec, Usage
from hermes_batch.model.provider_guard import provider_name
from hermes_batch.model.session_sampling import session_sampling
from hermes_batch.model.batching import BatchAPI, keep_result, management_error, result_lines, status_error
from hermes_batch.model.retry import RETRYABLE_STATUS, api_error_text, rate_limit_reset_seconds, retry_after_seconds

if TYPE_CHECKING:
    import openai

log = logging.getLogger(__name__)

_CONTEXT_TOO_LONG = re.compile(r"context.{0,20}(length|window)|maximum context|too many tokens|prompt is too long", re.I)
# OpenRouter answers an unknown model with 400, not 404
_UNKNOWN_MODEL = re.compile(r"not a valid model|model\b[^.]{0,80}\b(not found|does not exist)|unknown model|no such model", re.I)
_CONTENT_FILTERED = re.compile(r"content[ _-]?(filter|management policy)", re.I)
# What create() passes: the bearer key only.
_OPTIONS = {"security": {"bearer_auth": True}}


@hermes_batch.hookimpl
def register_model_clients(register):
    register(OpenAIClient)


class OpenAIClient(ModelClient):
    """Chat completions through the ``openai`` SDK's async client, with our own retry loop."""

    name = "openai"
    description = "Any OpenAI-compatible chat-completions endpoint (OpenRouter, OpenAI, vLLM, llama.cpp, Ollama)."
    packages = ("openai", "aiohttp")
    sampling = SAMPLING_SETTINGS  # all of them: OpenAI-compatible servers take what they know (top_k: vLLM, llama.cpp)
    sends_seed = True  # a branch's own seed (model/session_sampling.py), over --extra_body's
    token_logprobs = True

    def __init__(self, settings: ModelSettings):
        super().__init__(settings)
        # --extra_body last: a field it names is sent as given, over the one the routing options made
        self._extra_body = {**self._routing_body(settings), **self._logprobs_body(settings), **settings.sampling()}
        self._extra_body.update(self._extra_body.pop("extra_body", {}))
        # The parts of every body that do not change during the run, serialized once, in create()'s order.
        self._body_head = b'{"model":' + json_bytes(settings.model) + b',"messages":'
        self._max_tokens = b',"max_tokens":' + json_bytes(settings.max_tokens) if settings.max_tokens else b""
        self._body_tail = json_fields(self._extra_body)
        self._guarded = (-1, b"", {})  # (the guard's version, the tail with its exclusions, as a dict)
        self._message_json = WireCache(lambda message: json_bytes(_to_wire(message)))
        self._tool_json = WireCache(lambda tool: json_bytes(_tool_to_wire(tool)))

    @functools.cached_property
    def _client(self) -> "openai.AsyncOpenAI":
        # Made at the first request: a run with nothing left to run never imports the SDK (a second or more).
        import openai

        self._sdk = openai
        # The SDK's own retries know nothing of our run-wide stop on auth errors.
        return openai.AsyncOpenAI(
            api_key=self.settings.api_key or "EMPTY",
            base_url=self.settings.base_url,
            max_retries=0,
            timeout=self.settings.request_timeout,
            http_client=http_client(openai, self.settings),
        )

    @functools.cached_property
    def _poster(self):
        # the SDK's auth, base URL and error types; the body ours (see hermes_batch.model.model_http)
        client = self._client  # imports the SDK
        return poster(self._sdk, client, "/chat/completions", _OPTIONS, self.settings)

    @classmethod
    def handles_base_url(cls, base_url: str) -> bool:
        return True

    @staticmethod
    def _routing_body(settings: ModelSettings) -> dict:
        body: dict[str, Any] = {}
        provider: dict[str, Any] = {}
        if settings.providers_allowed:
            provider["only"] = list(settings.providers_allowed)
        if settings.providers_ignored:
            provider["ignore"] = list(settings.providers_ignored)
        if settings.providers_order:
            provider["order"] = list(settings.providers_order)
        if settings.provider_sort:
            provider["sort"] = settings.provider_sort
        if provider and sends_routing(settings):  # strict OpenAI-compatible servers refuse unknown fields
            body["provider"] = provider
        if settings.reasoning_disabled or settings.reasoning_effort == "none":
            body["reasoning"] = {"enabled": False} if speaks_openrouter(settings) else {"effort": "none"}
        elif settings.reasoning_effort:
            body["reasoning"] = {"effort": settings.reasoning_effort}
        if speaks_openrouter(settings):
            body["usage"] = {"include": True}  # OpenRouter's usage accounting: cost and cached tokens per call
        return body

    def excludes_providers(self) -> bool:
        return sends_routing(self.settings)

    def _tail(self) -> bytes:
        """The body's fixed fields, with the providers the run's guard excluded added to ``provider.ignore``."""
        return self._body_tail if self._guarded_body() is self._extra_body else self._guarded[1]

    def _guarded_body(self) -> dict:
        """The body's fixed fields as a dict, the guard's exclusions added (cached per exclusion)."""
        guard = self.guard
        if guard is None or not guard.excluded or not sends_routing(self.settings):
            return self._extra_body
        if self._guarded[0] != guard.version:
            body = dict(self._extra_body)
            provider = body.get("provider", {})
            if isinstance(provider, dict):  # --extra_body may set it as it likes: then it is sent as given
                ignore = provider.get("ignore")
                ignore = list(ignore) if isinstance(ignore, list) else []
                body["provider"] = {**provider, "ignore": ignore + [p for p in guard.excluded if p not in ignore]}
            self._guarded = (guard.version, json_fields(body), body)
        return self._guarded[2]
    @staticmethod
    def _logprobs_body(settings: ModelSettings) -> dict:
        if not settings.logprobs:
            return {}
        body: dict[str, Any] = {"logprobs": True}
        if settings.top_logprobs:
            body["top_logprobs"] = settings.top_logprobs
        if not _strict_host(settings.base_url):
            # vLLM and SGLang: each token as "token_id:N", and the ids themselves (newer vLLM); other
            # self-hosted servers ignore fields they do not know, OpenAI's and OpenRouter's refuse them
            body["return_tokens_as_token_ids"] = True
            body["return_token_ids"] = True
        return body

    def _request(self, messages, tools) -> bytes:
        """The JSON body of a chat completion: only messages new since the last turn are serialized."""
        parts = [self._body_head, json_array(map(self._message_json, messages)), self._max_tokens]
        if tools:
            parts += [b',"tools":', json_array(map(self._tool_json, tools))]
        own = session_sampling.get()  # a branch's own seed (--branches): this session's fields win
        parts.append(json_fields({**self._guarded_body(), **own}) if own else self._tail())
        return b"".join(parts)

    async def send(self, messages: tuple[Message, ...], tools: tuple[ToolSpec, ...]) -> ModelResponse:
        poster = self._poster
        try:
            # The SDK's create() would re-validate the whole conversation on every call: we send our own
            # body, and read only its bytes (building the SDK's ChatCompletion from them took a tenth of
            # the event loop's time at 64 sessions; our records are made straight from the JSON).
            answer = await poster.post(self._request(messages, tools))
        except self._sdk.APIStatusError as exc:
            raise self._classify(exc) from exc
        except (self._sdk.APITimeoutError, self._sdk.APIConnectionError) as exc:
            raise RetryableModelError(
                f"The model endpoint at {self.settings.base_url} could not be reached: {transport_error_text(exc)}"
            ) from exc
        return _from_wire(json_object(answer), self.settings.top_logprobs)

    async def tokenize(self, messages: tuple[Message, ...], tools: tuple[ToolSpec, ...]) -> Optional[tuple[int, ...]]:
        """The conversation through the endpoint's ``/tokenize``: vLLM's and SGLang's take the messages;
        llama.cpp's server takes text, which its ``/apply-template`` makes of them."""
        if _strict_host(self.settings.base_url) or self.__dict__.get("_no_tokenizer"):
            return None
        wire = [_to_wire(m) for m in messages]
        body = {"model": self.settings.model, "messages": wire, "add_generation_prompt": False}
        if tools:
            body["tools"] = [_tool_to_wire(t) for t in tools]
        answer = await self._post_root("/tokenize", body)
        found = token_ids(answer.get("tokens")) if answer is not None else None
        if found is not None:
            return found
        template = await self._post_root("/apply-template", {"messages": wire})
        prompt = template.get("prompt") if template is not None else None
        if not isinstance(prompt, str):
            if answer is None and template is None:  # neither endpoint answers: not asked again this run
                self._no_tokenizer = True
            return None
        answer = await self._post_root("/tokenize", {"content": prompt, "add_special": False, "parse_special": True})
        return token_ids(answer.get("tokens")) if answer is not None else None

    async def _post_root(self, path: str, body: dict) -> Optional[dict]:
        """POST ``body`` to ``path`` at the server's root (beside ``/v1``); None for any error or no object."""
        posters = self.__dict__.setdefault("_root_posters", {})
        if path not in posters:
            client = self._client  # imports the SDK
            root = re.sub(r"/v1/?$", "", self.settings.base_url.rstrip("/"))
            posters[path] = poster(self._sdk, client, root + path, _OPTIONS, self.settings)
        try:
            answer = json_object(await posters[path].post(json_bytes(body)))
        except (self._sdk.OpenAIError, ModelCallError, ValueError) as exc:
            log.debug("%s of the endpoint answered no token ids: %s", path, exc)
            return None
        return answer if isinstance(answer, dict) else None

    def _classify(self, exc: openai.APIStatusError) -> Exception:
        status, text, provider = exc.status_code, api_error_text(exc), _error_provider(exc)
        if status in (401, 403):
            return FatalModelError(
                f"The model endpoint refused the API key ({status}: {text}); "
                "pass a valid key with --api_key or set OPENROUTER_API_KEY / OPENAI_API_KEY."
            )
        if status == 404 or (status == 400 and _UNKNOWN_MODEL.search(text)):
            return FatalModelError(
                f"The model endpoint does not know the model {self.settings.model!r} ({status}: {text}); "
                "check --model and --base_url."
            )
        if status in RETRYABLE_STATUS:
            headers = exc.response.headers
            wait = retry_after_seconds(headers)
            if wait is None and status == 429:
                wait = rate_limit_reset_seconds(headers)
            return RetryableModelError(
                f"The model endpoint answered {status}: {text}", status=status, retry_after=wait, provider=provider,
            )
        if status in (400, 413) and _CONTEXT_TOO_LONG.search(text):
            return ModelOutcome(
                f"The conversation no longer fits the model's context ({text}).",
                reason="context_length", status=status, provider=provider,
            )
        if status == 400 and (_error_code(exc) == "content_filter" or _CONTENT_FILTERED.search(text)):
            return ModelOutcome(
                f"The provider's content filter refused the conversation ({text}).",
                reason="content_filter", status=status, provider=provider,
            )
        return ModelCallError(f"The model endpoint refused the request ({status}: {text}).", status=status, provider=provider)

    def batch_api(self) -> "OpenAIBatches":
        """Its Files and Batches endpoints, for --batch_api."""
        return OpenAIBatches(self)

    async def aclose(self) -> None:
        if "_poster" in self.__dict__:
            await self._poster.aclose()
        for root_poster in self.__dict__.pop("_root_posters", {}).values():
            await root_poster.aclose()
        if "_client" in self.__dict__:  # made, so opened
            await self._client.close()


class OpenAIBatches(BatchAPI):
    """OpenAI's Batch API: the requests uploaded as a JSONL file (Files API), a batch made of it, its output and
    error files read back once it ended."""

    ENDED = ("completed", "expired", "cancelled", "failed")
    max_requests = 50_000
    max_bytes = 190 * 1000 * 1000  # its Files API takes 200 MB for a batch; the rest is a margin

    def __init__(self, client: OpenAIClient):
        self.client = client
        self._ended: dict = {}  # batch id -> the SDK's Batch once it ended

    @functools.cached_property
    def _sdk_client(self) -> "openai.AsyncOpenAI":
        # Its own client: the run's one only builds requests (model_http.DirectPost); these calls are few.
        import openai

        self._sdk = openai
        settings = self.client.settings
        return openai.AsyncOpenAI(api_key=settings.api_key or "EMPTY", base_url=settings.base_url, max_retries=0,
                                  timeout=settings.request_timeout)

    async def _call(self, what: str, call, *args, **kwargs):
        sdk_client = self._sdk_client
        try:
            return await call(sdk_client)(*args, **kwargs)
        except self._sdk.OpenAIError as exc:
            raise management_error(self._sdk, exc, self.client.settings.base_url, what) from exc

    async def check(self) -> None:
        await self._call("its batch API", lambda c: c.batches.list, limit=1)

    def body(self, messages, tools) -> bytes:
        return self.client._request(messages, tools)

    async def submit(self, requests: list) -> str:
        lines = b"\n".join(
            b'{"custom_id":' + json_bytes(custom_id) + b',"method":"POST","url":"/v1/chat/completions","body":'
            + body + b"}" for custom_id, body in requests
        )
        upload = await self._call("the upload of a batch file", lambda c: c.files.create,
                                  file=("hermes-batch.jsonl", lines, "application/jsonl"), purpose="batch")
        batch = await self._call("a new batch", lambda c: c.batches.create, input_file_id=upload.id,
                                 endpoint="/v1/chat/completions", completion_window="24h")
        return batch.id

    async def poll(self, batch_id: str) -> Optional[str]:
        batch = await self._call("the state of a batch", lambda c: c.batches.retrieve, batch_id)
        if batch.status not in self.ENDED:
            return None
        self._ended[batch_id] = batch
        return batch.status

    async def results(self, batch_id: str, wanted: Optional[set] = None) -> dict:
        batch = self._ended.pop(batch_id, None) or await self._call("the state of a batch", lambda c: c.batches.retrieve, batch_id)
        found: dict = {}
        for file_id in (batch.output_file_id, batch.error_file_id):
            if not isinstance(file_id, str) or not file_id:
                continue
            await self._read_file(batch_id, file_id, wanted, found)
        return found

    async def _read_file(self, batch_id: str, file_id: str, wanted: Optional[set], found: dict) -> None:
        """The results in one output or error file, streamed (never downloaded whole: a file that decompresses
        to gigabytes is read a line at a time, and cut off past a bound)."""
        sdk_client = self._sdk_client
        try:
            async with sdk_client.files.with_streaming_response.content(file_id) as response:
                async for entry in result_lines(response.iter_bytes(), wanted, f"The results of batch {batch_id}"):
                    custom_id, answer = entry.get("custom_id"), entry.get("response")
                    if not isinstance(custom_id, str) or not isinstance(answer, dict):
                        continue  # not processed (the batch expired or was cancelled first): it goes out again
                    if wanted is None or custom_id in wanted:
                        keep_result(found, custom_id, self._outcome(answer))
        except self._sdk.OpenAIError as exc:
            raise management_error(self._sdk, exc, self.client.settings.base_url, "a batch's results") from exc

    def _outcome(self, response: dict):
        status, body = response.get("status_code"), response.get("body")
        if status == 200 and isinstance(body, dict):
            try:
                return _from_wire(body, self.client.settings.top_logprobs)
            except ModelCallError as exc:
                return exc
        status = status if isinstance(status, int) else 500
        url = self.client.settings.base_url.rstrip("/") + "/chat/completions"
        return self.client._classify(status_error(self._sdk, status, body, url))

    async def cancel(self, batch_id: str) -> None:
        await self._call("the cancel of a batch", lambda c: c.batches.cancel, batch_id)

    async def aclose(self) -> None:
        if "_sdk_client" in self.__dict__:
            await self._sdk_client.close()


def _error_field(exc: openai.APIStatusError) -> dict:
    body = exc.body
    err = body.get("error", body) if isinstance(body, dict) else None
    return err if isinstance(err, dict) else {}


def _error_code(exc: openai.APIStatusError) -> Optional[str]:
    code = _error_field(exc).get("code")
    return code if isinstance(code, str) else None


def _error_provider(exc: openai.APIStatusError) -> Optional[str]:
    """The upstream provider OpenRouter names in an error's metadata."""
    metadata = _error_field(exc).get("metadata")
    return provider_name(metadata.get("provider_name")) if isinstance(metadata, dict) else None


def _tool_to_wire(tool: ToolSpec) -> dict:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


def _to_wire(message: Message) -> dict:
    if message.role == "tool":
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    wire: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.role == "assistant":
        if message.tool_calls:
            wire["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.raw_arguments}}
                for c in message.tool_calls
            ]
            if not message.content:
                wire["content"] = None
        if message.provider_data:
            # OpenRouter keeps reasoning continuous across turns when its details come back.
            wire["reasoning_details"] = message.provider_data
    return wire


def _parse_arguments(raw: Optional[str]) -> Optional[dict]:
    if not raw or not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested beyond the decoder's limit
        return None
    return value if isinstance(value, dict) else None


def _strict_host(base_url: str) -> bool:
    """OpenAI's and OpenRouter's APIs, which refuse request fields they do not know and have no /tokenize."""
    return is_openrouter(base_url) or "api.openai.com" in base_url


def _turn_tokens(choice: dict, top: int):
    tokens = from_openai_logprobs(choice.get("logprobs"), top)
    if tokens is not None and tokens.ids is None:
        # vLLM's return_token_ids: the ids beside logprobs that give only the tokens' text
        ids = token_ids(choice.get("token_ids"), len(tokens.logprobs))
        if ids is not None and len(ids) == len(tokens.logprobs):
            tokens = TurnTokens(ids, tokens.logprobs, tokens.top)
    return tokens


def _from_wire(data: dict, top_logprobs: int = 0) -> ModelResponse:
    """Our response from a chat completion's JSON, each field checked for its type (the model's server is not trusted)."""
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise RetryableModelError("The model endpoint returned a response without choices.")
    choice = _object(choices[0])
    msg = _object(choice.get("message"))
    reasoning, content = extract_reasoning(msg, _text(msg.get("content")))
    calls = []
    tool_calls = msg.get("tool_calls")
    for i, tc in enumerate(tool_calls if isinstance(tool_calls, list) else ()):
        function = _object(tc).get("function")
        if not isinstance(function, dict):
            continue
        raw = function.get("arguments")
        if isinstance(raw, dict):  # some servers send the object itself
            raw = json.dumps(raw, ensure_ascii=False)
        raw = raw if isinstance(raw, str) else ""
        call_id = tc.get("id")
        call_id = call_id if isinstance(call_id, str) and call_id else f"call_{i}"
        calls.append(ToolCall(call_id, _text(function.get("name")) or "", _parse_arguments(raw), raw))
    details = msg.get("reasoning_details")
    message = Message(
        "assistant",
        content,
        reasoning=reasoning,
        tool_calls=tuple(calls),
        provider_data=details if isinstance(details, list) and details else None,
        tokens=_turn_tokens(choice, top_logprobs) if choice.get("logprobs") else None,
    )
    return ModelResponse(
        message=message,
        finish_reason=_text(choice.get("finish_reason")),
        usage=_usage(data.get("usage")),
        provider=provider_name(data.get("provider")),
        model=_text(data.get("model")),
    )


def _object(value) -> dict:
    return value if isinstance(value, dict) else {}


def _text(value) -> Optional[str]:
    return value if isinstance(value, str) else None


def _usage(usage) -> Usage:
    if not isinstance(usage, dict):
        return Usage()
    # checked at the boundary: NaN, 1e999, a negative cost or 10**30 tokens count as not reported
    return Usage(
        prompt_tokens=token_count(usage.get("prompt_tokens"), "prompt_tokens"),
        completion_tokens=token_count(usage.get("completion_tokens"), "completion_tokens"),
        reasoning_tokens=token_count(_object(usage.get("completion_tokens_details")).get("reasoning_tokens"),
                                     "reasoning_tokens"),
        cached_tokens=token_count(_object(usage.get("prompt_tokens_details")).get("cached_tokens"), "cached_tokens"),
        cost=call_cost(usage.get("cost")),
    )
