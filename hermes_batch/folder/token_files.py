"""The side files of --logprobs: ``batch_N.tokens.jsonl``, one line per sample beside the batch's records.

A line is written (fsynced) before its sample's record, for kept and discarded samples alike, to the side file
of the sample's batch; it names its record by the sample's key and a digest of its conversation
(``formats.token_ids.record_digest``), never by file or line, so a refilter that moves a record between a batch
file and discarded.jsonl, a renumbering that changes its ``prompt_index`` and the merge into trajectories.jsonl
all leave it found.  A prompt run again after a crash appends its line again: the last line of a key wins.
Side files are read back as untrusted: plain files only, lines bounded, every field checked.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Iterator, Optional

from ..formats.lines import TOO_LONG, loads, read_lines
from ..formats.token_ids import TokenSide, read_side_entry
from .readback import open_reader
from .offloop import check_stop

log = logging.getLogger(__name__)

_SIDE_RE = re.compile(r"batch_(\d+)\.tokens\.jsonl")
MAX_SIDE_LINE_BYTES = 64 * 1024 * 1024  # a long session's sequence and turns, with room; longer lines are skipped


def side_path(folder_dir: Path, batch_num: int) -> Path:
    """The side file of batch ``batch_num``."""
    return Path(folder_dir) / f"batch_{batch_num}.tokens.jsonl"


def side_files(folder_dir: Path) -> list[Path]:
    """Every ``batch_N.tokens.jsonl`` of a run folder, in batch-number order."""
    if not Path(folder_dir).is_dir():
        return []
    found = [(int(m.group(1)), Path(e.path)) for e in os.scandir(folder_dir) if (m := _SIDE_RE.fullmatch(e.name))]
    return [path for _num, path in sorted(found)]


class SideIndex:
    """Where each sample's side line is, over the side files of one or more run folders; entries read on demand."""

    def __init__(self) -> None:
        self._files: list[Path] = []
        self._where: dict = {}  # (key, digest) -> (file number, offset)

    def add_folder(self, folder_dir: Path) -> None:
        for path in side_files(folder_dir):
            self._add_file(path)

    def __len__(self) -> int:
        return len(self._where)

    def _add_file(self, path: Path) -> None:
        handle = open_reader(path, advice="move it away; export reads the side files a run wrote")
        if handle is None:
            return
        number = len(self._files)
        self._files.append(path)
        with handle:
            for count, (offset, raw) in enumerate(read_lines(handle, MAX_SIDE_LINE_BYTES), start=1):
                if not count & 0xFF:
                    check_stop()
                identity = _identity(raw)
                if identity is not None:
                    self._where[identity] = (number, offset)

    def get(self, key: str, digest: str) -> Optional[TokenSide]:
        """The side entry of the record with ``key`` and conversation ``digest``, or None."""
        where = self._where.get((key, digest))
        if where is None:
            return None
        handle = open_reader(self._files[where[0]])
        if handle is None:
            return None
        with handle:
            for _offset, raw in read_lines(handle, MAX_SIDE_LINE_BYTES, where[1]):
                entry = _entry(raw)
                return entry[1] if entry is not None else None
        return None


def _entry(raw) -> Optional[tuple]:
    if raw is TOO_LONG:
        return None
    try:
        return read_side_entry(loads(raw))
    except ValueError:
        return None


def _identity(raw) -> Optional[tuple]:
    entry = _entry(raw)
    if entry is None:
        log.debug("skipped a side file line that is not a side entry")
        return None
    return entry[0]


def iter_entries(folder_dir: Path) -> Iterator[tuple[tuple, TokenSide]]:
    """Every good side entry of a run folder, in file order (a key's later line after its earlier one)."""
    for path in side_files(folder_dir):
        handle = open_reader(path)
        if handle is None:
            continue
        with handle:
            for _offset, raw in read_lines(handle, MAX_SIDE_LINE_BYTES):
                entry = _entry(raw)
                if entry is not None:
                    yield entry
