"""Branches from a shared prefix (--branch_at TURN --branches K): a row's session run once to TURN model calls,
its sandbox kept as it was then, and K sessions continued from there, each in its own copy.

The prefix is a session of its own: its answers are journaled in responses.jsonl under the prefix's key
(:func:`prefix_key`, the records' ``metadata.branch_of``), so it is paid once, also across a kill: a resume,
or a branch that starts after every other branch of its row had copied the snapshot, rebuilds it by
replaying those answers (no model call; its tools run again, as a resumed session's do).  The snapshot is
the prefix's sandbox itself, its processes stopped, held open while branches copy its working folder
(``Sandbox.copy_workdir_to``: copy-on-write where the backend and filesystem can) and closed once the last
branch waiting for it has its copy; a backend that images a whole filesystem (``Sandbox.snapshot``: Docker's
committed image) opens each branch's sandbox from that image instead.  What a copy cannot carry: running processes, their memory, a
toolset's session (a browser page): each branch starts with none of them.

Each branch is one of the row's samples (its ``sample_index`` the branch's number), with a seed of its own
(:func:`branch_seed`) that the requests of a client that sends one carry, so that the branches' samples
differ; the seed is kept in the record's ``metadata.sampling``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Callable, Optional

import attrs

from ..contract.interfaces import ToolContext
from ..contract.toolsets import PromptToolsets
from ..errors import PromptTimeout
from ..formats.records import SandboxSpec
from .agent import SessionLog, _Tally, run_session
from .sandbox_start import OpeningSandbox

log = logging.getLogger("hermes_batch.prompt")


def prefix_key(row_key: str, turn: int) -> str:
    """The key of a row's prefix to ``turn`` model calls: its answers' key in responses.jsonl, its sandbox's, and
    the branches' ``metadata.branch_of``; never a sample's key (those are the row's key or 32 hex digits)."""
    return hashlib.sha256(f"{row_key}\0prefix\0{turn}".encode()).hexdigest()[:32] + f"@{turn}"


def branch_seed(run_seed: int, key: str, branch: int) -> int:
    """The seed of branch ``branch`` of the prefix ``key``: the same on a resume, another for each branch."""
    return int(hashlib.sha256(f"{run_seed}\0{key}\0{branch}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


@attrs.frozen
class Prefix:
    """A row's session to turn TURN, and the sandbox it left (processes stopped), held while branches copy it."""

    key: str
    state: SessionLog
    ended: Optional[tuple]  # (completed, end_reason) when the session ended by itself before TURN; else None
    sandbox: OpeningSandbox
    image: Optional[str] = None  # the backend's snapshot of the prefix's whole filesystem (Docker), else None

    def start(self, branch: int, state: SessionLog) -> None:
        """Make ``state`` (a branch's, fresh) the prefix's conversation; the prefix's usage and calls are the first
        branch's only, so the records' usage sums to what was paid."""
        state.messages[:] = self.state.messages
        state.api_calls = self.state.api_calls
        state.invalid[:] = self.state.invalid
        state.tallies.update((name, _Tally(t.count, t.success, t.failure)) for name, t in self.state.tallies.items())
        if branch == 0:
            state.calls[:] = self.state.calls
            state.usage = self.state.usage


@attrs.define
class _Held:
    task: asyncio.Task
    users: int = 0


class PrefixStore:
    """The prefixes of the rows whose branches run now, each made once while branches wait for it."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    async def copy_into(self, key: str, make: Callable, sandbox: OpeningSandbox) -> Prefix:
        """The prefix ``key`` (made by ``make()`` unless it is held), its sandbox's working folder copied into
        ``sandbox`` when the prefix opened one."""
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = _Held(asyncio.get_running_loop().create_task(make(), name=f"prefix {key}"))
        held.users += 1
        try:
            prefix = await asyncio.shield(held.task)
            if prefix.image is not None:
                sandbox.open_from(prefix.image)
            elif prefix.sandbox.started:
                await prefix.sandbox.copy_workdir_to(sandbox)
            return prefix
        finally:
            await self._release(key, held)

    async def _release(self, key: str, held: _Held) -> None:
        held.users -= 1
        if held.users:
            return
        if self._held.get(key) is held:
            del self._held[key]
        task = held.task
        if not task.done():
            task.cancel()  # nobody waits for it any more (Ctrl-C): its sandbox is closed as it ends
            await asyncio.wait((task,))
            return
        if not task.cancelled() and task.exception() is None:
            await task.result().sandbox.close()


async def run_prefix(processor, job, tools: dict, turn: int, say) -> Prefix:
    """Run the row of ``job`` to ``turn`` model calls in a sandbox of its own, replaying the answers journaled."""
    row = job.row
    key = prefix_key(row.content_key, turn)
    commands = any(getattr(tool, "runs_commands", False) for tool in tools.values())
    spec = SandboxSpec(processor.run_name, row.prompt_index, key, row.image, row.cwd, commands=commands)
    label = f"[B{job.batch_num}:P{row.prompt_index}] prefix"
    sandbox = OpeningSandbox(processor.backend, spec, processor.closer, label=label)
    state = SessionLog()
    replayer = processor.replayer
    if replayer is not None:
        answers = getattr(replayer.journal, "answers", None)
        state.replay = replayer.session(key, answers(key) if answers is not None else None)

    def count_usage(usage, journaled):
        state.usage = state.usage + usage
        if not journaled and processor.client.journal is not None:
            processor.client.journal.tool_usage(usage)

    runtimes = {n: processor.runtimes[n] for n in job.toolsets if n in processor.runtimes}
    sessions = PromptToolsets(runtimes, count_usage)
    agent = attrs.evolve(processor.agent, max_turns=turn)
    try:
        try:
            async with asyncio.timeout(agent.prompt_timeout) as deadline:
                ctx = ToolContext(
                    sandbox, command_timeout=agent.command_timeout, max_output_chars=agent.max_output_chars,
                    toolsets=sessions, thread_pool=processor.run.thread_pool if processor.run is not None else None,
                )
                result = await run_session(processor.client, tools, ctx, row.prompt, agent, say, state)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise PromptTimeout(f"--prompt_timeout ({agent.prompt_timeout:g} s) passed during the shared prefix "
                                f"(--branch_at {turn}).") from None
        finally:
            await sessions.aclose()
        image = None
        if sandbox.started:
            await sandbox.stop_processes()  # a snapshot carries files, never processes
            if processor.backend.snapshots_filesystems:
                image = await sandbox.snapshot()
    except BaseException:
        await sandbox.close()
        raise
    ended = None if result.end_reason == "max_turns" else (result.completed, result.end_reason)
    if say:
        say(f"prefix of {state.api_calls} model call(s) done" + (f", ended: {ended[1]}" if ended else ""))
    return Prefix(key, state, ended, sandbox, image)
