"""The session's prompts handed to the executor, as many at once as it runs, and each outcome recorded.

The jobs are made lazily, one per row left (or per sample left, with --samples_per_prompt), each with
its toolsets drawn from its content key and, on a resume, the answers its cut-off session got.  The
jobs stop before the dataset's end when the budget is reached or a write of the run folder failed.
With --stop_on_success a row's samples run one after another in the same worker, until one passes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional

import attrs

from ..contract.image_demand import ImageDemand
from ..contract.interfaces import PromptJob, PromptJobs
from ..errors import HermesBatchError
from ..folder import rowkeys
from ..formats.records import Failure, SandboxSpec
from . import distributions, image_order, resume_scan
from .adaptive import Allocation, Rule
from .budget import Budget
from .control import GatedProcessor
from .config import RunConfig
from .plan import RunPlan
from .progress import Progress
from .recorder import Recorder
from .session_journals import SessionJournals

log = logging.getLogger("hermes_batch.run")

PREPARE_AHEAD = 2  # images prepared ahead besides the one being handed out
PREPARED_KEPT = 64  # images remembered as prepared (one coming back later is asked again: backends cache)


class Scheduler:
    """Leases the prompts left to the executor and records their outcomes; ``jobs`` is halted by the budget."""

    def __init__(self, config: RunConfig, plan: RunPlan, executor, concurrency: int, match: resume_scan.Match,
                 budget: Budget, journals: SessionJournals):
        self.config, self.plan, self.executor, self.concurrency = config, plan, executor, concurrency
        self.match, self.budget, self.journals = match, budget, journals
        self.sampling = resume_scan.sampling(config)
        self.available = frozenset(plan.toolsets)
        self.jobs = PromptJobs(())  # the session's, once it runs; halted when --max_cost stopped it
        self.later_samples: dict[int, tuple] = {}  # --stop_on_success: prompt_index -> its samples still to run
        self.recorder: Optional[Recorder] = None
        self.progress: Optional[Progress] = None
        self.on_session_end: Optional[Callable[[], None]] = None  # after each outcome recorded, and the last job
        self.guard = None  # the run's ProviderGuard: each sample's verdict counts for the providers that served it
        self.control = None  # hermes-batch ctl's RunControl: with the local executor, each prompt passes its gate
        self.pilot_rows: Optional[set] = None  # --pilot: the prompt indexes of the rows it runs
        self.allocation: Optional[Allocation] = None  # --allocation adaptive
        self.window = 1  # rows read ahead to order them by image (follow_images)
        self.order: Optional[image_order.ImageOrder] = None
        self.backend = None  # the sandbox backend told of each image's demand (follow_images), or None
        self.demand: Optional[ImageDemand] = None
        self._prepared: dict[str, None] = {}  # the images whose preparation ahead was started last
        self._preparing: set[asyncio.Task] = set()
        self._builds: dict[str, Any] = {}  # image -> the TaskOptions of a task row read ahead that builds it

    def sessions_that_may_send(self) -> Optional[int]:
        """How many sessions can still send a model request: those running, once no other can start (the jobs are
        all leased, or every slot of the executor is taken); None while more may start."""
        running = self.progress.in_flight if self.progress is not None else 0
        if self.jobs.exhausted or self.jobs.halted or running >= self.concurrency:
            return running
        return None

    async def run(self, processor, recorder: Recorder, progress: Progress) -> tuple[bool, Optional[HermesBatchError]]:
        """Lease every prompt left and record the outcomes; (interrupted, fatal error).  The engine shuts down."""
        cfg = self.config
        self.recorder, self.progress = recorder, progress
        interrupted, fatal = False, None
        try:
            await processor.start()
            self.follow_images(processor.backend)
            if self.control is not None and self.control.gates_prompts:
                processor = GatedProcessor(processor, self.control)
            progress.start()
            rows = rowkeys.rows_left(cfg.dataset_file, cfg.max_rows, self.match.left)
            if self.pilot_rows is not None:
                rows = (row for row in rows if row.prompt_index in self.pilot_rows)
            self.jobs = PromptJobs(self._jobs(rows))
            on_outcome = self._record
            if self.sampling and cfg.stop_on_success:
                on_outcome = self._record_and_sample_on(processor)
            if self.sampling and cfg.allocation == "adaptive":
                self.allocation = Allocation(Rule(cfg.target_passes, cfg.max_failures), iter(rows),
                                             lambda index: self.match.outcomes.get(index, ()),
                                             lambda index: self.match.of(index, cfg.samples_per_prompt, cfg.max_samples),
                                             window=max(64, 4 * self.concurrency))
                self.jobs = PromptJobs(_AdaptiveJobs(self))
                on_outcome = self._record_adaptive(processor)
            await self.executor.run(self.jobs, processor, on_outcome, self.concurrency)
            self.journals.all_recorded = self.jobs.exhausted and not self.jobs.halted and not self.journals.kept
        except asyncio.CancelledError:
            interrupted = True
        except HermesBatchError as exc:
            fatal = exc
        finally:
            progress.stop()
            for task in list(self._preparing):
                task.cancel()
            if self._preparing:
                await asyncio.gather(*self._preparing, return_exceptions=True)
        return interrupted, fatal

    def _jobs(self, rows):
        size = self.config.batch_size
        order = self.order = image_order.ImageOrder(
            rows, size, self.window, image=self._image_of, on_read=self._expect)
        for row, sealed in order:
            if self.jobs.halted:
                break
            if self.journals.stopped:
                break  # a write failed: the run stops, and no prompt is leased that it could not save
            if self.budget.halt_if_reached(self.jobs):
                break
            self._prepare_ahead(order)
            batch = row.prompt_index // size
            if not self.sampling:
                self.journals.expect_branches(row, 1, self.config.branch_at)
                yield self._dispatched(batch, PromptJob(row, batch, self._toolsets(row.content_key)))
            else:
                for i, sample in enumerate(self._samples_left(row)):
                    if i and self.budget.halt_if_reached(self.jobs):
                        break
                    yield self._dispatched(batch, self._sample_job(row, batch, sample))
            for done in sealed:
                self.recorder.tracker.seal(done)
        if self.demand is not None:
            self.demand.clear()  # halted: what was read ahead will not start; when all ran nothing is left anyway
        self._end_of_jobs()

    def _end_of_jobs(self) -> None:
        self.jobs.exhausted = True
        self.recorder.tracker.end_of_jobs()
        if self.on_session_end is not None:
            self.on_session_end()

    def next_adaptive(self) -> Optional[PromptJob]:
        """The next job of an adaptive session (see adaptive.py); None once none waits, or the session stops."""
        if self.jobs.halted or self.journals.stopped or self.budget.halt_if_reached(self.jobs):
            return None
        taken = self.allocation.take()
        if taken is None:
            return None
        row, sample, opened = taken
        batch = row.prompt_index // self.config.batch_size
        job = self._sample_job(row, batch, sample)
        if opened:
            return self._dispatched(batch, job)
        self.progress.dispatched()  # its batch was held for it when the row's last sample ended
        return self.journals.with_replay(job)

    def _samples_left(self, row) -> tuple:
        """The samples of ``row`` this session hands out now (--stop_on_success: the first; the others wait)."""
        left = self.match.of(row.prompt_index, self.config.per_row, self.config.max_samples)
        self.journals.expect_branches(row, len(left), self.config.branch_at)
        if self.config.stop_on_success and len(left) > 1:
            # one after another: the next sample of the row starts only when this one did not pass
            self.later_samples[row.prompt_index] = left[1:]
            left = left[:1]
        return left

    # --- images: the order of the prompts, each image's demand, the next images prepared -----------------

    def follow_images(self, backend) -> None:
        """Order the prompts by image for ``backend`` and tell it each image's demand (before ``run``)."""
        uses_images = not getattr(backend, "ignores_images", True)
        self.window = image_order.window_size(self.concurrency, uses_images)
        if not uses_images:
            return
        self.backend = backend
        self.demand = ImageDemand(backend.image_for(SandboxSpec(self.config.run_name, 0, "", None, None)))
        backend.follow_demand(self.demand)

    def _image_of(self, row) -> str:
        return self.demand.image(row.image) if self.demand is not None else (row.image or "")

    def _expect(self, row) -> None:
        if self.demand is None:
            return
        count = 1
        if self.sampling:
            count = len(self.match.of(row.prompt_index, self.config.per_row, self.config.max_samples))
            count = min(count, 1) if self.config.stop_on_success else count
        self.demand.expect(row.image, row.prompt_index, count)
        task = row.task_options  # a Harbor task whose image is built from its Dockerfile: built ahead too
        if task is not None and task.context is not None:
            self._builds[self._image_of(row)] = task
            if len(self._builds) > PREPARED_KEPT * 4:  # read ahead at most a window of rows: the oldest are done
                del self._builds[next(iter(self._builds))]

    def _prepare_ahead(self, order) -> None:
        """Have the backend prepare the image being handed out and the next ones (``PREPARE_AHEAD``) in the
        background, while the prompts before them run; a failure is the prompts' to report, when they ask."""
        if self.backend is None:
            return
        for image in order.upcoming(PREPARE_AHEAD):
            if image in self._prepared:
                continue
            self._prepared[image] = None
            if len(self._prepared) > PREPARED_KEPT:  # a dataset of a million images: remember the recent ones
                del self._prepared[next(iter(self._prepared))]
            task = asyncio.get_running_loop().create_task(self._prepare(image))
            self._preparing.add(task)
            task.add_done_callback(self._preparing.discard)

    async def _prepare(self, image: str) -> None:
        try:
            task = self._builds.get(image)
            if task is not None:  # built first: a backend that looked for it before would find it missing
                await self.backend.build_image(task.image, task.context, task.digest, task.build_timeout)
            await self.backend.prepare_ahead(image)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the image's prompts fail with the reason when they prepare it themselves
            log.debug("Preparing the image %s ahead failed: %s", image, exc)

    def _job_ended(self, job: PromptJob) -> None:
        if self.demand is not None:
            self.demand.done(job.row.image, job.row.prompt_index)

    def _dispatched(self, batch: int, job: PromptJob) -> PromptJob:
        """``job``, counted as running (its batch is not complete until it is recorded), with its replay."""
        self.recorder.tracker.dispatched(batch)
        self.progress.dispatched()
        return self.journals.with_replay(job)

    def _toolsets(self, content_key: str) -> tuple:
        rng = distributions.rng_for(self.plan.seed, content_key)
        return distributions.sample_toolsets(self.plan.distribution, self.available, rng)

    @staticmethod
    def toolsets_drawer(plan: RunPlan) -> Callable[[str], tuple]:
        """The toolsets the run draws for a content key (the row's, or a sample's)."""
        available = frozenset(plan.toolsets)

        def draw(content_key: str) -> tuple:
            rng = distributions.rng_for(plan.seed, content_key)
            return distributions.sample_toolsets(plan.distribution, available, rng)

        return draw

    def _sample_job(self, row, batch: int, sample: int) -> PromptJob:
        """The job of a row's sample: the row's toolsets (drawn from the row's key), or with --toolsets_per_sample
        a toolset sample of its own, drawn from the sample's key."""
        job = PromptJob(row, batch, (), sample)
        key = job.content_key if self.config.toolsets_per_sample else row.content_key
        return attrs.evolve(job, toolsets=self._toolsets(key))

    async def _record(self, job: PromptJob, outcome) -> None:
        self._job_ended(job)
        if self.guard is not None:
            self.guard.sample_ended(outcome)
        kind = await self.recorder.record(job, outcome)
        # its answers are in its record now; a failed prompt's stay in responses.jsonl for the --resume that
        # runs it again, which replays what was paid for
        self.journals.recorded(job, failed=kind == "failed")
        if self.on_session_end is not None:
            self.on_session_end()

    def _record_and_sample_on(self, processor):
        """The executor's ``on_outcome`` under --stop_on_success: record a sample, then run the row's next one
        in the same worker unless this one passed (or the budget is spent).

        The next sample is counted as dispatched before this one is recorded, so its batch is not complete
        in between; a sample is recorded before the next starts, so a killed run pays for none of them twice.
        """

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
            following = self.journals.with_replay(self._sample_job(job.row, job.batch_num, left[0]))
            await on_outcome(following, await processor.process(following))

        return on_outcome

    def _record_adaptive(self, processor):
        """The executor's ``on_outcome`` under --allocation adaptive: record a sample; a row that goes on waits
        among the open rows for its turn, or, once the jobs have all been handed out (an executor asks no more),
        runs its next sample at once in this worker.  Its batch is held meanwhile, so it is not complete in between.
        """

        async def on_outcome(job: PromptJob, outcome) -> None:
            while True:
                index = job.row.prompt_index
                passed = None if isinstance(outcome, Failure) else bool(
                    getattr(getattr(outcome, "metadata", None), "passed", False))
                go_on = self.allocation.ended(index, job.sample_index, passed)
                if go_on and (self.jobs.halted or self.budget.halt_if_reached(self.jobs)):
                    self.allocation.drop(index)
                    go_on = False
                if go_on:
                    self.recorder.tracker.hold(job.batch_num)
                await self._record(job, outcome)
                if not go_on:
                    return
                if not self.jobs.exhausted:
                    self.allocation.wait(index)
                    return
                row, sample, _opened = self.allocation.next_of(index)
                self.progress.dispatched()
                job = self.journals.with_replay(self._sample_job(row, job.batch_num, sample))
                outcome = await processor.process(job)

        return on_outcome


class _AdaptiveJobs:
    """The jobs of an adaptive session as an iterator: it may run dry while rows still run, and the last
    StopIteration marks the jobs handed out (the rows still open then go on in their own workers)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def __iter__(self):
        return self

    def __next__(self) -> PromptJob:
        scheduler = self.scheduler
        job = None if scheduler.jobs.exhausted else scheduler.next_adaptive()
        if job is None:
            if not scheduler.jobs.exhausted:
                scheduler._end_of_jobs()
            raise StopIteration
        return job
