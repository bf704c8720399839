"""The Hermes function-calling text format of a ShareGPT record, written and read in this one module.

A saved conversation carries its structure in the text of its turns:

- the ``system`` turn: the agent's prompt, then ``\\n\\n<tools>\\n[...]\\n</tools>`` (the tool definitions);
- a ``gpt`` turn: ``<think>\\n...\\n</think>`` (the reasoning, if any), the text, then one
  ``<tool_call>\\n{"name", "arguments"}\\n</tool_call>`` block per call, joined by newlines;
- a ``tool`` turn: one ``<tool_response>\\n{"tool_call_id", "name", "content"}\\n</tool_response>`` block per
  result, joined by newlines.

The writer (conversation.py), the exports (openai_format.py), the viewer and the report, the statistics and
the testing helpers all go through these functions.  Readers are tolerant: they also read what other writers
(Hermes Agent's batch_runner.py, whose records ``hermes-batch import`` brings in) put around the blocks.
This module imports nothing of hermes_batch.
"""

from __future__ import annotations

import json
import re
from typing import Iterable, Optional

TOOLS_OPEN = "\n\n<tools>\n"
TOOLS_CLOSE = "\n</tools>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_THINK = re.compile(r"<think>\n?(.*?)\n?</think>\n?", re.S)
# the payloads are JSON written without raw newlines, but other writers' may hold some
_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_CALL_BLOCK = re.compile(r"\n?<tool_call>\n.*?\n</tool_call>", re.S)


def dumps(value) -> str:
    """JSON as the format writes it: not ASCII-escaped, default separators."""
    return json.dumps(value, ensure_ascii=False)


# --- writing -------------------------------------------------------------------------------------------------


def system_text(system_prompt: str, tool_definitions: list) -> str:
    """The system turn: the prompt, then the tool definitions (OpenAI ``{"type": "function", ...}``) in ``<tools>``."""
    return f"{system_prompt}{TOOLS_OPEN}{dumps(tool_definitions)}{TOOLS_CLOSE}"


def think_block(reasoning: str) -> str:
    return f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}"


def call_block(name: str, arguments) -> str:
    return f"<tool_call>\n{dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def assistant_text(reasoning: Optional[str], content: Optional[str], calls: Iterable[tuple]) -> str:
    """A ``gpt`` turn's text: the reasoning block, the text, then a block per ``(name, arguments)`` call."""
    parts = [think_block(reasoning)] if reasoning else []
    if content:
        parts.append(content)
    parts.extend(call_block(name, arguments) for name, arguments in calls)
    return "\n".join(parts)


def response_block(payload: dict) -> str:
    return f"<tool_response>\n{dumps(payload)}\n</tool_response>"


def tool_text(payloads: Iterable[dict]) -> str:
    """A ``tool`` turn's text: a block per ``{"tool_call_id", "name", "content"}`` result."""
    return "\n".join(response_block(payload) for payload in payloads)


# --- reading -------------------------------------------------------------------------------------------------


def split_system(value: str) -> tuple[str, list]:
    """(system prompt, tool definitions) of a system turn; ``(value, [])`` when it holds no tool list."""
    start = value.rfind(TOOLS_OPEN)
    if start < 0 or not value.endswith(TOOLS_CLOSE):
        return value, []
    try:
        tools = json.loads(value[start + len(TOOLS_OPEN):-len(TOOLS_CLOSE)])
    except ValueError:
        return value, []
    if not isinstance(tools, list):
        return value, []
    return value[:start], tools


def has_reasoning(value: str) -> bool:
    """True for a ``gpt`` turn's text that starts with reasoning."""
    return value.startswith(THINK_OPEN)


def split_reasoning(value: str) -> tuple[Optional[str], str]:
    """(reasoning or None, the rest) of a ``gpt`` turn's text: the ``<think>`` block that starts it taken off."""
    match = _THINK.match(value)
    if match is None:
        return None, value
    return match.group(1), value[match.end():]


def strip_calls(text: str, calls: Iterable[tuple]) -> str:
    """``text`` without the blocks of ``(name, arguments)`` calls that end it (rebuilt, so a look-alike stays)."""
    blocks = "\n".join(call_block(name, arguments) for name, arguments in calls)
    if blocks and text.endswith(blocks):
        text = text[:len(text) - len(blocks)]
        text = text[:-1] if text.endswith("\n") else text
    return text


def without_call_blocks(text: str) -> str:
    """``text`` without any ``<tool_call>`` block (for display, when the turn's structured calls are shown)."""
    return _CALL_BLOCK.sub("", text)


def call_texts(value: str) -> list[str]:
    """The JSON text inside each ``<tool_call>`` block of a ``gpt`` turn (records without structured calls)."""
    return _CALL.findall(value)


def response_texts(value: str) -> list[str]:
    """The JSON text inside each ``<tool_response>`` block of a ``tool`` turn, parsable or not."""
    return _RESPONSE.findall(value)


def tool_responses(value: str) -> list[dict]:
    """The ``{"tool_call_id", "name", "content"}`` payloads of a ``tool`` turn's text; unreadable blocks left out."""
    out = []
    for raw in response_texts(value):
        try:
            payload = json.loads(raw)
        except ValueError:
            continue
        if isinstance(payload, dict):
            out.append(payload)
    return out
