"""One invocation of ``hermes-batch run``: validate, plan, execute, merge, report."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Optional

import attrs
import pluggy

from ..folder import durable, offloop, record_index, rowkeys
from . import budget, cleanup, distributions, notices, preparation, resume_scan, run_settings
from ..formats import endpoint_numbers
from .checkpoint import write_run_json
from .config import RunConfig
from ..errors import (
    EXIT_FAILED_PROMPTS,
    EXIT_INTERRUPTED,
    EXIT_OK,
    HermesBatchError,
    PluginError,
    RunFolderWriteError,
)
from ..formats.jsonguard import finite_dumps
from ..folder.merge import merge_run
from ..contract.plugins import describe_plugins, get_plugin_manager
from .batch_client import BatchingClient
from .plan import RunPlan, build_processor
from ..session.processor import quietly
from .progress import Progress
from .recorder import Recorder
from .scheduler import Scheduler
from .session_journals import SessionJournals
from ..formats.redaction import Redactor
from ..formats.records import Checkpoint, SessionInfo
from ..contract.run_context import RunContext
from ..folder.offloop import Stopped, run_off_loop
from ..folder.durable import atomic_write_text
from ..folder.statistics import RunInfo, build_statistics, render_statistics

log = logging.getLogger("hermes_batch.run")



@attrs.frozen
class RunResult:
    exit_code: int
    statistics: Optional[dict] = None
    message: Optional[str] = None


class RunEngine:
    """Everything one invocation needs; ``prepare`` raises before anything is sent to a model."""

    def __init__(self, config: RunConfig, pm: Optional[pluggy.PluginManager] = None):
        self.config = config
        self.pm = pm or get_plugin_manager()
        self.scheduler: Optional[Scheduler] = None  # leases the prompts to the executor, once the run starts
        self.journals = SessionJournals()  # calls.jsonl and responses.jsonl, opened with the run folder
        self.recorder: Optional[Recorder] = None  # writes the outcomes, once the prompts run
        self.client = None
        self.budget = budget.Budget(config.max_cost)
        self.prepared: Optional[preparation.Prepared] = None  # the plan, its plugins and the run folder, by prepare
        # Whatever a sandbox read (a key included) is redacted before anything is written.
        self.redactor = Redactor.for_run(config)

    # --- before any model call -------------------------------------------------------------

    def prepare(self) -> RunPlan:
        """Check everything that can be checked before a model call and decide the run (``self.prepared``)."""
        self.prepared = preparation.prepare(self.config, self.pm)
        return self.prepared.plan

    def close(self) -> None:
        """Release the run folder (idempotent); ``execute`` does it when it ends."""
        if self.prepared is not None:
            self.prepared.lock.release()

    # --- the run -----------------------------------------------------------------------------

    async def execute(self) -> RunResult:
        try:
            return await self._execute()
        finally:
            self.close()

    async def _execute(self) -> RunResult:
        cfg, plan = self.config, self.prepared.plan
        pool = preparation.thread_pools(self.prepared.concurrency)
        fresh = not self.prepared.folder.has_outputs()
        endpoint_numbers.reset_warning()  # one warning per run for numbers no call can have
        self.index = record_index.RecordIndex(self.prepared.folder)
        self.resume_plan = resume_scan.nothing_finished(cfg, self.prepared.validated.keys)
        if cfg.resume:
            try:
                # off the event loop, like the merge: reading a big run folder must not make Ctrl-C wait
                self.resume_plan = await run_off_loop(
                    resume_scan.read_run_folder, self.prepared.folder, cfg, plan, self.prepared.validated.keys, self.prepared.checkpoints,
                    self.index)
            except (asyncio.CancelledError, Stopped):
                return RunResult(EXIT_INTERRUPTED, None, "Interrupted before any prompt ran.")
        self.prepared.checkpoints.previously_finished = self.resume_plan.finished
        to_run = resume_scan.prompts_to_run(self.resume_plan, cfg, plan)
        if to_run:
            try:  # before any prompt is leased, and before the preflight: a full disk costs nothing to fix
                durable.check_free_space(self.prepared.folder, self._space_needed(to_run))
            except RunFolderWriteError as exc:
                return RunResult(exc.exit_code, None, str(exc))
        self.context = RunContext(cfg.run_name, self.prepared.folder.dir, plan.seed, cfg.verbose, cfg.log_prefix_chars,
                                  pool)
        processor = build_processor(plan, self.context, self.prepared.registry, self.prepared.runtimes)
        self.client = processor.client
        self.budget = budget.Budget.of_run(cfg, self.prepared.folder, self.index)
        self.scheduler = Scheduler(cfg, plan, self.prepared.executor, self.prepared.concurrency, self.resume_plan,
                                   self.budget, self.journals)
        preflight = cfg.preflight and not self.budget.reached()
        stopped = await preparation.start(self.prepared.executor, processor, to_run, preflight)
        if stopped is None:
            stopped = self._open_folder(processor)
        if stopped is not None:
            await self._shut_down(processor)
            if isinstance(stopped, RunFolderWriteError) and fresh:
                cleanup.remove_outputs(self.prepared.folder, kept=False)
            if isinstance(stopped, asyncio.CancelledError):
                return RunResult(EXIT_INTERRUPTED, None, "Interrupted before any prompt ran.")
            return RunResult(stopped.exit_code, None, str(stopped))
        interrupted, fatal = await self._run_prompts(processor, to_run)
        if fatal is not None and fresh and not self.counts:
            # Nothing was achieved: leave nothing of this run behind, so the corrected command runs as typed.
            # Only the files it wrote: the folder may hold the user's own (the lock removes the folder if
            # this run created it).
            cleanup.remove_outputs(self.prepared.folder, self.prepared.writer_files(), kept=False)
            return RunResult(fatal.exit_code, None, str(fatal))
        return await self._result(interrupted, fatal, to_run)

    def _open_folder(self, processor) -> Optional[RunFolderWriteError]:
        """Write run.json, the row keys and the first checkpoint, open the call journal; a failed write, else None."""
        cfg, plan = self.config, self.prepared.plan
        try:
            self.prepared.folder.create()
            backend = processor.backend
            write_run_json(self.prepared.folder, plan, describe_plugins(self.pm), self.redactor, self.prepared.settings_history,
                           {"name": backend.name, "isolation": backend.isolation, **backend.isolation_details})
            rowkeys.save(self.prepared.folder, self.prepared.validated, cfg.max_rows)
            self.prepared.validated.keys.digests = self.prepared.validated.keys.indexes = None  # matched: 16 bytes a row less
            self.journals.open(self.prepared.folder, self.prepared.checkpoints.session_number, processor, cfg.response_cache,
                               self.resume_plan.left)
            self.budget.journal = self.journals.calls
            notices.skipped_lines(plan.dataset, self.prepared.folder, cfg.dataset_file, cfg.max_rows)
            # on record from the start, so a session killed before its first batch completes still counts
            self._save_checkpoint(interrupted=False)
        except RunFolderWriteError as exc:
            return exc
        return None

    async def _run_prompts(self, processor, to_run: int) -> tuple[bool, Optional[HermesBatchError]]:
        """Lease every prompt left to the executor and record the outcomes; (interrupted, fatal error)."""
        cfg, plan = self.config, self.prepared.plan
        # uninstalled toolsets first (one warning naming the plugins), then installed but unconfigured ones
        warning = distributions.unavailable_warning(plan.distribution, self.prepared.registry.names("toolsets"))
        if warning:
            log.warning("%s", warning)
        for name, reason in plan.unconfigured.items():
            log.warning("Toolset %s is left out of sampling: %s", name, reason)
        self.progress = Progress(total=to_run, enabled=cfg.progress)
        self.progress.watch(processor.client.limiter.summary)
        if isinstance(processor.client, BatchingClient):
            self.progress.watch(processor.client.batcher.summary)
        self.recorder = Recorder(
            self.prepared.folder, self.index, self.prepared.checkpoints, self.prepared.filters, self.redactor, self.progress, self.pm.hook,
            self.context, self.prepared.plugin_failures, on_batch_complete=lambda: self._save_checkpoint(interrupted=False),
            on_write_failed=self.journals.write_failed,
        )
        self.pm.hook.run_started(run=self.context)
        try:
            return await self.scheduler.run(processor, self.recorder, self.progress)
        finally:
            await self._shut_down(processor)

    async def _shut_down(self, processor) -> None:
        """The one way a session ends, whatever ended it: the executor's workers, then the toolsets' runtimes,
        sandboxes still opening, the backend and the client, then the records being written and the files."""
        await quietly(self.prepared.executor.shutdown())
        await processor.aclose()
        if self.recorder is not None:
            await self.recorder.close()
        self.journals.close()

    async def _result(self, interrupted: bool, fatal: Optional[HermesBatchError], to_run: int) -> RunResult:
        """Merge, count and say how the run ended."""
        try:
            statistics = await self._finish(interrupted)
        except (RunFolderWriteError, PluginError) as exc:  # PluginError: a writer's own bug
            fatal, statistics = fatal or exc, None
        except (asyncio.CancelledError, Stopped):
            return RunResult(
                EXIT_INTERRUPTED, None,
                "Interrupted while merging; finished prompts are saved, run again with --resume to merge them.",
            )
        if statistics is not None:
            notices.mostly_discarded(statistics, [f.name for f in self.prepared.filters], self.prepared.folder.dir)
        if fatal is not None:
            return RunResult(fatal.exit_code, statistics, str(fatal))
        if interrupted:
            return RunResult(EXIT_INTERRUPTED, statistics, "Interrupted; finished prompts are saved, run again with --resume to continue.")
        status = EXIT_FAILED_PROMPTS if self.counts["failed"] else EXIT_OK
        if self.budget_reached:
            return RunResult(status, statistics, self.budget.message(to_run, self.counts))
        self.budget.warn_if_unreported(self.client.limiter)
        return RunResult(status, statistics)

    @property
    def counts(self) -> collections.Counter:
        """Prompts of this session that ended, by kind (kept, discarded, failed)."""
        return self.recorder.counts if self.recorder is not None else collections.Counter()

    def _space_needed(self, to_run: int) -> int:
        """Bytes the records of the prompts that run at once take: as big as this run's records so far."""
        written = sum(path.stat().st_size for _num, path in self.prepared.folder.iter_batch_files())
        if self.prepared.folder.discarded.exists():
            written += self.prepared.folder.discarded.stat().st_size
        finished = self.resume_plan.finished
        per_record = written // finished if finished and written else durable.RECORD_BYTES
        return min(self.prepared.concurrency, to_run) * per_record

    @property
    def budget_reached(self) -> bool:
        """--max_cost stopped the session's jobs."""
        return self.scheduler is not None and self.scheduler.jobs.halted

    # --- bookkeeping -------------------------------------------------------------------------

    def _save_checkpoint(self, interrupted: bool) -> Checkpoint:
        return self.prepared.checkpoints.save(self.counts, self._session(interrupted))

    def _session(self, interrupted: bool) -> SessionInfo:
        limiter = self.client.limiter
        return SessionInfo(
            started_at=self.prepared.checkpoints.started_at,
            duration_s=round(time.monotonic() - self.prepared.checkpoints.started, 3),
            prompts_run=sum(self.counts.values()),
            invalid_skipped=self.prepared.plan.dataset.invalid,
            seed=self.prepared.plan.seed,
            interrupted=interrupted,
            rate_limited_calls=limiter.rate_limited,
            concurrency_start=limiter.start_limit,
            concurrency_min=limiter.min_limit,
            concurrency_final=limiter.limit,
            cost=None if limiter.cost is None else round(limiter.cost, 6),
            budget_reached=self.budget_reached,
        )

    async def _finish(self, interrupted: bool) -> dict:
        checkpoint = self._save_checkpoint(interrupted)
        # off the event loop, so Ctrl-C is heard at once: it stops the merge, which removes its temporary files
        stats = await run_off_loop(self._merge_and_count, checkpoint)
        self.pm.hook.run_finished(run=self.context, statistics=stats)
        return stats

    def _merge_and_count(self, checkpoint: Checkpoint) -> dict:
        self.index.close()
        aggregate, finish_times, batches = self.index.totals()
        try:
            merge_run(self.prepared.folder, self.prepared.writers, batches=batches, who=lambda name: self.prepared.plugin_failures.who("writers", name))
        except OSError as exc:  # a writer plugin's own write
            raise durable.write_error(self.prepared.folder.dir, exc) from exc
        stats = build_statistics(
            self.prepared.folder,
            totals=(aggregate, finish_times),
            journal=self.index.journal_totals(),
            filters_run=tuple(f.name for f in self.prepared.filters),
            sessions=checkpoint.sessions,
            invalid_skipped_total=self.prepared.plan.dataset.invalid,
            run=RunInfo(
                model=self.config.model, distribution=self.config.distribution, batch_size=self.config.batch_size,
                total_prompts=self.prepared.plan.dataset.valid, total_lines=self.prepared.plan.dataset.total,
                models=tuple(run_settings.distinct(self.prepared.settings_history, "model")),
                distributions=tuple(run_settings.distinct(self.prepared.settings_history, "distribution")),
            ),
        )
        if isinstance(self.client, BatchingClient):
            stats["batch_api"] = self.client.statistics()  # this session's batches
        offloop.check_stop()
        stats = self.redactor.data(stats)
        atomic_write_text(self.prepared.folder.statistics, finite_dumps(stats, indent=2) + "\n")
        return stats


def render(statistics: dict, console) -> None:
    render_statistics(statistics, console)
