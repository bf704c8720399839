"""The default quality filters: no-reasoning and hallucinated-tools."""

from __future__ import annotations

from typing import Optional

import attrs

import hermes_batch
from hermes_batch.formats.conversation import reasoning_counts
from hermes_batch.contract.interfaces import Filter
from hermes_batch.formats.records import Trajectory


@hermes_batch.hookimpl
def register_filters(register):
    register(NoReasoningFilter)
    register(HallucinatedToolsFilter)


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
