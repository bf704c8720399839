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
import re
from typing import Optional

from .records import Trajectory, Turn

_TOOLS_OPEN = "\n\n<tools>\n"
_TOOLS_CLOSE = "\n</tools>"
_THINK_OPEN = "<think>\n"
_THINK_CLOSE = "\n</think>"
# one block per line: the payload is JSON written without raw newlines
_RESPONSE = re.compile(r"<tool_response>\n(.*)\n</tool_response>")


class Unrepresentable(ValueError):
    """The trajectory cannot be written in the format (the reason is the message)."""


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def split_system(turn: Turn) -> tuple[str, list]:
    """(system prompt, tool definitions) of the saved system turn."""
    value = turn.value
    start = value.rfind(_TOOLS_OPEN)
    if start < 0 or not value.endswith(_TOOLS_CLOSE):
        return value, []
    try:
        tools = json.loads(value[start + len(_TOOLS_OPEN) : -len(_TOOLS_CLOSE)])
    except ValueError:
        return value, []
    if not isinstance(tools, list):
        return value, []
    return value[:start], tools


def _call_block(call) -> str:
    return f"<tool_call>\n{_dumps({'name': call.name, 'arguments': call.arguments})}\n</tool_call>"


def split_assistant(turn: Turn) -> tuple[Optional[str], str]:
    """(reasoning or None, text) of a ``gpt`` turn, without its ``<tool_call>`` blocks."""
    value = turn.value
    reasoning = None
    if value.startswith(_THINK_OPEN):
        end = value.find(_THINK_CLOSE)
        if end >= 0:
            reasoning = value[len(_THINK_OPEN) : end]
            value = value[end + len(_THINK_CLOSE) :]
            value = value[1:] if value.startswith("\n") else value
    if turn.tool_calls:
        blocks = "\n".join(_call_block(call) for call in turn.tool_calls)
        if value.endswith(blocks):
            value = value[: len(value) - len(blocks)]
            value = value[:-1] if value.endswith("\n") else value
    return reasoning, value


def final_answer(trajectory: Trajectory) -> str:
    """The text of the last assistant turn when it calls no tool, else ""."""
    for turn in reversed(trajectory.conversations):
        if turn.from_ == "gpt":
            return "" if turn.tool_calls else split_assistant(turn)[1]
    return ""


def _arguments_text(arguments) -> str:
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            raise Unrepresentable("a tool call's arguments are not valid JSON") from None
        return arguments
    return _dumps(arguments)


def tool_results(turn: Turn) -> list[dict]:
    """The ``{"tool_call_id", "name", "content"}`` payloads of a ``tool`` turn."""
    out = []
    for match in _RESPONSE.finditer(turn.value):
        try:
            payload = json.loads(match.group(1))
        except ValueError:
            continue
        if isinstance(payload, dict):
            out.append(payload)
    return out


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
            for payload in tool_results(turn):
                call_id = payload.get("tool_call_id")
                if call_id not in pending:
                    raise Unrepresentable("a tool result answers no open call of the assistant message before it")
                pending.discard(call_id)
                content = payload.get("content")
                messages.append({
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": content if isinstance(content, str) else _dumps(content),
                })
    if pending:
        raise Unrepresentable("a tool call was never answered")
    if not any(m["role"] == "assistant" for m in messages):
        raise Unrepresentable("it has no assistant message")
    return {"messages": messages, "tools": tools}


def _assistant_message(turn: Turn, reasoning: str, defined: set) -> dict:
    thought, text = split_assistant(turn)
    if thought and reasoning == "keep":
        text = f"{_THINK_OPEN}{thought}{_THINK_CLOSE}\n{text}" if text else f"{_THINK_OPEN}{thought}{_THINK_CLOSE}"
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
