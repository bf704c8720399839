"""Writing each prompt's outcome to the run folder: judged by the filters, appended, indexed and counted."""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Callable

from ..folder.record_index import RecordIndex
from .checkpoint import BatchTracker, Checkpoints
from ..errors import RunFolderWriteError
from ..contract.interfaces import PromptJob
from ..contract.plugin_errors import PluginFailures
from .progress import Progress
from ..formats.records import Discarded, Failure
from ..formats.redaction import Redactor
from ..contract.run_context import RunContext
from ..folder.durable import AppendLog
from ..folder.runfolder import RunFolder
from ..formats.serialization import to_json_line
from ..formats.token_ids import record_digest, side_entry
from ..folder.token_files import side_path


def side_line(trajectory, side) -> str:
    """The side file's line of a sample (--logprobs), tied to the record as written (after redaction)."""
    meta = trajectory.metadata
    entry = side_entry(meta.content_key, record_digest(trajectory.conversations), trajectory.prompt_index,
                       meta.sample_index, side)
    return json.dumps(entry, separators=(",", ":")) + "\n"


class Recorder:
    """The session's record files, index and counts; ``record`` is called with each prompt's outcome.

    A batch whose prompts have all ended gets its file closed, its index saved and ``on_batch_complete``
    called (the runner saves the checkpoint then).  A write that fails calls ``on_write_failed`` at once,
    from the writing thread, so no model request goes out after it.
    """

    def __init__(self, folder: RunFolder, index: RecordIndex, checkpoints: Checkpoints, filters: list, redactor: Redactor,
                 progress: Progress, hook, context: RunContext, plugin_failures: PluginFailures,
                 on_batch_complete: Callable[[], None], on_write_failed: Callable[[RunFolderWriteError], None]):
        self.folder, self.index, self.checkpoints = folder, index, checkpoints
        self.filters, self.redactor, self.progress = filters, redactor, progress
        self.hook, self.context, self.plugin_failures = hook, context, plugin_failures
        self.on_batch_complete, self.on_write_failed = on_batch_complete, on_write_failed
        self.counts: collections.Counter = collections.Counter()
        self.batch_logs: dict[int, AppendLog] = {}
        self.token_logs: dict[int, AppendLog] = {}  # --logprobs: batch_N.tokens.jsonl (folder/token_files.py)
        self.failed_logs = {
            "discarded": AppendLog(folder.discarded, on_error=on_write_failed),
            "failed": AppendLog(folder.failed, on_error=on_write_failed),
        }
        self.tracker = BatchTracker(self._batch_complete)
        self._recording: set = set()  # outcomes being written

    async def record(self, job: PromptJob, outcome) -> str:
        """Write one prompt's outcome; what it was recorded as ("kept", "discarded" or "failed").

        Shielded: a Ctrl-C that lands while the record is being written must not leave it written but
        uncounted; ``close`` waits for these before the session is saved.
        """
        recording = asyncio.ensure_future(self._record(job, outcome))
        self._recording.add(recording)
        recording.add_done_callback(self._recording.discard)
        return await asyncio.shield(recording)

    async def _record(self, job: PromptJob, outcome) -> str:
        side = getattr(outcome, "tokens", None)
        redacted = self.redactor.record(outcome)
        if side is not None and redacted is not outcome:
            side = side.redacted()  # the ids would still spell the secret the text no longer holds
        outcome = redacted
        kind, record = self._judge(outcome, job.row.prompt)
        log_ = self._batch_log(job.batch_num) if kind == "kept" else self.failed_logs[kind]
        index = self.index.touch(kind, job.batch_num)  # before the append: the index covers what the file held
        try:
            if side is not None and kind != "failed":  # before its record: a record never lacks its tokens
                await self._token_log(job.batch_num).append(side_line(outcome, side))
            await log_.append(to_json_line(record))
            index.add(record)
            self.counts[kind] += 1
            self.progress.ended(kind)
            self.tracker.finished(job.batch_num, failed=kind == "failed")  # a completed batch saves its index
        except RunFolderWriteError as exc:
            self.on_write_failed(exc)
            raise
        self.plugin_failures.observe(self.hook.prompt_finished, job.row.prompt_index, run=self.context, outcome=record)
        return kind

    def _judge(self, outcome, prompt: str) -> tuple:
        """``(kind, record)``: a failure (a filter that raised fails its prompt, naming the plugin), a sample a
        filter rejected (Discarded) or a kept one."""
        if isinstance(outcome, Failure):
            return "failed", outcome
        rejected = self.plugin_failures.filter(self.filters, outcome, prompt)
        if isinstance(rejected, Failure):
            return "failed", self.redactor.record(rejected)
        if rejected:
            return "discarded", Discarded(outcome, tuple(n for n, _ in rejected), tuple(r for _, r in rejected))
        return "kept", outcome

    def _batch_log(self, batch: int) -> AppendLog:
        log_ = self.batch_logs.get(batch)
        if log_ is None:
            log_ = self.batch_logs[batch] = AppendLog(self.folder.batch_path(batch), on_error=self.on_write_failed)
        return log_

    def _token_log(self, batch: int) -> AppendLog:
        log_ = self.token_logs.get(batch)
        if log_ is None:
            log_ = self.token_logs[batch] = AppendLog(side_path(self.folder.dir, batch), on_error=self.on_write_failed)
        return log_

    def _batch_complete(self, batch: int, failed: int) -> None:
        log_ = self.batch_logs.pop(batch, None)
        if log_ is not None:
            log_.close()
        token_log = self.token_logs.pop(batch, None)
        if token_log is not None:
            token_log.close()
        self.index.close_batch(batch)
        if not failed:  # as batch_runner.py: a batch is complete when all its prompts finished, none failed
            self.checkpoints.completed_batches.add(batch)
        self.on_batch_complete()

    async def close(self) -> None:
        """Wait for the outcomes being written (when Ctrl-C came they are saved, so they count); close the files."""
        if self._recording:
            await asyncio.gather(*self._recording, return_exceptions=True)
        for log_ in (*self.batch_logs.values(), *self.token_logs.values(), *self.failed_logs.values()):
            log_.close()
