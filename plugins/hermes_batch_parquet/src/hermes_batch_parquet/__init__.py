"""Parquet output for hermes-batch (distribution hermes-batch-parquet, entry point ``parquet``).

``--writer parquet`` writes ``trajectories.parquet`` beside ``trajectories.jsonl``;
``hermes-batch export RUN_DIR --format parquet`` writes any path, with splits.
Every file has the same typed schema (:data:`SCHEMA`), whatever the run holds,
so files of several runs concatenate and HuggingFace ``datasets``, DuckDB and
pandas read them without inferring anything.
"""

from __future__ import annotations

import attrs

import hermes_batch
from hermes_batch import FileWriter


@attrs.frozen
class ParquetOptions:
    compression: str = attrs.field(
        default="zstd", validator=attrs.validators.in_(("zstd", "snappy", "gzip", "brotli", "lz4", "none"))
    )
    row_group_size: int = attrs.field(default=1000, validator=attrs.validators.ge(1))  # trajectories per row group


class ParquetWriter(FileWriter):
    """trajectories.parquet: the typed nested schema :data:`SCHEMA`, zstd-compressed row groups."""

    name = "parquet"
    description = "trajectories.parquet: typed nested Arrow schema (parquet:compression=snappy,row_group_size=500)"
    filename = "trajectories.parquet"
    suffix = ".parquet"
    Config = ParquetOptions

    def open(self, path):
        from .arrow import ParquetSink

        return ParquetSink(path, self.config)


@hermes_batch.hookimpl
def register_writers(register):
    register(ParquetWriter)


def __getattr__(name: str):
    # SCHEMA and the rest of the Arrow side load pyarrow, so only on first use
    if name in ("SCHEMA", "to_row", "ParquetSink"):
        from . import arrow

        return getattr(arrow, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
