"""``hermes-batch tasks``: Harbor task suites without a model: their images built ahead, their oracle checked."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import attrs
import click

from ..errors import HermesBatchError, UsageError
from ..formats.records import PromptRow, SandboxSpec
from ..formats.serialization import parse_key_values
from ..formats.task_folders import TaskFolder, find_tasks, options_of, read_task, task_row

SOLUTION_PATH = "/solution"
CHECK_FAILED = 1  # a build failed, or a task failed its oracle check


@click.group("tasks")
def tasks_group():
    """Harbor task suites: build their images ahead, check their reference solutions."""


def _sandbox_options(func):
    func = click.option("--sandbox", default="docker", show_default=True, help="Sandbox backend the tasks run in.")(func)
    return click.option("-S", "--sandbox_option", "sandbox_options", multiple=True, metavar="KEY=VALUE",
                        help="Sandbox backend option (repeatable), as for run.")(func)


@tasks_group.command("build")
@click.argument("path", type=click.Path(path_type=Path, file_okay=False))
@_sandbox_options
def build_command(path, sandbox, sandbox_options):
    """Build the image of every distinct task environment under PATH, each once, a few at a time."""
    tasks = [read_task(p) for p in find_tasks(os.fspath(path))]

    async def build(backend) -> list:
        contexts = {t.image: t for t in tasks if t.environment is not None}
        results = await asyncio.gather(*(_timed(backend.build_image(t.image, t.environment, t.context_digest,
                                                                     t.build_timeout)) for t in contexts.values()),
                                       return_exceptions=True)
        return list(zip(contexts.values(), results))

    results = _with_backend(sandbox, sandbox_options, build)
    failed = 0
    for task, result in results:
        if isinstance(result, BaseException):
            failed += 1
            click.echo(f"{task.image}  FAILED  {task.environment}\n{result}", err=True)
        else:
            click.echo(f"{task.image}  ready in {result:.1f} s  {task.environment}")
    click.echo(f"{len(results) - failed} of {len(results)} environment image(s) ready ({len(tasks)} task(s)).")
    sys.exit(CHECK_FAILED if failed else 0)


async def _timed(awaitable) -> float:
    started = time.monotonic()
    await awaitable
    return time.monotonic() - started


@attrs.frozen
class Check:
    """One task's oracle check: the reward with its reference solution, and in its untouched environment."""

    name: str
    solved: Optional[float]  # None: no verdict (the entry's error says why)
    untouched: Optional[float]
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.solved == 1.0 and self.untouched is not None and self.untouched < 1.0


@tasks_group.command("check")
@click.argument("path", type=click.Path(path_type=Path, file_okay=False))
@_sandbox_options
@click.option("--jobs", default=4, show_default=True, type=click.IntRange(1, 64), help="Tasks checked at once.")
def check_command(path, sandbox, sandbox_options, jobs):
    """Per task, tests/ must pass after solution/solve.sh and fail in the untouched environment; no model call."""
    tasks = [read_task(p) for p in find_tasks(os.fspath(path))]
    missing = [t.name for t in tasks if not any(rel == "solve.sh" for rel, _ in t.solution)]
    if missing:
        raise UsageError(f"{len(missing)} task(s) have no solution/solve.sh ({', '.join(missing[:5])}); "
                         "write one for each.")

    async def check_all(backend) -> list:
        slots = asyncio.Semaphore(jobs)

        async def one(task: TaskFolder) -> Check:
            async with slots:
                return await check_task(backend, verifier, task)

        return list(await asyncio.gather(*(one(t) for t in tasks)))

    verifier = _command_verifier()
    checks = _with_backend(sandbox, sandbox_options, check_all)
    width = max(len(c.name) for c in checks)
    click.echo(f"{'task':<{width}}  solution  untouched  verdict")
    for c in checks:
        verdict = "ok" if c.ok else (f"error: {c.error}" if c.error else
                                     "FAILS WITH ITS SOLUTION" if c.solved != 1.0 else "PASSES WITHOUT A SOLUTION")
        click.echo(f"{c.name:<{width}}  {_reward(c.solved):>8}  {_reward(c.untouched):>9}  {verdict}")
    fails = [c.name for c in checks if not c.error and c.solved != 1.0]
    passes = [c.name for c in checks if not c.error and c.solved == 1.0 and not (c.untouched is not None
                                                                                 and c.untouched < 1.0)]
    errors = [c.name for c in checks if c.error]
    if fails:
        click.echo(f"Fail with their solution: {', '.join(fails)}")
    if passes:
        click.echo(f"Pass without a solution: {', '.join(passes)}")
    if errors:
        click.echo(f"Could not be checked: {', '.join(errors)}")
    click.echo(f"{sum(c.ok for c in checks)} of {len(checks)} task(s) pass their oracle check.")
    sys.exit(CHECK_FAILED if fails or passes or errors else 0)


