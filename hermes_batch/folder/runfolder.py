"""The run folder: its paths, which files hold records, and reading them tolerantly.

Writing goes through durable.py (fsynced appends, atomic replacement); long
reads run off the event loop through offloop.py.  Readers skip a torn last
line (a crash while it was written) and lines that are no record.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Iterator, Optional, TypeVar, Union

from ..errors import RunFolderError, UsageError
from ..formats.serialization import describe_structure_error, from_json
from .offloop import check_stop

log = logging.getLogger(__name__)

T = TypeVar("T")
PathLike = Union[str, os.PathLike]


MAX_RUN_NAME_LENGTH = 128
_RUN_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_BATCH_RE = re.compile(r"batch_(\d+)\.jsonl")


_RECORD_FILES = {"discarded.jsonl": "discarded", "failed.jsonl": "failed"}


def record_kind(name: str) -> Optional[str]:
    """What a run folder's file of this name holds: "kept" (a batch file), "discarded", "failed", or None."""
    return "kept" if _BATCH_RE.fullmatch(name) else _RECORD_FILES.get(name)


def record_order(name: str) -> tuple:
    """The order in which the record files are read: batch files by number, then discarded, then failed."""
    match = _BATCH_RE.fullmatch(name)
    return (0, int(match.group(1))) if match else (1 if name == "discarded.jsonl" else 2, 0)


def validate_run_name(name: str) -> str:
    """Return ``name`` if it is a plain folder name, else raise UsageError."""
    if not isinstance(name, str) or not name:
        raise UsageError("The run name is empty; pass --run_name with letters, digits, '.', '_' or '-'.")
    if len(name) > MAX_RUN_NAME_LENGTH:
        raise UsageError(f"The run name is longer than {MAX_RUN_NAME_LENGTH} characters; choose a shorter --run_name.")
    if not _RUN_NAME_RE.fullmatch(name):
        raise UsageError(
            f"Invalid run name {name!r}: use only letters, digits, '.', '_' and '-', not starting with '.'."
        )
    return name


class RunFolder:
    """The paths of ``<output_dir>/<run_name>/`` and what is in it."""

    def __init__(self, output_dir: PathLike, run_name: str):
        self.run_name = validate_run_name(run_name)
        self.dir = Path(output_dir) / run_name

    def __repr__(self) -> str:
        return f"RunFolder({str(self.dir)!r})"

    def batch_path(self, batch_num: int) -> Path:
        """The file of batch ``batch_num``."""
        return self.dir / f"batch_{batch_num}.jsonl"

    @property
    def trajectories(self) -> Path:
        return self.dir / "trajectories.jsonl"

    @property
    def discarded(self) -> Path:
        return self.dir / "discarded.jsonl"

    @property
    def failed(self) -> Path:
        return self.dir / "failed.jsonl"

    @property
    def checkpoint(self) -> Path:
        return self.dir / "checkpoint.json"

    @property
    def statistics(self) -> Path:
        return self.dir / "statistics.json"

    @property
    def run_json(self) -> Path:
        return self.dir / "run.json"

    @property
    def scratch(self) -> Path:
        return self.dir / "scratch"

    def iter_batch_files(self) -> Iterator[tuple[int, Path]]:
        """``(batch_num, path)`` of every ``batch_N.jsonl``, in batch-number order."""
        if not self.dir.is_dir():
            return iter(())
        found = []
        for entry in os.scandir(self.dir):
            match = _BATCH_RE.fullmatch(entry.name)
            if match and entry.is_file():
                found.append((int(match.group(1)), Path(entry.path)))
        return iter(sorted(found))

    def record_files(self) -> list[tuple[Path, str]]:
        """Every record file with its kind (:func:`record_kind`) in :func:`record_order`; discarded.jsonl and
        failed.jsonl are listed whether they exist or not."""
        batches = [(path, "kept") for _num, path in self.iter_batch_files()]
        return batches + [(self.discarded, "discarded"), (self.failed, "failed")]

    def has_outputs(self) -> bool:
        """True when the folder already holds any output file of a run."""
        fixed = (self.trajectories, self.discarded, self.failed, self.checkpoint, self.statistics, self.run_json)
        return any(p.exists() for p in fixed) or next(self.iter_batch_files(), None) is not None

    def create(self) -> None:
        """Create the folder (and its parents) if needed."""
        self.dir.mkdir(parents=True, exist_ok=True)


def read_records(path: PathLike, cls: type[T], start: int = 0, stop: Optional[int] = None) -> Iterator[tuple[int, T]]:
    """Yield ``(line_no, record)`` for each good line of a JSONL file; bad and torn lines are logged and skipped.

    With ``start`` and ``stop``, only the lines that begin between those byte offsets (``start`` must begin a
    line; line numbers then count from it).
    """
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise RunFolderError(
            f"{path} cannot be read ({exc.strerror or exc}); it must be a file a run wrote, so move it away."
        ) from None
    with fh:
        fh.seek(start)
        offset = start
        for line_no, raw in enumerate(fh, start=1):
            if not line_no & 0xFF:
                check_stop()
            if stop is not None and offset >= stop:
                return
            offset += len(raw)
            if not raw.endswith(b"\n"):
                # an unterminated last line is a torn write: AppendLog.open cuts it, so never count it
                log.warning("%s:%d: ignored an incomplete last line (interrupted write).", path, line_no)
                return
            if not raw.strip():
                continue
            try:
                data = json.loads(raw)
            except ValueError as exc:
                log.warning("%s:%d: skipped a line that is not valid JSON (%s).", path, line_no, exc)
                continue
            try:
                record = from_json(data, cls)
            except Exception as exc:  # cattrs raises several exception types
                log.warning("%s:%d: skipped a line that is not a %s: %s", path, line_no, cls.__name__,
                            describe_structure_error(exc))
                continue
            yield line_no, record
