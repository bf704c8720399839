"""Records for tests of filters and writers, built with every field filled in; records of two runs compared."""

from __future__ import annotations

import re
from typing import Any

import attrs

from hermes_batch.formats import hermes_format
from hermes_batch.formats.records import Metadata, ToolCallRecord, ToolStat, Trajectory, Turn


def make_trajectory(**overrides: Any) -> Trajectory:
    """A kept, completed Trajectory (system, human, gpt with reasoning and a tool call, tool, final gpt turn).

    Any field can be overridden by name; ``metadata`` may be a dict of Metadata
    fields to change, and ``answer`` / ``reasoning`` set the last turn's text::

        make_trajectory(tool_stats={"terminal": ToolStat(4, 1, 3)}, metadata={"end_reason": "max_turns"})
    """
    answer = overrides.pop("answer", "The answer is 42.")
    reasoning = overrides.pop("reasoning", "The user wants a number.")
    call = ToolCallRecord("call-1", "terminal", {"command": "echo 42"})
    final = hermes_format.assistant_text(reasoning, answer, ())
    result = {"tool_call_id": "call-1", "name": "terminal", "content": {"output": "42", "exit_code": 0, "error": None}}
    fields: dict[str, Any] = dict(
        prompt_index=0,
        conversations=(
            Turn("system", "You are a helpful assistant."),
            Turn("human", "What is six times seven?"),
            Turn("gpt", hermes_format.assistant_text("Let me compute.", "", [(call.name, call.arguments)]), (call,)),
            Turn("tool", hermes_format.tool_text([result])),
            Turn("gpt", final),
        ),
        metadata=Metadata(
            batch_num=0, timestamp="2025-01-01T00:00:00Z", model="scripted-model", content_key="0" * 32,
            end_reason="final_answer", tools_offered=("terminal",),
        ),
        completed=True,
        partial=False,
        api_calls=2,
        toolsets_used=("terminal",),
        tool_stats={"terminal": ToolStat(1, 1, 0)},
        tool_error_counts={"terminal": 0},
    )
    metadata = overrides.pop("metadata", None)
    if isinstance(metadata, dict):
        fields["metadata"] = attrs.evolve(fields["metadata"], **metadata)
    elif metadata is not None:
        fields["metadata"] = metadata
    fields.update(overrides)
    return Trajectory(**fields)


def make_filter(spec: str, pm=None):
    """The filter ``--filter SPEC`` selects (``NAME[:OPTIONS]``), its options structured as the command line does.

    ``pm``: a plugin manager (default: the core's plugins and the plugin under test, ``hermes_batch.testing.scope``;
    ``get_plugin_manager()`` for every installed one).
    """
    from hermes_batch.run.selection import plugin

    from .scope import plugin_manager

    return plugin((pm or plugin_manager()).registry(), "filters", spec, "--filter")


RUN_NOISE = frozenset({"timestamp", "duration_s", "latency_s"})
"""The record fields that differ between any two runs of the same dataset."""
_CALL_ID = re.compile(r"call_hb\d+")  # the scripted server numbers tool calls in the order requests arrive


def steady(value: Any) -> Any:
    """A record (any JSON value) without what differs between two runs of one dataset against the scripted
    server: the ``RUN_NOISE`` fields, and tool call ids, which the server numbers in arrival order."""
    if isinstance(value, dict):
        return {k: steady(v) for k, v in value.items() if k not in RUN_NOISE}
    if isinstance(value, list):
        return [steady(v) for v in value]
    if isinstance(value, str):
        return _CALL_ID.sub("call_hb#", value)
    return value
