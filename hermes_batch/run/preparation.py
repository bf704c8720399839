"""Everything checked and decided before a model call: the plan, the run folder, the engine and the preflight.

``prepare`` is synchronous and raises (HermesBatchError) before anything is sent to a model or written:
the run's name, the concurrency the machine's limits allow, the ``RunPlan`` with its plugins, the run
folder taken (its lock) and cleared as --overwrite asks, the checkpoint a resume continues.  ``start``
runs in the event loop just before the run folder is written: the sandbox backend's engine, the
executor's workers, the preflight model request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from typing import Optional

import attrs

from ..contract.plugin_errors import PluginFailures
from ..contract.interfaces import Executor
from ..contract.plugins import Registry, collect
from ..errors import ConfigError, HermesBatchError, RunFolderError
from ..folder import unfinished
from ..folder.lock import RunFolderLock
from ..folder.rowkeys import Validated
from ..folder.runfolder import RunFolder, validate_run_name
from . import cleanup, limits, notices, run_settings, selection
from .batch_client import BatchingClient
from .checkpoint import Checkpoints, load_checkpoint
from .config import RunConfig
from .plan import RunPlan, make_plan

log = logging.getLogger("hermes_batch.run")


@attrs.define
class Prepared:
    """What ``prepare`` decided and holds: the plan and its plugins, the run folder and its lock."""

    plan: RunPlan
    concurrency: int  # prompts at once, as the machine's limits allow
    folder: RunFolder
    lock: RunFolderLock  # held until the run ends
    registry: Registry  # the plugins by kind and name
    runtimes: dict  # toolset name -> its runtime, built once for the run
    validated: Validated  # the dataset's report and row keys
    filters: list
    writers: list
    plugin_failures: PluginFailures
    executor: Executor
    checkpoints: Checkpoints
    settings_history: list  # the settings of every session so far (run_settings)

    def writer_files(self) -> list:
        """The files the writers write in the run folder."""
        return writer_files(self.writers)


def writer_files(writers) -> list:
    return [name for w in writers if isinstance(name := getattr(w, "filename", None), str)]


def prepare(config: RunConfig, pm) -> Prepared:
    """Check everything that can be checked before a model call and decide the run; the run folder is locked."""
    validate_run_name(config.run_name)
    # files and threads for the concurrency asked, said before any model call rather than as EMFILE after it
    fit = limits.fit_concurrency(config.num_workers)
    folder = RunFolder(config.output_dir, config.run_name)
    registry = collect(pm)
    validated = []
    plan, concurrency, runtimes = _plan(config, registry, folder, fit, validated.append)
    filters = selection.filters(registry, plan.filters)
    notices.discarding_everything(config, [f.name for f in filters])
    writers = selection.writers(registry, plan.writers)
    plugin_failures = PluginFailures(pm, registry)
    executor = registry.get("executors", plan.executor)(plan.executor_config)

    lock = take_folder(config, folder, writers)
    try:
        checkpoints = Checkpoints(folder, config, load_checkpoint(folder) if config.resume else None)
        # a resume continues the run's data: settings that change what it means are refused, or kept apart
        settings_history = run_settings.check_resume(plan, folder, checkpoints.session_number)
    except BaseException:
        lock.release()
        raise
    return Prepared(plan, concurrency, folder, lock, registry, runtimes, validated[-1], filters, writers,
                    plugin_failures, executor, checkpoints, settings_history)


def _plan(config: RunConfig, registry, folder: RunFolder, fit: limits.Fit, on_validated) -> tuple[RunPlan, int, dict]:
    """The plan, with the concurrency the machine's open files and threads allow, and the toolsets' runtimes."""
    concurrency = fit.concurrency
    plan, runtimes = make_plan(config, registry, folder, concurrency, on_validated=on_validated)
    # what the toolsets hold whatever the prompts in flight (a browser's proxies) is known once they are built
    reserved = sum(runtime.files_needed() for runtime in runtimes.values())
    if reserved:
        fit = limits.fit_concurrency(config.num_workers, files_reserved=reserved)
        if fit.concurrency != concurrency:
            concurrency = fit.concurrency
            calls = config.max_concurrent_requests or fit.concurrency
            plan = attrs.evolve(plan, model=attrs.evolve(plan.model, max_concurrent_requests=calls))
    if fit.reasons:
        log.warning("%s", limits.describe(config.num_workers, fit))
    return plan, concurrency, runtimes


def take_folder(config: RunConfig, folder: RunFolder, writers) -> RunFolderLock:
    """Lock the run folder and clear what --overwrite clears; the lock, or raise with the folder released."""
    # Held until the run ends: a second run on this folder would write every prompt twice.
    lock = RunFolderLock(folder.dir)
    lock.acquire()
    try:
        if config.resume and unfinished.is_seed_folder(folder):
            # its records have no content key: a resume would find nothing finished and pay for all again
            raise RunFolderError(
                f"{folder.dir} is a run folder of batch_runner.py; convert it first with "
                f"'hermes-batch import {folder.dir} --dataset_file {config.dataset_file}', then resume."
            )
        if folder.has_outputs() and not config.resume:
            _overwrite(config, folder, writer_files(writers))
        cleanup.remove_leftovers(folder)
    except BaseException:
        lock.release()
        raise
    return lock


def _overwrite(config: RunConfig, folder: RunFolder, files: list) -> None:
    if not config.overwrite:
        raise RunFolderError(
            f"{folder.dir} already holds the outputs of a run; pass --resume to continue it "
            "or --overwrite to start afresh."
        )
    # the run's own files only: the folder may hold the user's notes or the dataset itself
    doomed = cleanup.output_files(folder, files)
    if any(os.path.samefile(config.dataset_file, path) for path in doomed if path.exists()):
        raise RunFolderError(
            f"The dataset {config.dataset_file} is an output of the run in {folder.dir}, which "
            "--overwrite would delete; copy it out of the run folder first."
        )
    cleanup.remove_outputs(folder, files)


def thread_pools(concurrency: int) -> concurrent.futures.ThreadPoolExecutor:
    """Set the event loop's default executor; the pool of the sandboxes and tools."""
    # Sandboxes and tools get a pool of their own: a tool stuck for ever (a FIFO) may take all of it, but
    # not the threads the SDKs need (DNS lookups, the openai SDK's platform probe: the default executor)
    # nor those that write the run folder (offloop.io_executor).  Threads start only when needed.
    asyncio.get_running_loop().set_default_executor(
        concurrent.futures.ThreadPoolExecutor(concurrency + 4, thread_name_prefix="hermes-batch")
    )
    return concurrent.futures.ThreadPoolExecutor(concurrency + 4, thread_name_prefix="hermes-batch-tools")


