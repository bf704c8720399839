"""The driver end of a run split over workers: lease prompts, re-lease a lost worker's, record every outcome once.

The driver (the ``hermes-batch run`` process) keeps the run folder to itself:
the runner reads the dataset, decides what is left, samples toolsets and writes
every record. The Dispatcher only moves jobs and outcomes: each worker holds
what it runs and as many again queued (at least ``PREFETCH``), so the driver's
memory stays flat and a worker whose sessions all end at once has their next
prompts at hand; an outcome frees a place, which the next prompt fills. Once the
dataset is exhausted a worker holds at most its concurrency plus ``PREFETCH``,
and a worker that would idle takes the prompts a busy one has not started (the
busy one hands them back: ``("return",)`` answered by ``("returned", [lease,
...])``), so a slow worker never hoards the last prompts. When the run stops
starting prompts early (``--max_cost`` reached: ``jobs.halted``) every worker
hands back what it has not started, and those prompts do not run; under
``--max_cost`` the queue is ``PREFETCH`` deep throughout, since a worker starts
a queued prompt without asking. A worker that is lost (its process or node died)
takes only its leased prompts with it: they go to the remaining workers before
any new prompt, and an outcome is recorded only for a prompt still leased to the
worker that sends it, so every prompt ends exactly once.

Budgets stay per run: the journal lines of every worker's model calls reach the
run's calls.jsonl through the driver (``CallJournal.relay``), so ``--max_cost``
sees the whole run's cost before each new prompt is leased; the run's call limit
and per-minute budgets are divided among the workers in proportion to their
concurrency (``worker.worker_plan``).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import itertools
import logging
import time
from typing import Awaitable, Callable, Iterator, Optional

from ..formats.endpoint_numbers import stored_cost
from ..formats.records import CANCELLED_STATUS
from ..errors import HermesBatchError
from ..contract.interfaces import PromptJob, PromptJobs
from ..run.batch_client import BatchingClient

log = logging.getLogger("hermes_batch.executors.dispatch")

PREFETCH = 4
"""Prompts a worker holds beyond those it runs once the dataset is exhausted (before: as many as it runs, if more)."""

CLOSE_GRACE_S = 10.0
"""How long the driver still listens to a worker once it is stopped, for the last messages on their way."""


class WorkerLost(Exception):
    """The worker's process, actor or node is gone; ``str`` says how."""


class WorkerError(HermesBatchError):
    """No worker is left to run the remaining prompts."""


class WorkerLink(abc.ABC):
    """The driver's end of one worker, whatever carries the messages (pipes, Ray calls)."""

    name: str = "worker"
    concurrency: int = 1

    @abc.abstractmethod
    async def send(self, message: tuple) -> None:
        """Send ``("lease", [(lease, job), ...])``, ``("return",)`` or ``("batched", id, outcome)`` (batch_relay.py);
        raise WorkerLost when the worker is gone."""

    @abc.abstractmethod
    async def receive(self) -> list:
        """The next messages of the worker (at least one); raise WorkerLost when it is gone."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop the worker (its prompts in flight are cancelled and their sandboxes closed) and wait for it; never raises."""


def split(total: int, parts: int) -> list[int]:
    """``total`` divided into ``parts`` whole shares differing by at most one, none zero (fewer parts if needed)."""
    parts = max(1, min(parts, total))
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


