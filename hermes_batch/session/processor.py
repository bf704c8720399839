"""What happens to one prompt: sandbox, agent session, trajectory record."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timezone
from typing import Callable, Mapping, Optional, Union

import attrs

from .agent import AgentSettings, SessionLog, run_session
from .replay import replay_key
from ..formats.conversation import to_sharegpt
from ..errors import FatalModelError, ModelCallError, PromptFailure, PromptTimeout, RunFolderWriteError, SandboxError
from ..contract.interfaces import ModelClient, PromptJob, SandboxBackend, ToolContext
from ..folder.journal import current_prompt
from ..formats.records import Failure, Metadata, PromptRow, SandboxSpec, Trajectory
from .audit import audit_sample
from .token_check import check_tokens
from .verification import verify
from ..contract.run_context import RunContext
from .sandbox_start import OpeningSandbox, SandboxCloser
from .branches import PrefixStore, branch_seed, prefix_key, run_prefix
from ..model.session_sampling import session_sampling
from ..contract.toolsets import PromptToolsets


log = logging.getLogger("hermes_batch.prompt")


async def quietly(awaitable) -> None:
    """Await a cleanup step; its failure is logged, since it must not hide the outcome being reported."""
    try:
        await awaitable
    except Exception:
        log.debug("cleanup step failed", exc_info=True)


def now_iso() -> str:
    # milliseconds: statistics tell sessions apart by these, and a resume may start within the same second
    return datetime.now(timezone.utc).replace(tzinfo=None).isoformat(timespec="milliseconds")


@attrs.define
class PromptProcessor:
    """Turns a PromptJob into a Trajectory or a Failure; shared by all prompts of a run."""

    run_name: str
    model: str
    seed: int
    client: ModelClient
    backend: SandboxBackend
    toolsets: Mapping[str, tuple]  # toolset name -> Tool instances
    all_tools: tuple  # every tool name known to the run, for the fixed record schema
    agent: AgentSettings
    verbose: bool = False
    runtimes: Mapping = attrs.Factory(dict)  # toolset name -> ToolsetRuntime
    run: Optional[RunContext] = None  # what the runtimes are started with
    plan: Optional[object] = None  # the run.plan.RunPlan what it was built from (plan.build_processor), for executors that run prompts elsewhere
    verifiers: tuple = ()  # Verifier instances, in --verifier order
    min_reward: float = 1.0  # what a verified sample's reward must reach to pass
    model_client: Optional[Callable] = None  # (name, ModelSettings) -> another installed client, for verifiers
    sampling: Mapping = attrs.Factory(dict)  # the sampling settings the requests send (ModelSettings.sampling)
    closer: SandboxCloser = attrs.field(factory=SandboxCloser, init=False)  # sandboxes closed once they are open
    replayer: Optional[object] = None  # session.replay.Replayer: answers journaled, replayed on --resume (set by run/session_journals.py)
    branch_at: Optional[int] = None  # --branch_at: each sample continues its row's prefix of this many model calls
    prefixes: PrefixStore = attrs.field(factory=PrefixStore, init=False)  # the prefixes branches wait for or copy

    async def start(self) -> None:
        """Before the first prompt: start the sandbox backend, then the toolset runtimes."""
        await self.backend.start()
        for runtime in self.runtimes.values():
            await runtime.start(self.run, self.client)
        for verifier in self.verifiers:
            verifier.check_backend(self.backend)
            await verifier.start(self.run, self.client, self.model_client)

    async def aclose(self) -> None:
        """After the last prompt, also on Ctrl-C: shut the runtimes down, wait for the
        sandboxes still being opened when their prompts ended to be closed, then shut
        the backend and the client down."""
        for runtime in self.runtimes.values():
            await quietly(runtime.shutdown())
        await quietly(self.closer.drain())
        for verifier in self.verifiers:  # after the last sample's verification
            await quietly(verifier.shutdown())
        await quietly(self.backend.shutdown())
        await quietly(self.client.aclose())

    async def process(self, job: PromptJob) -> Union[Trajectory, Failure]:
        row: PromptRow = job.row
        current_prompt.set(row.prompt_index)  # for the call journal; each prompt runs in a task of its own
        started = time.monotonic()
        state = SessionLog()
        if self.replayer is not None:
            state.replay = self.replayer.session(replay_key(job), job.replay, job.sample_index)
        try:
            return await self._run(job, row, started, state)
        except (FatalModelError, RunFolderWriteError):  # the run stops: no prompt can go on
            raise
        except PromptFailure as exc:
            return self._failure(job, exc, type(exc).kind, state)
        except ModelCallError as exc:
            return self._failure(job, exc, "model_request", state)
        except Exception as exc:  # a bug in a plugin fails its prompt, not the run
            log.debug("[B%d:P%d] unexpected error", job.batch_num, row.prompt_index, exc_info=True)
            return self._failure(job, exc, "internal", state)

    async def _run(self, job: PromptJob, row: PromptRow, started: float, state: SessionLog) -> Trajectory:
        tools = {tool.name: tool for name in job.toolsets for tool in self.toolsets[name]}
        say = self._logger(job) if self.verbose else None
        if say:
            sample = f" (sample {job.sample_index})" if job.sample_index else ""
            say(f"toolsets{sample}: {', '.join(job.toolsets) or 'none'} -> {len(tools)} tools: {', '.join(tools)}")
        task = row.task_options  # a Harbor task's row (formats/task_folders.py): its image and limits
        if task is not None and self.backend.ignores_images:  # its tests replace /tests and /logs: containers only
            raise SandboxError(f"The {self.backend.name} sandbox runs no image, so it cannot run a Harbor task "
                               "(its image, /tests and /logs); use --sandbox docker.")
        if task is not None and task.context is not None:  # built once per content, shared: not on its clock
            await self.backend.build_image(task.image, task.context, task.digest, task.build_timeout)
        await self.backend.prepare_image(row.image)  # shared by every prompt of the image, so not on its clock
        commands = any(getattr(tool, "runs_commands", False) for tool in tools.values())
        key = job.content_key if job.sample_index else row.content_key  # the sample's key (sample 0: the row's)
        spec = SandboxSpec(self.run_name, row.prompt_index, key, row.image, row.cwd, commands=commands,
                           limits=task if task is not None and task.limits_sandbox else None)
        sandbox = OpeningSandbox(self.backend, spec, self.closer, label=f"[B{job.batch_num}:P{row.prompt_index}]")
        # a branch opened from its prefix's snapshot (Sandbox.snapshot) waits for that image
        snapshot = self.branch_at is not None and self.backend.snapshots_filesystems
        if tools and self.backend.open_early and not snapshot:
            sandbox.start()  # beside the first model request, which does not need it; a tool call waits for it

        def count_usage(usage, journaled):  # model calls made by tools count in the prompt's usage and the run's
            state.usage = state.usage + usage
            if not journaled and self.client.journal is not None:
                self.client.journal.tool_usage(usage)

        sessions = PromptToolsets({n: self.runtimes[n] for n in job.toolsets if n in self.runtimes}, count_usage)
        try:
            try:
                # the deadline covers the session and the open of the sandbox; closing is outside, so it always happens
                prompt_timeout = task.agent_timeout if task is not None and task.agent_timeout else self.agent.prompt_timeout
                async with asyncio.timeout(prompt_timeout) as deadline:
                    ctx = ToolContext(
                        sandbox, command_timeout=self.agent.command_timeout,
                        max_output_chars=self.agent.max_output_chars,
                        toolsets=sessions, thread_pool=self.run.thread_pool if self.run is not None else None,
                    )
                    if self.branch_at is None:
                        result = await run_session(self.client, tools, ctx, row.prompt, self.agent, say, state)
                    else:
                        result = await self._branch(job, tools, sandbox, ctx, say, state)
            except TimeoutError:
                if not deadline.expired():
                    raise
                if not state.api_calls:
                    raise PromptTimeout(
                        f"--prompt_timeout ({prompt_timeout:g} s) passed before the model answered once."
                    ) from None
                log.warning("[B%d:P%d] stopped by --prompt_timeout after %g s; saved as partial.",
                            job.batch_num, row.prompt_index, prompt_timeout)
                result = state.result(completed=False, end_reason="timeout")
            finally:
                await sessions.aclose()  # a browser context, say; before the sandbox, and also on errors and Ctrl-C
            trajectory = self._trajectory(job, row, key, tools, spec, result, state, started)
            if self.client.settings.logprobs:
                side = await check_tokens(self.client, self.agent.system_prompt, row.prompt, result.messages,
                                          tuple(tool.spec() for tool in tools.values()), trajectory.conversations)
                metadata = attrs.evolve(trajectory.metadata, token_check=side.check)
                trajectory = attrs.evolve(trajectory, metadata=metadata, tokens=side)
            # every sample, verified or not: about a millisecond, in a thread for the rare long ones
            pool = self.run.thread_pool if self.run is not None else None
            trajectory = await audit_sample(trajectory, row.extra, sandbox.workdir, pool)
            if self.verifiers:  # after the session, in its sandbox, before that closes; on no deadline but their own
                trajectory = await verify(self, sandbox, row, trajectory, state, self._fresh_sandbox(spec, job))
        finally:
            await sandbox.close()  # at once when it is open; one still opening is closed when it is
        return trajectory

    async def _branch(self, job: PromptJob, tools: dict, sandbox: OpeningSandbox, ctx: ToolContext, say, state):
        """--branch_at: the session of branch ``job.sample_index``, continued from its row's prefix (made once) in
        ``sandbox``, a copy of the prefix's; with a seed of its own where the client sends one."""
        key = prefix_key(job.row.content_key, self.branch_at)
        prefix = await self.prefixes.copy_into(key, lambda: run_prefix(self, job, tools, self.branch_at, say), sandbox)
        prefix.start(job.sample_index, state)
        state.branch_of, state.branch_turn = key, prefix.state.api_calls
        if self.client.sends_seed:
            state.sampling = {**self.sampling, "seed": branch_seed(self.seed, key, job.sample_index)}
        if prefix.ended is not None:  # the session ended by itself before the branch point: nothing to continue
            completed, end_reason = prefix.ended
            return state.result(completed=completed, end_reason=end_reason)
        token = session_sampling.set({"seed": state.sampling["seed"]} if state.sampling else None)
        try:
            return await run_session(self.client, tools, ctx, job.row.prompt, self.agent, say, state)
        finally:
            session_sampling.reset(token)

    def _fresh_sandbox(self, spec: SandboxSpec, job: PromptJob):
        """A function that opens another sandbox of ``spec``, ready, for a verifier (which closes it)."""

        async def open_fresh():
            fresh = OpeningSandbox(self.backend, attrs.evolve(spec, commands=True), self.closer,
                                   label=f"[B{job.batch_num}:P{job.row.prompt_index}] fresh")
            try:
                await fresh.ready()
            except BaseException:
                await fresh.close()
                raise
            return fresh

        return open_fresh

    def _trajectory(self, job: PromptJob, row: PromptRow, key: str, tools: dict, spec: SandboxSpec, result,
                    state: SessionLog, started: float) -> Trajectory:
        specs = tuple(tool.spec() for tool in tools.values())
        metadata = Metadata(
            batch_num=job.batch_num,
            timestamp=now_iso(),
            model=self.model,
            content_key=key,
            id="" if row.id is None else str(row.id),
            row=row.extra,
            seed=self.seed,
            sandbox=self.backend.name,
            isolation=self.backend.isolation,
            image=self.backend.image_for(spec),  # what the sandbox runs or would run, whether or not a tool opened it
            cwd=row.cwd or "",
            tools_offered=tuple(tools),
            end_reason=result.end_reason,
            invalid_tool_calls=result.invalid_tool_calls,
            duration_s=round(time.monotonic() - started, 3),
            usage=result.usage,
            calls=tuple(state.calls),
            sample_index=job.sample_index,
            replayed_turns=state.replayed_turns,
            sampling=dict(self.sampling if state.sampling is None else state.sampling),
            branch_of=state.branch_of,
            branch_turn=state.branch_turn,
        )
        trajectory = Trajectory(
            prompt_index=row.prompt_index,
            conversations=to_sharegpt(self.agent.system_prompt, specs, row.prompt, result.messages),
            metadata=metadata,
            completed=result.completed,
            partial=result.partial,
            api_calls=result.api_calls,
            toolsets_used=tuple(job.toolsets),
            tool_stats=result.tool_stats,
            tool_error_counts={name: stat.failure for name, stat in result.tool_stats.items()},
        )
        return trajectory.with_tools(self.all_tools)

    def _failure(self, job: PromptJob, exc: BaseException, kind: str, state: SessionLog) -> Failure:
        row = job.row
        message = str(exc) or type(exc).__name__
        log.warning("[B%d:P%d] failed: %s", job.batch_num, row.prompt_index, message)
        return Failure(
            prompt_index=row.prompt_index,
            content_key=job.content_key if job.sample_index else row.content_key,
            batch_num=job.batch_num,
            error_class=type(exc).__name__,
            error_kind=kind,
            message=message,
            timestamp=now_iso(),
            prompt=row.prompt,
            api_calls=state.api_calls,
            usage=state.usage,
            calls=tuple(state.calls),
            sample_index=job.sample_index,
        )

    @staticmethod
    def _logger(job: PromptJob) -> Callable[[str], None]:
        prefix = f"[B{job.batch_num}:P{job.row.prompt_index}]"
        return lambda text: log.info("%s %s", prefix, text)
