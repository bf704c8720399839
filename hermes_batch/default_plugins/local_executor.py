"""The local executor: every prompt is a task in this process's event loop."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Iterator

import hermes_batch
from hermes_batch.contract.interfaces import Executor, PromptJob, stop_if_cancelled


@hermes_batch.hookimpl
def register_executors(register):
    register(LocalExecutor)


class LocalExecutor(Executor):
    """Runs ``concurrency`` agent sessions at once in one asyncio event loop."""

    name = "local"
    description = "One process, one event loop; --num_workers sessions at once (hundreds are fine)."

    async def run(
        self,
        jobs: Iterator[PromptJob],
        processor,
        on_outcome: Callable[[PromptJob, object], Awaitable[None]],
        concurrency: int,
    ) -> None:
        # Workers pull the next job as soon as they are free, so a slow prompt never holds up the others.
        async def worker() -> None:
            for job in jobs:
                outcome = await processor.process(job)
                await on_outcome(job, outcome)
                stop_if_cancelled()

        tasks = [asyncio.create_task(worker()) for _ in range(max(1, concurrency))]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                # gather returns when the first task ends; one it already cancelled is still closing its
                # sandbox, and a second cancel would cut that cleanup short
                if not task.cancelling():
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