class Dispatcher:
    """Runs ``jobs`` on ``links`` (each started: it has sent ``ready``) and hands each outcome to ``on_outcome``.

    ``relay(entry)`` takes each journal line a worker sends; ``limits`` is called
    with the summed state of the workers' call limiters.
    """

    def __init__(
        self,
        links: list[WorkerLink],
        jobs: Iterator[PromptJob],
        on_outcome: Callable[[PromptJob, object], Awaitable[None]],
        relay: Callable[[dict], None],
        limits: Optional[Callable[[tuple], None]] = None,
        queue: Optional[int] = None,
    ):
        self.links = list(links)
        self.started_links = list(links)  # lost ones too: close() stops them all
        self.jobs = jobs if isinstance(jobs, PromptJobs) else PromptJobs(jobs)
        self.on_outcome = on_outcome
        self.relay = relay
        self.report_limits = limits
        self.queue = queue  # prompts a worker holds beyond its concurrency (None: as many, at least PREFETCH)
        self.leased: dict[WorkerLink, dict[int, PromptJob]] = {link: {} for link in self.links}
        self.again: collections.deque = collections.deque()  # leases of lost workers and handed back, first
        self.exhausted = False
        self.asked: set[WorkerLink] = set()  # asked to hand back what they have not started, not yet answered
        self.dropping = False  # jobs.halted was seen: every worker was asked for its queue, which is dropped
        self._ids = itertools.count()
        self._events: asyncio.Queue = asyncio.Queue()
        self._limits: dict[WorkerLink, tuple] = {}
        self._recording: set[asyncio.Future] = set()  # outcomes being written while the leasing goes on
        self._receivers: list[asyncio.Task] = []
        self.responses = None  # the run's ResponseJournal, which the workers' answers are written to
        self.batches = None  # under --batch_api, the BatchService that runs the workers' batch calls (batch_relay.py)

    async def run(self) -> None:
        """Lease every job and record every outcome; then call ``close``, also when this raises or is cancelled."""
        # The receivers outlive run(): a read cut off by a cancel can lose a message half read, and the last
        # messages of a stopped worker (the end of the model calls its stop cut off) are still to come.
        self._receivers = [asyncio.create_task(self._receive(link)) for link in self.links]
        for link in list(self.links):
            await self._fill(link)
        while self._outstanding():
            link, messages = await self._events.get()
            if isinstance(messages, WorkerLost):
                await self._lost(link, messages)
                continue
            if isinstance(messages, BaseException):  # an outcome could not be written (disk full)
                raise messages
            for message in messages:
                await self._handle(link, message)
            if link in self.leased:
                await self._fill(link)

    async def close(self, grace: float = CLOSE_GRACE_S) -> None:
        """Stop every worker and take in what each sends until it is gone, then wait for the outcomes being written.

        A worker told to stop cancels its prompts in flight; the end of each model
        call that cuts off is journaled and sent like any other, so calls.jsonl
        holds no request without its end (as with the local executor), and an
        outcome that arrives meanwhile is recorded.  The error of an outcome
        that could not be written (disk full) is raised.
        """
        if self.batches is not None:  # as Ctrl-C does to the local executor's sessions: their batches stay out
            await self.batches.aclose()
        closing = asyncio.ensure_future(close_all(self.started_links))
        try:
            await self._drain(closing, grace)
            await closing
        finally:
            if not closing.done():  # cancelled (a second Ctrl-C): the links kill their workers
                closing.cancel()
                await asyncio.gather(closing, return_exceptions=True)
            for task in self._receivers:
                task.cancel()
            await asyncio.gather(*self._receivers, return_exceptions=True)
        for recording in list(self._recording):
            await recording  # its error (disk full) is the run's

    async def _drain(self, closing: asyncio.Future, grace: float) -> None:
        receiving = asyncio.gather(*self._receivers, return_exceptions=True)  # each ends when its worker is gone
        deadline = None
        try:
            while not (receiving.done() and self._events.empty()):
                if self._events.empty():
                    if deadline is None and closing.done():
                        deadline = asyncio.get_running_loop().time() + grace
                    timeout = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
                    waiting = {receiving, closing} if not closing.done() else {receiving}
                    getter = asyncio.ensure_future(self._events.get())
                    done, _ = await asyncio.wait({getter, *waiting}, timeout=timeout,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if getter not in done:
                        getter.cancel()
                        await asyncio.gather(getter, return_exceptions=True)
                        if not done:  # the grace ran out: whatever a worker still had is lost with it
                            return
                        continue
                    link, messages = getter.result()
                else:
                    link, messages = self._events.get_nowait()
                if isinstance(messages, BaseException):
                    continue  # a worker gone, or a write error: close() raises the latter from its recording
                for message in messages:
                    if message[0] in ("journal", "responses", "outcome"):
                        await self._handle(link, message)
        finally:
            receiving.cancel()

    def _recorded(self, recording: asyncio.Future) -> None:
        self._recording.discard(recording)
        if not recording.cancelled() and recording.exception() is not None:
            self._events.put_nowait((None, recording.exception()))

    def _outstanding(self) -> bool:
        return bool(self.again) or not self.exhausted or any(self.leased.values())

    async def _receive(self, link: WorkerLink) -> None:
        while True:
            try:
                messages = await link.receive()
            except WorkerLost as exc:
                await self._events.put((link, exc))
                return
            await self._events.put((link, messages))

    async def _handle(self, link: WorkerLink, message: tuple) -> None:
        kind = message[0]
        if kind == "journal":
            self.relay(message[1])
        elif kind == "responses":
            if self.responses is not None:
                self.responses.relay(message[1])  # before the outcome of its prompt: one pipe, in order
        elif kind == "outcome":
            job = self.leased.get(link, {}).pop(message[1], None)
            if job is not None:  # else: already re-leased elsewhere (never happens with the transports we have)
                # Written while the worker gets its next prompt: outcomes that arrive together share a write
                # and an fsync (AppendLog.append), where waiting for each in turn held the leasing up.
                recording = asyncio.ensure_future(self.on_outcome(job, message[2]))
                self._recording.add(recording)
                recording.add_done_callback(self._recorded)
        elif kind == "returned":
            self.asked.discard(link)
            held = self.leased.get(link, {})
            for lease in message[1]:
                job = held.pop(lease, None)
                if job is not None and not self.jobs.halted:
                    self.again.append(job)
            for other in list(self.links):
                if other is not link:
                    await self._fill(other)
        elif kind == "batch":
            if self.batches is not None:
                self.batches.handle(link, message)
        elif kind == "limits":
            self._limits[link] = message[1:]
            # summed once every worker has reported: one worker's limit alone is not the run's
            if self.report_limits is not None and len(self._limits) == len(self.links):
                self.report_limits(tuple(map(sum, zip(*self._limits.values()))))
        elif kind == "fatal":
            raise message[1]

    async def _lost(self, link: WorkerLink, why: WorkerLost) -> None:
        orphans = self.leased.pop(link, {})
        self.links.remove(link)
        if self.batches is not None:
            self.batches.drop(link)
        self._limits.pop(link, None)
        self.asked.discard(link)
        self.again.extendleft(reversed(list(orphans.values())))
        if orphans or not self.exhausted:
            log.warning("%s was lost (%s); its %d prompt(s) in flight go to the other workers.", link.name, why, len(orphans))
        if not self.links and self._outstanding():
            raise WorkerError(
                f"Every worker was lost (the last: {link.name}, {why}); finished prompts are saved, "
                "run again with --resume to continue."
            )
        for other in list(self.links):
            await self._fill(other)

    async def _fill(self, link: WorkerLink) -> None:
        """Lease prompts to ``link`` up to what it may hold, in one message; when none is left, take some back."""
        held = self.leased[link]
        # A deep queue while prompts keep coming: the sessions of a worker often end together (they
        # started together), and each waiting for the driver's next lease left them idle for a round trip.
        queue = PREFETCH if self.exhausted else self.queue or max(PREFETCH, link.concurrency)
        room = link.concurrency + queue - len(held)
        batch = []
        while room > 0:
            job = self._next_job()
            if job is None:
                break
            lease = next(self._ids)
            held[lease] = job
            batch.append((lease, job))
            room -= 1
        if batch:
            await self._send(link, ("lease", batch))
        if self.jobs.halted and not self.dropping:  # once: after that no worker is leased anything new
            self.dropping = True
            await self._take_back(lambda other: bool(self.leased[other]))
        elif room > 0 and self.exhausted and len(held) < link.concurrency:  # a session of link would idle
            await self._take_back(lambda other: len(self.leased[other]) > other.concurrency)

    async def _take_back(self, holds_unstarted: Callable[[WorkerLink], bool]) -> None:
        """Ask each worker that ``holds_unstarted`` prompts, and was not asked already, to hand them back."""
        for other in list(self.links):
            if other not in self.asked and holds_unstarted(other):
                self.asked.add(other)
                await self._send(other, ("return",))

    async def _send(self, link: WorkerLink, message: tuple) -> None:
        try:
            await link.send(message)
        except WorkerLost:
            pass  # its receiver reports the loss, and its leases go with the rest

    def _next_job(self) -> Optional[PromptJob]:
        if self.again:
            return self.again.popleft()
        if self.exhausted:
            return None
        job = next(self.jobs, None)
        if job is None:
            self.exhausted = True
        return job


# --- what every executor with workers does -----------------------------------------------------


def worker_setups(processor, shares: list, run_dir) -> list:
    """One WorkerSetup per worker, ``shares`` its concurrency (see ``split``)."""
    from .worker import WorkerSetup, without_secrets

    plan = without_secrets(processor.plan)
    journal = processor.client.journal
    session = journal.session if journal is not None else 0
    total = sum(shares)
    return [WorkerSetup(plan, str(run_dir), share, share / total, session, i) for i, share in enumerate(shares)]


async def wait_ready(link: WorkerLink) -> None:
    """Wait for a started worker's ``ready``; raise its fatal error, or WorkerError when it died starting."""
    while True:
        try:
            messages = await link.receive()
        except WorkerLost as exc:
            raise WorkerError(f"{link.name} ended before it was ready ({exc}); see the errors above it.") from None
        for message in messages:
            if message[0] == "fatal":
                raise message[1]
            if message[0] == "ready":
                return


async def drive(links: list, jobs, processor, on_outcome) -> None:
    """Wait for every worker to be ready, dispatch ``jobs`` over them, the driver's journal and limiter fed, and
    stop them (taking in their last messages), also on errors and Ctrl-C."""
    dispatcher = None
    try:
        started = time.monotonic()
        await asyncio.gather(*(wait_ready(link) for link in links))
        log.info("%d workers ready in %.1f s: %s.", len(links), time.monotonic() - started,
                 ", ".join(f"{link.name} ({link.concurrency} sessions)" for link in links))
        relay, limits = _mirror(processor)
        # Under --max_cost a short queue: a worker starts a queued prompt without asking the driver, so a deep
        # one could start as many prompts again as it has sessions after the budget is reached.
        queue = PREFETCH if processor.plan.config.max_cost is not None else None
        dispatcher = Dispatcher(links, jobs, on_outcome, relay, limits, queue)
        dispatcher.responses = getattr(processor.replayer, "journal", None)
        if isinstance(processor.client, BatchingClient):  # the driver submits and collects every worker's batches
            from .batch_relay import BatchService

            dispatcher.batches = BatchService(processor.client.batcher)
        await dispatcher.run()
    finally:
        if dispatcher is not None:
            await dispatcher.close()
        else:
            await close_all(links)


async def run_on_workers(
    start: Callable[..., Awaitable[WorkerLink]],
    shares: list,
    jobs: Iterator[PromptJob],
    processor,
    on_outcome: Callable[[PromptJob, object], Awaitable[None]],
) -> None:
    """What an executor with workers does in ``Executor.run``: start them, lease them ``jobs``, stop them.

    ``start(setup, api_key)`` starts one worker per entry of ``shares`` (its
    sessions) and returns its link without waiting for it to be ready: it
    hands ``setup`` (a WorkerSetup, without the key) to a ``PromptWorker`` where
    the prompts are to run, and ``api_key`` through that place's environment
    (``PromptWorker.environment``).  Every worker is stopped at the end, also
    on errors and Ctrl-C.
    """
    links = []
    try:
        for setup in worker_setups(processor, shares, processor.run.run_dir):
            links.append(await start(setup, processor.plan.model.api_key))
    except BaseException:
        await close_all(links)
        raise
    await drive(links, jobs, processor, on_outcome)


async def close_all(links: list) -> None:
    """Stop every worker at once (each cancels its prompts and closes their sandboxes) and wait for all."""
    await asyncio.gather(*(link.close() for link in links), return_exceptions=True)


def _mirror(processor) -> tuple:
    """Relay journal lines to the run's calls.jsonl and keep the driver's limiter showing the workers' totals.

    The driver's limiter makes no call itself: it is what the progress display
    and the session record of the checkpoint read (requests, 429s, cost, limits).
    """
    journal, limiter = processor.client.journal, processor.client.limiter

    def relay(entry: dict) -> None:
        if journal is not None:
            journal.relay(entry)
        if entry.get("event") != "done":
            return
        limiter.requests += 1
        status = entry.get("status")
        if status not in (200, CANCELLED_STATUS):  # as the worker's limiter counts them
            limiter.errors += 1
        if status == 429:
            limiter.rate_limited += 1
        cost = stored_cost(entry.get("cost"))  # a worker's line, checked like any journal line
        if cost is not None:
            limiter.cost = (limiter.cost or 0.0) + cost

    def limits(summed: tuple) -> None:
        if len(summed) >= 3:
            limiter.in_flight, limiter.limit = summed[0], summed[1]
            limiter.min_limit = min(limiter.min_limit, summed[2])

    return relay, limits
