"""The Arrow side of the Parquet writer, imported only when a run or an export writes Parquet.

pyarrow takes most of a second to import: a run that writes JSON Lines only should not pay it.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from hermes_batch import SCHEMA_VERSION, Sink, Trajectory, trajectory_to_dict

TOOL_CALL = pa.struct([("id", pa.string()), ("name", pa.string()), ("arguments", pa.string())])
TURN = pa.struct([("from", pa.string()), ("value", pa.string()), ("tool_calls", pa.list_(TOOL_CALL))])
USAGE = pa.struct([
    ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("reasoning_tokens", pa.int64()),
    ("cached_tokens", pa.int64()), ("cost", pa.float64()), ("cost_reported", pa.bool_()),
])
CALL = pa.struct([("provider", pa.string()), ("latency_s", pa.float64()), ("status", pa.int64())])
METADATA = pa.struct([
    ("batch_num", pa.int64()), ("timestamp", pa.string()), ("model", pa.string()), ("content_key", pa.string()),
    ("schema_version", pa.int64()), ("id", pa.string()), ("row", pa.string()), ("seed", pa.int64()),
    ("sandbox", pa.string()), ("image", pa.string()), ("cwd", pa.string()), ("tools_offered", pa.list_(pa.string())),
    ("end_reason", pa.string()), ("invalid_tool_calls", pa.string()), ("duration_s", pa.float64()),
    ("usage", USAGE), ("calls", pa.list_(CALL)),
    # --verifier (0, 0.0, false and [] without one)
    ("sample_index", pa.int64()), ("reward", pa.float64()), ("verified", pa.bool_()), ("passed", pa.bool_()),
    ("verifiers", pa.string()),  # JSON text, as in the JSONL
])
TOOL_STAT = pa.struct([
    ("name", pa.string()), ("count", pa.int64()), ("success", pa.int64()), ("failure", pa.int64()), ("errors", pa.int64()),
])
SCHEMA = pa.schema(
    [
        ("prompt_index", pa.int64()),
        ("conversations", pa.list_(TURN)),
        ("metadata", METADATA),
        ("completed", pa.bool_()),
        ("partial", pa.bool_()),
        ("api_calls", pa.int64()),
        ("toolsets_used", pa.list_(pa.string())),
        # one entry per tool, in name order: a list rather than a struct keyed by tool names, so the
        # schema is the same for every run (tool_error_counts is the ``errors`` field)
        ("tool_stats", pa.list_(TOOL_STAT)),
    ],
    metadata={"hermes_batch.record_schema_version": str(SCHEMA_VERSION), "hermes_batch.format": "trajectories"},
)
"""The Arrow schema of every Parquet file hermes-batch writes."""


_VERIFY_FIELDS = (("sample_index", 0), ("reward", 0.0), ("verified", False), ("passed", False), ("verifiers", "[]"))


def to_row(trajectory: Trajectory) -> dict:
    """A trajectory as a row of :data:`SCHEMA`."""
    row = trajectory_to_dict(trajectory)
    meta = row["metadata"]
    for name, absent in _VERIFY_FIELDS:  # records of versions before --verifier
        meta.setdefault(name, absent)
    for turn in row["conversations"]:
        turn.setdefault("tool_calls", None)
    errors = row.pop("tool_error_counts")
    row["tool_stats"] = [
        {"name": name, **stat, "errors": errors.get(name, 0)} for name, stat in sorted(row["tool_stats"].items())
    ]
    return row


class ParquetSink(Sink):
    """Buffers ``row_group_size`` rows, then writes them as one row group."""

    def __init__(self, path, options):
        super().__init__(path)
        self.options = options
        self.rows: list = []
        compression = None if options.compression == "none" else options.compression
        self.writer = pq.ParquetWriter(self.file, SCHEMA, compression=compression)

    def add(self, trajectory: Trajectory) -> None:
        self.rows.append(to_row(trajectory))
        self.count += 1
        if len(self.rows) >= self.options.row_group_size:
            self._flush_rows()

    def _flush_rows(self) -> None:
        if not self.rows:
            return
        try:
            table = pa.Table.from_pylist(self.rows, schema=SCHEMA)
        except UnicodeEncodeError:  # a lone surrogate of an old record: repaired, as the run repairs text
            scrubbed = [self.scrub(row) for row in self.rows]
            self.repaired += sum(1 for old, new in zip(self.rows, scrubbed) if old != new)
            table = pa.Table.from_pylist(scrubbed, schema=SCHEMA)
        self.writer.write_table(table)
        self.rows = []

    def finish(self) -> None:
        self._flush_rows()
        self.writer.close()  # writes the footer; the file object stays open for the commit's fsync

    def abort(self) -> None:
        try:
            self.writer.close()
        except Exception:  # the file is being thrown away
            pass
        super().abort()
