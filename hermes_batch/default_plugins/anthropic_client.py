"""The native Anthropic client: the Messages API through the ``anthropic`` SDK.

Trajectories come out exactly as from the OpenAI-compatible client: the
thinking text becomes ``Message.reasoning`` (saved in ``<think>``), ``tool_use``
blocks become ``ToolCall``s (saved in ``<tool_call>``).  The raw content blocks
of each answer travel in ``Message.provider_data`` and are sent back unchanged,
because the API rejects thinking blocks whose signature does not match.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, Mapping, Optional
from urllib.parse import urlsplit

import attrs

import hermes_batch
from hermes_batch.formats.endpoint_numbers import token_count
from hermes_batch.errors import ConfigError, FatalModelError, ModelCallError, ModelOutcome, RetryableModelError
from hermes_batch.contract.interfaces import ModelClient, ModelSettings
from hermes_batch.model.model_http import (
    WireCache, http_client, json_array, json_bytes, json_fields, json_object, poster, transport_error_text,
)
from hermes_batch.formats.reasoning import split_inline_reasoning
from hermes_batch.formats.records import Message, ModelResponse, ToolCall, ToolSpec, Usage
from hermes_batch.model.batching import BatchAPI, keep_result, management_error, result_lines, status_error
from hermes_batch.model.retry import RETRYABLE_STATUS, api_error_text, choose_reset_wait, retry_after_seconds

if TYPE_CHECKING:
    import anthropic

log = logging.getLogger(__name__)

ANTHROPIC_HOST = "api.anthropic.com"

# --reasoning_effort -> thinking.budget_tokens (the API's minimum is 1024)
THINKING_BUDGETS = {"minimal": 1024, "low": 2048, "medium": 8192, "high": 16384, "xhigh": 32000}
# Output tokens left for the answer when --max_tokens is not given (the API requires max_tokens).
ANSWER_TOKENS = 8192
MIN_THINKING_BUDGET = 1024
DEFAULT_EFFORT = "medium"

_CONTEXT_TOO_LONG = re.compile(
    r"prompt is too long|exceed context limit|context.{0,20}(length|window)|too many tokens", re.I
)
_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "refusal": "content_filter",
}
_RESET_HEADER = re.compile(r"anthropic-ratelimit-(.+)-reset", re.I)


@hermes_batch.hookimpl
def register_model_clients(register):
    register(AnthropicClient)


def is_anthropic_url(base_url: str) -> bool:
    """True for Anthropic's own API."""
    try:
        host = urlsplit(base_url).hostname or ""
    except ValueError:
        return False
    return host == ANTHROPIC_HOST


