"""--allocation adaptive: which row gets the next sample, and when a row gets no more.

A row's samples run one at a time, in sample order, so what decides its end is a function of its
finished samples in sample order, whichever session ran them: it stops once ``--target_passes`` of them
passed, once the last ``--max_failures`` of them failed, or when its ``--samples_per_prompt`` are spent.  A
resume reads the same outcomes back from the records (``samples.match``) and so reaches the same decisions;
a finished sample is never run again.

Which row goes next: among the rows open (started, not stopped, no sample running) the one whose pass
rate is least certain, by the variance of its Beta(1 + passes, 1 + failures) posterior; fresh rows (the
most uncertain of all) are opened first while fewer than ``window`` rows are open, so memory stays that
of the open rows, never of the dataset.
"""

from __future__ import annotations

import heapq
from typing import Iterator, Optional, Sequence

import attrs

TARGET, FAILURES, SPENT = "target", "failures", "samples"


@attrs.frozen
class Rule:
    """When a row gets no more samples."""

    target_passes: int
    max_failures: Optional[int]

    def settled(self, outcomes: Sequence[bool], more: bool) -> Optional[str]:
        """Why a row whose finished samples, in sample order, passed as ``outcomes`` stops (TARGET, FAILURES,
        SPENT); None while it goes on.  ``more``: it has samples left."""
        if sum(outcomes) >= self.target_passes:
            return TARGET
        if self.max_failures is not None and len(outcomes) >= self.max_failures \
                and not any(outcomes[-self.max_failures:]):
            return FAILURES
        return None if more else SPENT


def uncertainty(outcomes: Sequence[bool]) -> float:
    """The variance of the row's pass rate under a uniform prior: Beta(1 + passes, 1 + failures)."""
    a = 1 + sum(outcomes)
    b = 1 + len(outcomes) - (a - 1)
    return a * b / ((a + b) ** 2 * (a + b + 1))


class _Row:
    __slots__ = ("row", "outcomes", "samples", "next")

    def __init__(self, row, finished: Sequence[tuple], samples_left):
        self.row = row
        self.outcomes = dict(finished)  # sample index -> passed, of the finished samples
        self.samples: Iterator[int] = iter(samples_left)
        self.next: Optional[int] = next(self.samples, None)

    def in_order(self) -> list:
        return [self.outcomes[i] for i in sorted(self.outcomes)]


class Allocation:
    """The open rows of an adaptive session; ``take`` gives the next (row, sample), ``ended`` hears how it went."""

    def __init__(self, rule: Rule, rows: Iterator, finished_of, samples_of, window: int):
        self.rule = rule
        self.rows = rows  # fresh rows, in file order (PromptRows)
        self.finished_of = finished_of  # prompt_index -> ((sample, passed), ...) finished in earlier sessions
        self.samples_of = samples_of  # prompt_index -> its sample indexes left
        self.window = window
        self.fresh = True  # rows of the file not opened yet
        self.open: dict[int, _Row] = {}
        self.ready: list = []  # heap of (-uncertainty, samples finished, prompt_index): open rows waiting
        self.stopped: dict[str, int] = {TARGET: 0, FAILURES: 0, SPENT: 0}  # rows this session stopped, by why

    def take(self) -> Optional[tuple]:
        """The next (PromptRow, sample index, opened) to run; None when no row waits (rows may still be running)."""
        if self.ready and (len(self.open) >= self.window or not self.fresh):
            return self._pop()
        while self.fresh:
            row = next(self.rows, None)
            if row is None:
                self.fresh = False
                break
            state = _Row(row, self.finished_of(row.prompt_index), self.samples_of(row.prompt_index))
            if self._settled(state):
                continue
            self.open[row.prompt_index] = state
            return self._hand_out(state, opened=True)
        return self._pop() if self.ready else None

    def ended(self, prompt_index: int, sample: int, passed: Optional[bool]) -> bool:
        """Record a sample's outcome (``passed`` None: it failed to run and says nothing); whether the row goes on."""
        state = self.open[prompt_index]
        if passed is not None:
            state.outcomes[sample] = passed
        if self._settled(state):
            del self.open[prompt_index]
            return False
        return True

    def wait(self, prompt_index: int) -> None:
        """The row's next sample waits for its turn among the open rows."""
        state = self.open[prompt_index]
        heapq.heappush(self.ready, (-uncertainty(state.in_order()), len(state.outcomes), prompt_index))

    def next_of(self, prompt_index: int) -> tuple:
        """The row's next sample, run at once (the fresh rows are all open: no other row can wait for it)."""
        return self._hand_out(self.open[prompt_index], opened=False)

    def drop(self, prompt_index: int) -> None:
        """The row is left open but gets no more samples this session (the budget is spent)."""
        self.open.pop(prompt_index, None)

    def _pop(self) -> tuple:
        _u, _n, prompt_index = heapq.heappop(self.ready)
        return self._hand_out(self.open[prompt_index], opened=False)

    def _hand_out(self, state: _Row, opened: bool) -> tuple:
        sample = state.next
        state.next = next(state.samples, None)
        return state.row, sample, opened

    def _settled(self, state: _Row) -> bool:
        why = self.rule.settled(state.in_order(), state.next is not None)
        if why is not None:
            self.stopped[why] += 1
        return why is not None
