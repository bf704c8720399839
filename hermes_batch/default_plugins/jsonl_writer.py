"""The default output writer: trajectories.jsonl, one ShareGPT trajectory per line (also ``export --format sharegpt``)."""

from __future__ import annotations

import os

import hermes_batch
from hermes_batch.formats.serialization import to_json_line
from hermes_batch.contract.writers import FileWriter, LineSink


class JsonlWriter(FileWriter):
    """Writes ``trajectories.jsonl`` atomically; every line has the same schema, so HuggingFace datasets loads it."""

    name = "jsonl"
    description = "trajectories.jsonl: one ShareGPT-style trajectory per line"
    filename = "trajectories.jsonl"
    suffix = ".jsonl"

    can_append = True

    def open(self, path) -> LineSink:
        return LineSink(path, to_json_line)

    def append(self, path, trajectories) -> None:
        """Add ``trajectories`` to the end of ``path``, then flush and fsync."""
        with open(path, "a", encoding="utf-8", newline="") as handle:
            for traj in trajectories:
                handle.write(to_json_line(traj))
            handle.flush()
            os.fsync(handle.fileno())


class ShareGPTWriter(JsonlWriter):
    """The same records as ``jsonl`` under the format's name, for ``export --format sharegpt`` and ``--writer sharegpt``."""

    name = "sharegpt"
    description = "trajectories.sharegpt.jsonl: the records of trajectories.jsonl (ShareGPT conversations)"
    filename = "trajectories.sharegpt.jsonl"


@hermes_batch.hookimpl
def register_writers(register):
    register(JsonlWriter)
    register(ShareGPTWriter)
