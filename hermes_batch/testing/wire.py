"""The OpenAI chat-completions and Anthropic messages wire formats, as the scripted server speaks them.

Requests are normalized into a :class:`~hermes_batch.testing.scripts.ScriptRequest`;
a :class:`~hermes_batch.testing.scripts.Reply` is rendered into the response or
error body of the API that was called.  Ids come from the server's ``next_id``
counter and thinking blocks are signed with its secret, so this module keeps no state.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from typing import Any, Callable, Iterable, Optional

from ..formats.records import Usage
from .scripts import Reply, ScriptRequest

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


def error_body(
    api: str, status: int, message: str, error_type: Optional[str] = None, provider: Optional[str] = None
) -> dict:
    """The provider's error body for ``status``."""
    if api == "anthropic":
        default = _ANTHROPIC_ERRORS.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": error_type or default, "message": message}}
    fallback = ("server_error" if status >= 500 else "invalid_request_error", None)
    default_type, code = _OPENAI_ERRORS.get(status, fallback)
    error = {"message": message, "type": error_type or default_type, "param": None, "code": code}
    if provider is not None:
        error["metadata"] = {"provider_name": provider}  # as OpenRouter names the upstream that failed
    return {"error": error}


class BadRequest(Exception):
    """A request body the provider would reject with a 400."""


# --- signatures of thinking blocks ---------------------------------------------------


def sign_thinking(secret: bytes, thinking: str) -> str:
    """The signature of a thinking block, as the server hands it out."""
    digest = hmac.new(secret, thinking.encode("utf-8"), hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def signature_valid(secret: bytes, thinking: str, signature: str) -> bool:
    """True if ``signature`` is the one the server gave ``thinking``."""
    return hmac.compare_digest(sign_thinking(secret, thinking), signature or "")


# --- requests ------------------------------------------------------------------------


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise BadRequest(f"content must be a string or a list of parts, got {type(content).__name__}")


def _images(content: Any) -> list:
    """URLs of the ``image_url`` parts of a multimodal message (data: URLs included)."""
    if not isinstance(content, list):
        return []
    urls = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise BadRequest("image_url parts need an image_url.url string")
            urls.append(url)
    return urls


def _openai_messages(body: dict) -> list:
    out = []
    for m in body["messages"]:
        msg = {"role": m.get("role"), "content": _text(m.get("content"))}
        images = _images(m.get("content"))
        if images:
            msg["images"] = images
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


def parse_request(api: str, body: Any, headers: dict, verify: Callable[[str, str], bool]) -> ScriptRequest:
    """Normalize a request body of ``api``; ``verify(thinking, signature)`` checks Anthropic thinking blocks.

    Raises ``BadRequest`` (or ``KeyError``, ``TypeError``, ``AttributeError`` on
    malformed parts) for a body the provider would reject.
    """
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise BadRequest("messages: a list of messages is required")
    if not isinstance(body.get("model"), str):
        raise BadRequest("model: a string is required")
    if api == "anthropic":
        if not isinstance(body.get("max_tokens"), int):
            raise BadRequest("max_tokens: Field required")
        messages = _anthropic_messages(body, verify)
    else:
        messages = _openai_messages(body)
    return ScriptRequest(api, body["model"], tuple(messages), _tool_names(api, body.get("tools")), body, headers)


# --- responses -----------------------------------------------------------------------


def _tokens(text: str) -> int:
    return (len(text) + 3) // 4


def estimate_usage(request: ScriptRequest, reply: Reply) -> Usage:
    """Token counts estimated from text lengths, for replies without ``usage``."""
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


def render_openai(request: ScriptRequest, reply: Reply, usage: Usage, next_id: Callable[[], int]) -> dict:
    """The chat-completions response body for ``reply``."""
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
            _function_call(f"call_hb{next_id()}", name, _arguments_json(args)) for name, args in reply.tool_calls
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
        "id": f"chatcmpl-hb{next_id()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": usage_body,
    }
    if reply.provider is not None:
        body["provider"] = reply.provider
    return body


def render_anthropic(
    request: ScriptRequest, reply: Reply, usage: Usage, next_id: Callable[[], int], sign: Callable[[str], str]
) -> dict:
    """The messages response body for ``reply``; ``sign(thinking)`` signs the thinking block."""
    blocks: list = []
    if reply.reasoning is not None and reply.reasoning_format != "none":
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": sign(reply.reasoning)})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    for name, args in reply.tool_calls:
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # sent verbatim: Anthropic never does this, but a client may want to survive it
        blocks.append({"type": "tool_use", "id": f"toolu_hb{next_id()}", "name": name, "input": args})
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
        "id": f"msg_hb{next_id()}",
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": blocks,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage_body,
    }


# --- models --------------------------------------------------------------------------


def model_info(api: str, model: str) -> dict:
    """The body of ``GET /v1/models/{model}``."""
    if api == "anthropic":
        return {"type": "model", "id": model, "display_name": model, "created_at": "2025-01-01T00:00:00Z"}
    return {"id": model, "object": "model", "created": 0, "owned_by": "hermes-batch"}


def model_list(api: str, models: Iterable[str]) -> dict:
    """The body of ``GET /v1/models``."""
    models = tuple(models)
    if api == "anthropic":
        data = [model_info("anthropic", m) for m in models]
        return {"data": data, "has_more": False, "first_id": models[0], "last_id": models[-1]}
    return {"object": "list", "data": [model_info("openai", m) for m in models]}
