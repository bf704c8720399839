"""Trajectories as OpenAI chat fine-tuning lines (``export --format openai``, ``--writer openai``).

Each line is ``{"messages": [...], "tools": [...]}`` as OpenAI's fine-tuning
format defines it: roles ``system``, ``user``, ``assistant`` and ``tool``;
assistant tool calls as ``{"id", "type": "function", "function": {"name",
"arguments"}}`` with ``arguments`` a JSON string; each ``tool`` message answers a
call of the assistant message before it by its ``tool_call_id``; ``tools`` the
function definitions offered to that prompt.

The record holds each assistant turn as ``<think>`` + text + ``<tool_call>``
blocks and its structured ``tool_calls``; the text is recovered by taking the
reasoning block off the front and the call blocks (rebuilt from the structured
calls, so text that merely looks like a call is left alone) off the end.
"""

from __future__ import annotations

import json
from typing import Optional

from . import hermes_format
from .records import Trajectory, Turn


class Unrepresentable(ValueError):
    """The trajectory cannot be written in the format (the reason is the message)."""


def split_system(turn: Turn) -> tuple[str, list]:
    """(system prompt, tool definitions) of the saved system turn."""
    return hermes_format.split_system(turn.value)


def split_assistant(turn: Turn) -> tuple[Optional[str], str]:
    """(reasoning or None, text) of a ``gpt`` turn, without its ``<tool_call>`` blocks."""
    reasoning, text = hermes_format.split_reasoning(turn.value)
    if turn.tool_calls:
        text = hermes_format.strip_calls(text, ((call.name, call.arguments) for call in turn.tool_calls))
    return reasoning, text


def _arguments_text(arguments) -> str:
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            raise Unrepresentable("a tool call's arguments are not valid JSON") from None
        return arguments
    return hermes_format.dumps(arguments)


def to_openai(trajectory: Trajectory, *, reasoning: str = "keep") -> dict:
    """The fine-tuning line of ``trajectory``; raises Unrepresentable when the format cannot hold it.

    ``reasoning="keep"`` puts each turn's reasoning in a ``<think>`` block at the
    start of the assistant text; ``"drop"`` leaves it out.  The format requires
    every call to name a defined tool, carry JSON arguments and be answered once,
    so a record that breaks that (a hallucinated tool, a session cut off between
    a call and its result) is refused rather than written in a form trainers reject.
    """
    messages: list[dict] = []
    tools: list = []
    defined: set = set()
    pending: set = set()  # calls of the last assistant message not answered yet
    for turn in trajectory.conversations:
        if turn.from_ != "tool" and pending:
            raise Unrepresentable("a tool call was never answered")
        if turn.from_ == "system":
            content, tools = split_system(turn)
            defined = {t["function"]["name"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)}
            messages.append({"role": "system", "content": content})
        elif turn.from_ == "human":
            messages.append({"role": "user", "content": turn.value})
        elif turn.from_ == "gpt":
            messages.append(_assistant_message(turn, reasoning, defined))
            pending = {call.id for call in turn.tool_calls or ()}
            if len(pending) != len(turn.tool_calls or ()):
                raise Unrepresentable("two tool calls of one message share an id")
        elif turn.from_ == "tool":
            for payload in hermes_format.tool_responses(turn.value):
                call_id = payload.get("tool_call_id")
                if call_id not in pending:
                    raise Unrepresentable("a tool result answers no open call of the assistant message before it")
                pending.discard(call_id)
                content = payload.get("content")
                messages.append({
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": content if isinstance(content, str) else hermes_format.dumps(content),
                })
    if pending:
        raise Unrepresentable("a tool call was never answered")
    if not any(m["role"] == "assistant" for m in messages):
        raise Unrepresentable("it has no assistant message")
    return {"messages": messages, "tools": tools}


def _assistant_message(turn: Turn, reasoning: str, defined: set) -> dict:
    thought, text = split_assistant(turn)
    if thought and reasoning == "keep":
        text = f"{hermes_format.think_block(thought)}\n{text}" if text else hermes_format.think_block(thought)
    message: dict = {"role": "assistant"}
    if text or not turn.tool_calls:
        message["content"] = text
    if turn.tool_calls:
        for call in turn.tool_calls:
            if call.name not in defined:
                raise Unrepresentable(f"it calls {call.name!r}, a tool that was not offered")
        message["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": _arguments_text(call.arguments)}}
            for call in turn.tool_calls
        ]
    return message
