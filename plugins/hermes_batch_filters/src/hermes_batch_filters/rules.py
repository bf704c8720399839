"""The per-record filters: each decides from one trajectory record alone, with a reason a person can act on."""

from __future__ import annotations

import json
from typing import Optional

import attrs

from hermes_batch import Filter, Trajectory

_v = attrs.validators


def _share(_instance, attribute, value):
    if not 0 <= value <= 1:
        raise ValueError(f"{attribute.name} must be between 0 and 1, got {value}")


def _at_least(minimum):
    def check(_instance, attribute, value):
        if value < minimum:
            raise ValueError(f"{attribute.name} must be at least {minimum}, got {value}")

    return check


def tool_calls_and_failures(trajectory: Trajectory) -> tuple[int, int]:
    """(tool calls made, of which failed); calls of unknown tools count as failed calls."""
    calls = sum(stat.count for stat in trajectory.tool_stats.values())
    failures = sum(stat.failure for stat in trajectory.tool_stats.values())
    unknown = sum(1 for call in trajectory.metadata.invalid_tool_calls if call.reason == "unknown tool")
    return calls + unknown, failures + unknown


class MaxToolErrorsFilter(Filter):
    """Discard samples in which too large a share of the tool calls failed."""

    @attrs.frozen
    class Config:
        max_share: float = attrs.field(default=0.5, validator=_share)  # discard above this share of failed calls

    name = "max-tool-errors"
    description = "Discard samples whose share of failed tool calls is above max_share (default 0.5)."

    def check(self, trajectory: Trajectory) -> Optional[str]:
        calls, failures = tool_calls_and_failures(trajectory)
        if calls and failures / calls > self.config.max_share:
            return f"{failures} of {calls} tool calls failed ({failures / calls:.0%}, above {self.config.max_share:.0%})"
        return None


class MinToolCallsFilter(Filter):
    """Discard samples with fewer tool calls than asked for."""

    @attrs.frozen
    class Config:
        min_calls: int = attrs.field(default=1, validator=_at_least(0))

    name = "min-tool-calls"
    description = "Discard samples with fewer than min_calls tool calls (default 1)."

    def check(self, trajectory: Trajectory) -> Optional[str]:
        calls, _failures = tool_calls_and_failures(trajectory)
        if calls < self.config.min_calls:
            return f"{calls} tool call(s), fewer than {self.config.min_calls}"
        return None


class FinalAnswerFilter(Filter):
    """Discard samples that did not end with a final answer of their own."""

    @attrs.frozen
    class Config:
        min_chars: int = attrs.field(default=1, validator=_at_least(1))  # of the answer, whitespace stripped

    name = "final-answer"
    description = ("Discard samples that did not end with a non-empty final answer (cut by --max_turns, "
                   "--prompt_timeout, the context or max tokens).")

    def check(self, trajectory: Trajectory) -> Optional[str]:
        end = trajectory.metadata.end_reason
        if end == "empty_answer":  # the model ended with nothing to say
            return "the final answer is empty"
        if end and end != "final_answer":
            return f"ended by {end}, not by a final answer"
        if trajectory.partial or not trajectory.completed:
            return "ended before a final answer"
        answer = (trajectory.final_answer or "").strip()
        if len(answer) < self.config.min_chars:
            if not answer:
                return "the final answer is empty"
            return f"the final answer has {len(answer)} characters, fewer than {self.config.min_chars}"
        return None


class RepetitionFilter(Filter):
    """Discard samples that make the same tool call several times in a row (a loop)."""

    @attrs.frozen
    class Config:
        times: int = attrs.field(default=3, validator=_at_least(2))  # this many identical calls in a row discard

    name = "repetition"
    description = "Discard samples that call the same tool with the same arguments `times` times in a row (default 3)."

    def check(self, trajectory: Trajectory) -> Optional[str]:
        previous, run, worst, worst_name = None, 0, 0, ""
        for turn in trajectory.conversations:
            for call in turn.tool_calls or ():
                key = (call.name, json.dumps(call.arguments, sort_keys=True, ensure_ascii=False))
                run = run + 1 if key == previous else 1
                previous = key
                if run > worst:
                    worst, worst_name = run, call.name
        if worst >= self.config.times:
            return f"called {worst_name} with the same arguments {worst} times in a row"
        return None


class LengthFilter(Filter):
    """Discard samples outside character or token bounds (0: no bound)."""

    @attrs.frozen
    class Config:
        max_chars: int = attrs.field(default=0, validator=_at_least(0))
        min_chars: int = attrs.field(default=0, validator=_at_least(0))
        max_tokens: int = attrs.field(default=0, validator=_at_least(0))
        min_tokens: int = attrs.field(default=0, validator=_at_least(0))

    name = "length"
    description = ("Discard samples outside bounds of characters (of the user, assistant and tool turns) or of "
                   "tokens (completion tokens the endpoint reported); 0 is no bound.")

    def check(self, trajectory: Trajectory) -> Optional[str]:
        c = self.config
        chars = sum(len(turn.value) for turn in trajectory.conversations if turn.from_ != "system")
        if c.max_chars and chars > c.max_chars:
            return f"{chars} characters, more than {c.max_chars}"
        if chars < c.min_chars:
            return f"{chars} characters, fewer than {c.min_chars}"
        usage = trajectory.metadata.usage
        if not (usage.prompt_tokens or usage.completion_tokens):
            return None  # the endpoint reported no usage: token bounds cannot be judged (README)
        tokens = usage.completion_tokens
        if c.max_tokens and tokens > c.max_tokens:
            return f"{tokens} completion tokens, more than {c.max_tokens}"
        if tokens < c.min_tokens:
            return f"{tokens} completion tokens, fewer than {c.min_tokens}"
        return None