def sdk_base_url(base_url: str) -> str:
    """The SDK appends ``/v1/messages`` itself: a trailing ``/v1`` given out of OpenAI habit is dropped."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def thinking_limits(settings: ModelSettings) -> tuple[Optional[int], int]:
    """(thinking budget or None for no thinking, max_tokens) of each request."""
    # Thinking is on unless turned off: the default no-reasoning filter would discard every sample.
    effort = settings.reasoning_effort or DEFAULT_EFFORT
    if settings.reasoning_disabled or effort == "none":
        return None, settings.max_tokens or ANSWER_TOKENS
    budget = THINKING_BUDGETS[effort]
    if not settings.max_tokens:
        return budget, budget + ANSWER_TOKENS
    if budget < settings.max_tokens:
        return budget, settings.max_tokens
    # The budget must stay below max_tokens: give thinking half of what the user allows.
    shrunk = settings.max_tokens // 2
    if shrunk < MIN_THINKING_BUDGET:
        log.warning(
            "--max_tokens %d leaves no room for thinking (at least %d tokens); thinking is off.",
            settings.max_tokens, MIN_THINKING_BUDGET,
        )
        return None, settings.max_tokens
    return shrunk, settings.max_tokens


class AnthropicClient(ModelClient):
    """Anthropic's Messages API through the ``anthropic`` SDK's async client, with our own retry loop."""

    name = "anthropic"
    description = "Anthropic's Messages API (api.anthropic.com, or any endpoint that speaks it)."
    packages = ("anthropic", "aiohttp")
    sampling = ("temperature", "top_p", "top_k", "extra_body")  # the Messages API has no penalties

    def __init__(self, settings: ModelSettings):
        super().__init__(settings)
        self._budget, self._max_tokens = thinking_limits(settings)
        fields = settings.sampling()
        fields.update(fields.pop("extra_body", {}))  # --extra_body's fields as fields of the body
        self._sampling = json_fields(fields)[:-1]  # ',"temperature":0.7', or b"" when none is given
        self._provider = "Anthropic" if is_anthropic_url(settings.base_url) else None
        # The parts of every body that do not change during the run, serialized once, in create()'s order.
        self._body_head = b'{"max_tokens":' + json_bytes(self._max_tokens) + b',"messages":'
        self._model = b',"model":' + json_bytes(settings.model)
        thinking = {"type": "enabled", "budget_tokens": self._budget}
        self._thinking = b',"thinking":' + json_bytes(thinking) if self._budget is not None else b""
        self._options = {"timeout": settings.request_timeout}  # as create() was given it
        self._part_json = WireCache(_part_json)
        self._tool_json = WireCache(lambda tool: json_bytes(_tool_param(tool)))

    @functools.cached_property
    def _client(self) -> "anthropic.AsyncAnthropic":
        # Made at the first request: the SDK costs ~40 MB and seconds to import, which runs with other
        # clients, and a resume with nothing left to run, should not pay.
        import anthropic

        from anthropic.types import Message as AnthropicMessage

        self._sdk = anthropic
        self._response_type = AnthropicMessage
        # An explicit key, always: without one the SDK would look for profiles in the home folder.
        api_key = self.settings.api_key or os.environ.get("ANTHROPIC_API_KEY") or "EMPTY"
        # The SDK's own retries know nothing of our run-wide stop on auth errors.
        return anthropic.AsyncAnthropic(
            api_key=api_key,
            base_url=sdk_base_url(self.settings.base_url),
            max_retries=0,
            timeout=self.settings.request_timeout,
            http_client=http_client(anthropic, self.settings),
        )

    @functools.cached_property
    def _poster(self):
        # the SDK's auth, base URL and error types; the body ours (see hermes_batch.model.model_http)
        client = self._client  # imports the SDK
        return poster(self._sdk, client, "/v1/messages", self._options, self.settings)

    @classmethod
    def handles_base_url(cls, base_url: str) -> bool:
        return is_anthropic_url(base_url)

    @classmethod
    def check_settings(cls, settings: ModelSettings) -> None:
        super().check_settings(settings)
        # with extended thinking the API takes no top_k, a temperature of 1 only and a top_p of 0.95 or more
        if settings.reasoning_disabled or (settings.reasoning_effort or DEFAULT_EFFORT) == "none":
            return
        odd = [f"--{name} {value:g}" for name, value, fine in (
            ("temperature", settings.temperature, lambda v: v == 1), ("top_k", settings.top_k, lambda v: False),
            ("top_p", settings.top_p, lambda v: v >= 0.95)) if value is not None and not fine(value)]
        if odd:
            raise ConfigError(
                f"The Anthropic API takes no {', '.join(odd)} while the model thinks (with thinking on it takes a "
                "temperature of 1, a top_p of 0.95 or more and no top_k); pass --reasoning_disabled to sample "
                "without thinking, or leave those options out."
            )

    def _request(self, messages, tools) -> bytes:
        """The JSON body of a Messages API call: only messages new since the last turn are serialized."""
        system, items = _group(map(self._part_json, messages))
        # a list is a run of tool results: one user message
        wire = (b'{"role":"user","content":' + json_array(i) + b"}" if isinstance(i, list) else i for i in items)
        parts = [self._body_head, json_array(wire), self._model]
        if system:
            parts += [b',"system":', json_bytes("\n\n".join(system))]
        parts.append(self._thinking)
        if tools:
            parts += [b',"tools":', json_array(map(self._tool_json, tools))]
        parts += [self._sampling, b"}"]
        return b"".join(parts)

    async def send(self, messages: tuple[Message, ...], tools: tuple[ToolSpec, ...]) -> ModelResponse:
        poster = self._poster
        try:
            # Not messages.create(), which would re-validate the whole conversation: our body as it is.
            answer = await poster.post(self._request(messages, tools))
        except self._sdk.APIStatusError as exc:
            raise self._classify(exc) from exc
        except (self._sdk.APITimeoutError, self._sdk.APIConnectionError) as exc:
            raise RetryableModelError(
                f"The Anthropic endpoint at {self.settings.base_url} could not be reached: {transport_error_text(exc)}"
            ) from exc
        data = json_object(answer)
        data.pop("_fields_set", None)  # the one name construct() takes for itself
        # The SDK's own lenient construction of its Message, nested blocks and all, as its post() makes it.
        return from_wire(self._response_type.construct(**data), self._provider)

    def _classify(self, exc: anthropic.APIStatusError) -> Exception:
        status, text = exc.status_code, api_error_text(exc)
        if status in (401, 403):
            return FatalModelError(
                f"The Anthropic endpoint refused the API key ({status}: {text}); "
                "pass a valid key with --api_key or set ANTHROPIC_API_KEY."
            )
        if status == 404:
            return FatalModelError(
                f"The Anthropic endpoint does not know the model {self.settings.model!r} ({status}: {text}); "
                "check --model and --base_url."
            )
        if status in RETRYABLE_STATUS or status >= 500:
            return RetryableModelError(
                f"The Anthropic endpoint answered {status}: {text}", status=status,
                retry_after=rate_limit_wait(exc.response.headers),
            )
        if status in (400, 413) and _CONTEXT_TOO_LONG.search(text):
            return ModelOutcome(
                f"The conversation no longer fits the model's context ({text}).", reason="context_length", status=status
            )
        return ModelCallError(f"The Anthropic endpoint refused the request ({status}: {text}).", status=status)

    async def preflight(self) -> None:
        # The probe asks for a few tokens, too few for any thinking budget: check without thinking.
        quiet = AnthropicClient(attrs.evolve(self.settings, reasoning_disabled=True))
        try:
            await ModelClient.preflight(quiet)
        finally:
            await quiet.aclose()

    def batch_api(self) -> "AnthropicBatches":
        """Its Message Batches endpoints, for --batch_api."""
        return AnthropicBatches(self)

    async def aclose(self) -> None:
        if "_poster" in self.__dict__:
            await self._poster.aclose()
        if "_client" in self.__dict__:  # made, so opened
            await self._client.close()


# The status an error type inside a batch stands for, for the client's classification.
_ERROR_STATUS = {
    "invalid_request_error": 400, "authentication_error": 401, "permission_error": 403, "not_found_error": 404,
    "request_too_large": 413, "rate_limit_error": 429, "api_error": 500, "overloaded_error": 529,
}


class AnthropicBatches(BatchAPI):
    """Anthropic's Message Batches: the requests sent in one create call, the results read as JSONL once it ended."""

    max_requests = 100_000
    max_bytes = 240 * 1000 * 1000  # a create call may be 256 MB; the rest is a margin

    def __init__(self, client: AnthropicClient):
        self.client = client

    @functools.cached_property
    def _sdk_client(self) -> "anthropic.AsyncAnthropic":
        # Its own client: the run's one only builds requests (model_http.DirectPost); these calls are few.
        import anthropic

        self._sdk = anthropic
        settings = self.client.settings
        api_key = settings.api_key or os.environ.get("ANTHROPIC_API_KEY") or "EMPTY"
        return anthropic.AsyncAnthropic(api_key=api_key, base_url=sdk_base_url(settings.base_url), max_retries=0,
                                        timeout=settings.request_timeout)

    async def _call(self, what: str, call, *args, **kwargs):
        sdk_client = self._sdk_client
        try:
            return await call(sdk_client.messages.batches)(*args, **kwargs)
        except self._sdk.AnthropicError as exc:
            raise management_error(self._sdk, exc, self.client.settings.base_url, what) from exc

    async def check(self) -> None:
        await self._call("its batch API", lambda b: b.list, limit=1)

    def body(self, messages, tools) -> bytes:
        return self.client._request(messages, tools)

    async def submit(self, requests: list) -> str:
        params = [{"custom_id": custom_id, "params": json.loads(body)} for custom_id, body in requests]
        batch = await self._call("a new batch", lambda b: b.create, requests=params)
        return batch.id

    async def poll(self, batch_id: str) -> Optional[str]:
        batch = await self._call("the state of a batch", lambda b: b.retrieve, batch_id)
        if batch.processing_status != "ended":
            return None
        counts = batch.request_counts
        return "expired" if counts.expired else "cancelled" if counts.canceled else "completed"

    async def results(self, batch_id: str, wanted: Optional[set] = None) -> dict:
        found: dict = {}
        # the SDK's decoder stops at the first line that is not JSON (losing every result after it): the raw
        # lines are read here instead, streaming, and each one checked
        decoder = await self._call("a batch's results", lambda b: b.results, batch_id)
        try:
            chunks = decoder.http_response.aiter_bytes()
            async for entry in result_lines(chunks, wanted, f"The results of batch {batch_id}"):
                custom_id, result = entry.get("custom_id"), entry.get("result")
                if not isinstance(custom_id, str) or not isinstance(result, dict):
                    continue
                if wanted is not None and custom_id not in wanted:
                    continue
                if result.get("type") == "succeeded":
                    keep_result(found, custom_id, self._answer(result.get("message")))
                elif result.get("type") == "errored":
                    keep_result(found, custom_id, self._error(result.get("error")))
                # expired, canceled: not processed, so it goes out again
        except self._sdk.AnthropicError as exc:
            raise management_error(self._sdk, exc, self.client.settings.base_url, "a batch's results") from exc
        finally:
            await decoder.close()
        return found

    def _answer(self, message):
        if not isinstance(message, dict):
            return RetryableModelError("The Anthropic endpoint's batch result holds no message.")
        from anthropic.types import Message as AnthropicMessage

        data = dict(message)
        data.pop("_fields_set", None)  # the one name construct() takes for itself
        try:
            return from_wire(AnthropicMessage.construct(**data), self.client._provider)
        except ModelCallError as exc:
            return exc
        except (TypeError, ValueError, AttributeError, KeyError) as exc:  # a message of another shape
            return RetryableModelError(f"The Anthropic endpoint's batch result is no message it could send ({exc}).")

    def _error(self, error):
        body = error if isinstance(error, dict) else {}
        kind = body.get("error", {}).get("type") if isinstance(body.get("error"), dict) else None
        status = _ERROR_STATUS.get(kind, 500)
        url = sdk_base_url(self.client.settings.base_url) + "/v1/messages"
        return self.client._classify(status_error(self._sdk, status, body, url))

    async def cancel(self, batch_id: str) -> None:
        await self._call("the cancel of a batch", lambda b: b.cancel, batch_id)

    async def aclose(self) -> None:
        if "_sdk_client" in self.__dict__:
            await self._sdk_client.close()


