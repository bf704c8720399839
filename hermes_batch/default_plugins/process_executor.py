"""The processes executor: worker processes on this machine, each an event loop with its share of the sessions.

One ``hermes-batch run`` process is one event loop, so it uses one core; with
``--executor processes`` the run's process becomes the driver (it alone writes
the run folder) and ``-E workers=N`` worker processes run the prompts.  The
protocol is in ``hermes_batch.executors.pipe_worker``, the leasing in ``hermes_batch.executors.dispatch``.
"""

from __future__ import annotations

import functools
import os
from typing import Awaitable, Callable, Iterator, Optional

import attrs

import hermes_batch
from hermes_batch.executors.dispatch import run_on_workers, split
from hermes_batch.contract.interfaces import Executor, PromptJob


@hermes_batch.hookimpl
def register_executors(register):
    register(ProcessExecutor)


def _positive(_instance, attribute, value) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, not {value}")


@attrs.frozen
class ProcessesConfig:
    workers: Optional[int] = attrs.field(default=None, validator=_positive)  # None: one per core


def default_workers() -> int:
    """One worker per core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ProcessExecutor(Executor):
    """Worker processes on this machine share --num_workers; the run's process writes the run folder."""

    name = "processes"
    description = "Worker processes on this machine (-E workers=N, default one per core) share --num_workers."
    Config = ProcessesConfig

    def __init__(self, config):
        super().__init__(config)
        self._forkserver = None

    async def start(self, processor) -> None:
        # Workers are forked warm: the imports are paid once, not per worker, and while the run checks its
        # sandbox engine and sends the preflight request, not after.
        from hermes_batch.executors.forkserver import Forkserver  # the run engine: loaded when a run starts

        if self._forkserver is None:
            self._forkserver = await Forkserver.start(type(processor.client).packages)

    async def run(
        self,
        jobs: Iterator[PromptJob],
        processor,
        on_outcome: Callable[[PromptJob, object], Awaitable[None]],
        concurrency: int,
    ) -> None:
        from hermes_batch.executors.pipe_worker import PipeLink

        await self.start(processor)
        shares = split(concurrency, self.config.workers or default_workers())
        await run_on_workers(functools.partial(PipeLink.spawn, self._forkserver), shares, jobs, processor, on_outcome)

    async def shutdown(self) -> None:
        if self._forkserver is not None:
            forkserver, self._forkserver = self._forkserver, None
            await forkserver.close()
