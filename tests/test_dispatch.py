"""The Dispatcher's leasing on its own, with workers simulated in this event loop: bounded leases, re-leases, once each."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from hermes_batch.dispatch import PREFETCH, Dispatcher, WorkerError, WorkerLink, WorkerLost, split
from hermes_batch.errors import FatalModelError, RunFolderWriteError


class SimulatedWorker(WorkerLink):
    """Runs each leased job for ``delay`` seconds, ``concurrency`` at a time; ``die()`` loses it like a killed process."""

    def __init__(self, name: str, concurrency: int, delay: float = 0.001):
        self.name, self.concurrency, self.delay = name, concurrency, delay
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.slots = asyncio.Semaphore(concurrency)
        self.held = 0
        self.most_held = 0
        self.ran: list = []
        self.tasks: set = set()
        self.dead = False

    async def send(self, message):
        if self.dead:
            raise WorkerLost("dead")
        for lease, job in message[1]:
            self.held += 1
            self.most_held = max(self.most_held, self.held)
            task = asyncio.create_task(self._run(lease, job))
            self.tasks.add(task)

    async def _run(self, lease, job):
        async with self.slots:
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
        pass


async def dispatch(links, jobs, on_outcome=None):
    recorded, journal = [], []

    async def record(job, outcome):
        recorded.append((job, outcome))
        if on_outcome is not None:
            await on_outcome(job, outcome)

    await Dispatcher(links, iter(jobs), record, journal.append).run()
    return recorded, journal


async def test_every_job_ends_once_and_no_worker_holds_more_than_its_share_and_the_prefetch():
    links = [SimulatedWorker("a", 3), SimulatedWorker("b", 5, delay=0.003)]
    recorded, journal = await dispatch(links, range(200))
    assert sorted(job for job, _ in recorded) == list(range(200))
    assert all(outcome == f"out-{job}" for job, outcome in recorded)
    assert len(journal) == 200
    for link in links:
        assert link.most_held <= link.concurrency + PREFETCH
        assert link.ran, "both workers ran prompts"


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
