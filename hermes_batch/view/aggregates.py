"""What the view index keeps beside its columns: interned values and the counts the summary shows.

The run-wide sums (tokens, cost, tool calls, reasoning, latencies, discard reasons) are not here: the
report and the viewer take them from the run folder's own index (aggregate.py), as statistics.json does.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional


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
        self.scored: int = data.get("scored", 0)  # samples a verifier ran on: the viewer offers the reward filter

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
        other.scored = self.scored
        return other

    def to_dict(self) -> dict:
        return {"status": self.status, "end": self.end, "turns": self.turns, "toolsets": self.toolsets,
                "filters": self.filters, "model_calls": self.model_calls, "unreadable": self.unreadable,
                "scored": self.scored, "duration": {repr(k): v for k, v in self.duration.items()}}
