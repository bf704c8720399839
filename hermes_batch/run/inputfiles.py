"""Reading the small files a run is configured with (prefill messages, distributions), or one sentence why not."""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Union

from ..errors import HermesBatchError, UsageError
from ..formats.jsonguard import value_problem
from ..formats.records import Message, ToolCall

PathLike = Union[str, "os.PathLike[str]"]


def read_text_file(path: PathLike, what: str, option: str, error: type = HermesBatchError) -> str:
    """The UTF-8 text of ``path``; ``error`` (one sentence) if it is missing, a folder, a pipe, unreadable or not UTF-8.

    ``what`` names the file for the user ("prefill messages file"), ``option`` is the option that gave it.
    """
    name = os.fspath(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below like any non-file
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise error(f"The {what} {name} does not exist; check the {option} path.") from None
    except IsADirectoryError:
        raise error(f"The {what} {name} is a folder; pass a file to {option}.") from None
    except OSError as exc:
        raise _unreadable(error, what, name, exc) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise error(f"The {what} {name} is a folder; pass a file to {option}.")
        if not stat.S_ISREG(mode):
            raise error(f"The {what} {name} is not a regular file (a pipe, socket or device); pass a file to {option}.")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            raw = handle.read()
    except OSError as exc:
        raise _unreadable(error, what, name, exc) from None
    finally:
        os.close(fd)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"The {what} {name} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "save it as UTF-8."
        ) from None


def _unreadable(error: type, what: str, name: str, exc: OSError) -> HermesBatchError:
    fix = "check its permissions" if exc.errno in (errno.EACCES, errno.EPERM) else "check the path"
    return error(f"The {what} {name} cannot be read ({exc.strerror or exc}); {fix}.")


def load_prefill(path) -> tuple:
    """The few-shot messages of --prefill_messages_file: a JSON list of messages in the OpenAI chat format.

    ``{role, content}`` for system, user and assistant messages; an assistant message may carry ``tool_calls``
    (``[{id, type: "function", function: {name, arguments}}]``, the arguments a JSON object or its text) and each
    call is answered by a ``{role: "tool", tool_call_id, content}`` message after it, so every client can send the
    example in its own format (the Anthropic client as tool_use and tool_result blocks).
    """
    if path is None:
        return ()
    text = read_text_file(path, "prefill messages file", "--prefill_messages_file", UsageError)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"The prefill messages file {path} is not valid JSON ({exc}).") from None
    problem = value_problem(data, int_range=False)
    if problem is not None:
        raise UsageError(f"The prefill messages file {path} cannot be sent: {problem}.")
    if not isinstance(data, list):
        raise UsageError(f"The prefill messages file {path} must hold a JSON list of {{role, content}} objects.")
    out = []
    unanswered: dict = {}  # tool call id -> tool name, of the last assistant message's calls
    for i, item in enumerate(data):
        where = f"{path}: message {i}"
        role = item.get("role") if isinstance(item, dict) else None
        if role == "tool":
            call_id = item.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in unanswered:
                raise UsageError(f"{where} is a tool result whose tool_call_id answers no call of the assistant "
                                 "message before it; give each call's id to the tool message that answers it.")
            out.append(Message("tool", _text(item.get("content"), where), tool_call_id=call_id,
                               name=unanswered.pop(call_id)))
            continue
        if unanswered:
            raise UsageError(f"{where} comes before the tool results of the calls {', '.join(sorted(unanswered))}; "
                             "answer each call with a tool message right after the assistant message that made it.")
        if role not in ("system", "user", "assistant") or not (
                isinstance(item.get("content"), str) or (role == "assistant" and item.get("content") is None)):
            raise UsageError(
                f"{where} must be an object with role system, user, assistant or tool and a string content."
            )
        calls = _tool_calls(item.get("tool_calls"), where) if role == "assistant" else ()
        if role != "assistant" and "tool_calls" in item:
            raise UsageError(f"{where} has tool_calls, which only an assistant message may make.")
        unanswered = {call.id: call.name for call in calls}
        out.append(Message(role, item.get("content") or "", tool_calls=calls))
    if unanswered:
        raise UsageError(f"{path}: the calls {', '.join(sorted(unanswered))} of the last assistant message have no "
                         "tool result; answer each with a tool message.")
    return tuple(out)


def _text(content, where: str) -> str:
    """A tool result's content: text, or a JSON value (written as its text)."""
    if isinstance(content, str):
        return content
    if content is None:
        raise UsageError(f"{where} is a tool result without a content; give its output as text.")
    return json.dumps(content, ensure_ascii=False)


def _tool_calls(calls, where: str) -> tuple:
    """An assistant message's ``tool_calls`` in the OpenAI format, as ToolCalls."""
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise UsageError(f"{where}: tool_calls must be a list of calls.")
    out, seen = [], set()
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        call_id = call.get("id") if isinstance(call, dict) else None
        if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
            raise UsageError(f'{where}: tool call {j} must be {{"id", "type": "function", "function": {{"name", '
                             f'"arguments"}}}} with a text id and name.')
        if call_id in seen:
            raise UsageError(f"{where}: the tool call id {call_id!r} is given twice; give each call its own id.")
        seen.add(call_id)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(arguments, dict):
            raise UsageError(f"{where}: the arguments of tool call {j} ({name}) must be a JSON object or its text.")
        out.append(ToolCall(call_id, name, arguments, json.dumps(arguments, ensure_ascii=False)))
    return tuple(out)
