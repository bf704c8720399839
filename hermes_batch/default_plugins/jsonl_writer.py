"""The default output writer: trajectories.jsonl, one ShareGPT trajectory per line."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import hermes_batch
from hermes_batch.interfaces import Writer
from hermes_batch.records import Trajectory
from hermes_batch.runfolder import atomic_write_lines
from hermes_batch.serialization import to_json_line


class JsonlWriter(Writer):
    """Writes ``trajectories.jsonl`` atomically; every line has the same schema, so HuggingFace datasets loads it."""

    name = "jsonl"
    description = "trajectories.jsonl: one ShareGPT-style trajectory per line"
    filename = "trajectories.jsonl"

    def write(self, run_dir, trajectories: Iterable[Trajectory]) -> str:
        """Replace ``run_dir/trajectories.jsonl`` with ``trajectories``."""
        atomic_write_lines(Path(run_dir) / self.filename, (to_json_line(t) for t in trajectories))
        return self.filename


@hermes_batch.hookimpl
def register_writers(register):
    register(JsonlWriter)