def check_branching(processor) -> None:
    """--branch_at needs a backend whose sandboxes copy a working folder into a fresh one: refused before the
    preflight otherwise (Apptainer, Modal, Docker's -S reuse=namespace)."""
    backend = processor.backend
    if processor.branch_at is not None and not (backend.copies_workdirs or backend.snapshots_filesystems):
        raise ConfigError(f"--branch_at copies each row's prefix sandbox into its branches, which the {backend.name} "
                          "sandbox cannot (here); use the local sandbox, or docker with -S reuse=none.")


async def start(executor, processor, to_run: int, preflight: bool) -> Optional[BaseException]:
    """Check the engine, start the executor's workers and pay the preflight; what stopped it, else None.

    Before the run folder is touched and any sandbox started: a dead engine or a refused key costs
    nothing to fix.  The engine goes first, since the preflight costs a model request (``preflight``:
    asked for, and the budget not spent).  The executor starts its workers meanwhile.
    """
    starting = asyncio.ensure_future(executor.start(processor) if to_run else asyncio.sleep(0))
    try:
        await processor.backend.check()
        check_branching(processor)
        if starting.done():
            starting.result()  # a cluster that cannot be reached says so before the preflight is paid for
        if to_run and preflight:
            await processor.client.preflight()
        if to_run and isinstance(processor.client, BatchingClient):
            await processor.client.check_batch_api()  # an endpoint without one says so before any prompt
        await starting
    except (HermesBatchError, asyncio.CancelledError) as exc:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        return exc
    return None
