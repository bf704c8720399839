"""The default quality filters: no-reasoning, hallucinated-tools, empty-answer; verified (for runs with --verifier)
and no-shortcuts (the shortcut audit of metadata.audit), which a run applies only when asked."""

from __future__ import annotations

import logging
from typing import Any, Optional

import attrs

import hermes_batch
from hermes_batch.formats.conversation import reasoning_counts
from hermes_batch.contract.interfaces import Filter
from hermes_batch.formats.records import AUDIT_KINDS, Trajectory

log = logging.getLogger(__name__)


@hermes_batch.hookimpl
def register_filters(register):
    register(NoReasoningFilter)
    register(HallucinatedToolsFilter)
    register(EmptyAnswerFilter)
    register(VerifiedFilter)
    register(NoShortcutsFilter)


class NoReasoningFilter(Filter):
    """Discard samples whose assistant turns carry no reasoning at all (or too few of them: ``no-reasoning:0.5``)."""

    @attrs.frozen
    class Config:
        min_share: float = attrs.field(default=0.0, validator=[attrs.validators.ge(0), attrs.validators.le(1)])  # of assistant turns with reasoning

    name = "no-reasoning"
    description = ("Discard samples in which no assistant turn has reasoning (thinking, <think>, scratchpad); "
                   "no-reasoning:0.5 also those where fewer than half of the turns have it.")

    def check(self, trajectory: Trajectory) -> Optional[str]:
        with_, without = reasoning_counts(trajectory.conversations)
        if with_ == 0:
            return f"none of the {without} assistant turns has reasoning"
        share = with_ / (with_ + without)
        if share < self.config.min_share:
            return f"{with_} of {with_ + without} assistant turns have reasoning, fewer than {self.config.min_share:.0%}"
        return None


class HallucinatedToolsFilter(Filter):
    """Discard samples where the model called a tool that was not offered to that prompt."""

    name = "hallucinated-tools"
    description = "Discard samples that call a tool name not among the tools offered to that prompt."

    def check(self, trajectory: Trajectory) -> Optional[str]:
        offered = set(trajectory.metadata.tools_offered)
        called = {
            call.name for turn in trajectory.conversations if turn.tool_calls for call in turn.tool_calls
        }
        unknown = sorted(called - offered)
        if unknown:
            return f"called tools that were not offered: {', '.join(unknown)}"
        return None


class EmptyAnswerFilter(Filter):
    """Discard samples whose session ended in an empty reply or in a tool call the endpoint could not parse."""

    name = "empty-answer"
    description = ("Discard samples that ended in an empty reply or a tool call the endpoint could not parse "
                   "(end_reason empty_answer or unparsed_tool_call) instead of an answer; other partial samples "
                   "(turn limit, timeout) are kept.")

    def check(self, trajectory: Trajectory) -> Optional[str]:
        end = trajectory.metadata.end_reason
        if end == "empty_answer":
            return "the session ended in an empty reply"
        if end == "unparsed_tool_call":
            return "the session ended in a tool call the endpoint could not parse"
        if trajectory.completed and not (trajectory.final_answer or "").strip():  # a record of an earlier version
            return "the final answer is empty"
        return None


class VerifiedFilter(Filter):
    """Keep only samples every verifier scored, at or above a reward (rejection sampling; ``verified:0.5``).

    Without a reward given, a sample is kept when it passed: its ``metadata.passed``, which the run set from its
    ``--min_reward`` (default 1.0), so ``refilter --filter verified`` judges as the run did.
    """

    @attrs.frozen
    class Config:
        min_reward: Optional[float] = attrs.field(default=None, validator=attrs.validators.optional(
            attrs.validators.instance_of((int, float))))  # None: the run's --min_reward

    name = "verified"
    description = ("Keep only samples that passed their verifiers (--verifier): reward at or above the run's "
                   "--min_reward, or verified:0.5 for another threshold; discards unverified ones too.")

    def check(self, trajectory: Trajectory) -> Optional[str]:
        meta = trajectory.metadata
        if not meta.verifiers:
            return "no verifier ran on it"
        if not meta.verified:
            failed = [v.name for v in meta.verifiers if v.error]
            return f"not verified: the verifier {', '.join(failed) or 'run'} failed"
        threshold = self.config.min_reward
        if threshold is None:
            return None if meta.passed else f"reward {meta.reward:g} is below the run's --min_reward"
        return None if meta.reward >= threshold else f"reward {meta.reward:g} is below {threshold:g}"


def _kinds(value: Any) -> tuple:
    """Audit kinds given as ``tests-read+reward-file`` (or spaces) or a JSON list, checked against AUDIT_KINDS."""
    if isinstance(value, str):
        value = value.replace("+", " ").split()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"kinds are audit kinds joined by '+' (tests-read+reward-file), got {value!r}")
    unknown = [v for v in value if v not in AUDIT_KINDS]
    if unknown:
        raise ValueError(f"{', '.join(map(repr, unknown))} is not an audit kind; choose among {', '.join(AUDIT_KINDS)}")
    return tuple(value)


class NoShortcutsFilter(Filter):
    """Discard samples whose shortcut audit (``metadata.audit``) found something: every kind, or those chosen.

    Records without an audit (written before it existed) have no findings and are kept; the first one is logged.
    """

    @attrs.frozen
    class Config:
        kinds: Any = attrs.field(default="", converter=_kinds)  # the kinds that discard; () is every kind
        ignore: Any = attrs.field(default="", converter=_kinds)  # kinds that never discard

    name = "no-shortcuts"
    description = ("Discard samples whose shortcut audit (metadata.audit) found something, such as reading the "
                   "hidden tests or the git history; no-shortcuts:tests-read+reward-file for some kinds only, "
                   "no-shortcuts:ignore=outside-read to leave one out.")

    _said_unaudited = False

    def check(self, trajectory: Trajectory) -> Optional[str]:
        findings = trajectory.metadata.audit
        if findings is None:
            if not self._said_unaudited:
                self._said_unaudited = True
                log.warning("prompt %d has no shortcut audit (its record is older than the audit), so no-shortcuts "
                            "keeps it; so it does every record without one", trajectory.prompt_index)
            return None
        kinds = set(self.config.kinds or AUDIT_KINDS) - set(self.config.ignore)
        found = [f for f in findings if f.kind in kinds]
        if not found:
            return None
        first = {}
        for f in found:
            first.setdefault(f.kind, f)
        return "; ".join(f"{kind}: {f.target[:80]} (turn {f.turn})" for kind, f in first.items())
