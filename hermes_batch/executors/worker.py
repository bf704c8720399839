"""The worker end of a run split over processes or machines: leased prompts in, outcomes and journal lines out.

A worker runs the same prompt processor as the local executor, rebuilt from the
run's RunPlan, with its share of the concurrency.  It owns nothing of the run
folder: every outcome and every line of calls.jsonl goes back to the driver as
a message (``emit``), and the driver alone writes them.  The transport (pipes
to a child process, Ray actor calls) is not its business.

Messages to the driver (tuples): ``("ready",)`` once started, ``("journal",
entry)`` per line of calls.jsonl, ``("responses", entry)`` per line of
responses.jsonl (a live model answer), ``("outcome", lease, outcome)`` per prompt,
``("limits", in_flight, limit, min_limit)`` with each batch of
messages, ``("returned", [lease, ...])`` when the driver asks for the prompts
not started yet (``take_back``), ``("batch", id, op, args)`` for a call of the
driver's Batcher under ``--batch_api`` (answered with ``("batched", id,
outcome)``: ``batched``, see batch_relay.py), and ``("fatal", error)`` when the
run must stop (a refused key, a sandbox backend that cannot start).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional

import attrs

from ..errors import HermesBatchError
from .batch_relay import BatchRelay
from ..contract.interfaces import stop_if_cancelled
from ..folder.journal import CallJournal
from ..folder.replay_journal import encode_response
from ..folder.response_cache import open_cache
from ..session.replay import Replayer
from ..run.plan import RunPlan, build_processor
from ..contract.plugins import DISABLE_ENV, collect, get_plugin_manager
from ..contract.run_context import RunContext, private_paths

log = logging.getLogger("hermes_batch.executors.worker")

API_KEY_VARIABLE = "HERMES_BATCH_WORKER_API_KEY"
"""Where a worker finds the run's API key: its environment, never the plan that travels in messages."""


@attrs.frozen
class WorkerSetup:
    """What the driver tells a worker before its first lease: plain, picklable, without the API key."""

    plan: RunPlan
    run_dir: str  # where the worker's sandboxes keep their folders (scratch/ below it)
    concurrency: int  # prompts this worker runs at once
    share: float  # its part of the run's per-minute budgets and call limit (its concurrency / the run's)
    session: int  # the run folder's session number, for the journal lines it relays
    index: int  # 0-based, for log lines


def without_secrets(plan: RunPlan) -> RunPlan:
    """``plan`` without the API key, for sending to a worker (it reads the key from API_KEY_VARIABLE)."""
    return attrs.evolve(plan, config=attrs.evolve(plan.config, api_key=None), model=attrs.evolve(plan.model, api_key=None))


def worker_plan(setup: WorkerSetup, api_key: Optional[str]) -> RunPlan:
    """The plan a worker runs: the key from its environment, its share of the call limit and per-minute budgets."""
    plan, share = setup.plan, setup.share
    model = plan.model

    def part(value):
        return None if value is None else value * share

    model = attrs.evolve(
        model,
        api_key=api_key,
        max_concurrent_requests=None if model.max_concurrent_requests is None
        else max(1, round(model.max_concurrent_requests * share)),
        max_requests_per_minute=part(model.max_requests_per_minute),
        max_tokens_per_minute=part(model.max_tokens_per_minute),
    )
    return attrs.evolve(plan, config=attrs.evolve(plan.config, api_key=api_key), model=model)


@functools.cache
def plugin_registry():
    """The installed plugins' registry, built once per process (a forkserver builds it for its workers):
    the entry points take a tenth of a second to load."""
    return collect(get_plugin_manager())


class RelayJournal(CallJournal):
    """A worker's call journal: each line goes to the driver, which alone writes calls.jsonl."""

    def __init__(self, emit: Callable[[tuple], None], session: int):  # no file: the driver has it
        self.path = None
        self.session = session
        self.cost = None
        self._emit = emit

    def _write(self, entry: dict) -> None:
        self._emit(("journal", entry))

    def close(self) -> None:
        pass


class RelayResponses:
    """A worker's replay journal: each live answer goes to the driver, which alone writes responses.jsonl."""

    def __init__(self, emit: Callable[[tuple], None]):
        self._emit = emit

    def write(self, key: str, request_hash: str, response) -> None:
        self._emit(("responses", {"p": key, "h": request_hash, "r": encode_response(response)}))