def _reward(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:g}"


def _command_verifier():
    from ..contract.plugins import collect
    from ..run import selection
    from . import plugin_manager

    return selection.verifiers(collect(plugin_manager()), ("command",))[0]


async def check_task(backend, verifier, task: TaskFolder) -> Check:
    """The oracle check of one task: its tests after solution/solve.sh, and in a fresh untouched sandbox."""
    try:
        if task.environment is not None:
            await backend.build_image(task.image, task.environment, task.context_digest, task.build_timeout)
        await backend.prepare_image(task.image)
        solved = await _graded(backend, verifier, task, solve=True)
        untouched = await _graded(backend, verifier, task, solve=False)
    except (HermesBatchError, OSError) as exc:
        return Check(task.name, None, None, " ".join(str(exc).split())[:300])
    error = solved[1] or untouched[1]
    return Check(task.name, solved[0], untouched[0], error)


async def _graded(backend, verifier, task: TaskFolder, solve: bool) -> tuple:
    """(reward or None, error) of the task's tests in a fresh sandbox, after its solution when ``solve``."""
    from ..contract.interfaces import VerifierContext

    row = PromptRow(0, task.instruction, 0, task.image, extra=task_row(task), task_options=options_of(task))
    spec = SandboxSpec("tasks-check", 0, task.context_digest or task.name, task.image, None, commands=True,
                       limits=row.task_options if row.task_options.limits_sandbox else None)
    sandbox = await backend.open(spec)
    try:
        if solve:
            for rel, text in task.solution:
                await sandbox.write_file(f"{SOLUTION_PATH}/{rel}", text.encode())
            timeout = task.agent_timeout or 600.0
            result = await sandbox.exec(f"if command -v bash >/dev/null 2>&1; then bash {SOLUTION_PATH}/solve.sh; "
                                        f"else sh {SOLUTION_PATH}/solve.sh; fi", timeout)
            if result.timed_out:
                return None, f"solution/solve.sh ran past {timeout:g} s"
        await sandbox.stop_processes()
        ctx = VerifierContext(sandbox, row, None, None, lambda *a, **k: None)
        try:
            verdict = await asyncio.wait_for(verifier.verify(ctx), verifier.timeout_for(row) + 30)
        except (TimeoutError, ValueError) as exc:
            return None, f"{'solution' if solve else 'untouched'}: {exc}"
        return verdict.reward, ""
    finally:
        await sandbox.close()


def _with_backend(name: str, options: tuple, work):
    """Run ``work(backend)`` with the sandbox backend ``name`` started (and shut down after)."""
    from ..contract.plugins import collect
    from ..contract.run_context import RunContext
    from ..run import selection
    from . import plugin_manager

    registry = collect(plugin_manager())
    given = parse_key_values(options, "-S/--sandbox_option")
    cls, _ = selection.sandbox_backend(registry, name, given)
    if "pool" in attrs.fields_dict(cls.Config) and "pool" not in given:
        given = {**given, "pool": 0}  # each sandbox made when asked: no containers started ahead for every image
    cls, config = selection.sandbox_backend(registry, name, given)

    async def main():
        with tempfile.TemporaryDirectory(prefix="hermes-batch-tasks-") as folder, \
                concurrent.futures.ThreadPoolExecutor(32) as pool:
            run = RunContext("tasks", Path(folder), 0, thread_pool=pool)
            backend = cls(config, run)
            await backend.check()
            await backend.start()
            try:
                return await work(backend)
            finally:
                await backend.shutdown()

    def interrupt(_signal, _frame):  # SIGTERM as Ctrl-C: the backend's shutdown removes its sandboxes
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        return asyncio.run(main())
    finally:
        signal.signal(signal.SIGTERM, previous)
