"""The ``openai`` writer: OpenAI chat fine-tuning lines (``messages`` with tool calls, and ``tools``)."""

from __future__ import annotations

import json
from typing import Optional

import attrs

import hermes_batch
from hermes_batch.formats.openai_format import Unrepresentable, to_openai
from hermes_batch.formats.records import Trajectory
from hermes_batch.contract.writers import FileWriter, LineSink


@attrs.frozen
class OpenAIOptions:
    reasoning: str = attrs.field(default="keep", validator=attrs.validators.in_(("keep", "drop")))
    # OpenAI's own fine-tuning refuses any other key on a line: the reward is added only when asked for
    reward: str = attrs.field(default="drop", validator=attrs.validators.in_(("keep", "drop")))


class OpenAIWriter(FileWriter):
    """One ``{"messages", "tools"}`` line per trajectory, as OpenAI's chat fine-tuning format defines it."""

    name = "openai"
    description = ("trajectories.openai.jsonl: OpenAI chat fine-tuning lines (openai:reasoning=drop leaves reasoning "
                   "out; openai:reward=keep adds each sample's reward, passed and sample_index)")
    filename = "trajectories.openai.jsonl"
    suffix = ".jsonl"
    Config = OpenAIOptions
    skips = "a call of a tool not offered, arguments that are not JSON, a call never answered"

    def encode(self, trajectory: Trajectory) -> Optional[str]:
        try:
            line = to_openai(trajectory, reasoning=self.config.reasoning)
        except Unrepresentable:
            return None
        if self.config.reward == "keep":
            meta = trajectory.metadata
            line.update(reward=float(meta.reward), passed=bool(meta.passed), sample_index=meta.sample_index)
        return json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n"

    def open(self, path) -> LineSink:
        return LineSink(path, self.encode)


@hermes_batch.hookimpl
def register_writers(register):
    register(OpenAIWriter)