def _reset_seconds(value: str, now: float) -> Optional[float]:
    try:
        moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return max(0.0, moment.timestamp() - now)


def rate_limit_wait(headers: Optional[Mapping[str, str]], now: Optional[float] = None) -> Optional[float]:
    """Seconds to wait: ``retry-after``, else the reset time (RFC 3339) of an exhausted ``anthropic-ratelimit-*`` limit."""
    wait = retry_after_seconds(headers)
    if wait is not None or not headers:
        return wait
    now = time.time() if now is None else now
    limits = []
    for name, value in headers.items():
        match = _RESET_HEADER.fullmatch(name)
        seconds = _reset_seconds(value, now) if match else None
        if seconds is not None:
            spent = str(headers.get(f"anthropic-ratelimit-{match.group(1)}-remaining", "")).strip() == "0"
            limits.append((seconds, spent))
    return choose_reset_wait(limits)


# --- conversion ----------------------------------------------------------------------------------


def _tool_result(message: Message) -> dict:
    block = {"type": "tool_result", "tool_use_id": message.tool_call_id, "content": message.content}
    try:
        result = json.loads(message.content)
    except ValueError:
        result = None
    if isinstance(result, dict) and result.get("error") is not None:
        block["is_error"] = True
    return block


def _assistant_content(message: Message) -> Any:
    data = message.provider_data
    if isinstance(data, dict) and isinstance(data.get("anthropic_content"), list):
        return [dict(block) for block in data["anthropic_content"]]
    blocks: list[dict] = []
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    for call in message.tool_calls:
        arguments = call.arguments if call.arguments is not None else {}
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": arguments})
    return blocks or message.content


