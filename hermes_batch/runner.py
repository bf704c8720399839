"""One invocation of ``hermes-batch run``: validate, plan, execute, merge, report."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import os
import random
import time
from typing import Optional

import attrs
import pluggy

from . import (
    __version__, bookkeeping, cleanup, dataset, distributions, limits, notices, refilter, reindex, rowkeys, runfolder,
    selection, toolsets,
)
from .agent import AgentSettings
from .config import RunConfig
from .conversation import DEFAULT_SYSTEM_PROMPT
from .errors import DatasetError, HermesBatchError, RunFolderError, RunFolderWriteError, UsageError
from .inputfiles import load_prefill
from .interfaces import ModelSettings, PromptJob
from .journal import CallJournal, journal_path
from .lock import RunFolderLock
from .merge import merge_run
from .plugins import collect, describe_plugins, get_plugin_manager
from .processor import PromptProcessor, now_iso
from .progress import Progress
from .redaction import Redactor
from .records import Checkpoint, Discarded, Failure, SessionInfo
from .run_context import RunContext
from .runfolder import (
    AppendLog,
    RunFolder,
    Stopped,
    atomic_write_text,
    read_records,
    repair_torn_tail,
    run_off_loop,
    validate_run_name,
)
from .serialization import to_json_line
from .statistics import RunInfo, build_statistics, render_statistics, reported_cost

log = logging.getLogger("hermes_batch.run")

EXIT_OK, EXIT_FAILED_PROMPTS, EXIT_USAGE, EXIT_INTERRUPTED = 0, 3, 2, 130


@attrs.frozen
class RunResult:
    exit_code: int
    statistics: Optional[dict] = None
    message: Optional[str] = None


class BatchTracker:
    """Knows when every prompt of a batch dispatched in this session has ended."""

    def __init__(self, on_complete):
        self.pending: collections.Counter = collections.Counter()
        self.current: Optional[int] = None
        self.exhausted = False
        self.on_complete = on_complete

    def dispatched(self, batch: int) -> None:
        if self.current is not None and batch != self.current:
            self._leave(self.current)
        self.current = batch
        self.pending[batch] += 1

    def finished(self, batch: int) -> None:
        self.pending[batch] -= 1
        if self.pending[batch] == 0 and (batch != self.current or self.exhausted):
            self._complete(batch)

    def end_of_jobs(self) -> None:
        self.exhausted = True
        if self.current is not None:
            self._leave(self.current)

    def _leave(self, batch: int) -> None:
        if self.pending[batch] == 0:
            self._complete(batch)

    def _complete(self, batch: int) -> None:
        del self.pending[batch]
        self.on_complete(batch)


class Run:
    """Everything one invocation needs; ``prepare`` raises before anything is sent to a model."""

    def __init__(self, config: RunConfig, pm: Optional[pluggy.PluginManager] = None):
        self.config = config
        self.pm = pm or get_plugin_manager()
        self.started = time.monotonic()
        self.started_at = now_iso()
        self.counts = collections.Counter()
        self.batch_logs: dict[int, AppendLog] = {}
        self.completed_batches: set[int] = set()
        self.budget_reached = False
        self.journal: Optional[CallJournal] = None  # calls.jsonl, opened with the run folder
        self.client = None
        self.previous_cost = 0.0
        self._recording: set = set()  # outcomes being written
        self.lock: Optional[RunFolderLock] = None
        # Whatever a sandbox read (a key included) is redacted before anything is written.
        self.redactor = Redactor.for_run(config)

    # --- before any model call -------------------------------------------------------------

    def prepare(self) -> None:
        cfg = self.config
        validate_run_name(cfg.run_name)
        # files and threads for the concurrency asked, said before any model call rather than as EMFILE after it
        fit = limits.fit_concurrency(cfg.num_workers)
        if fit.reasons:
            log.warning("%s", limits.describe(cfg.num_workers, fit))
        self.concurrency = fit.concurrency
        self.folder = RunFolder(cfg.output_dir, cfg.run_name)
        self.registry = collect(self.pm)
        if cfg.distribution_file is not None:
            for dist in distributions.load_distribution_file(cfg.distribution_file):
                self.registry.add("distributions", dist, f"file {cfg.distribution_file}")
        self.distribution = selection.distribution(self.registry, cfg.distribution)
        available = set(self.registry.names("toolsets"))
        self.available = {name for name, _p in self.distribution.probabilities if name in available}
        if not self.available:
            wanted = [name for name, _p in self.distribution.probabilities]
            raise UsageError(
                f"None of the toolsets of distribution {cfg.distribution!r} is installed ({', '.join(wanted)}): "
                f"{distributions.where_to_get(wanted)}; install it or choose another --distribution."
            )
        self._prepare_toolsets()
        self.toolsets = selection.toolset_tools(self.registry, sorted(self.available))
        self.all_tools = tuple(sorted(t.name for tools in self.toolsets.values() for t in tools))
        self.backend_cls, self.backend_config = selection.sandbox_backend(self.registry, cfg.sandbox, cfg.sandbox_options)
        self.client_cls = selection.model_client_class(self.registry, cfg.model_client, cfg.base_url)
        self.filters = selection.filters(self.registry, cfg.filters)
        self.writers = selection.writers(self.registry, cfg.writers)
        self.executor = selection.executor(self.registry, cfg.executor, cfg.executor_options)
        self.prefill = load_prefill(cfg.prefill_messages_file)
        notices.routing_elsewhere(cfg)

        # on a resume over the same file, the report and row keys of the last session (rowkeys.py)
        self.validated = rowkeys.validate(cfg.dataset_file, cfg.max_samples, self.folder if cfg.resume else None)
        self.report = self.validated.report
        if self.report.invalid and not cfg.skip_invalid:
            raise DatasetError(dataset.format_problems(self.report), self.report.problems)
        if self.report.valid == 0:
            raise DatasetError(f"{cfg.dataset_file} holds no valid prompt; add rows with a non-empty \"prompt\".")
        notices.ignored_images(self.report, self.backend_cls, cfg.dataset_file)
        self.dataset_fingerprint = self.validated.fingerprint

        self._check_folder()
        try:
            self.previous = self._load_checkpoint()
            self.seed = self._choose_seed()
        except BaseException:
            self.close()
            raise

    def _prepare_toolsets(self) -> None:
        """Structure the -T options; leave out the toolsets whose provider is not configured."""
        cfg = self.config
        self.runtimes = toolsets.build_runtimes(self.registry, self.available, cfg.tool_options, self._model_settings())
        self.unconfigured = {
            name: reason for name in sorted(self.available) if (reason := self.runtimes[name].unavailable_reason())
        }
        self.available -= set(self.unconfigured)
        if not self.available:
            reasons = " ".join(f"{name}: {reason}" for name, reason in self.unconfigured.items())
            raise UsageError(f"No toolset of distribution {cfg.distribution!r} can run. {reasons}")
        self._all_runtimes = self.runtimes
        self.runtimes = {name: rt for name, rt in self.runtimes.items() if name in self.available}

    def _check_folder(self) -> None:
        cfg = self.config
        # Held until the run ends: a second run on this folder would write every prompt twice.
        self.lock = RunFolderLock(self.folder.dir)
        self.lock.acquire()
        try:
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

    def _load_checkpoint(self) -> Optional[Checkpoint]:
        if not self.config.resume:
            return None
        for _line, checkpoint in read_records(self.folder.checkpoint, Checkpoint):
            return checkpoint
        return None

    def _choose_seed(self) -> int:
        if self.config.seed is not None:
            return self.config.seed
        if self.config.resume and self.folder.run_json.exists():
            try:
                recorded = json.loads(self.folder.run_json.read_text())["seed"]
                if isinstance(recorded, int):
                    return recorded
            except (OSError, ValueError, KeyError, TypeError):
                pass
        return random.SystemRandom().randrange(2**32)

    # --- the run -----------------------------------------------------------------------------

    async def execute(self) -> RunResult:
        try:
            return await self._execute()
        finally:
            self.close()

    async def _execute(self) -> RunResult:
        cfg = self.config
        loop = asyncio.get_running_loop()
        # Sandboxes and tools get a pool of their own: a tool stuck for ever (a FIFO) may take all of it, but
        # not the threads the SDKs need (DNS lookups, the openai SDK's platform probe: the default executor)
        # nor those that write the run folder (runfolder.io_executor).  Threads start only when needed.
        pool = concurrent.futures.ThreadPoolExecutor(self.concurrency + 4, thread_name_prefix="hermes-batch-tools")
        loop.set_default_executor(
            concurrent.futures.ThreadPoolExecutor(self.concurrency + 4, thread_name_prefix="hermes-batch")
        )
        fresh = not self.folder.has_outputs()
        self.index = bookkeeping.RunIndex(self.folder)
        self.plan = rowkeys.plan(self.validated.keys, None)
        if cfg.resume:
            try:
                # off the event loop, like the merge: reading a big run folder must not make Ctrl-C wait
                self.plan = await run_off_loop(self._read_run_folder)
            except (asyncio.CancelledError, Stopped):
                return RunResult(EXIT_INTERRUPTED, None, "Interrupted before any prompt ran.")
        self.previously_finished = self.plan.finished
        to_run = self.report.valid - self.plan.skipped
        client = self.client = self.client_cls(self._model_settings())
        self.context = RunContext(cfg.run_name, self.folder.dir, self.seed, cfg.verbose, cfg.log_prefix_chars, pool)
        backend = self.backend_cls(self.backend_config, self.context)
        if cfg.resume and cfg.max_cost is not None:
            self.previous_cost = reported_cost(self.folder, self.index.journal_totals())
        # Before the run folder is touched and any sandbox started: a dead engine or a refused key
        # costs nothing to fix.  The engine goes first, since the preflight costs a model request.
        try:
            await backend.check()
            if to_run and cfg.preflight and not self._over_budget():
                await client.preflight()
        except (HermesBatchError, asyncio.CancelledError) as exc:
            await _quietly(backend.shutdown())
            await _quietly(client.aclose())
            if isinstance(exc, asyncio.CancelledError):
                return RunResult(EXIT_INTERRUPTED, None, "Interrupted before any prompt ran.")
            return RunResult(exc.exit_code, None, str(exc))
        try:
            self.folder.create()
            self._write_run_json()
            rowkeys.save(self.folder, self.validated, cfg.max_samples)
            self.validated.keys.digests = self.validated.keys.indexes = None  # matched: 16 bytes a row less
            client.journal = self.journal = CallJournal(journal_path(self.folder.dir), self._session_number())
            notices.skipped_lines(self.report, self.folder, cfg.dataset_file, cfg.max_samples)
            # on record from the start, so a session killed before its first batch completes still counts
            self._save_checkpoint(interrupted=False)
        except RunFolderWriteError as exc:
            await _quietly(backend.shutdown())
            await _quietly(client.aclose())
            if self.journal is not None:
                self.journal.close()
            if fresh:
                cleanup.remove_outputs(self.folder, kept=False)
            return RunResult(exc.exit_code, None, str(exc))
        # uninstalled toolsets first (one warning naming the plugins), then installed but unconfigured ones
        warning = distributions.unavailable_warning(self.distribution, self.registry.names("toolsets"))
        if warning:
            log.warning("%s", warning)
        for name, reason in self.unconfigured.items():
            log.warning("Toolset %s is left out of sampling: %s", name, reason)
        self.progress = Progress(total=to_run, enabled=cfg.progress)
        self.progress.watch(client.limiter.summary)
        self.failed_logs = {
            "discarded": AppendLog(self.folder.discarded),
            "failed": AppendLog(self.folder.failed),
        }
        self.tracker = BatchTracker(self._batch_complete)
        processor = PromptProcessor(
            run_name=cfg.run_name, model=cfg.model, seed=self.seed, client=client, backend=backend,
            toolsets=self.toolsets, all_tools=self.all_tools, agent=self._agent_settings(), verbose=cfg.verbose,
            runtimes=self.runtimes,
        )
        self.pm.hook.hermes_batch_run_start(run=self.context)
        interrupted = False
        fatal: Optional[HermesBatchError] = None
        try:
            await backend.start()
            for runtime in self.runtimes.values():
                await runtime.start(self.context, client)
            self.progress.start()
            jobs = self._jobs(rowkeys.rows_left(cfg.dataset_file, cfg.max_samples, self.plan.left))
            await self.executor.run(jobs, processor, self._on_outcome, self.concurrency)
        except asyncio.CancelledError:
            interrupted = True
        except HermesBatchError as exc:
            fatal = exc
        finally:
            self.progress.stop()
            for runtime in self.runtimes.values():
                await _quietly(runtime.shutdown())
            await _quietly(processor.aclose())  # sandboxes of ended prompts that were still opening
            await _quietly(backend.shutdown())
            await _quietly(client.aclose())
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
        if fatal is not None:
            return RunResult(fatal.exit_code, statistics, str(fatal))
        if interrupted:
            return RunResult(EXIT_INTERRUPTED, statistics, "Interrupted; finished prompts are saved, run again with --resume to continue.")
        status = EXIT_FAILED_PROMPTS if self.counts["failed"] else EXIT_OK
        if self.budget_reached:
            return RunResult(status, statistics, self._budget_message(to_run))
        if cfg.max_cost is not None and client.limiter.cost is None and client.limiter.requests:
            log.warning("The endpoint reported no cost, so --max_cost had no effect.")
        return RunResult(status, statistics)

    def _cost_so_far(self) -> float:
        # the journal counts every request of this session and the model calls tools made on other endpoints
        journaled = self.journal.cost if self.journal is not None else None
        return self.previous_cost + (journaled or 0.0)

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

    def _read_run_folder(self) -> rowkeys.Plan:
        """What a resume starts from, the folder repaired: the rows left, from the indexes and the row keys."""
        refilter.recover_files(self.folder)  # an interrupted refilter's files, before anything reads them
        if (self.folder.dir / reindex.STAGING).is_dir():
            self.index.drop()  # the records may be rewritten under their indexes
        reindex.recover(self.folder)
        self._repair_torn_tails()
        self._reindex()
        return rowkeys.plan(self.validated.keys, self.index.finished_digests())

    def _repair_torn_tails(self) -> None:
        # also in files this session will never append to, so every file parses when the resume ends
        paths = [path for _num, path in self.folder.iter_batch_files()] + [self.folder.discarded, self.folder.failed]
        for path in paths:
            dropped = repair_torn_tail(path)
            if dropped:
                log.warning("%s: dropped %d bytes of a torn last line left by an interrupted write.", path, dropped)

    def _reindex(self) -> None:
        # prompt_index stays "the row of the current file": renumber the records if the file changed
        cfg = self.config
        if not reindex.needs_check(self.folder, self.dataset_fingerprint, cfg.batch_size):
            return
        result = reindex.reindex(self.folder, cfg.dataset_file, cfg.batch_size)
        reindex.warn(result)
        if result.rewritten:
            self.index.drop()  # the records moved: their indexes are built again from them
        if result.rewritten and self.previous is not None:
            # batch numbers changed meaning; the batches of this session will be recorded again
            self.previous = attrs.evolve(self.previous, completed_batches=())

    def _jobs(self, rows):
        size = self.config.batch_size
        for row in rows:
            if self._over_budget():
                self.budget_reached = True
                log.warning("The cost budget --max_cost %g is reached; no new prompt is started.", self.config.max_cost)
                break
            batch = row.prompt_index // size
            rng = distributions.rng_for(self.seed, row.content_key)
            toolsets = distributions.sample_toolsets(self.distribution, self.available, rng)
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
        await log_.append(to_json_line(record))
        index.add(record)
        self.counts[kind] += 1
        self.progress.ended(kind)
        self.tracker.finished(job.batch_num)
        self.pm.hook.hermes_batch_prompt_finished(run=self.context, outcome=record)

    def _batch_log(self, batch: int) -> AppendLog:
        log_ = self.batch_logs.get(batch)
        if log_ is None:
            log_ = self.batch_logs[batch] = AppendLog(self.folder.batch_path(batch))
        return log_

    def _batch_complete(self, batch: int) -> None:
        log_ = self.batch_logs.pop(batch, None)
        if log_ is not None:
            log_.close()
        self.index.close_batch(batch)
        self.completed_batches.add(batch)
        self._save_checkpoint(interrupted=False)

    # --- bookkeeping -------------------------------------------------------------------------

    def _session_number(self) -> int:
        """0 for the first session of the run, then 1, 2, ... for each resume."""
        return len(self.previous.sessions) if self.previous else 0

    def _session(self, interrupted: bool) -> SessionInfo:
        limiter = self.client.limiter
        return SessionInfo(
            started_at=self.started_at,
            duration_s=round(time.monotonic() - self.started, 3),
            prompts_run=sum(self.counts.values()),
            invalid_skipped=self.report.invalid,
            seed=self.seed,
            interrupted=interrupted,
            rate_limited_calls=limiter.rate_limited,
            concurrency_start=limiter.start_limit,
            concurrency_min=limiter.min_limit,
            concurrency_final=limiter.limit,
            cost=None if limiter.cost is None else round(limiter.cost, 6),
            budget_reached=self.budget_reached,
        )

    def _save_checkpoint(self, interrupted: bool) -> Checkpoint:
        prev = self.previous
        finished = self.previously_finished + self.counts["kept"] + self.counts["discarded"]
        updated = now_iso()
        checkpoint = Checkpoint(
            run_name=self.config.run_name,
            batch_size=self.config.batch_size,
            completed_batches=tuple(sorted(self.completed_batches | set(prev.completed_batches if prev else ()))),
            prompts_finished=finished,
            prompts_failed=self.counts["failed"],
            sessions=(prev.sessions if prev else ()) + (self._session(interrupted),),
            updated_at=updated,
            completed_prompts=finished,
            last_updated=updated,
        )
        atomic_write_text(self.folder.checkpoint, to_json_line(checkpoint))
        return checkpoint

    def _write_run_json(self) -> None:
        data = {
            "schema_version": 1,
            "hermes_batch_version": __version__,
            "seed": self.seed,
            "config": self.config.public() | {"seed": self.seed},
            "model_client": self.client_cls.name,
            "distribution": {"name": self.distribution.name, "probabilities": dict(self.distribution.probabilities)},
            # a resume over a file whose fingerprint differs renumbers the records (reindex.py)
            "dataset": {"path": str(self.config.dataset_file), "fingerprint": self.dataset_fingerprint,
                        "lines": self.report.total, "valid": self.report.valid},
            "tools": list(self.all_tools),
            "toolsets": {
                name: {"options": toolsets.describe_config(rt.config), "left_out": self.unconfigured.get(name)}
                for name, rt in self._all_runtimes.items()
            },
            "plugins": [{k: p[k] for k in ("name", "distribution", "version")} for p in describe_plugins(self.pm)],
        }
        atomic_write_text(self.folder.run_json, json.dumps(self.redactor.data(data), indent=2, default=str) + "\n")

    async def _finish(self, interrupted: bool) -> dict:
        checkpoint = self._save_checkpoint(interrupted)
        # off the event loop, so Ctrl-C is heard at once: it stops the merge, which removes its temporary files
        stats = await run_off_loop(self._merge_and_count, checkpoint)
        self.pm.hook.hermes_batch_run_end(run=self.context, statistics=stats)
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
            invalid_skipped_total=self.report.invalid,
            run=RunInfo(
                model=self.config.model, distribution=self.config.distribution, batch_size=self.config.batch_size,
                total_prompts=self.report.valid, total_lines=self.report.total,
            ),
        )
        runfolder.check_stop()
        stats = self.redactor.data(stats)
        atomic_write_text(self.folder.statistics, json.dumps(stats, indent=2) + "\n")
        return stats

    def _model_settings(self) -> ModelSettings:
        cfg = self.config
        return ModelSettings(
            model=cfg.model, base_url=cfg.base_url, api_key=cfg.api_key, max_tokens=cfg.max_tokens,
            reasoning_effort=cfg.reasoning_effort, reasoning_disabled=cfg.reasoning_disabled,
            providers_allowed=cfg.providers_allowed, providers_ignored=cfg.providers_ignored,
            providers_order=cfg.providers_order, provider_sort=cfg.provider_sort, max_retries=cfg.max_retries,
            request_timeout=cfg.request_timeout,
            max_concurrent_requests=cfg.max_concurrent_requests or self.concurrency,
            max_requests_per_minute=cfg.max_requests_per_minute, max_tokens_per_minute=cfg.max_tokens_per_minute,
            http_backend=cfg.http_backend,
        )

    def _agent_settings(self) -> AgentSettings:
        cfg = self.config
        return AgentSettings(
            max_turns=cfg.max_turns, system_prompt=DEFAULT_SYSTEM_PROMPT,
            ephemeral_system_prompt=cfg.ephemeral_system_prompt, prefill=self.prefill,
            command_timeout=cfg.command_timeout, log_prefix_chars=cfg.log_prefix_chars,
            prompt_timeout=cfg.prompt_timeout, max_tool_calls_per_turn=cfg.max_tool_calls_per_turn,
        )


async def _quietly(awaitable) -> None:
    try:
        await awaitable
    except Exception:  # cleanup must not hide the run's own outcome
        log.debug("cleanup step failed", exc_info=True)


def render(statistics: dict, console) -> None:
    render_statistics(statistics, console)
