"""--max_cost: what the run's model calls have cost so far, and the stop once that reaches the budget.

The cost is what the endpoints reported: the earlier sessions' (a resume) plus this session's call
journal, which counts every request and the model calls tools make on other endpoints.  Reaching the
budget halts the jobs: no new prompt starts, the ones running end and are recorded.
"""

from __future__ import annotations

import collections
import logging
from typing import Optional

from ..contract.interfaces import PromptJobs
from ..folder.journal import CallJournal
from ..folder.record_index import RecordIndex
from ..folder.runfolder import RunFolder
from ..folder.statistics import reported_cost
from . import forecast
from .config import RunConfig

log = logging.getLogger("hermes_batch.run")


class Budget:
    """The run's --max_cost (None: no budget) and the cost reported against it."""

    def __init__(self, max_cost: Optional[float], previous: float = 0.0):
        self.max_cost = max_cost if max_cost != "auto" else None  # auto: resolved by of_run
        self.previous = previous  # the earlier sessions' cost, on a resume
        self.journal: Optional[CallJournal] = None  # this session's calls.jsonl, once the run folder is open

    @classmethod
    def of_run(cls, config: RunConfig, folder: RunFolder, index: RecordIndex) -> "Budget":
        """The budget of this session, with what the earlier ones cost when it resumes under a budget."""
        previous = 0.0
        max_cost = config.max_cost
        if max_cost == "auto":
            max_cost = forecast.auto_budget(folder)
            log.warning("--max_cost auto: $%.4f, the upper end of the pilot's 90%% interval of the run's cost "
                        "(forecast.json).", max_cost)
        if config.resume and max_cost is not None:
            previous = reported_cost(folder, index.journal_totals())
        return cls(max_cost, previous)

    @property
    def journaled(self) -> Optional[float]:
        """This session's reported cost (None: none reported)."""
        return self.journal.cost if self.journal is not None else None

    def spent(self) -> float:
        """The cost reported so far, this session's and the earlier ones'."""
        return self.previous + (self.journaled or 0.0)

    def reached(self) -> bool:
        return self.max_cost is not None and self.spent() >= self.max_cost

    def halt_if_reached(self, jobs: PromptJobs) -> bool:
        """Halt ``jobs`` and say so when the budget is reached; whether it was."""
        if not self.reached():
            return False
        jobs.halt()
        log.warning("The cost budget --max_cost %g is reached; no new prompt is started.", self.max_cost)
        return True

    def message(self, to_run: int, counts: collections.Counter) -> str:
        """How a session the budget stopped ended, and how to go on."""
        not_started = to_run - sum(counts.values())
        failed = f" and {counts['failed']} prompt(s) failed (see failed.jsonl)" if counts["failed"] else ""
        return (
            f"The cost budget --max_cost {self.max_cost:g} was reached (${self.spent():.4f} reported), so "
            f"{not_started} prompt(s) were not started{failed}; run the same command with --resume and a higher "
            "--max_cost to continue."
        )

    def warn_if_unreported(self, limiter) -> None:
        """A budget no endpoint reported a cost against (a judge's own endpoint counts) had no effect: say so."""
        if self.max_cost is not None and limiter.cost is None and self.journaled is None and limiter.requests:
            log.warning("The endpoint reported no cost, so --max_cost had no effect.")
