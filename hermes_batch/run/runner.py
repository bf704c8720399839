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

from ..folder import record_index, reindex, rowkeys, runfolder
from . import cleanup, distributions, limits, notices, run_settings, selection
from ..formats import endpoint_numbers
from ..offline import refilter, seed_import
from .checkpoint import BatchTracker, Checkpoints, load_checkpoint, repair_torn_tails, write_run_json
from .config import RunConfig
from ..errors import (
    EXIT_FAILED_PROMPTS,
    EXIT_INTERRUPTED,
    EXIT_OK,
    HermesBatchError,
    RunFolderError,
    RunFolderWriteError,
)
from ..contract.interfaces import PromptJob, PromptJobs
from ..folder.journal import CallJournal, journal_path
from ..formats.jsonguard import finite_dumps
from ..folder.lock import RunFolderLock
from ..folder.merge import merge_run
from ..contract.plugins import collect, describe_plugins, get_plugin_manager
from .plan import RunPlan, build_processor, make_plan
from ..session.processor import quietly
from .progress import Progress
from ..formats.redaction import Redactor
from ..formats.records import Checkpoint, Discarded, Failure, SessionInfo
from ..contract.run_context import RunContext
from ..folder.runfolder import AppendLog, RunFolder, Stopped, atomic_write_text, run_off_loop, validate_run_name
from ..formats.serialization import to_json_line
from ..folder.statistics import RunInfo, build_statistics, render_statistics, reported_cost

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
        self.counts = collections.Counter()
        self.batch_logs: dict[int, AppendLog] = {}
        self.jobs = PromptJobs(())  # the session's, once it runs; halted when --max_cost stopped it
        self.journal: Optional[CallJournal] = None  # calls.jsonl, opened with the run folder
        self.client = None
        self.previous_cost = 0.0
        self._recording: set = set()  # outcomes being written
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
            if cfg.resume and seed_import.is_seed_folder(self.folder):
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
        loop = asyncio.get_running_loop()
        # Sandboxes and tools get a pool of their own: a tool stuck for ever (a FIFO) may take all of it, but
        # not the threads the SDKs need (DNS lookups, the openai SDK's platform probe: the default executor)
        # nor those that write the run folder (runfolder.io_executor).  Threads start only when needed.
        pool = concurrent.futures.ThreadPoolExecutor(self.concurrency + 4, thread_name_prefix="hermes-batch-tools")
        loop.set_default_executor(
            concurrent.futures.ThreadPoolExecutor(self.concurrency + 4, thread_name_prefix="hermes-batch")
        )
        fresh = not self.folder.has_outputs()
        endpoint_numbers.reset_warning()  # one warning per run for numbers no call can have
        self.index = record_index.RunIndex(self.folder)
        self.resume_plan = rowkeys.match_finished(self.validated.keys, None)
        if cfg.resume:
            try:
                # off the event loop, like the merge: reading a big run folder must not make Ctrl-C wait
                self.resume_plan = await run_off_loop(self._read_run_folder)
            except (asyncio.CancelledError, Stopped):
                return RunResult(EXIT_INTERRUPTED, None, "Interrupted before any prompt ran.")
        self.checkpoints.previously_finished = self.resume_plan.finished
        to_run = plan.dataset.valid - self.resume_plan.skipped
        if to_run:
            try:  # before any prompt is leased, and before the preflight: a full disk costs nothing to fix
                runfolder.check_free_space(self.folder, self._space_needed(to_run))
            except RunFolderWriteError as exc:
                return RunResult(exc.exit_code, None, str(exc))
        self.context = RunContext(cfg.run_name, self.folder.dir, plan.seed, cfg.verbose, cfg.log_prefix_chars, pool)
        processor = build_processor(plan, self.context, self.registry, self.runtimes)
        client = self.client = processor.client
        backend = processor.backend
        if cfg.resume and cfg.max_cost is not None:
            self.previous_cost = reported_cost(self.folder, self.index.journal_totals())
        # Before the run folder is touched and any sandbox started: a dead engine or a refused key
        # costs nothing to fix.  The engine goes first, since the preflight costs a model request.  The
        # executor starts its workers meanwhile.
        starting = asyncio.ensure_future(self.executor.start(processor) if to_run else asyncio.sleep(0))
        try:
            await backend.check()
            if starting.done():
                starting.result()  # a cluster that cannot be reached says so before the preflight is paid for
            if to_run and cfg.preflight and not self._over_budget():
                await client.preflight()
            await starting
        except (HermesBatchError, asyncio.CancelledError) as exc:
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await quietly(self.executor.shutdown())
            await quietly(backend.shutdown())
            await quietly(client.aclose())
            if isinstance(exc, asyncio.CancelledError):
                return RunResult(EXIT_INTERRUPTED, None, "Interrupted before any prompt ran.")
            return RunResult(exc.exit_code, None, str(exc))
        try:
            self.folder.create()
            write_run_json(self.folder, plan, describe_plugins(self.pm), self.redactor, self.settings_history)
            rowkeys.save(self.folder, self.validated, cfg.max_samples)
            self.validated.keys.digests = self.validated.keys.indexes = None  # matched: 16 bytes a row less
            client.journal = self.journal = CallJournal(journal_path(self.folder.dir), self.checkpoints.session_number)
            notices.skipped_lines(plan.dataset, self.folder, cfg.dataset_file, cfg.max_samples)
            # on record from the start, so a session killed before its first batch completes still counts
            self._save_checkpoint(interrupted=False)
        except RunFolderWriteError as exc:
            await quietly(self.executor.shutdown())
            await quietly(backend.shutdown())
            await quietly(client.aclose())
            if self.journal is not None:
                self.journal.close()
            if fresh:
                cleanup.remove_outputs(self.folder, kept=False)
            return RunResult(exc.exit_code, None, str(exc))
        # uninstalled toolsets first (one warning naming the plugins), then installed but unconfigured ones
        warning = distributions.unavailable_warning(plan.distribution, self.registry.names("toolsets"))
        if warning:
            log.warning("%s", warning)
        for name, reason in plan.unconfigured.items():
            log.warning("Toolset %s is left out of sampling: %s", name, reason)
        self.progress = Progress(total=to_run, enabled=cfg.progress)
        self.progress.watch(client.limiter.summary)
        self.failed_logs = {
            "discarded": AppendLog(self.folder.discarded, on_error=self._write_failed),
            "failed": AppendLog(self.folder.failed, on_error=self._write_failed),
        }
        self.tracker = BatchTracker(self._batch_complete)
        self.pm.hook.run_started(run=self.context)
        interrupted = False
        fatal: Optional[HermesBatchError] = None
        try:
            await processor.start()
            self.progress.start()
            rows = rowkeys.rows_left(cfg.dataset_file, cfg.max_samples, self.resume_plan.left)
            self.jobs = PromptJobs(self._jobs(rows))
            await self.executor.run(self.jobs, processor, self._on_outcome, self.concurrency)
        except asyncio.CancelledError:
            interrupted = True
        except HermesBatchError as exc:
            fatal = exc
        finally:
            self.progress.stop()
            await quietly(self.executor.shutdown())
            await processor.aclose()  # the runtimes, sandboxes of ended prompts still opening, backend, client
            if self._recording:  # outcomes being written when Ctrl-C came: they are saved, so they count
                await asyncio.gather(*self._recording, return_exceptions=True)
            for log_ in (*self.batch_logs.values(), *self.failed_logs.values()):
                log_.close()
            self.journal.close()
        if fatal is not None and fresh and not self.counts:
            # Nothing was achieved: leave nothing of this run behind, so the corrected command runs as typed.
            # Only the files it wrote: the folder may hold the user's own (the lock removes the folder if
            # this run created it).
            cleanup.remove_outputs(self.folder, self._writer_files(), kept=False)
            return RunResult(fatal.exit_code, None, str(fatal))
        try:
            statistics = await self._finish(interrupted)
        except RunFolderWriteError as exc:
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
            return RunResult(status, statistics, self._budget_message(to_run))
        if cfg.max_cost is not None and client.limiter.cost is None and client.limiter.requests:
            log.warning("The endpoint reported no cost, so --max_cost had no effect.")
        return RunResult(status, statistics)

    def _cost_so_far(self) -> float:
        # the journal counts every request of this session and the model calls tools made on other endpoints
        journaled = self.journal.cost if self.journal is not None else None
        return self.previous_cost + (journaled or 0.0)

    def _space_needed(self, to_run: int) -> int:
        """Bytes the records of the prompts that run at once take: as big as this run's records so far."""
        written = sum(path.stat().st_size for _num, path in self.folder.iter_batch_files())
        if self.folder.discarded.exists():
            written += self.folder.discarded.stat().st_size
        finished = self.resume_plan.finished
        per_record = written // finished if finished and written else runfolder.RECORD_BYTES
        return min(self.concurrency, to_run) * per_record

    def _write_failed(self, error: RunFolderWriteError) -> None:
        # in the writing thread, at once: no model request goes out after a write of the run folder failed
        if self.journal is not None:
            self.journal.stop(error)

    def _over_budget(self) -> bool:
        return self.config.max_cost is not None and self._cost_so_far() >= self.config.max_cost

    def _budget_message(self, to_run: int) -> str:
        cfg = self.config
        not_started = to_run - sum(self.counts.values())
        failed = f" and {self.counts['failed']} prompt(s) failed (see failed.jsonl)" if self.counts["failed"] else ""
        return (
            f"The cost budget --max_cost {cfg.max_cost:g} was reached (${self._cost_so_far():.4f} reported), so "
            f"{not_started} prompt(s) were not started{failed}; run the same command with --resume and a higher "
            "--max_cost to continue."
        )

    def _read_run_folder(self) -> rowkeys.ResumeMatch:
        """What a resume starts from, the folder repaired: the rows left, from the indexes and the row keys."""
        refilter.recover_files(self.folder)  # an interrupted refilter's files, before anything reads them
        if reindex.recover(self.folder):  # it drops the indexes of the files it rewrote
            self.checkpoints.renumbered()
        repair_torn_tails(self.folder)
        self._reindex()
        keys = self.validated.keys
        plan = rowkeys.match_finished(keys, self.index.finished_digests())
        size = self.config.batch_size
        self.checkpoints.completed_batches |= rowkeys.batches_finished(keys, plan.left, size)
        if plan.left is not None:  # a batch with a prompt to run again (it failed) is not complete
            self.checkpoints.not_complete(index // size for index in runfolder.stoppable(plan.left, 1 << 16))
        return plan

    def _reindex(self) -> None:
        # prompt_index stays "the row of the current file": renumber the records if the file changed
        cfg = self.config
        if not reindex.needs_check(self.folder, self.plan.dataset_fingerprint, cfg.batch_size):
            return
        if reindex.same_dataset(self.folder, self.plan.dataset_fingerprint):
            # only --batch_size changed: the records keep their prompt_index and move to their new batch files
            result = reindex.refile(self.folder, cfg.batch_size)
            log.info("--batch_size %d: %d record(s) moved to the batch files of that size.", cfg.batch_size, result.moved)
        else:
            result = reindex.reindex(self.folder, cfg.dataset_file, cfg.batch_size)
            reindex.warn(result)
        if result.rewritten:  # the records moved (their indexes were dropped with the old files)
            self.checkpoints.renumbered()

    def _jobs(self, rows):
        size = self.config.batch_size
        available = frozenset(self.plan.toolsets)
        for row in rows:
            if self.journal is not None and self.journal.stopped is not None:
                break  # a write failed: the run stops, and no prompt is leased that it could not save
            if self._over_budget():
                self.jobs.halt()
                log.warning("The cost budget --max_cost %g is reached; no new prompt is started.", self.config.max_cost)
                break
            batch = row.prompt_index // size
            rng = distributions.rng_for(self.plan.seed, row.content_key)
            toolsets = distributions.sample_toolsets(self.plan.distribution, available, rng)
            self.tracker.dispatched(batch)
            self.progress.dispatched()
            yield PromptJob(row, batch, toolsets)
        self.tracker.end_of_jobs()

    async def _on_outcome(self, job: PromptJob, outcome) -> None:
        # Shielded: a Ctrl-C that lands while the record is being written must not leave it written
        # but uncounted; the runner waits for these before it saves the session.
        recording = asyncio.ensure_future(self._record_outcome(job, outcome))
        self._recording.add(recording)
        recording.add_done_callback(self._recording.discard)
        await asyncio.shield(recording)

    async def _record_outcome(self, job: PromptJob, outcome) -> None:
        outcome = self.redactor.record(outcome)
        if isinstance(outcome, Failure):
            kind, record, log_ = "failed", outcome, self.failed_logs["failed"]
        else:
            rejected = [(f.name, reason) for f in self.filters if (reason := f.check(outcome)) is not None]
            if rejected:
                record = Discarded(outcome, tuple(n for n, _ in rejected), tuple(r for _, r in rejected))
                kind, log_ = "discarded", self.failed_logs["discarded"]
            else:
                kind, record, log_ = "kept", outcome, self._batch_log(job.batch_num)
        index = self.index.touch(kind, job.batch_num)  # before the append: the index covers what the file held
        try:
            await log_.append(to_json_line(record))
            index.add(record)
            self.counts[kind] += 1
            self.progress.ended(kind)
            self.tracker.finished(job.batch_num, failed=kind == "failed")  # a completed batch saves its index and the checkpoint
        except RunFolderWriteError as exc:
            self._write_failed(exc)
            raise
        self.pm.hook.prompt_finished(run=self.context, outcome=record)

    def _batch_log(self, batch: int) -> AppendLog:
        log_ = self.batch_logs.get(batch)
        if log_ is None:
            log_ = self.batch_logs[batch] = AppendLog(self.folder.batch_path(batch), on_error=self._write_failed)
        return log_

    def _batch_complete(self, batch: int, failed: int) -> None:
        log_ = self.batch_logs.pop(batch, None)
        if log_ is not None:
            log_.close()
        self.index.close_batch(batch)
        if not failed:  # as batch_runner.py: a batch is complete when all its prompts finished, none failed
            self.checkpoints.completed_batches.add(batch)
        self._save_checkpoint(interrupted=False)

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
            merge_run(self.folder, self.writers, batches=batches)
        except OSError as exc:  # a writer plugin's own write
            raise runfolder.write_error(self.folder.dir, exc) from exc
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
        runfolder.check_stop()
        stats = self.redactor.data(stats)
        atomic_write_text(self.folder.statistics, finite_dumps(stats, indent=2) + "\n")
        return stats


def render(statistics: dict, console) -> None:
    render_statistics(statistics, console)
