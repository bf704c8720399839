"""Turning an agent session into the ShareGPT / Hermes function-calling record."""

from __future__ import annotations

import json
from typing import Iterable, Sequence

from . import hermes_format
from .records import Message, ToolCallRecord, ToolSpec, Turn

DEFAULT_SYSTEM_PROMPT = (
    "You are a capable assistant with access to tools. Work step by step: think, "
    "call tools to inspect and change the environment, read their results, and "
    "finish with a final answer that does not call any tool."
)


def system_turn(system_prompt: str, tools: Sequence[ToolSpec]) -> Turn:
    """The saved system turn: the agent's prompt and the tools in the Hermes ``<tools>`` layout."""
    specs = [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in tools
    ]
    return Turn("system", hermes_format.system_text(system_prompt, specs))


def assistant_turn(message: Message) -> Turn:
    """A ``gpt`` turn: reasoning in ``<think>``, the text, then each call in ``<tool_call>``."""
    records = tuple(
        ToolCallRecord(call.id, call.name, call.arguments if call.arguments is not None else call.raw_arguments)
        for call in message.tool_calls
    )
    text = hermes_format.assistant_text(message.reasoning, message.content, ((r.name, r.arguments) for r in records))
    return Turn("gpt", text, records or None)


def tool_turn(results: Iterable[Message]) -> Turn:
    """All results of one assistant turn as one ``tool`` turn of ``<tool_response>`` blocks."""
    payloads = []
    for msg in results:
        try:
            content = json.loads(msg.content)
        except ValueError:
            content = msg.content
        payloads.append({"tool_call_id": msg.tool_call_id, "name": msg.name, "content": content})
    return Turn("tool", hermes_format.tool_text(payloads))


def to_sharegpt(system_prompt: str, tools: Sequence[ToolSpec], prompt: str, messages: Sequence[Message]) -> tuple:
    """The saved conversation: system, the prompt, then the session's assistant and tool messages."""
    turns = [system_turn(system_prompt, tools), Turn("human", prompt)]
    pending: list[Message] = []
    for msg in messages:
        if msg.role == "tool":
            pending.append(msg)
            continue
        if pending:
            turns.append(tool_turn(pending))
            pending = []
        if msg.role == "assistant":
            turns.append(assistant_turn(msg))
    if pending:
        turns.append(tool_turn(pending))
    return tuple(turns)


def has_reasoning(turn: Turn) -> bool:
    """True for a ``gpt`` turn that carries reasoning."""
    return hermes_format.has_reasoning(turn.value)


def reasoning_counts(conversations: Iterable[Turn]) -> tuple[int, int]:
    """(assistant turns with reasoning, assistant turns without)."""
    with_ = without = 0
    for turn in conversations:
        if turn.from_ == "gpt":
            if has_reasoning(turn):
                with_ += 1
            else:
                without += 1
    return with_, without
