"""One invocation of ``hermes-batch run``: prepare, scan, start, run the prompts, shut down, merge, report.

``RunEngine`` is the pipeline; each stage is a module of ``run/`` (docs/internals.md, "How a run goes
through the code"): ``preparation`` (the plan, the run folder taken, the engine and preflight),
``resume_scan`` (which prompts are finished), ``budget`` (--max_cost), ``session_journals`` (calls.jsonl,
responses.jsonl), ``scheduler`` (the prompts leased to the executor) and ``recorder`` (each outcome
written); here they are put together, the session shut down one way, the run folder merged and counted.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Optional

import attrs
import pluggy

from ..contract.plugins import describe_plugins, get_plugin_manager
from ..contract.run_context import RunContext, private_paths
from ..errors import EXIT_FAILED_PROMPTS, EXIT_INTERRUPTED, EXIT_OK, HermesBatchError, PluginError, RunFolderWriteError
from ..folder import durable, offloop, record_index, rowkeys
from ..folder.durable import atomic_write_text
from ..folder.merge import merge_run
from ..folder.offloop import Stopped, run_off_loop
from ..folder.statistics import RunInfo, build_statistics, render_statistics
from ..formats import endpoint_numbers
from ..formats.jsonguard import finite_dumps
from ..formats.records import Checkpoint, SessionInfo
from ..formats.redaction import Redactor
from ..session.processor import quietly
from . import cleanup, forecast, limits, notices, pilot, preparation, provider_exclusions, resume_scan, run_settings
from ..model.batching import Batcher
from .batch_client import BatchingClient
from .budget import Budget
from .checkpoint import write_run_json
from .control import ControlServer, RunControl
from .config import RunConfig
from .plan import RunPlan, build_processor
from .progress import Progress
from .recorder import Recorder
from .scheduler import Scheduler
from .session_journals import SessionJournals

log = logging.getLogger("hermes_batch.run")

NOTHING_RAN = "Interrupted before any prompt ran."


@attrs.frozen
class RunResult:
    exit_code: int
    statistics: Optional[dict] = None
    message: Optional[str] = None
    forecast: Optional[dict] = None  # --pilot's forecast.json


class RunEngine:
    """Everything one invocation needs; ``prepare`` raises before anything is sent to a model."""

    def __init__(self, config: RunConfig, pm: Optional[pluggy.PluginManager] = None):
        self.config = config
        self.pm = pm or get_plugin_manager()
        # Whatever a sandbox read (a key included) is redacted before anything is written.
        self.redactor = Redactor.for_run(config)
        self.prepared: Optional[preparation.Prepared] = None  # the plan, its plugins, the run folder: prepare
        # the session's parts, made by _execute
        self.index: Optional[record_index.RecordIndex] = None
        self.context: Optional[RunContext] = None
        self.client = None
        self.budget = Budget(config.max_cost)
        self.journals = SessionJournals()  # calls.jsonl and responses.jsonl, opened with the run folder
        self.scheduler: Optional[Scheduler] = None
        self.recorder: Optional[Recorder] = None  # writes the outcomes, once the prompts run
        self.guard = None  # the provider guard (model/provider_guard.py), None with --no_provider_guard
        self._backend = None  # the sandbox backend run.json describes
        self.control: Optional[RunControl] = None  # what hermes-batch ctl changes, while the prompts run
        self._control_server: Optional[ControlServer] = None
        self._task: Optional[asyncio.Task] = None  # the one execute runs in: ctl stop cancels it, as Ctrl-C does

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
        self._task = asyncio.current_task()
        try:
            return await self._execute()
        finally:
            self.close()

    async def _execute(self) -> RunResult:
        cfg, prepared = self.config, self.prepared
        pool = preparation.thread_pools(prepared.concurrency)
        fresh = not prepared.folder.has_outputs()
        endpoint_numbers.reset_warning()  # one warning per run for numbers no call can have
        self.index = record_index.RecordIndex(prepared.folder)
        try:
            match = await self._scan()
        except (asyncio.CancelledError, Stopped):
            return RunResult(EXIT_INTERRUPTED, None, NOTHING_RAN)
        to_run = resume_scan.prompts_to_run(match, cfg, prepared.plan)
        self.pilot = None
        if cfg.pilot is not None:
            try:
                self.pilot = await run_off_loop(
                    pilot.choose, cfg.dataset_file, cfg.max_rows, cfg.pilot, cfg.pilot_by,
                    Scheduler.toolsets_drawer(prepared.plan), prepared.plan.seed)
            except (asyncio.CancelledError, Stopped):
                return RunResult(EXIT_INTERRUPTED, None, NOTHING_RAN)
            to_run = min(to_run, len(self.pilot.rows) * cfg.per_row)
        if to_run:
            try:  # before any prompt is leased, and before the preflight: a full disk costs nothing to fix
                needed = limits.space_needed(prepared.folder, match.finished, prepared.concurrency, to_run)
                durable.check_free_space(prepared.folder, needed)
            except RunFolderWriteError as exc:
                return RunResult(exc.exit_code, None, str(exc))
            try:  # before the preflight too: a --response_cache that cannot be used costs nothing to fix
                self.journals.open_cache(cfg.response_cache)
            except HermesBatchError as exc:
                return RunResult(exc.exit_code, None, str(exc))
        self.context = RunContext(cfg.run_name, prepared.folder.dir, prepared.plan.seed, cfg.verbose,
                                  cfg.log_prefix_chars, pool, private_paths=private_paths(cfg))
        processor = build_processor(prepared.plan, self.context, prepared.registry, prepared.runtimes)
        self.client = processor.client
        try:
            self.guard = provider_exclusions.make_guard(cfg, prepared.folder, self.client)
        except HermesBatchError as exc:
            return RunResult(exc.exit_code, None, str(exc))
        self.client.guard = self.guard
        self.budget = Budget.of_run(cfg, prepared.folder, self.index)
        self.scheduler = Scheduler(cfg, prepared.plan, prepared.executor, prepared.concurrency, match, self.budget,
                                   self.journals)
        self.scheduler.guard = self.guard
        if self.pilot is not None:
            self.scheduler.pilot_rows = self.pilot.rows
        stopped, interrupted, fatal = await self._session(processor, to_run)
        if stopped is not None:
            return self._stopped_before_any_prompt(stopped, fresh)
        if fatal is not None and fresh and not self.counts:
            # Nothing was achieved: leave nothing of this run behind, so the corrected command runs as typed.
            # Only the files it wrote: the folder may hold the user's own (the lock removes the folder if
            # this run created it).
            cleanup.remove_outputs(prepared.folder, prepared.writer_files(), kept=False)
            return RunResult(fatal.exit_code, None, str(fatal))
        return await self._result(interrupted, fatal, to_run)

    async def _scan(self) -> resume_scan.Match:
        """The prompts finished before (none unless --resume), read off the event loop."""
        cfg, prepared = self.config, self.prepared
        keys = prepared.validated.keys
        match = resume_scan.nothing_finished(cfg, keys)
        if cfg.resume:
            # off the event loop, like the merge: reading a big run folder must not make Ctrl-C wait
            match = await run_off_loop(resume_scan.read_run_folder, prepared.folder, cfg, prepared.plan, keys,
                                       prepared.checkpoints, self.index)
            await run_off_loop(self.journals.load, prepared.folder)  # the journals left, checked before the preflight
        prepared.checkpoints.previously_finished = match.finished
        return match

    async def _session(self, processor,
                       to_run: int) -> tuple[Optional[BaseException], bool, Optional[HermesBatchError]]:
        """Start, open the run folder and run the prompts, then shut down whatever ended the session.

        (what stopped it before any prompt ran, else None; interrupted; the fatal error, else None).
        """
        try:
            preflight = self.config.preflight and not self.budget.reached()
            stopped = await preparation.start(self.prepared.executor, processor, to_run, preflight)
            if stopped is None:
                stopped = self._open_folder(processor)
            if stopped is not None:
                return stopped, False, None
            interrupted, fatal = await self._run_prompts(processor, to_run)
            return None, interrupted, fatal
        finally:
            await self._shut_down(processor)

    def _write_run_json(self, backend) -> None:
        prepared, self._backend = self.prepared, backend
        write_run_json(prepared.folder, prepared.plan, describe_plugins(self.pm), self.redactor,
                       prepared.settings_history,
                       {"name": backend.name, "isolation": backend.isolation, **backend.isolation_details},
                       self.guard.excluded if self.guard is not None else ())

    def _open_folder(self, processor) -> Optional[RunFolderWriteError]:
        """Write run.json, the row keys and the first checkpoint, open the journals; a failed write, else None."""
        cfg, prepared = self.config, self.prepared
        folder, validated = prepared.folder, prepared.validated
        try:
            folder.create()
            self._write_run_json(processor.backend)
            rowkeys.save(folder, validated, cfg.max_rows)
            validated.keys.digests = validated.keys.indexes = None  # matched: 16 bytes a row less
            self.journals.open(folder, prepared.checkpoints.session_number, processor, self.scheduler.match.left)
            self.budget.journal = self.journals.calls
            notices.skipped_lines(prepared.plan.dataset, folder, cfg.dataset_file, cfg.max_rows)
            # on record from the start, so a session killed before its first batch completes still counts
            self._save_checkpoint(interrupted=False)
        except RunFolderWriteError as exc:
            return exc
        return None

    async def _run_prompts(self, processor, to_run: int) -> tuple[bool, Optional[HermesBatchError]]:
        """Lease every prompt left to the executor and record the outcomes; (interrupted, fatal error)."""
        cfg, prepared = self.config, self.prepared
        plan = prepared.plan
        notices.start_banner(plan, prepared.registry.names("toolsets"), to_run, self.scheduler.match.finished,
                             prepared.concurrency, processor.backend)
        progress = Progress(total=to_run, enabled=cfg.progress)
        progress.watch(processor.client.limiter.summary)
        if self.guard is not None:
            progress.watch(self.guard.summary)
        if isinstance(processor.client, BatchingClient):
            batcher = processor.client.batcher
            progress.watch(batcher.summary)
            if isinstance(batcher, Batcher):  # the run's own (a worker's relays to the driver's, which is this)
                batcher.senders = self.scheduler.sessions_that_may_send
                self.scheduler.on_session_end = batcher.wake
        self.recorder = Recorder(
            prepared.folder, self.index, prepared.checkpoints, prepared.filters, self.redactor, progress,
            self.pm.hook, self.context, prepared.plugin_failures,
            on_batch_complete=lambda: self._save_checkpoint(interrupted=False),
            on_write_failed=self.journals.write_failed,
        )
        await self._listen(processor, to_run, progress)
        self.pm.hook.run_started(run=self.context)
        return await self.scheduler.run(processor, self.recorder, progress)

    async def _listen(self, processor, to_run: int, progress: Progress) -> None:
        """Open the control socket for hermes-batch ctl; a run that cannot goes on without it, and says so."""
        limiter = processor.client.limiter

        def status() -> dict:
            return {"prompts_to_run": to_run, "prompts_in_flight": progress.in_flight, **dict(self.counts),
                    "model_calls": limiter.requests, "model_calls_in_flight": limiter.in_flight,
                    "cost": round(self.budget.spent(), 6), "max_cost": self.budget.max_cost,
                    "budget_reached": self.budget_reached,
                    "excluded_providers": list(self.guard.excluded) if self.guard is not None else []}

        def set_max_cost(value: float) -> None:
            self.budget.max_cost = value

        def stop() -> None:  # a moment later, so the answer goes out first
            asyncio.get_running_loop().call_later(0.2, self._task.cancel)

        self.control = RunControl(self.prepared.concurrency, limiter=limiter, status=status,
                                  set_max_cost=set_max_cost, stop=stop,
                                  gates_prompts=self.prepared.executor.name == "local")
        self.scheduler.control = self.control
        server = ControlServer(self.prepared.folder.dir, self.control)
        try:
            await server.start()
        except (OSError, HermesBatchError) as exc:
            log.warning("hermes-batch ctl cannot reach this run: its control socket could not be made (%s).", exc)
            return
        self._control_server = server

    async def _shut_down(self, processor) -> None:
        """The one way a session ends, whatever ended it: the executor's workers, then the toolsets' runtimes,
        sandboxes still opening, the backend and the client, then the records being written and the files."""
        if self._control_server is not None:
            await self._control_server.close()
        await quietly(self.prepared.executor.shutdown())
        await processor.aclose()
        if self.recorder is not None:
            await self.recorder.close()
        self.journals.close()

    def _stopped_before_any_prompt(self, stopped: BaseException, fresh: bool) -> RunResult:
        if isinstance(stopped, RunFolderWriteError) and fresh:
            cleanup.remove_outputs(self.prepared.folder, kept=False)
        if isinstance(stopped, asyncio.CancelledError):
            return RunResult(EXIT_INTERRUPTED, None, NOTHING_RAN)
        return RunResult(stopped.exit_code, None, str(stopped))

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
        if self.pilot is not None and fatal is None and not interrupted:
            return await self._forecast(statistics)
        if fatal is not None:
            return RunResult(fatal.exit_code, statistics, str(fatal))
        if interrupted:
            return RunResult(EXIT_INTERRUPTED, statistics, "Interrupted; finished prompts are saved, run again with --resume to continue.")
        status = EXIT_FAILED_PROMPTS if self.counts["failed"] else EXIT_OK
        if self.budget_reached:
            return RunResult(status, statistics, self.budget.message(to_run, self.counts))
        self.budget.warn_if_unreported(self.client.limiter)
        return RunResult(status, statistics)

    async def _forecast(self, statistics: Optional[dict]) -> RunResult:
        """The pilot ended: forecast the whole run into forecast.json and say how to go on."""
        prepared = self.prepared
        wall = time.monotonic() - prepared.checkpoints.started
        content = await run_off_loop(forecast.forecast, prepared.folder, self.pilot,
                                     tuple(f.name for f in prepared.filters), prepared.concurrency, wall,
                                     prepared.plan.seed)
        forecast.write(prepared.folder, content)
        status = EXIT_FAILED_PROMPTS if self.counts["failed"] else EXIT_OK
        message = (f"The pilot ran {content['pilot']['rows']} of {content['pilot']['rows_of_dataset']} rows and wrote "
                   f"{forecast.FORECAST_NAME}; run the same command with --resume instead of --pilot to run the rest "
                   "(--max_cost auto takes the budget from the forecast).")
        return RunResult(status, statistics, message, content)

    @property
    def counts(self) -> collections.Counter:
        """Prompts of this session that ended, by kind (kept, discarded, failed)."""
        return self.recorder.counts if self.recorder is not None else collections.Counter()

    @property
    def budget_reached(self) -> bool:
        """--max_cost stopped the session's jobs."""
        return self.scheduler is not None and self.scheduler.jobs.halted

    # --- bookkeeping -------------------------------------------------------------------------

    def _save_checkpoint(self, interrupted: bool) -> Checkpoint:
        return self.prepared.checkpoints.save(self.counts, self._session_info(interrupted))

    def _session_info(self, interrupted: bool) -> SessionInfo:
        limiter, checkpoints = self.client.limiter, self.prepared.checkpoints
        return SessionInfo(
            started_at=checkpoints.started_at,
            duration_s=round(time.monotonic() - checkpoints.started, 3),
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
        prepared, cfg = self.prepared, self.config
        folder, plan = prepared.folder, prepared.plan
        self.index.close()
        aggregate, finish_times, batches = self.index.totals()
        try:
            merge_run(folder, prepared.writers, batches=batches,
                      who=lambda name: prepared.plugin_failures.who("writers", name))
        except OSError as exc:  # a writer plugin's own write
            raise durable.write_error(folder.dir, exc) from exc
        stats = build_statistics(
            folder,
            totals=(aggregate, finish_times),
            journal=self.index.journal_totals(),
            allocation=((cfg.samples_per_prompt, cfg.target_passes, cfg.max_failures)
                        if cfg.allocation == "adaptive" and cfg.samples_per_prompt > 1 else None),
            filters_run=tuple(f.name for f in prepared.filters),
            sessions=checkpoint.sessions,
            invalid_skipped_total=plan.dataset.invalid,
            run=RunInfo(
                model=cfg.model, distribution=cfg.distribution, batch_size=cfg.batch_size,
                total_prompts=plan.dataset.valid, total_lines=plan.dataset.total,
                models=tuple(run_settings.distinct(prepared.settings_history, "model")),
                distributions=tuple(run_settings.distinct(prepared.settings_history, "distribution")),
            ),
        )
        if isinstance(self.client, BatchingClient):
            stats["batch_api"] = self.client.statistics()  # this session's batches
        if self.guard is not None:
            stats["provider_guard"] = self.guard.statistics()
            if self.guard.exclusions and self._backend is not None:  # run.json names the providers left out
                self._write_run_json(self._backend)
        offloop.check_stop()
        stats = self.redactor.data(stats)
        atomic_write_text(folder.statistics, finite_dumps(stats, indent=2) + "\n")
        return stats


def render(statistics: dict, console) -> None:
    render_statistics(statistics, console)