def _tool_param(tool: ToolSpec) -> dict:
    return {"name": tool.name, "description": tool.description, "input_schema": tool.parameters}


def _wire_part(message: Message) -> tuple[str, Any]:
    """What ``message`` adds to a request: ("system", text), ("tool", tool_result block) or ("message", message)."""
    if message.role == "system":
        return "system", message.content
    if message.role == "tool":
        return "tool", _tool_result(message)
    if message.role == "assistant":
        return "message", {"role": "assistant", "content": _assistant_content(message)}
    return "message", {"role": "user", "content": message.content}


def _part_json(message: Message) -> tuple[str, Any]:
    kind, value = _wire_part(message)
    return kind, value if kind == "system" else json_bytes(value)


def _group(parts) -> tuple[list, list]:
    """(system texts, messages), each run of tool results gathered into one list: the user message that carries them."""
    system: list = []
    items: list = []
    results = None
    for kind, value in parts:
        if kind == "tool":
            if results is None:
                results = []
                items.append(results)
            results.append(value)
            continue
        results = None
        if kind == "system":
            if value:
                system.append(value)
        else:
            items.append(value)
    return system, items


def to_wire(messages) -> tuple[str, list]:
    """(system prompt, Messages API messages) for a conversation.

    System messages become the ``system`` parameter; the tool results that
    follow one assistant turn become one user message of ``tool_result`` blocks,
    in order.
    """
    system, items = _group(map(_wire_part, messages))
    wire = [{"role": "user", "content": item} if isinstance(item, list) else item for item in items]
    return "\n\n".join(system), wire


