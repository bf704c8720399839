"""The numbers an endpoint reports about a call (tokens, cost), checked where they enter the run and read back.

A model endpoint, or the endpoint of a tool, is not trusted: ``NaN``,
``1e999`` (Infinity once decoded), a negative cost or ``10**30`` tokens would
be summed into ``--max_cost``, written into every record and the call
journal, and crash each later ``--resume`` and ``stats``.  So a value no call
can have (not a number, not finite, negative, a fraction of a token, more
than ``MAX_CALL_TOKENS`` tokens or ``MAX_CALL_COST`` dollars) is taken as not
reported: 0 tokens, no cost.  The first one a process meets is logged once.

Records and journal lines written by older versions are read with the same
rules (a record's usage sums up to ``CALLS_PER_RECORD`` calls), so a run
folder that already holds such values resumes, and sums of checked values
stay far from any overflow.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Optional

from .records import Usage

log = logging.getLogger("hermes_batch.run")

MAX_CALL_TOKENS = 10**9
"""Most tokens of one kind one call may report: far beyond any model's context."""

MAX_CALL_COST = 10_000.0
"""Most dollars one call may report: far beyond any price list."""

CALLS_PER_RECORD = 10**6
"""Most calls one record's usage sums when it is read back (its bound: this many times a call's)."""

TOKEN_FIELDS = ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens")

_warned = False


def reset_warning() -> None:
    """Let the next implausible value be logged again (a run calls this as it starts)."""
    global _warned
    _warned = False


def _implausible(what: str, value: Any) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    log.warning(
        "An endpoint reported %s %s for one call, which no call can have; it counts as not reported, as does any "
        "such value (not finite, negative, above %s tokens or $%s a call) for the rest of the run.",
        what, shown.encode("ascii", "backslashreplace").decode("ascii"), f"{MAX_CALL_TOKENS:,}", f"{MAX_CALL_COST:,.0f}",
    )


def _tokens(value: Any, limit: int) -> Optional[int]:
    """``value`` as a token count within ``limit``; None when it cannot be one."""
    kind = type(value)
    if kind is int:
        return value if 0 <= value <= limit else None
    if kind is float and value.is_integer() and 0 <= value <= limit:  # 12.0 from a lenient server
        return int(value)
    return None


def _cost(value: Any, limit: float) -> Optional[float]:
    """``value`` as dollars within ``limit`` (which may be infinite); None when it cannot be a cost."""
    kind = type(value)
    if kind is int:
        return float(value) if 0 <= value <= limit and value < 1e300 else None
    if kind is float and 0.0 <= value <= limit and value != math.inf:  # NaN fails every comparison
        return value
    return None


def token_count(value: Any, field: str) -> int:
    """A token count from an endpoint's JSON: the count, or 0 when absent or implausible (logged once)."""
    if type(value) is int and 0 <= value <= MAX_CALL_TOKENS:  # the common case, first
        return value
    if value is None:
        return 0
    count = _tokens(value, MAX_CALL_TOKENS)
    if count is None:
        _implausible(f"{field} of", value)
        return 0
    return count


def call_cost(value: Any) -> Optional[float]:
    """A cost from an endpoint's JSON: dollars, or None when absent or implausible (logged once)."""
    if value is None:
        return None
    cost = _cost(value, MAX_CALL_COST)
    if cost is None:
        _implausible("a cost of", value)
    return cost


def checked_usage(usage: Optional[Usage]) -> Usage:
    """``usage`` itself when every field is one a call can have, else a copy with the others not reported.

    For a Usage some code built from an endpoint's answer (a model client's or a
    tool's plugin): a few comparisons when it is fine.
    """
    if usage is None:
        return Usage()
    cost = usage.cost
    if _plain(usage.prompt_tokens) and _plain(usage.completion_tokens) and _plain(usage.reasoning_tokens) \
            and _plain(usage.cached_tokens) and (cost is None or (type(cost) is float and 0.0 <= cost <= MAX_CALL_COST)):
        return usage
    return Usage(*(token_count(getattr(usage, name), name) for name in TOKEN_FIELDS), call_cost(cost))


def _plain(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_CALL_TOKENS


def stored_usage(fields: Mapping, calls: int = CALLS_PER_RECORD) -> Usage:
    """The usage of a record or journal line as written (``calls``: how many calls it may sum), without a warning.

    What a call cannot have reported (see the module's docstring) reads as not
    reported, also in files written before these checks.
    """
    token_limit = MAX_CALL_TOKENS * calls
    counts = []
    for name in TOKEN_FIELDS:
        count = _tokens(fields.get(name), token_limit)
        counts.append(0 if count is None else count)
    cost = None if fields.get("cost_reported") is False else _cost(fields.get("cost"), MAX_CALL_COST * calls)
    return Usage(*counts, cost)


def stored_cost(value: Any, calls: Optional[int] = 1) -> Optional[float]:
    """A cost as a journal line (``calls`` 1), a worker's message or a session (``calls`` None: any finite
    amount) holds it; None when no ``calls`` calls could report it."""
    return _cost(value, math.inf if calls is None else MAX_CALL_COST * calls)


def finite_seconds(value: Any) -> float:
    """A duration read back from a record: the number, or 0.0 when it is not a finite, non-negative one."""
    if type(value) in (int, float) and math.isfinite(value) and value >= 0:
        return float(value)
    return 0.0
