"""One invocation of ``hermes-batch run``: validate, plan, execute, merge, report."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import time
from typing import Optional

import attrs
import pluggy

from ..folder import durable, offloop, record_index, rowkeys
from . import budget, cleanup, distributions, limits, notices, resume_scan, run_settings, selection
from ..formats import endpoint_numbers
from ..folder import unfinished
from .checkpoint import Checkpoints, load_checkpoint, write_run_json
from .config import RunConfig
from ..errors import (
    EXIT_FAILED_PROMPTS,
    EXIT_INTERRUPTED,
    EXIT_OK,
    HermesBatchError,
    PluginError,
    RunFolderError,
    RunFolderWriteError,
)
from ..contract.interfaces import PromptJob, PromptJobs
from ..formats.jsonguard import finite_dumps
from ..folder.lock import RunFolderLock
from ..folder.merge import merge_run
from ..contract.plugin_errors import PluginFailures
from ..contract.plugins import collect, describe_plugins, get_plugin_manager
from .batch_client import BatchingClient
from .plan import RunPlan, build_processor, make_plan
from ..session.processor import quietly
from .progress import Progress
from .recorder import Recorder
from .session_journals import SessionJournals
from ..formats.redaction import Redactor
from ..formats.records import Checkpoint, SessionInfo
from ..contract.run_context import RunContext
from ..folder.runfolder import RunFolder, validate_run_name
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
        self.jobs = PromptJobs(())  # the session's, once it runs; halted when --max_cost stopped it
        self.journals = SessionJournals()  # calls.jsonl and responses.jsonl, opened with the run folder
        self.recorder: Optional[Recorder] = None  # writes the outcomes, once the prompts run
        self.client = None
        self.budget = budget.Budget(config.max_cost)
        self.lock: Optional[RunFolderLock] = None
        # Whatever a sandbox read (a key included) is redacted before anything is written.
        self.redactor = Redactor.for_run(config)

    # --- before any model call -------------------------------------------------------------

    def prepare(self) -> RunPlan:
        """Check everything that can be checked before a model call and decide the run (``self.plan``)."""
        cfg = self.config
        validate_run_name(cfg.run_name)
        # files and threads for the concurrency asked, said before any model call rather than as EMFILE after it
        fit = limits.fit_concurrency(cfg.num_workers)
        self.concurrency = fit.concurrency
        self.folder = RunFolder(cfg.output_dir, cfg.run_name)
        self.registry = collect(self.pm)
        plan, self.runtimes = make_plan(
            cfg, self.registry, self.folder, self.concurrency, on_validated=lambda v: setattr(self, "validated", v)
        )
        # what the toolsets hold whatever the prompts in flight (a browser's proxies) is known once they are built
        reserved = sum(runtime.files_needed() for runtime in self.runtimes.values())
        if reserved:
            fit = limits.fit_concurrency(cfg.num_workers, files_reserved=reserved)
            if fit.concurrency != self.concurrency:
                self.concurrency = fit.concurrency
                calls = cfg.max_concurrent_requests or fit.concurrency
                plan = attrs.evolve(plan, model=attrs.evolve(plan.model, max_concurrent_requests=calls))
        if fit.reasons:
            log.warning("%s", limits.describe(cfg.num_workers, fit))
        self.plan = plan
        self.filters = selection.filters(self.registry, plan.filters)
        notices.discarding_everything(cfg, [f.name for f in self.filters])
        self.writers = selection.writers(self.registry, plan.writers)
        self.plugin_failures = PluginFailures(self.pm, self.registry)
        self.executor = self.registry.get("executors", plan.executor)(plan.executor_config)

        self._check_folder()
        try:
            self.checkpoints = Checkpoints(self.folder, cfg, load_checkpoint(self.folder) if cfg.resume else None)
            # a resume continues the run's data: settings that change what it means are refused, or kept apart
            self.settings_history = run_settings.check_resume(plan, self.folder, self.checkpoints.session_number)
        except BaseException:
            self.close()
            raise
        return plan

    def _check_folder(self) -> None:
        cfg = self.config
        # Held until the run ends: a second run on this folder would write every prompt twice.
        self.lock = RunFolderLock(self.folder.dir)
        self.lock.acquire()
        try:
            if cfg.resume and unfinished.is_seed_folder(self.folder):
                # its records have no content key: a resume would find nothing finished and pay for all again
                raise RunFolderError(
                    f"{self.folder.dir} is a run folder of batch_runner.py; convert it first with "
                    f"'hermes-batch import {self.folder.dir} --dataset_file {cfg.dataset_file}', then resume."
                )
            if self.folder.has_outputs() and not cfg.resume:
                if not cfg.overwrite:
                    raise RunFolderError(
                        f"{self.folder.dir} already holds the outputs of a run; pass --resume to continue it "
                        "or --overwrite to start afresh."
                    )
                # the run's own files only: the folder may hold the user's notes or the dataset itself
                doomed = cleanup.output_files(self.folder, self._writer_files())
                if any(os.path.samefile(cfg.dataset_file, path) for path in doomed if path.exists()):
                    raise RunFolderError(
                        f"The dataset {cfg.dataset_file} is an output of the run in {self.folder.dir}, which "
                        "--overwrite would delete; copy it out of the run folder first."
                    )
                cleanup.remove_outputs(self.folder, self._writer_files())
            cleanup.remove_leftovers(self.folder)
        except BaseException:
            self.close()
            raise

    def _writer_files(self) -> list:
        return [name for w in self.writers if isinstance(name := getattr(w, "filename", None), str)]

    def close(self) -> None:
        """Release the run folder (idempotent); ``execute`` does it when it ends."""
        if self.lock is not None:
            self.lock.release()

    # --- the run -----------------------------------------------------------------------------

    async def execute(self) -> RunResult:
        try:
            return await self._execute()
        finally:
            self.close()

    async def _execute(self) -> RunResult:
        cfg, plan = self.config, self.plan
        pool = self._thread_pools()
        fresh = not self.folder.has_outputs()
        endpoint_numbers.reset_warning()  # one warning per run for numbers no call can have
        self.index = record_index.RecordIndex(self.folder)
        self.sampling = resume_scan.sampling(cfg)
        self.later_samples: dict[int, tuple] = {}  # --stop_on_success: prompt_index -> its samples still to run
        self.resume_plan = resume_scan.nothing_finished(cfg, self.validated.keys)
        if cfg.resume:
            try:
                # off the event loop, like the merge: reading a big run folder must not make Ctrl-C wait
                self.resume_plan = await run_off_loop(
                    resume_scan.read_run_folder, self.folder, cfg, plan, self.validated.keys, self.checkpoints,
                    self.index)
            except (asyncio.CancelledError, Stopped):
                return RunResult(EXIT_INTERRUPTED, None, "Interrupted before any prompt ran.")
        self.checkpoints.previously_finished = self.resume_plan.finished
        to_run = resume_scan.prompts_to_run(self.resume_plan, cfg, plan)
        if to_run:
            try:  # before any prompt is leased, and before the preflight: a full disk costs nothing to fix
                durable.check_free_space(self.folder, self._space_needed(to_run))
            except RunFolderWriteError as exc:
                return RunResult(exc.exit_code, None, str(exc))
        self.context = RunContext(cfg.run_name, self.folder.dir, plan.seed, cfg.verbose, cfg.log_prefix_chars,
                                  pool)
        processor = build_processor(plan, self.context, self.registry, self.runtimes)
        self.client = processor.client
        self.budget = budget.Budget.of_run(cfg, self.folder, self.index)
        stopped = await self._start(processor, to_run)
        if stopped is None:
            stopped = self._open_folder(processor)
        if stopped is not None:
            await self._shut_down(processor)
            if isinstance(stopped, RunFolderWriteError) and fresh:
                cleanup.remove_outputs(self.folder, kept=False)
            if isinstance(stopped, asyncio.CancelledError):
                return RunResult(EXIT_INTERRUPTED, None, "Interrupted before any prompt ran.")
            return RunResult(stopped.exit_code, None, str(stopped))
        interrupted, fatal = await self._run_prompts(processor, to_run)
        if fatal is not None and fresh and not self.counts:
            # Nothing was achieved: leave nothing of this run behind, so the corrected command runs as typed.
            # Only the files it wrote: the folder may hold the user's own (the lock removes the folder if
            # this run created it).
            cleanup.remove_outputs(self.folder, self._writer_files(), kept=False)
            return RunResult(fatal.exit_code, None, str(fatal))
        return await self._result(interrupted, fatal, to_run)

    def _thread_pools(self) -> concurrent.futures.ThreadPoolExecutor:
        # Sandboxes and tools get a pool of their own: a tool stuck for ever (a FIFO) may take all of it, but
        # not the threads the SDKs need (DNS lookups, the openai SDK's platform probe: the default executor)
        # nor those that write the run folder (offloop.io_executor).  Threads start only when needed.
        asyncio.get_running_loop().set_default_executor(
            concurrent.futures.ThreadPoolExecutor(self.concurrency + 4, thread_name_prefix="hermes-batch")
        )
        return concurrent.futures.ThreadPoolExecutor(self.concurrency + 4, thread_name_prefix="hermes-batch-tools")

    async def _start(self, processor, to_run: int) -> Optional[BaseException]:
        """Check the engine, start the executor's workers and pay the preflight; what stopped it, else None.

        Before the run folder is touched and any sandbox started: a dead engine or a refused key costs
        nothing to fix.  The engine goes first, since the preflight costs a model request.  The executor
        starts its workers meanwhile.
        """
        starting = asyncio.ensure_future(self.executor.start(processor) if to_run else asyncio.sleep(0))
        try:
            await processor.backend.check()
            if starting.done():
                starting.result()  # a cluster that cannot be reached says so before the preflight is paid for
            if to_run and self.config.preflight and not self.budget.reached():
                await processor.client.preflight()
            if to_run and isinstance(processor.client, BatchingClient):
                await processor.client.check_batch_api()  # an endpoint without one says so before any prompt
            await starting
        except (HermesBatchError, asyncio.CancelledError) as exc:
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return exc
        return None

    def _open_folder(self, processor) -> Optional[RunFolderWriteError]:
        """Write run.json, the row keys and the first checkpoint, open the call journal; a failed write, else None."""
        cfg, plan = self.config, self.plan
        try:
            self.folder.create()
            backend = processor.backend
            write_run_json(self.folder, plan, describe_plugins(self.pm), self.redactor, self.settings_history,
                           {"name": backend.name, "isolation": backend.isolation, **backend.isolation_details})
            rowkeys.save(self.folder, self.validated, cfg.max_rows)
            self.validated.keys.digests = self.validated.keys.indexes = None  # matched: 16 bytes a row less
            self.journals.open(self.folder, self.checkpoints.session_number, processor, cfg.response_cache,
                               self.resume_plan.left)
            self.budget.journal = self.journals.calls
            notices.skipped_lines(plan.dataset, self.folder, cfg.dataset_file, cfg.max_rows)
            # on record from the start, so a session killed before its first batch completes still counts
            self._save_checkpoint(interrupted=False)
        except RunFolderWriteError as exc:
            return exc
        return None

    async def _run_prompts(self, processor, to_run: int) -> tuple[bool, Optional[HermesBatchError]]:
        """Lease every prompt left to the executor and record the outcomes; (interrupted, fatal error)."""
        cfg, plan = self.config, self.plan
        # uninstalled toolsets first (one warning naming the plugins), then installed but unconfigured ones
        warning = distributions.unavailable_warning(plan.distribution, self.registry.names("toolsets"))
        if warning:
            log.warning("%s", warning)
        for name, reason in plan.unconfigured.items():
            log.warning("Toolset %s is left out of sampling: %s", name, reason)
        self.progress = Progress(total=to_run, enabled=cfg.progress)
        self.progress.watch(processor.client.limiter.summary)
        if isinstance(processor.client, BatchingClient):
            self.progress.watch(processor.client.batcher.summary)
        self.recorder = Recorder(
            self.folder, self.index, self.checkpoints, self.filters, self.redactor, self.progress, self.pm.hook,
            self.context, self.plugin_failures, on_batch_complete=lambda: self._save_checkpoint(interrupted=False),
            on_write_failed=self.journals.write_failed,
        )
        self.pm.hook.run_started(run=self.context)
        interrupted, fatal = False, None
        try:
            await processor.start()
            self.progress.start()
            rows = rowkeys.rows_left(cfg.dataset_file, cfg.max_rows, self.resume_plan.left)
            self.jobs = PromptJobs(self._jobs(rows))
            on_outcome = self._record
            if self.sampling and cfg.stop_on_success:
                on_outcome = self._record_and_sample_on(processor)
            await self.executor.run(self.jobs, processor, on_outcome, self.concurrency)
            self.journals.all_recorded = self.jobs.exhausted and not self.jobs.halted
        except asyncio.CancelledError:
            interrupted = True
        except HermesBatchError as exc:
            fatal = exc
        finally:
            self.progress.stop()
            await self._shut_down(processor)
        return interrupted, fatal

    async def _shut_down(self, processor) -> None:
        """The one way a session ends, whatever ended it: the executor's workers, then the toolsets' runtimes,
        sandboxes still opening, the backend and the client, then the records being written and the files."""
        await quietly(self.executor.shutdown())
        await processor.aclose()
        if self.recorder is not None:
            await self.recorder.close()
        self.journals.close()

    async def _record(self, job: PromptJob, outcome) -> None:
        await self.recorder.record(job, outcome)
        self.journals.recorded(job)  # its answers are in its record now

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
            notices.mostly_discarded(statistics, [f.name for f in self.filters], self.folder.dir)
        if fatal is not None:
            return RunResult(fatal.exit_code, statistics, str(fatal))
        if interrupted:
            return RunResult(EXIT_INTERRUPTED, statistics, "Interrupted; finished prompts are saved, run again with --resume to continue.")
        status = EXIT_FAILED_PROMPTS if self.counts["failed"] else EXIT_OK
        if self.jobs.halted:
            return RunResult(status, statistics, self.budget.message(to_run, self.counts))
        self.budget.warn_if_unreported(self.client.limiter)
        return RunResult(status, statistics)

    @property
    def counts(self) -> collections.Counter:
        """Prompts of this session that ended, by kind (kept, discarded, failed)."""
        return self.recorder.counts if self.recorder is not None else collections.Counter()

    def _space_needed(self, to_run: int) -> int:
        """Bytes the records of the prompts that run at once take: as big as this run's records so far."""
        written = sum(path.stat().st_size for _num, path in self.folder.iter_batch_files())
        if self.folder.discarded.exists():
            written += self.folder.discarded.stat().st_size
        finished = self.resume_plan.finished
        per_record = written // finished if finished and written else durable.RECORD_BYTES
        return min(self.concurrency, to_run) * per_record

    def _jobs(self, rows):
        size = self.config.batch_size
        available = frozenset(self.plan.toolsets)
        for row in rows:
            if self.jobs.halted:
                break
            if self.journals.stopped:
                break  # a write failed: the run stops, and no prompt is leased that it could not save
            if self.budget.halt_if_reached(self.jobs):
                break
            batch = row.prompt_index // size
            if not self.sampling:
                rng = distributions.rng_for(self.plan.seed, row.content_key)
                toolsets = distributions.sample_toolsets(self.plan.distribution, available, rng)
                self.recorder.tracker.dispatched(batch)
                self.progress.dispatched()
                yield self.journals.with_replay(PromptJob(row, batch, toolsets))
                continue
            left = self.resume_plan.of(row.prompt_index, self.config.samples_per_prompt, self.config.max_samples)
            if self.config.stop_on_success and len(left) > 1:
                # one after another: the next sample of the row starts only when this one did not pass
                self.later_samples[row.prompt_index] = left[1:]
                left = left[:1]
            for i, sample in enumerate(left):
                if i and self.budget.halt_if_reached(self.jobs):
                    break
                self.recorder.tracker.dispatched(batch)
                self.progress.dispatched()
                yield self._sample_job(row, batch, sample, available)
        self.jobs.exhausted = True
        self.recorder.tracker.end_of_jobs()

    def _sample_job(self, row, batch: int, sample: int, available: frozenset) -> PromptJob:
        """The job of a row's sample: a toolset sample of its own, drawn from the sample's key."""
        job = PromptJob(row, batch, (), sample)
        rng = distributions.rng_for(self.plan.seed, job.content_key)
        return self.journals.with_replay(
            attrs.evolve(job, toolsets=distributions.sample_toolsets(self.plan.distribution, available, rng)))

    def _record_and_sample_on(self, processor):
        """The executor's ``on_outcome`` under --stop_on_success: record a sample, then run the row's next one
        in the same worker unless this one passed (or the budget is spent).

        The next sample is counted as dispatched before this one is recorded, so its batch is not complete
        in between; a sample is recorded before the next starts, so a killed run pays for none of them twice.
        """
        available = frozenset(self.plan.toolsets)

        async def on_outcome(job: PromptJob, outcome) -> None:
            left = self.later_samples.get(job.row.prompt_index, ())
            passed = getattr(getattr(outcome, "metadata", None), "passed", False)
            go_on = bool(left) and not passed and not self.jobs.halted
            if go_on and self.budget.halt_if_reached(self.jobs):
                go_on = False
            if not go_on:
                self.later_samples.pop(job.row.prompt_index, None)
            else:
                self.recorder.tracker.hold(job.batch_num)
            await self._record(job, outcome)
            if not go_on:
                return
            self.later_samples[job.row.prompt_index] = left[1:]
            self.progress.dispatched()
            following = self._sample_job(job.row, job.batch_num, left[0], available)
            await on_outcome(following, await processor.process(following))

        return on_outcome

    # --- bookkeeping -------------------------------------------------------------------------

    def _save_checkpoint(self, interrupted: bool) -> Checkpoint:
        return self.checkpoints.save(self.counts, self._session(interrupted))

    def _session(self, interrupted: bool) -> SessionInfo:
        limiter = self.client.limiter
        return SessionInfo(
            started_at=self.checkpoints.started_at,
            duration_s=round(time.monotonic() - self.checkpoints.started, 3),
            prompts_run=sum(self.counts.values()),
            invalid_skipped=self.plan.dataset.invalid,
            seed=self.plan.seed,
            interrupted=interrupted,
            rate_limited_calls=limiter.rate_limited,
            concurrency_start=limiter.start_limit,
            concurrency_min=limiter.min_limit,
            concurrency_final=limiter.limit,
            cost=None if limiter.cost is None else round(limiter.cost, 6),
            budget_reached=self.jobs.halted,
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
            merge_run(self.folder, self.writers, batches=batches, who=lambda name: self.plugin_failures.who("writers", name))
        except OSError as exc:  # a writer plugin's own write
            raise durable.write_error(self.folder.dir, exc) from exc
        stats = build_statistics(
            self.folder,
            totals=(aggregate, finish_times),
            journal=self.index.journal_totals(),
            filters_run=tuple(f.name for f in self.filters),
            sessions=checkpoint.sessions,
            invalid_skipped_total=self.plan.dataset.invalid,
            run=RunInfo(
                model=self.config.model, distribution=self.config.distribution, batch_size=self.config.batch_size,
                total_prompts=self.plan.dataset.valid, total_lines=self.plan.dataset.total,
                models=tuple(run_settings.distinct(self.settings_history, "model")),
                distributions=tuple(run_settings.distinct(self.settings_history, "distribution")),
            ),
        )
        if isinstance(self.client, BatchingClient):
            stats["batch_api"] = self.client.statistics()  # this session's batches
        offloop.check_stop()
        stats = self.redactor.data(stats)
        atomic_write_text(self.folder.statistics, finite_dumps(stats, indent=2) + "\n")
        return stats


def render(statistics: dict, console) -> None:
    render_statistics(statistics, console)