def _block_dict(block: Any) -> dict:
    """A response content block as the request param the API accepts back."""
    kind = getattr(block, "type", None)
    if kind == "thinking":
        return {"type": "thinking", "thinking": block.thinking, "signature": block.signature}
    if kind == "redacted_thinking":
        return {"type": "redacted_thinking", "data": block.data}
    if kind == "text":
        return {"type": "text", "text": block.text}
    if kind == "tool_use":
        return {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
    return block.model_dump(mode="json", exclude_none=True)


def from_wire(response, provider: Optional[str] = None) -> ModelResponse:
    """A Messages API response as a provider-neutral ModelResponse."""
    blocks = [_block_dict(b) for b in response.content or ()]
    thoughts = [b["thinking"].strip() for b in blocks if b["type"] == "thinking" and (b["thinking"] or "").strip()]
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    inline, content = split_inline_reasoning(text)
    if inline:
        thoughts.append(inline)
    calls = tuple(
        ToolCall(
            b["id"],
            b["name"],
            b["input"] if isinstance(b["input"], dict) else None,
            b["input"] if isinstance(b["input"], str) else json.dumps(b["input"], ensure_ascii=False),
        )
        for b in blocks
        if b["type"] == "tool_use"
    )
    message = Message(
        "assistant",
        content,
        reasoning="\n\n".join(thoughts) or None,
        tool_calls=calls,
        provider_data={"anthropic_content": blocks} if blocks else None,
    )
    stop = response.stop_reason
    return ModelResponse(
        message=message,
        finish_reason=_FINISH_REASONS.get(stop, stop),
        usage=_usage(response.usage),
        provider=provider,
        model=response.model,
    )


def _field(value, name: str):
    # construct() leaves what does not fit the SDK's types as it came: a dict, a string, a number
    return value.get(name) if isinstance(value, dict) else getattr(value, name, None)


def _usage(usage) -> Usage:
    if usage is None:
        return Usage()
    # checked at the boundary: NaN, 1e999, negative or 10**30 tokens count as not reported
    cache_read = token_count(_field(usage, "cache_read_input_tokens"), "cache_read_input_tokens")
    cache_creation = token_count(_field(usage, "cache_creation_input_tokens"), "cache_creation_input_tokens")
    return Usage(
        prompt_tokens=token_count(_field(usage, "input_tokens"), "input_tokens") + cache_read + cache_creation,
        completion_tokens=token_count(_field(usage, "output_tokens"), "output_tokens"),
        reasoning_tokens=token_count(_field(_field(usage, "output_tokens_details"), "thinking_tokens"), "thinking_tokens"),
        cached_tokens=cache_read,
    )
