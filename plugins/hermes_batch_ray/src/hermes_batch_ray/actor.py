"""The Ray actor that runs prompts: a PromptWorker in the actor's event loop, polled by the driver."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import sys
import tempfile
from typing import Optional

import attrs

from hermes_batch import PromptWorker, WorkerSetup


class PromptActor:
    """One worker of a run.  The driver calls ``lease`` with prompts (``take_back`` for those not started)
    and ``poll`` for what happened.

    The API key arrives in the actor's runtime environment and is taken out of
    ``os.environ`` at once; the setup (in Ray's object store) never holds it.
    Sandboxes keep their folders in a new folder under ``scratch_dir`` (default:
    the temporary folder) of the node the actor runs on, removed when it stops
    (unless a sandbox was told to keep its folder).  An actor that is killed
    leaves the folders of its prompts in flight there.
    """

    def __init__(self, setup: WorkerSetup, scratch_dir: Optional[str] = None):
        self.api_key = PromptWorker.take_api_key()
        self.setup = setup
        self.pending: list = []
        self.wake = asyncio.Event()
        self.worker = None
        self.run_dir = None
        self.scratch_dir = scratch_dir

    async def start(self) -> tuple[str, str]:
        """Start the worker (it says ``ready`` or ``fatal`` through ``poll``); returns the host name and Ray node id."""
        import ray

        setup = self.setup
        _setup_logging(setup)
        if self.scratch_dir is not None:
            os.makedirs(self.scratch_dir, exist_ok=True)
        self.run_dir = tempfile.mkdtemp(prefix=f"hermes-batch-{setup.plan.config.run_name}-", dir=self.scratch_dir)
        self.worker = PromptWorker(attrs.evolve(setup, run_dir=self.run_dir), self._emit, api_key=self.api_key)
        await self.worker.start()
        return socket.gethostname(), ray.get_runtime_context().get_node_id()

    def _emit(self, message: tuple) -> None:
        self.pending.append(message)
        self.wake.set()

    async def lease(self, leases: list) -> None:
        self.worker.lease(leases)

    async def batched(self, key: int, outcome) -> None:
        """Under --batch_api: the outcome of a session's batch call, which the driver made."""
        self.worker.batched(key, outcome)

    async def take_back(self) -> None:
        """Hand back the prompts not started yet (``("returned", [...])`` in the next poll)."""
        self.worker.take_back()

    async def poll(self) -> list:
        """Whatever happened since the last poll; waits until something has."""
        await self.wake.wait()
        self.wake.clear()
        messages, self.pending = self.pending, []
        if self.worker is not None:
            messages.append(self.worker.limits())
        return messages

    async def stop(self) -> list:
        """Cancel the prompts in flight (each closes its sandbox) and shut the worker down; returns the messages
        no poll took (the end of the model calls the stop cut off, for the run's journal)."""
        if self.worker is not None:
            await self.worker.stop()
        if self.run_dir is not None:
            scratch = os.path.join(self.run_dir, "scratch")
            if not (os.path.isdir(scratch) and os.listdir(scratch)):
                shutil.rmtree(self.run_dir, ignore_errors=True)
        messages, self.pending = self.pending, []
        return messages


def _setup_logging(setup: WorkerSetup) -> None:
    # Ray forwards an actor's stderr to the driver, prefixed with the actor and its node
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(levelname)s [worker {setup.index + 1}] %(message)s"))
    root = logging.getLogger("hermes_batch")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if setup.plan.config.verbose else logging.WARNING)
    root.propagate = False
