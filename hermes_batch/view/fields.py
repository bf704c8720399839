"""What the view index takes of one record line: its columns and its search text.

Records are read as parsed JSON, not as record classes: a line of an odd shape (an old version's, a
hand edit) is still listed, and a value where a number belongs that is none counts as not reported.
"""

from __future__ import annotations

import json

from ..formats import hermes_format
from ..formats.reward_numbers import stored_reward

STATUSES = ("kept", "discarded", "failed")
KEPT, DISCARDED, FAILED = range(3)
VERDICTS = ("unscored", "unverified", "failed", "passed")  # no verifier ran; one failed; below the mark; passed
SEARCH_FIELD_CHARS = 4096  # of the prompt and of the answer: what the search looks at


def clip(text, limit: int = SEARCH_FIELD_CHARS) -> str:
    return str(text or "")[:limit]


def _turns(traj: dict) -> list:
    turns = traj.get("conversations")
    return turns if isinstance(turns, list) else []


def prompt_of(traj: dict) -> str:
    for turn in _turns(traj):
        if isinstance(turn, dict) and turn.get("from") == "human":
            return str(turn.get("value", ""))
    return ""


def answer_of(traj: dict) -> str:
    for turn in reversed(_turns(traj)):
        if isinstance(turn, dict) and turn.get("from") == "gpt":
            return str(turn.get("value", ""))
    return ""


def unwrap(status: int, data) -> dict:
    """The trajectory (or failure) dict of a parsed record line; ``{}`` for a line of another shape."""
    rec = (data.get("trajectory") or {} if status == DISCARDED else data) if isinstance(data, dict) else None
    return rec if isinstance(rec, dict) else {}


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _names(value) -> tuple:
    """A list of names from a record (toolsets, filters, reasons) as a tuple of strings; () for anything else."""
    return tuple(map(str, value)) if isinstance(value, list) else ()


def _count(value, high: int = 0xFFFFFFFF) -> int:
    """A count from a record, 0 when it is not a finite number (an old or hand-edited line may hold 1e999)."""
    if type(value) is int and 0 <= value <= high:  # the usual case, first
        return value
    try:
        return min(high, max(0, int(value or 0)))
    except (TypeError, ValueError, OverflowError):
        return 0


def _prompt_index(value) -> int:
    if type(value) is int and -(2**63) <= value < 2**63:
        return value
    try:
        return max(-(2**63), min(2**63 - 1, int(value or 0)))
    except (TypeError, ValueError, OverflowError):
        return 0


def _seconds(value) -> float:
    try:
        seconds = float(value or 0.0)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return seconds if 0 <= seconds < 1e9 else 0.0  # NaN fails both tests


_SYSTEM_START = b'"conversations":[{"from":"system","value":"'
_SYSTEM_END = json.dumps(hermes_format.TOOLS_CLOSE)[1:-1].encode() + b'"}'  # the system turn's end, as JSON
_NEXT_TURN = b'"},{"from":"'


def without_system_prompt(line: bytes) -> bytes:
    """The record with its system turn's text left out: often most of its bytes, and nothing the index needs.

    The system turn always ends with the ``<tools>`` list; inside a JSON string
    a quote is always escaped, so the first ``\\n</tools>"}`` after the turn's
    start ends it, and no ``"},{"from":"`` can lie in between.  Anything else
    (another writer's layout) is parsed whole.
    """
    start = line.find(_SYSTEM_START, 0, 200)
    if start < 0:
        return line
    start += len(_SYSTEM_START)
    end = line.find(_SYSTEM_END, start)
    if end < 0 or line.find(_NEXT_TURN, start, end) >= 0:
        return line
    return line[:start] + line[end + len(_SYSTEM_END) - 2:]


def _reward(value) -> float:
    reward = stored_reward(value)  # NaN, 1e308, a string: no reward (and its sample not verified, below)
    return 0.0 if reward is None else reward


def verifiers_of(meta: dict) -> list:
    """The verifiers' results of a record's metadata: JSON text in records (a list in hand-made ones)."""
    value = meta.get("verifiers")
    if isinstance(value, str) and value not in ("", "[]"):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return []
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def verdict_of(meta: dict) -> int:
    """The index of a sample's verdict in VERDICTS, from its metadata."""
    verifiers = meta.get("verifiers")
    if not verifiers or verifiers == "[]":
        return 0
    if meta.get("verified") is not True or stored_reward(meta.get("reward")) is None:
        return 1  # a reward that is no number in [0, 1] is read as a failed verifier's, as everywhere
    return 3 if meta.get("passed") is True else 2


def fields(status: int, data: dict, rec: dict, vocab: dict) -> tuple:
    """The columns of one record (its strings interned in ``vocab``) and its search texts."""
    if status == FAILED:
        meta, usage = {}, _dict(rec.get("usage"))
        texts = (str(rec.get("prompt", "")), str(rec.get("message", "")))
        key = rec.get("content_key", "")
        tools = toolsets = filters = 0
        end = 0
        error = vocab["error"].id(str(rec.get("error_kind") or rec.get("error_class") or "unknown"))
        duration = 0.0
    else:
        meta = _dict(rec.get("metadata"))
        usage = _dict(meta.get("usage"))
        texts = (prompt_of(rec), answer_of(rec))
        key = meta.get("content_key", "")
        tool_stats = rec.get("tool_stats")
        called = tuple(sorted(n for n, s in tool_stats.items() if isinstance(s, dict) and s.get("count"))) \
            if isinstance(tool_stats, dict) else ()
        tools = vocab["tools"].id(called)
        toolsets = vocab["toolsets"].id(_names(rec.get("toolsets_used")))
        end = vocab["end"].id(str(meta.get("end_reason") or ""))
        filters = vocab["filters"].id(_names(data.get("filters"))) if status == DISCARDED else 0
        error = 0
        duration = _seconds(meta.get("duration_s"))
        if status == DISCARDED:
            texts = (texts[0], " ".join(_names(data.get("reasons"))) + " " + clip(texts[1]))
    ident = str(meta.get("id", "")) if meta else ""
    turns = _count(rec.get("api_calls"))
    tokens = min(0xFFFFFFFF, _count(usage.get("prompt_tokens")) + _count(usage.get("completion_tokens")))
    prompt = _prompt_index(rec.get("prompt_index"))
    reward, verdict = (_reward(meta.get("reward")), verdict_of(meta)) if meta else (0.0, 0)
    return (tools, toolsets, end, filters, error, turns, duration, tokens, key, (ident,) + texts, prompt, reward,
            verdict)
