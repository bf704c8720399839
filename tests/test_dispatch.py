"""The Dispatcher's leasing on its own, with workers simulated in this event loop: bounded leases, re-leases, once each."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from hermes_batch.executors.dispatch import PREFETCH, Dispatcher, WorkerError, WorkerLink, WorkerLost, split
from hermes_batch.errors import FatalModelError, RunFolderWriteError
from hermes_batch.contract.interfaces import PromptJobs


class SimulatedWorker(WorkerLink):
    """Runs each leased job for ``delay`` seconds, ``concurrency`` at a time, queueing the rest as PromptWorker
    does (``("return",)`` hands back the queued ones); ``die()`` loses it like a killed process."""

    def __init__(self, name: str, concurrency: int, delay: float = 0.001):
        self.name, self.concurrency, self.delay = name, concurrency, delay
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.held = 0
        self.most_held = 0
        self.ran: list = []
        self.returned: list = []
        self.tasks: set = set()
        self.dead = False

    async def send(self, message):
        if self.dead:
            raise WorkerLost("dead")
        if not self.tasks:
            self.tasks = {asyncio.create_task(self._consume()) for _ in range(self.concurrency)}
        if message[0] == "return":
            leases = []
            while not self.queue.empty():
                lease, job = self.queue.get_nowait()
                leases.append(lease)
                self.returned.append(job)
                self.held -= 1
            self.outbox.put_nowait([("returned", leases)])
            return
        for item in message[1]:
            self.held += 1
            self.most_held = max(self.most_held, self.held)
            self.queue.put_nowait(item)

    async def _consume(self):
        while True:
            lease, job = await self.queue.get()
            await self._run(lease, job)

    async def _run(self, lease, job):
        await asyncio.sleep(self.delay)
        self.ran.append(job)
        self.held -= 1
        self.outbox.put_nowait([("journal", {"event": "done", "prompt_index": job}), ("outcome", lease, f"out-{job}")])

    async def receive(self):
        message = await self.outbox.get()
        if isinstance(message, WorkerLost):
            raise message
        return message

    def die(self):
        self.dead = True
        for task in self.tasks:
            task.cancel()
        self.outbox.put_nowait(WorkerLost("killed by signal 9"))

    async def close(self):
        for task in self.tasks:
            task.cancel()
        self.outbox.put_nowait(WorkerLost("stopped"))  # a stopped worker's messages end


async def dispatch(links, jobs, on_outcome=None, queue=None, journal=None):
    recorded, journal = [], [] if journal is None else journal

    async def record(job, outcome):
        recorded.append((job, outcome))
        if on_outcome is not None:
            await on_outcome(job, outcome)

    dispatcher = Dispatcher(links, iter(jobs), record, journal.append, queue=queue)
    try:
        await dispatcher.run()
    finally:
        await dispatcher.close(grace=1.0)
    return recorded, journal


async def test_every_job_ends_once_and_no_worker_holds_more_than_twice_its_share():
    links = [SimulatedWorker("a", 6), SimulatedWorker("b", 8, delay=0.003)]
    recorded, journal = await dispatch(links, range(200))
    assert sorted(job for job, _ in recorded) == list(range(200))
    assert all(outcome == f"out-{job}" for job, outcome in recorded)
    assert len(journal) == 200
    for link in links:
        assert link.concurrency + PREFETCH < link.most_held <= 2 * link.concurrency, "a queue as deep as the sessions"
        assert link.ran, "both workers ran prompts"
    for link in links:
        await link.close()


async def test_a_queue_of_fixed_depth_is_kept_to():
    link = SimulatedWorker("a", 8)
    recorded, _ = await dispatch([link], range(100), queue=PREFETCH)
    assert len(recorded) == 100
    assert link.most_held == 8 + PREFETCH
    await link.close()


async def test_a_worker_with_an_idle_session_takes_the_prompts_a_slow_one_has_not_started():
    slow, fast = SimulatedWorker("slow", 2, delay=0.5), SimulatedWorker("fast", 2, delay=0.001)
    started = asyncio.get_running_loop().time()
    recorded, _ = await dispatch([slow, fast], range(40))
    assert Counter(job for job, _ in recorded) == Counter(range(40))
    assert sorted(slow.ran) == [0, 1], "the slow worker ran only what it had started"
    assert sorted(slow.returned) == [2, 3, 4, 5] and {2, 3, 4, 5} <= set(fast.ran)
    assert asyncio.get_running_loop().time() - started < 0.9, "nobody waited for the slow worker's queue"
    for link in (slow, fast):
        await link.close()


async def test_once_the_run_halts_the_prompts_queued_on_workers_are_dropped_not_run():
    def until_the_budget_is_spent():
        yield from range(10)
        jobs.halt()  # what the runner does when --max_cost is reached

    jobs = PromptJobs(until_the_budget_is_spent())
    link = SimulatedWorker("a", 2, delay=0.02)
    recorded, _ = await dispatch([link], jobs)
    ran = sorted(job for job, _ in recorded)
    assert ran == sorted(link.ran) == list(range(len(ran)))
    assert link.returned and ran + sorted(link.returned) == list(range(10))
    assert set(ran).isdisjoint(link.returned)
    await link.close()


async def test_a_lost_workers_leases_go_to_the_others_and_each_job_is_recorded_once():
    doomed, survivor = SimulatedWorker("doomed", 4, delay=0.05), SimulatedWorker("survivor", 4, delay=0.002)
    seen = Counter()

    async def on_outcome(job, _outcome):
        seen[job] += 1
        if seen.total() == 20:
            doomed.die()

    recorded, _journal = await dispatch([doomed, survivor], range(100), on_outcome)
    assert Counter(job for job, _ in recorded) == Counter(range(100))
    lost = set(range(100)) - set(doomed.ran)
    assert lost <= set(survivor.ran)


async def test_when_every_worker_is_lost_the_run_stops_with_one_sentence():
    only = SimulatedWorker("only", 2, delay=0.05)

    async def on_outcome(job, _outcome):
        only.die()

    with pytest.raises(WorkerError, match=r"^Every worker was lost .*--resume to continue\.$"):
        await dispatch([only], range(10), on_outcome)


async def test_a_workers_fatal_error_stops_the_run():
    class Refused(SimulatedWorker):
        async def _run(self, lease, job):
            self.outbox.put_nowait([("fatal", FatalModelError("The endpoint refused the API key; pass a valid one."))])

    with pytest.raises(FatalModelError, match="refused the API key"):
        await dispatch([Refused("r", 2)], range(5))


def test_split_shares_the_concurrency_evenly():
    assert split(256, 2) == [128, 128]
    assert split(10, 3) == [4, 3, 3]
    assert split(2, 8) == [1, 1]  # never a worker without a session


async def test_outcomes_are_written_while_the_leasing_goes_on_and_a_failed_write_stops_it():
    slow = asyncio.Event()

    async def wait_for_the_disk(job, outcome):
        await slow.wait()  # a write that takes a while: the worker still gets its next prompts

    link = SimulatedWorker("a", 2)
    dispatching = asyncio.ensure_future(dispatch([link], range(30), wait_for_the_disk))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if len(link.ran) == 30:
            break
    assert len(link.ran) == 30 and not dispatching.done()  # every prompt ran, none yet written
    slow.set()
    recorded, _ = await dispatching
    assert sorted(job for job, _ in recorded) == list(range(30))

    async def disk_full(job, outcome):
        if job == 5:
            raise RunFolderWriteError("Writing batch_0.jsonl failed: No space left on device (ENOSPC).")

    with pytest.raises(RunFolderWriteError, match="ENOSPC"):
        await dispatch([SimulatedWorker("b", 2)], range(30), disk_full)


async def test_what_a_stopped_worker_sends_on_its_way_out_is_still_taken_in():
    # Ctrl-C: the driver stops its workers; each cancels its model calls in flight and journals their end,
    # which must reach calls.jsonl (else statistics.json counts them "unanswered", killed, which they were not)
    class Stuck(SimulatedWorker):
        async def _run(self, lease, job):
            self.outbox.put_nowait([("journal", {"event": "sent", "prompt_index": job})])
            try:
                await asyncio.sleep(3600)
            finally:
                self.outbox.put_nowait([("journal", {"event": "done", "prompt_index": job, "status": 0})])

        async def close(self):
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            await asyncio.sleep(0.05)  # the last frame is on its way
            self.outbox.put_nowait(WorkerLost("exit status 0"))

    link = Stuck("a", 2)
    journal = []
    dispatching = asyncio.ensure_future(dispatch([link], range(2), journal=journal))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if len(journal) == 2:
            break
    dispatching.cancel()  # what Ctrl-C does to the executor
    with pytest.raises(asyncio.CancelledError):
        await dispatching
    assert Counter(entry["event"] for entry in journal) == Counter(sent=2, done=2)
