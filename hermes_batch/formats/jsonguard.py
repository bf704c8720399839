"""JSON every part of a run can hash, write and read back: nesting depth, lone surrogates, numbers.

Python's ``json`` accepts things the rest of a run cannot carry: a ``\\ud800``
escape decodes to a lone surrogate that no UTF-8 encoder takes, nesting a few
hundred levels deep overflows the recursion of whatever serializes the record,
and ``NaN``, ``Infinity`` or ``1e999`` come back out as tokens JSON does not
have.  Dataset rows with any of them are bad input (reported as ``FILE:LINE``
before a model is called); text from the model is repaired instead (a lone
surrogate becomes U+FFFD) so the sample is kept.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from typing import Any, Optional

import attrs

from .records import Message, ToolCall

MAX_DEPTH = 100
"""Most levels of nesting in one dataset row (the row's object is level 1) or one tool call's arguments.

Records add a few levels around them (``metadata.row``), and the result stays
under the 128 that common JSON parsers accept by default.
"""

INT_RANGE = (-(2**63), 2**63 - 1)
"""Integers dataset loaders (HuggingFace ``datasets``, Arrow) accept in a column: 64-bit signed."""

_INT_MIN, _INT_MAX = INT_RANGE
_PATH_CHARS = 60
_CONTAINERS_AND_NUMBERS = (dict, list, float)


def has_lone_surrogate(text: str) -> bool:
    """True when ``text`` holds a code point U+D800..U+DFFF, which UTF-8 cannot encode."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def scrub_text(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD; a pair split in two code points is joined again."""
    if not has_lone_surrogate(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _first_surrogate(text: str) -> str:
    for char in text:
        if 0xD800 <= ord(char) <= 0xDFFF:
            return f"\\u{ord(char):04x}"
    return ""


def _path(parts: list) -> str:
    text = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)
    if len(text) > _PATH_CHARS:
        text = text[: _PATH_CHARS - 3] + "..."
    return scrub_text(text)


def value_problem(
    value: Any, *, int_range: bool = True, text: bool = True, any_int: frozenset = frozenset()
) -> Optional[str]:
    """What makes decoded JSON ``value`` unfit for a record, as ``$.path: reason``; None when it is fine.

    Checks nesting (at most MAX_DEPTH levels), non-finite floats, (with ``text``)
    lone surrogates in strings and keys and (with ``int_range``) integers beyond 64 bits.
    Top-level keys in ``any_int`` may hold any integer.  Iterative, so any depth is safe.
    """
    if type(value) is dict and text and _flat_and_plain(value, int_range):
        return None  # the common dataset row, checked without the walk below
    # each entry: (value, depth, index of the parent entry, key or index in the parent)
    entries: list = [(value, 1, -1, None)]
    todo = [0]
    while todo:
        at = todo.pop()
        item, depth, _parent, _key = entries[at]
        kind = type(item)
        problem = None
        if kind is str:
            if text and has_lone_surrogate(item):
                problem = (f"holds a lone surrogate ({_first_surrogate(item)}), half of a UTF-16 pair that is not "
                           "text; fix or remove that escape")
        elif kind is dict or kind is list:
            if depth > MAX_DEPTH:
                problem = f"is nested more than {MAX_DEPTH} levels deep; flatten the field"
            else:
                pairs = item.items() if kind is dict else enumerate(item)
                for key, child in pairs:
                    if kind is dict and text and has_lone_surrogate(key):
                        return (f"{_path(_trail(entries, at))}: a key holds a lone surrogate "
                                f"({_first_surrogate(key)}); fix or remove that escape")
                    child_kind = type(child)
                    if child_kind is int and depth == 1 and key in any_int:
                        continue
                    if child_kind in _CONTAINERS_AND_NUMBERS or (text and child_kind is str) or (
                        int_range and child_kind is int
                    ):
                        entries.append((child, depth + 1, at, key))
                        todo.append(len(entries) - 1)
        elif kind is float:
            if not math.isfinite(item):
                problem = f"{item} is not a number JSON can hold; use null or a string"
        elif kind is int and not INT_RANGE[0] <= item <= INT_RANGE[1]:
            problem = (f"the integer {str(item)[:20]}... ({len(str(abs(item)))} digits) is beyond the 64-bit range "
                       "dataset loaders accept; quote it as a string")
        if problem is not None:
            return f"{_path(_trail(entries, at))}: {problem}"
    return None


def _flat_and_plain(row: dict, int_range: bool) -> bool:
    # no allocation per row: validation runs this for every line of a million-line file
    for key, child in row.items():
        kind = type(child)
        if kind is str:
            if not child.isascii() and has_lone_surrogate(child):
                return False
        elif kind is int:
            if int_range and not _INT_MIN <= child <= _INT_MAX:
                return False
        elif kind is not bool and child is not None:
            return False
        if not key.isascii() and has_lone_surrogate(key):
            return False
    return True


def _trail(entries: list, at: int) -> list:
    parts = []
    while at > 0:
        _item, _depth, parent, key = entries[at]
        parts.append(key)
        at = parent
    return parts[::-1]


def scrub_value(value: Any) -> Any:
    """Decoded JSON with every lone surrogate (in strings and keys) replaced; ``value`` itself when clean.

    Meant for values already checked to be at most MAX_DEPTH deep.
    """
    kind = type(value)
    if kind is str:
        return scrub_text(value)
    if kind is dict:
        out, changed = {}, False
        for key, item in value.items():
            new_key = scrub_text(key) if type(key) is str else key
            new_item = scrub_value(item)
            changed = changed or new_key is not key or new_item is not item
            out[new_key] = new_item
        return out if changed else value
    if kind is list or kind is tuple:
        items = [scrub_value(item) for item in value]
        return kind(items) if any(a is not b for a, b in zip(items, value)) else value
    return value


def finite_value(value: Any) -> Any:
    """Decoded JSON with every float that is not finite (NaN, Infinity) replaced by 0.0; ``value`` itself when clean.

    What JSON writers fall back on, so that nothing any reader would choke on is ever written.
    """
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else 0.0
    if kind is dict:
        out = {key: finite_value(item) for key, item in value.items()}
        return out if any(out[key] is not item for key, item in value.items()) else value
    if kind is list or kind is tuple:
        items = [finite_value(item) for item in value]
        return kind(items) if any(a is not b for a, b in zip(items, value)) else value
    return value


def finite_dumps(value: Any, **options) -> str:
    """``json.dumps(value, **options)`` that never writes NaN or Infinity: such a float is written as 0.0."""
    try:
        return json.dumps(value, allow_nan=False, **options)
    except ValueError:  # a float that is not finite reached a record some way: writing it would poison the file
        return json.dumps(finite_value(value), allow_nan=False, **options)


def escape_controls(text: str, keep: str = "") -> str:
    """``text`` with what a terminal would act on (C0 and C1 controls such as ESC and NUL, DEL, line separators,
    bidirectional overrides) written as escapes; characters in ``keep`` (a newline, say) stay as they are."""
    return text.translate(_escapes_keeping(keep))


@functools.lru_cache(maxsize=8)
def _escapes_keeping(keep: str) -> dict:
    return {code: escape for code, escape in _CONTROL_ESCAPES.items() if chr(code) not in keep}


class TerminalFormatter(logging.Formatter):
    """Log lines with control characters escaped: a model's or an endpoint's text must not drive the terminal."""

    def format(self, record: logging.LogRecord) -> str:
        return escape_controls(super().format(record), keep="\n")


_CONTROL_ESCAPES = {
    code: "\\t" if code == 9 else f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
    for code in (*range(0x20), *range(0x7F, 0xA0), 0x061C, 0x200E, 0x200F, 0x2028, 0x2029, *range(0x202A, 0x202F),
                 *range(0x2066, 0x206A))
}


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON can hold")


def safe_message(message: Message) -> Message:
    """A model's message fit for every record and the next request; ``message`` itself when it already is.

    Lone surrogates (half an emoji) become U+FFFD.  Tool-call arguments nested
    deeper than MAX_DEPTH or holding NaN or Infinity become None, as invalid
    JSON does: the tool is not called and the raw text is what gets saved.
    """
    content, reasoning = scrub_text(message.content), message.reasoning
    if reasoning is not None:
        reasoning = scrub_text(reasoning)
    calls = tuple(_safe_call(call) for call in message.tool_calls)
    changed = content is not message.content or reasoning is not message.reasoning or any(
        a is not b for a, b in zip(calls, message.tool_calls)
    )
    return attrs.evolve(message, content=content, reasoning=reasoning, tool_calls=calls) if changed else message


def _safe_call(call: ToolCall) -> ToolCall:
    arguments = call.arguments
    if arguments is not None:
        arguments = None if value_problem(arguments, int_range=False, text=False) else scrub_value(arguments)
    fields = {"id": scrub_text(call.id), "name": scrub_text(call.name), "raw_arguments": scrub_text(call.raw_arguments)}
    if arguments is call.arguments and all(fields[k] is getattr(call, k) for k in fields):
        return call
    return attrs.evolve(call, arguments=arguments, **fields)


def arguments_problem(raw: str) -> str:
    """Why the raw arguments of a tool call could not be used, for the model and ``invalid_tool_calls``."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        return f"arguments are nested more than {MAX_DEPTH} levels deep"
    except ValueError as exc:
        if "is not a number JSON can hold" in str(exc):
            return f"arguments are not valid JSON ({exc})"
        return "arguments are not valid JSON"
    problem = value_problem(value, int_range=False, text=False)
    if problem is not None:
        if "nested more than" in problem:
            return f"arguments are nested more than {MAX_DEPTH} levels deep"
        return f"arguments are not valid JSON ({problem.partition(': ')[2].partition(';')[0]})"
    return "arguments are not valid JSON"
