"""The scripted server's token ids, logprobs and tokenizer, for testing --logprobs and the rollouts export.

A toy tokenizer with a toy chat template, both exact and easy to reason about: every UTF-8 byte is one token
(id ``BYTE_BASE + byte``), a message is ``START, <role id>, <its text's tokens>, END``, and an answer the server
makes is sampled as its text's tokens followed by ``END``.  The text of an assistant message is its content
followed by ``<tool_call>NAME ARGUMENTS</tool_call>`` for each call, as it was generated and as the template
renders it back.  So a conversation's encoding holds each answer's sampled ids exactly, unless the server
tokenizes with ``TOKENIZER_DRIFT``, which (like a re-tokenization that merges differently) encodes the two
bytes ``in`` of a message's text as the one token ``MERGED_IN``.

How a server spells the tokens of ``logprobs`` (``ScriptedModelServer(logprobs=...)``):

- ``"vllm"``: each token as ``token_id:N`` when the request asks ``return_tokens_as_token_ids``, else its text;
- ``"llama.cpp"``: each entry with its ``id`` beside its text;
- ``"openai"``: the text only (no id anywhere);
- None: the server ignores ``logprobs`` and answers ``"logprobs": null``.
"""

from __future__ import annotations

import json
from typing import Any, Optional

START, END = 1, 2
ROLE_IDS = {"system": 3, "user": 4, "assistant": 5, "tool": 6}
BYTE_BASE = 16
MERGED_IN = 300
LOGPROBS_FORMATS = ("vllm", "llama.cpp", "openai")
TOKENIZER_AGREE, TOKENIZER_DRIFT = "agree", "drift"


def encode_text(text: str, drift: bool = False) -> list[int]:
    """The toy tokenizer: a token per byte (with ``drift``, ``in`` is one token)."""
    data = text.encode("utf-8", "surrogatepass")
    ids: list[int] = []
    i = 0
    while i < len(data):
        if drift and data[i:i + 2] == b"in":
            ids.append(MERGED_IN)
            i += 2
            continue
        ids.append(BYTE_BASE + data[i])
        i += 1
    return ids


def piece(token_id: int) -> str:
    """A token's text as an endpoint shows it."""
    if token_id == END:
        return "<|end|>"
    if token_id == MERGED_IN:
        return "in"
    return bytes([token_id - BYTE_BASE]).decode("latin-1")


def logprob(token_id: int, position: int) -> float:
    """A deterministic logprob for the token sampled at ``position``."""
    return -round(((token_id * 7919 + position * 104729) % 1000) / 1000.0 + 0.001, 6)


def message_text(message: dict) -> str:
    """A wire message's text as the template renders it (an assistant's calls after its content)."""
    text = message.get("content") if isinstance(message.get("content"), str) else ""
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        text += f"<tool_call>{function.get('name', '')} {arguments}</tool_call>"
    return text


def encode_messages(messages: list, drift: bool = False, generation_prompt: bool = False) -> list[int]:
    """The toy chat template's encoding of wire messages."""
    ids: list[int] = []
    for message in messages:
        ids += [START, ROLE_IDS.get(message.get("role"), 7)] + encode_text(message_text(message), drift) + [END]
    if generation_prompt:
        ids += [START, ROLE_IDS["assistant"]]
    return ids


def completion_logprobs(message: dict, spelling: str, top: int, as_ids: bool) -> dict:
    """The ``logprobs`` of a choice whose message is ``message``: its text's tokens then END, as ``spelling``
    writes them, each with ``top`` alternatives."""
    ids = encode_text(message_text(message)) + [END]
    content = []
    for position, token_id in enumerate(ids):
        entry = _entry(token_id, logprob(token_id, position), spelling, as_ids)
        alternatives = [(token_id, entry["logprob"])] + [
            (BYTE_BASE + (token_id + j + 1) % 256, entry["logprob"] - 1.0 - j) for j in range(max(0, top - 1))]
        entry["top_logprobs"] = [_entry(i, v, spelling, as_ids) for i, v in alternatives[:top]]
        content.append(entry)
    return {"content": content}


def _entry(token_id: int, value: float, spelling: str, as_ids: bool) -> dict:
    text = piece(token_id)
    entry: dict[str, Any] = {"token": text, "logprob": value, "bytes": list(text.encode("latin-1", "replace"))}
    if spelling == "vllm" and as_ids:
        entry["token"] = f"token_id:{token_id}"
    elif spelling == "llama.cpp":
        entry["id"] = token_id
    return entry


def tokenize_answer(body: Any, drift: bool) -> Optional[dict]:
    """The answer of ``POST /tokenize`` to ``body``: vLLM's form (``messages``) or llama.cpp's (``content``)."""
    if not isinstance(body, dict):
        return None
    if isinstance(body.get("messages"), list):
        ids = encode_messages(body["messages"], drift, bool(body.get("add_generation_prompt", True)))
    elif isinstance(body.get("content"), str):
        ids = encode_text(body["content"], drift)
    elif isinstance(body.get("prompt"), str):
        ids = encode_text(body["prompt"], drift)
    else:
        return None
    return {"tokens": ids, "count": len(ids), "max_model_len": 1 << 20}
