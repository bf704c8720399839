"""A checker of OpenAI chat fine-tuning lines, written from OpenAI's documented format.

The rules (OpenAI's fine-tuning guide, its "chat format" data-preparation
cookbook and the ``FineTuneChatRequestInput`` schema of its API reference):

* a line is a JSON object with a non-empty ``messages`` list, and optionally
  ``tools`` (function definitions), ``parallel_tool_calls`` and the deprecated
  ``functions``; no other key;
* a message has a ``role`` of ``system``, ``developer``, ``user``, ``assistant``
  or ``tool`` and only the keys ``role``, ``content``, ``name``, ``tool_calls``,
  ``tool_call_id``, ``weight`` (and the deprecated ``function_call``);
* ``content`` is a string (or a list of content parts); only an assistant
  message that makes tool calls may leave it out;
* an assistant's ``tool_calls`` are ``{"id", "type": "function", "function":
  {"name", "arguments"}}`` with ``arguments`` a string holding valid JSON, and
  each name a function defined in ``tools``;
* a ``tool`` message carries the ``tool_call_id`` of a call of the assistant
  message it follows, every call is answered once before the conversation
  moves on, and nothing else answers it;
* ``weight``, where given, is 0 or 1; an example has at least one assistant message.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = {"system", "developer", "user", "assistant", "tool"}
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "weight", "function_call"}
LINE_KEYS = {"messages", "tools", "parallel_tool_calls", "functions"}


def check_line(line: Any) -> list[str]:
    """The rules ``line`` (a JSON text or its decoded object) breaks; [] when it is a valid example."""
    if isinstance(line, str):
        try:
            line = json.loads(line)
        except ValueError as exc:
            return [f"not JSON: {exc}"]
    if not isinstance(line, dict):
        return ["a line must be a JSON object"]
    problems = [f"unexpected key {key!r}" for key in sorted(set(line) - LINE_KEYS)]
    tools = line.get("tools", [])
    defined = set()
    if not isinstance(tools, list):
        problems.append("tools must be a list")
        tools = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            problems.append(f"tools[{i}] must be {{type: function, function: {{name, ...}}}}")
            continue
        if "parameters" in function and not isinstance(function["parameters"], dict):
            problems.append(f"tools[{i}].function.parameters must be a JSON schema object")
        defined.add(function["name"])
    messages = line.get("messages")
    if not isinstance(messages, list) or not messages:
        return problems + ["messages must be a non-empty list"]
    open_calls: set = set()
    answered: set = set()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            problems.append(f"{where} must be an object")
            continue
        role = message.get("role")
        if role not in ROLES:
            problems.append(f"{where}: unknown role {role!r}")
        problems += [f"{where}: unexpected key {key!r}" for key in sorted(set(message) - MESSAGE_KEYS)]
        if "weight" in message and message["weight"] not in (0, 1):
            problems.append(f"{where}: weight must be 0 or 1")
        content = message.get("content")
        calls = message.get("tool_calls")
        if content is None and not (role == "assistant" and calls):
            problems.append(f"{where}: content is missing")
        elif content is not None and not isinstance(content, (str, list)):
            problems.append(f"{where}: content must be a string or a list of parts")
        if role != "tool" and open_calls - answered:
            problems.append(f"{where}: tool calls {sorted(open_calls - answered)} were never answered")
            open_calls = set()
        if role == "assistant":
            open_calls, answered = set(), set()
            if calls is not None:
                problems += _check_calls(where, calls, defined, bool(tools), open_calls)
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                problems.append(f"{where}: a tool message needs a tool_call_id")
            elif call_id not in open_calls:
                problems.append(f"{where}: tool_call_id {call_id!r} answers no call of the assistant message before it")
            elif call_id in answered:
                problems.append(f"{where}: tool_call_id {call_id!r} is answered twice")
            else:
                answered.add(call_id)
        elif calls is not None:
            problems.append(f"{where}: only assistant messages make tool calls")
    if open_calls - answered:
        problems.append(f"tool calls {sorted(open_calls - answered)} at the end were never answered")
    if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
        problems.append("an example needs at least one assistant message")
    return problems


def _check_calls(where: str, calls: Any, defined: set, have_tools: bool, open_calls: set) -> list[str]:
    if not isinstance(calls, list) or not calls:
        return [f"{where}: tool_calls must be a non-empty list"]
    problems = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("id"), str) or call.get("type") != "function" \
                or not isinstance(function, dict):
            problems.append(f"{at} must be {{id, type: function, function: {{name, arguments}}}}")
            continue
        if call["id"] in open_calls:
            problems.append(f"{at}: id {call['id']!r} is used twice in one message")
        open_calls.add(call["id"])
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not name:
            problems.append(f"{at}: function.name must be a non-empty string")
        elif have_tools and name not in defined:
            problems.append(f"{at}: calls {name!r}, which tools does not define")
        if not isinstance(arguments, str):
            problems.append(f"{at}: function.arguments must be a string of JSON")
            continue
        try:
            json.loads(arguments)
        except ValueError:
            problems.append(f"{at}: function.arguments is not valid JSON")
    return problems
