"""The journals a session keeps beside its records: calls.jsonl (every model call, its usage and cost) and
responses.jsonl (the model answers of the prompts still running, replayed when a resume runs them again).

They are opened with the run folder, before the first prompt, and closed by the engine's one shutdown.
A write that fails stops them at once, from the writing thread, so that no model request goes out after
it and no prompt is leased that the run could not save.
"""

from __future__ import annotations

import logging
from typing import Optional

import attrs

from ..contract.interfaces import PromptJob
from ..errors import RunFolderWriteError
from ..folder import readback
from ..folder.batch_journal import batch_journal_path
from ..folder.journal import CallJournal, journal_path
from ..folder.replay_journal import ResponseJournal, replay_journal_path
from ..folder.response_cache import open_cache
from ..folder.runfolder import RunFolder
from ..session.branches import prefix_key
from ..session.replay import Replayer, replay_key
from .batch_client import BatchingClient

log = logging.getLogger("hermes_batch.run")


class SessionJournals:
    """calls.jsonl and responses.jsonl of this session, and the --response_cache; None until opened."""

    def __init__(self):
        self.calls: Optional[CallJournal] = None
        self.responses: Optional[ResponseJournal] = None
        self.replayer: Optional[Replayer] = None
        self.cache = None  # --response_cache's ResponseCache, opened before the preflight
        self.all_recorded = False  # every prompt of the run has its record: responses.jsonl goes at close
        self.kept = 0  # failed prompts whose answers stay in responses.jsonl for the --resume that runs them again
        self.branches: dict = {}  # --branch_at: row content key -> [its prefix's key, branches not recorded, failed]

    def load(self, folder: RunFolder) -> None:
        """On a resume, before any model call and off the event loop: read (and repair) what the sessions before
        left, refusing a journal that is no plain file (a link, a FIFO, a device) before the preflight is paid."""
        for path in (journal_path(folder.dir), batch_journal_path(folder.dir)):
            readback.check_file(path)
        self.responses = ResponseJournal(replay_journal_path(folder.dir))

    def open_cache(self, response_cache) -> None:
        """Open --response_cache, before the preflight: a cache that cannot be used stops the run (UsageError)
        before anything is paid or written."""
        self.cache = open_cache(response_cache)

    def open(self, folder: RunFolder, session_number: int, processor, left) -> None:
        """Open the journals and give them, with the cache, to the processor's client and replayer (``left``: the
        rows to run)."""
        processor.client.journal = self.calls = CallJournal(journal_path(folder.dir), session_number)
        if self.responses is None:
            self.responses = ResponseJournal(replay_journal_path(folder.dir))
        processor.replayer = self.replayer = Replayer(self.responses, processor.client, self.cache)
        if self.responses.cut_off:
            log.info("%d prompt(s) cut off before replay their recorded model answers.", self.responses.cut_off)
        if isinstance(processor.client, BatchingClient):
            processor.client.open_journal(folder.dir, session_number, None if left is None else set(left))

    @property
    def stopped(self) -> bool:
        """A write of a journal failed: the run stops."""
        return any(journal is not None and journal.stopped is not None for journal in (self.calls, self.responses))

    def write_failed(self, error: RunFolderWriteError) -> None:
        # in the writing thread, at once: no model request goes out after a write of the run folder failed
        if self.calls is not None:
            self.calls.stop(error)

    def with_replay(self, job: PromptJob) -> PromptJob:
        """``job`` with the answers its cut-off session got, on a resume that found some."""
        if not self.responses.cut_off:
            return job
        return attrs.evolve(job, replay=self.responses.recorded(replay_key(job)))

    def expect_branches(self, row, count: int, turn) -> None:
        """--branch_at: ``count`` branches of ``row`` run now; once all are recorded and none failed, the answers
        of their prefix are dead too (a resume would have no branch of the row to run)."""
        if turn is not None and count:
            self.branches[row.content_key] = [prefix_key(row.content_key, turn), count, False]

    def _branch_recorded(self, job: PromptJob, failed: bool) -> None:
        held = self.branches.get(job.row.content_key)
        if held is None:
            return
        held[1] -= 1
        held[2] = held[2] or failed
        if held[1] <= 0:
            del self.branches[job.row.content_key]
            if not held[2]:
                self.responses.end(held[0])

    def recorded(self, job: PromptJob, failed: bool = False) -> None:
        """The prompt's record is written: its answers need no replay any more, unless it failed (``failed``):
        a --resume runs it again, and replays the answers it paid for instead of paying again."""
        self._branch_recorded(job, failed)
        key = replay_key(job)
        if failed and self.responses.holds(key):
            self.kept += 1
            return
        self.responses.end(key)

    def close(self) -> None:
        """Close what was opened; responses.jsonl is removed once every prompt has its record."""
        if self.calls is not None:
            self.calls.close()
        if self.responses is not None:
            self.responses.close(finished=self.all_recorded)
        if self.cache is not None:
            self.cache.close()
            self.cache = None
