"""A third party's plugins: a filter, a toolset, a writer, and the ``blockbox`` sandbox (in backend.py)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional

import hermes_batch
from hermes_batch import Distribution, Filter, Toolset, Trajectory, Writer

from .backend import BlockboxBackend


class NeedsToolCallsFilter(Filter):
    """Discard samples that made no tool call."""

    name = "needs-tool-calls"
    description = "Discard samples that made no tool call."

    def check(self, trajectory: Trajectory) -> Optional[str]:
        calls = sum(stat.count for stat in trajectory.tool_stats.values())
        return None if calls else "no tool call"


class CsvWriter(Writer):
    """One CSV line per kept trajectory: its prompt index, its turns and its final answer."""

    name = "turns-csv"
    description = "One CSV line per kept trajectory: prompt index, turns, final answer."

    def write(self, run_dir, trajectories) -> str:
        with open(Path(run_dir) / "turns.csv", "w", newline="", encoding="utf-8") as f:
            out = csv.writer(f)
            out.writerow(["prompt_index", "turns", "answer"])
            for trajectory in trajectories:
                out.writerow([trajectory.prompt_index, len(trajectory.conversations), trajectory.conversations[-1].value])
        return "turns.csv"


@hermes_batch.tool
async def shout(text: str) -> str:
    """Return ``text`` in capitals.

    Args:
        text: What to shout.
    """
    return text.upper()


@hermes_batch.hookimpl
def register_filters(register):
    register(NeedsToolCallsFilter)


@hermes_batch.hookimpl
def register_writers(register):
    register(CsvWriter)


@hermes_batch.hookimpl
def register_toolsets(register):
    register(Toolset("shouting", "Shout a text back.", (shout,)))


@hermes_batch.hookimpl
def register_distributions(register):
    register(Distribution("blockbox", "The shouting toolset and the terminal", (("shouting", 1.0), ("terminal", 1.0))))


@hermes_batch.hookimpl
def register_sandbox_backends(register):
    register(BlockboxBackend)
