"""What the index sums over a run beside its columns: interned values and run-wide totals."""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Iterable, Optional

from .. import hermes_format

_MAX_REASONS = 2000  # distinct discard reasons counted one by one; the rest are summed


# An old or hand-edited record may hold anything where a number belongs (1e999, NaN, a string): such a value
# counts as not reported, so it can neither stop the sums nor poison them.

_LARGEST = 10**18  # a count or a cost past this is no measurement


def _number(value):
    """``value`` if it is a finite number, not negative and not absurd, else None."""
    kind = type(value)  # not isinstance: True is no number here
    if kind is int or kind is float:
        return value if 0 <= value < _LARGEST else None  # NaN fails the comparison
    return None


_USAGE_FIELDS = (("prompt", "prompt_tokens"), ("completion", "completion_tokens"),
                 ("reasoning", "reasoning_tokens"), ("cached", "cached_tokens"))


def _int(value) -> int:
    if type(value) is int:  # the usual case, first: these run for every tool of every record
        return value if 0 <= value < _LARGEST else 0
    number = _number(value)
    return int(number) if number is not None else 0


def _dicts(value) -> list:
    """The dicts of a list field (a list, or JSON text of one); anything else holds none."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return []
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


class Vocabulary:
    """Interned values (strings or tuples of strings) and their ids, in first-seen order."""

    def __init__(self, values: Iterable = ()):
        self.values: list = []
        self._ids: dict = {}
        for value in values:
            self.id(value)

    def id(self, value) -> int:
        found = self._ids.get(value)
        if found is None:
            found = self._ids[value] = len(self.values)
            self.values.append(value)
        return found

    def ids_where(self, predicate) -> set:
        return {i for i, value in enumerate(self.values) if predicate(value)}


class Aggregates:
    """Run-wide sums the columns cannot give: tool calls, reasoning turns, latencies, reasons, providers."""

    def __init__(self, data: Optional[dict] = None):
        data = data or {}
        self.tools: dict[str, list[int]] = data.get("tools", {})  # name -> [calls, success, failure], all finished
        self.reasoning: dict[str, list[int]] = data.get("reasoning", {"finished": [0, 0, 0], "kept": [0, 0, 0]})
        self.latency_ms = Counter({int(k): v for k, v in data.get("latency_ms", {}).items()})
        self.reasons = Counter({tuple(k.split("\x1f", 1)): v for k, v in data.get("reasons", {}).items()})
        self.providers: dict[str, list[int]] = data.get("providers", {})  # name -> [requests, errors, rate-limited]
        self.usage: dict[str, float] = data.get("usage", {"prompt": 0, "completion": 0, "reasoning": 0, "cached": 0})
        self.cost = data.get("cost")
        self.partial = data.get("partial", 0)

    def to_dict(self) -> dict:
        return {
            "tools": self.tools, "reasoning": self.reasoning,
            "latency_ms": {str(k): v for k, v in self.latency_ms.items()},
            "reasons": {"\x1f".join(k): v for k, v in self.reasons.items()},
            "providers": self.providers, "usage": self.usage, "cost": self.cost, "partial": self.partial,
        }

    def add_calls(self, calls) -> None:
        for call in calls if isinstance(calls, list) else _dicts(calls):
            if not isinstance(call, dict):
                continue
            provider = str(call.get("provider") or "unknown")
            row = self.providers.setdefault(provider, [0, 0, 0])
            status = call.get("status")
            row[0] += 1
            row[1] += status != 200
            row[2] += status == 429
            latency = call.get("latency_s") or 0
            if (type(latency) is float or type(latency) is int) and 0 <= latency < 1e9:
                self.latency_ms[int(round(latency * 1000))] += 1

    def add_usage(self, usage) -> None:
        usage = usage if isinstance(usage, dict) else {}
        totals = self.usage
        for ours, theirs in _USAGE_FIELDS:
            value = usage.get(theirs, 0)
            totals[ours] += value if type(value) is int and 0 <= value < _LARGEST else _int(value)
        cost = _number(usage.get("cost"))
        if cost is not None and usage.get("cost_reported", True):
            total = (self.cost or 0.0) + cost
            if math.isfinite(total):  # two costs near the largest float must not sum to infinity
                self.cost = total

    def add_finished(self, traj: dict, kept: bool) -> None:
        scopes = ("finished", "kept") if kept else ("finished",)
        with_, without = 0, 0
        turns = traj.get("conversations")
        for turn in turns if isinstance(turns, list) else ():
            if isinstance(turn, dict) and turn.get("from") == "gpt":
                if hermes_format.has_reasoning(str(turn.get("value", ""))):
                    with_ += 1
                else:
                    without += 1
        for scope in scopes:
            row = self.reasoning[scope]
            row[0] += with_
            row[1] += without
            row[2] += with_ == 0
        tool_stats = traj.get("tool_stats")
        for name, stat in (tool_stats.items() if isinstance(tool_stats, dict) else ()):
            if isinstance(stat, dict):
                row = self.tools.setdefault(name, [0, 0, 0])  # a JSON object's keys are strings
                count, success, failure = stat.get("count", 0), stat.get("success", 0), stat.get("failure", 0)
                if (type(count) is int and type(success) is int and type(failure) is int  # the usual case, first
                        and count >= 0 and success >= 0 and failure >= 0):
                    row[0] += count
                    row[1] += success
                    row[2] += failure
                else:
                    row[0] += _int(count)
                    row[1] += _int(success)
                    row[2] += _int(failure)
        self.partial += bool(traj.get("partial"))

    def add_reasons(self, filters, reasons) -> None:
        if not isinstance(filters, list) or not isinstance(reasons, list):
            return
        for name, reason in zip(filters, reasons):
            key = (str(name), str(reason)[:300])
            if key in self.reasons or len(self.reasons) < _MAX_REASONS:
                self.reasons[key] += 1
            else:
                self.reasons[(str(name), "(other reasons)")] += 1


class Tallies:
    """Counts over the columns that the summary shows, kept up to date as rows are added.

    A summary of a million-record run then reads these few counters instead of
    walking every row (which took seconds at each run's end).
    """

    def __init__(self, data: Optional[dict] = None):
        data = data or {}
        self.status: list[int] = [int(n) for n in data.get("status", (0, 0, 0))]  # rows per status
        # over finished rows (kept and discarded): ids of the interned values, model calls, rounded durations
        self.end = Counter({int(k): v for k, v in data.get("end", {}).items()})
        self.turns = Counter({int(k): v for k, v in data.get("turns", {}).items()})
        self.duration = Counter({float(k): v for k, v in data.get("duration", {}).items()})
        self.toolsets = Counter({int(k): v for k, v in data.get("toolsets", {}).items()})
        self.filters = Counter({int(k): v for k, v in data.get("filters", {}).items()})  # over discarded rows
        self.model_calls: int = data.get("model_calls", 0)
        self.unreadable: int = data.get("unreadable", 0)  # lines of the record files that are no record: skipped

    def add(self, status: int, finished: bool, discarded: bool, end: int, turns: int, duration: float,
            toolsets: int, filters: int) -> None:
        self.status[status] += 1
        if finished:
            self.end[end] += 1
            self.turns[turns] += 1
            self.duration[round(duration, 3)] += 1
            self.toolsets[toolsets] += 1
            self.model_calls += turns
        if discarded:
            self.filters[filters] += 1

    def copy(self) -> "Tallies":
        other = Tallies()
        other.status = list(self.status)
        for name in ("end", "turns", "duration", "toolsets", "filters"):
            setattr(other, name, Counter(getattr(self, name)))
        other.model_calls = self.model_calls
        other.unreadable = self.unreadable
        return other

    def to_dict(self) -> dict:
        return {"status": self.status, "end": self.end, "turns": self.turns, "toolsets": self.toolsets,
                "filters": self.filters, "model_calls": self.model_calls, "unreadable": self.unreadable,
                "duration": {repr(k): v for k, v in self.duration.items()}}