class PromptWorker:
    """Runs leased prompts ``setup.concurrency`` at a time and emits what happens.

    ``emit`` is called in the worker's event loop with each message; it must not
    block (the transport batches them).  ``api_key``: what ``take_api_key``
    found in the worker's environment.
    """

    def __init__(self, setup: WorkerSetup, emit: Callable[[tuple], None], *, api_key: Optional[str] = None,
                 registry: Any = None):
        self.setup = setup
        self.emit = emit
        self.plan = worker_plan(setup, api_key)
        self.registry = registry if registry is not None else plugin_registry()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.processor = None
        self.failed = False
        self.batches = BatchRelay(emit) if self.plan.config.batch_api else None

    @staticmethod
    def environment(api_key: Optional[str]) -> dict:
        """The variables to add to a worker's environment (its process's, or a Ray runtime environment): the API
        key, and the plugins this command leaves out (``-p no:NAME`` or HERMES_BATCH_DISABLE_PLUGINS), so a worker
        on another machine leaves them out too."""
        env = {API_KEY_VARIABLE: api_key} if api_key else {}
        if os.environ.get(DISABLE_ENV):
            env[DISABLE_ENV] = os.environ[DISABLE_ENV]
        return env

    @staticmethod
    def take_api_key() -> Optional[str]:
        """The API key from this process's environment, removed from it (before any sandbox or tool starts)."""
        return os.environ.pop(API_KEY_VARIABLE, None)

    async def start(self) -> None:
        """Build and start the prompt processor, then the consumers of leases; emits ``ready`` or ``fatal``."""
        setup, plan = self.setup, self.plan
        loop = asyncio.get_running_loop()
        # as in the runner: tools get a pool of their own, so a tool stuck for ever cannot starve the SDKs
        pool = concurrent.futures.ThreadPoolExecutor(setup.concurrency + 4, thread_name_prefix="hermes-batch-tools")
        loop.set_default_executor(
            concurrent.futures.ThreadPoolExecutor(setup.concurrency + 4, thread_name_prefix="hermes-batch")
        )
        cfg = plan.config
        run = RunContext(cfg.run_name, Path(setup.run_dir), plan.seed, cfg.verbose, cfg.log_prefix_chars, pool,
                         private_paths=private_paths(cfg))
        try:
            self.processor = build_processor(plan, run, self.registry, batcher=self.batches)
            self.processor.client.journal = RelayJournal(self.emit, setup.session)
            # the driver writes responses.jsonl; a prompt's recorded answers come with its job
            self.processor.replayer = Replayer(RelayResponses(self.emit), self.processor.client,
                                               open_cache(plan.config.response_cache))
            await self.processor.start()
        except Exception as exc:  # noqa: BLE001 - the driver raises it, as the runner would have
            log.debug("the worker could not start", exc_info=True)
            self._fatal(exc)
            return
        self.tasks = [asyncio.create_task(self._consume()) for _ in range(max(1, setup.concurrency))]
        self.emit(("ready",))

    def lease(self, leases: list) -> None:
        """Queue ``(lease, PromptJob)`` pairs; the driver leases at most as many again as the concurrency."""
        for item in leases:
            self.queue.put_nowait(item)

    def batched(self, key: int, outcome) -> None:
        """The driver's outcome of the batch call ``key`` (``("batched", key, outcome)``)."""
        if self.batches is not None:
            self.batches.answer(key, outcome)

    def take_back(self) -> None:
        """Hand the driver back every leased prompt not started yet: emits ``("returned", [lease, ...])``."""
        returned = []
        while not self.queue.empty():
            lease, _job = self.queue.get_nowait()
            returned.append(lease)
        self.emit(("returned", returned))

    async def _consume(self) -> None:
        while True:
            lease, job = await self.queue.get()
            try:
                outcome = await self.processor.process(job)
            except HermesBatchError as exc:  # FatalModelError, RunFolderWriteError: the run stops
                self._fatal(exc)
                return
            self.emit(("outcome", lease, outcome))
            stop_if_cancelled()

    def _fatal(self, exc: Exception) -> None:
        self.failed = True
        self.emit(("fatal", exc))

    def limits(self) -> tuple:
        """The state of this worker's call limiter, which the driver sums up for the progress and run.json."""
        limiter = self.processor.client.limiter if self.processor is not None else None
        if limiter is None:
            return ("limits", 0, 0, 0)
        return ("limits", limiter.in_flight, limiter.limit, limiter.min_limit)

    async def stop(self) -> None:
        """Cancel every prompt in flight (each closes its sandbox), then shut the processor down."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.processor is not None:
            await self.processor.aclose()
            if self.processor.replayer is not None and self.processor.replayer.cache is not None:
                self.processor.replayer.cache.close()
