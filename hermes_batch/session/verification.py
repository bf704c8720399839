"""A sample's verification: each --verifier in turn, in the sample's sandbox, each on its own clock.

First every process the session left running in the sandbox is ended (``Sandbox.stop_processes``):
the verifiers see the files the session made, never a process of the model's still at work.

A verifier that raises, outlasts its timeout or returns a reward that is not a
number in [0, 1] (formats/reward_numbers.py) gives an entry with ``error`` and
reward 0.0; the sample is then not verified (so it cannot pass), and the run goes
on.  Only the run's own stop (Ctrl-C, a fatal model or folder error) passes through.
"""

from __future__ import annotations

import asyncio
import logging
import time

import attrs

from ..contract.interfaces import VerifierContext
from ..errors import FatalModelError, RunFolderWriteError, SandboxError
from ..formats.endpoint_numbers import checked_usage
from ..formats.records import Trajectory, VerifierResult
from ..formats.reward_numbers import checked_reward

log = logging.getLogger("hermes_batch.prompt")

MAX_REASON_CHARS = 500
MAX_ERROR_CHARS = 500


def _short(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def verify(processor, sandbox, row, trajectory: Trajectory, state, fresh_sandbox=None) -> Trajectory:
    """``trajectory`` with its verifiers' results, reward, verified and passed; the usage of their model calls added.

    ``fresh_sandbox`` opens another sandbox of the sample's spec, for a verifier that grades in one
    (``command:clean=true``)."""
    extra = []

    def report_usage(usage, journaled: bool = False) -> None:
        usage = checked_usage(usage)
        extra.append(usage)
        if not journaled and processor.client.journal is not None:
            processor.client.journal.tool_usage(usage)

    await _stop_processes(sandbox)
    ctx = VerifierContext(sandbox, row, trajectory, processor.client, report_usage, state.calls, fresh_sandbox)
    calls_before = len(state.calls)
    results = [await _one(verifier, ctx) for verifier in processor.verifiers]
    verified = bool(results) and all(r.ok for r in results)
    reward = min(r.reward for r in results) if verified else 0.0
    meta = trajectory.metadata
    usage = meta.usage
    for part in extra:
        usage = usage + part
    meta = attrs.evolve(
        meta, reward=reward, verified=verified, passed=verified and reward >= processor.min_reward,
        verifiers=tuple(results), usage=usage, calls=meta.calls + tuple(state.calls[calls_before:]),
    )
    return attrs.evolve(trajectory, metadata=meta)


_said_cannot_stop: set = set()  # backends warned about once


async def _stop_processes(sandbox) -> None:
    """End what the session left running, so that a daemon of the model's cannot rewrite the tests or the reward."""
    try:
        stopped = await sandbox.stop_processes()
    except SandboxError as exc:  # the verifiers' commands fail the same way, each with its entry
        log.warning("could not end the session's processes before verification: %s", exc)
        return
    kind = type(getattr(sandbox, "opened", None) or sandbox).__name__
    if not stopped and kind not in _said_cannot_stop:
        _said_cannot_stop.add(kind)
        log.warning("%s cannot end the processes a session left running; a process the model left behind can "
                    "change what the verifiers see.", kind)


async def _one(verifier, ctx: VerifierContext) -> VerifierResult:
    started = time.monotonic()
    timeout = verifier.timeout_for(ctx.row) if hasattr(verifier, "timeout_for") else verifier.timeout

    def result(**fields) -> VerifierResult:
        return VerifierResult(verifier.name, duration_s=round(time.monotonic() - started, 3), **fields)

    try:
        async with asyncio.timeout(timeout):
            verdict = await verifier.verify(ctx)
        try:
            reward = checked_reward(verdict.reward)
        except ValueError as exc:  # a reward outside [0, 1] would pass any --min_reward or poison the sums
            raise ValueError(f"it returned the reward {exc}") from None
    except (FatalModelError, RunFolderWriteError):  # the run stops: nothing can be recorded anyway
        raise
    except TimeoutError as exc:
        elapsed = time.monotonic() - started
        why = f"timed out after {timeout:g} s" if elapsed >= timeout - 0.01 else (str(exc) or "timed out")
        log.warning("verifier %s: %s", verifier.name, why)
        return result(error=_short(why, MAX_ERROR_CHARS))
    except Exception as exc:  # a verifier's bug or a refused row fails its entry, not the sample or the run
        log.warning("verifier %s failed: %s", verifier.name, exc)
        log.debug("verifier %s failed", verifier.name, exc_info=True)
        return result(error=_short(f"{type(exc).__name__}: {exc}", MAX_ERROR_CHARS))
    disagree = getattr(verdict, "disagree", None)
    return result(reward=reward, reason=_short(verdict.reason or "", MAX_REASON_CHARS), output=str(verdict.output or ""),
                  disagree=disagree if isinstance(disagree, bool) else None)
