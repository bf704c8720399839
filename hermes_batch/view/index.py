"""An index of a run folder's records, built by streaming: where each record is, plus a few small fields.

The report and the viewer never hold the run in memory.  One pass over the
record files (``batch_*.jsonl``, ``discarded.jsonl``, ``failed.jsonl``) keeps,
per record, its file and byte offset and the handful of fields the viewer
filters and sorts on, each in a compact ``array`` column (about 60 bytes a
record); strings that repeat (end reasons, tool sets, filters, error kinds)
are interned.  The prompt and final answer (with a discarded sample's filter reasons, a
failure's error message), casefolded, go to a search file
that is scanned with ``mmap.find``.  The run-wide sums (tokens, cost, tool
calls, reasoning, latencies) are not summed here: the summary takes them from
the run folder's own index, as statistics.json does (summary.run_totals).

The record files only ever grow (one whole line per record), so
:meth:`RunIndex.refresh` reads just the bytes appended since the last pass:
that is how the viewer is live.  A file that was replaced (``--overwrite``,
a reindex) is noticed by its inode and first bytes, and the index is rebuilt.

The index is cached in ``RUN_DIR/.hermes-batch-view/`` (elsewhere when the run
folder is read-only), so the second start is a load, not a pass.  The cache is
a list of segments, each the rows one save added (its columns and its search
text), never changed once written: a save writes only the rows added since
the index was loaded or last saved, so the report a run writes at its end
costs what that run added, not what the whole run folder holds.  The counts
the summary shows are kept as rows are added (:class:`Tallies`), so a summary
never walks the rows either.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional

from ..errors import RunFolderError
from ..folder import readback
from ..folder.liveness import owner_alive
from ..formats.lines import loads
from ..formats.records import key_digest
from ..folder.runfolder import record_kind, record_order
from . import cache
from .cache import _Columns
from . import sampling
from .aggregates import Tallies, Vocabulary
from .fields import (  # noqa: F401 (the list, the report and the summary take these from here)
    DISCARDED, FAILED, KEPT, STATUSES, VERDICTS, answer_of, clip, fields, prompt_of, unwrap, without_system_prompt,
)
from .search import SearchText

log = logging.getLogger(__name__)

CACHE_DIR_NAME = ".hermes-batch-view"
MAX_LINE_BYTES = 64 * 1024 * 1024
"""Longest line of a record file the viewer reads: a longer one is skipped (counted), never held whole."""
_HEAD_BYTES = 256
_CHUNK = 4 * 1024 * 1024
_WARN_LINES = 10  # lines that are no record, named in the log one by one; the rest are only counted


def _source_status(name: str) -> Optional[int]:
    kind = record_kind(name)
    return None if kind is None else STATUSES.index(kind)


def _head(source) -> str:
    """The digest of the first bytes of a record file (a path, or a file object open on it)."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as fh:
            return _head(fh)
    return hashlib.sha256(os.pread(source.fileno(), _HEAD_BYTES, 0)).hexdigest()[:16]


def _whole_lines(fh: BinaryIO, offset: int) -> Iterator[tuple[int, Optional[bytes], int]]:
    """``(offset, line, length)`` of each whole line of ``fh`` from ``offset`` on (newline left off); an unfinished
    last line (one still being written) is not yielded.  A line that spans chunks costs its length once; one
    longer than MAX_LINE_BYTES comes as None, never held whole."""
    fh.seek(offset)
    pending: list = []  # the pieces of a line that spans chunks, joined once
    size, skipping = 0, False  # of the pending pieces; past MAX_LINE_BYTES they are dropped, the line skipped
    while chunk := fh.read(_CHUNK):
        start = 0
        if pending or skipping:
            end = chunk.find(b"\n")
            if end < 0:
                size += len(chunk)
                if size > MAX_LINE_BYTES:
                    pending, skipping = [], True
                elif not skipping:
                    pending.append(chunk)
                continue
            size += end
            line = None if skipping or size > MAX_LINE_BYTES else b"".join([*pending, chunk[:end]])
            yield offset, line, size
            offset += size + 1
            pending, size, skipping = [], 0, False
            start = end + 1
        lines = chunk[start:].split(b"\n") if start else chunk.split(b"\n")
        rest = lines.pop()  # incomplete: the next chunk, or a line still being written
        for line in lines:
            yield offset, line, len(line)
            offset += len(line) + 1
        if rest:
            pending.append(rest)
            size = len(rest)


def _remove_orphans(cache_dir: Path) -> None:
    """Remove the search files of viewers that were killed (each process has its own)."""
    for path in cache_dir.glob("work-*.search"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not owner_alive(pid):
            path.unlink(missing_ok=True)


class RunIndex:
    """The index of one run folder; :meth:`refresh` brings it up to date with what was appended."""

    def __init__(self, run_dir, cache_dir: Optional[Path] = None, persist: bool = True):
        self.run_dir = Path(run_dir)
        self._tmp: Optional[str] = None
        if cache_dir is None:
            cache_dir = self.run_dir / CACHE_DIR_NAME
            try:
                cache_dir.mkdir(exist_ok=True)
                probe = cache_dir / ".probe"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError:  # a read-only run folder: keep the index for this process only
                self._tmp = tempfile.mkdtemp(prefix="hermes-batch-view-")
                cache_dir, persist = Path(self._tmp), False
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.persist = persist
        self._lock = threading.Lock()  # one refresh at a time; readers do not take it
        # the run folder's own index, read only, for the run-wide sums (summary.py)
        self.record_index = None
        self.totals_lock = threading.Lock()
        self._warned = 0
        _remove_orphans(self.cache_dir)
        self._reset()
        if persist:
            cache.load(self)

    # -- state --------------------------------------------------------------------------

    def _reset(self) -> None:
        self.files: list[str] = []
        self.sources: dict[str, dict] = {}  # file name -> {"ino", "head", "offset", "size"}
        self.vocab = {name: Vocabulary() for name in ("tools", "toolsets", "end", "filters", "error")}
        for name in ("tools", "toolsets", "filters"):
            self.vocab[name].id(())
        for name in ("end", "error"):
            self.vocab[name].id("")
        self.tallies = Tallies()
        self.columns = _Columns()
        # bumps when records are added or the index is rebuilt (never back: pages compare it)
        self.generation = getattr(self, "generation", -1) + 1
        old = getattr(self, "text", None)
        self.text = SearchText(self.cache_dir)  # a new file at each reset (see SearchText)
        if old is not None:
            old.close()
        self._segments: list[dict] = []  # the cache's segments that hold this index's first rows: {dir, rows, bytes}

    def __len__(self) -> int:
        return len(self.columns)

    def close(self) -> None:
        self.text.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    # -- building -------------------------------------------------------------------------

    def _list_sources(self) -> dict:
        """``{file name: stat}`` of the record files, in the order they are indexed."""
        found = {}
        try:
            entries = list(os.scandir(self.run_dir))
        except FileNotFoundError:
            return {}
        for entry in entries:
            if _source_status(entry.name) is not None:
                try:
                    if entry.is_file():
                        found[entry.name] = entry.stat()
                except FileNotFoundError:
                    continue
        return {name: found[name] for name in sorted(found, key=record_order)}

    def _stale(self, files: dict) -> bool:
        """True when a file already indexed was replaced or cut, so appending to the index would be wrong."""
        for name, state in self.sources.items():
            st = files.get(name)
            if st is None or st.st_ino != state["ino"] or st.st_size < state["offset"]:
                return True
            # a file replaced by one of another size can reuse the inode: compare its first bytes
            if st.st_size != state.get("size"):
                try:
                    if _head(self.run_dir / name) != state["head"]:
                        return True
                except FileNotFoundError:
                    return True
        return False

    def refresh(self, progress: Optional[Callable[[int], None]] = None) -> int:
        """Index what was appended since the last call (everything, the first time); return the records added.

        ``progress(records)`` is called after each file of a long pass, with the records indexed so far.
        """
        with self._lock:
            files = self._list_sources()
            if self._stale(files):
                log.info("%s: a record file was replaced; rebuilding the view index.", self.run_dir)
                self._reset()
            before = len(self.columns)
            grown = [name for name, st in files.items() if st.st_size != self.sources.get(name, {}).get("size")]
            if grown:  # a live run appends to one or two files at a time: the others are not even opened
                self.text.open()
                try:
                    for name in grown:
                        self._index_file(name)
                        if progress is not None:
                            progress(len(self.columns))
                finally:
                    self.text.close_file()
                    if len(self.columns) != before:  # also when a pass failed part way: what it added is listed
                        self.generation += 1
            return len(self.columns) - before

    def _index_file(self, name: str) -> int:
        path = self.run_dir / name
        status = _source_status(name)
        try:
            fh = readback.open_reader(path)  # a plain file: a FIFO or a link to a device is not read
        except RunFolderError as exc:
            log.warning("%s", exc)
            return 0
        if fh is None:
            return 0
        with fh:
            st = os.fstat(fh.fileno())
            state = self.sources.get(name)
            if state is None:
                if st.st_size == 0:
                    return 0
                state = {"ino": st.st_ino, "head": _head(fh), "offset": 0}
            if st.st_size <= state["offset"]:
                return 0
            if name not in self.files:
                self.files.append(name)
            file_id = self.files.index(name)
            added = 0
            # what was indexed stays indexed even if a write of the search file failed: the next pass goes on
            # from the first line not taken, and never counts a record twice
            self.sources[name] = state
            for offset, line, length in _whole_lines(fh, state["offset"]):
                if line is None:
                    self._skip(file_id, offset, f"is longer than {MAX_LINE_BYTES >> 20} MiB")
                elif line.strip():
                    added += self._add(file_id, status, offset, line)
                state["offset"] = offset + length + 1
            state["size"] = st.st_size
            return added

    def _add(self, file_id: int, status: int, offset: int, line: bytes) -> int:
        try:
            data = json.loads(without_system_prompt(line))
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or absurdly nested
            return self._skip(file_id, offset, "is not JSON")
        if not isinstance(data, dict) or (status == DISCARDED and not isinstance(data.get("trajectory") or {}, dict)):
            return self._skip(file_id, offset, "is not a record (a JSON object)")
        rec = unwrap(status, data)
        try:
            row_fields = fields(status, data, rec, self.vocab)
        except (TypeError, ValueError, AttributeError, OverflowError, RecursionError) as exc:
            # a record of an unexpected shape: list it anyway
            log.warning("%s: a record at byte %d has an unexpected shape (%s).", self.files[file_id], offset, exc)
            row_fields = (0, 0, 0, 0, 0, 0, 0.0, 0, "", ("", ""), 0, 0.0, 0)
        return self._append(file_id, status, offset, len(line), row_fields)

    def _skip(self, file_id: int, offset: int, why: str) -> int:
        """Count a line that is no record (as ``stats`` and ``export`` skip it); the first few are named in the log."""
        self.tallies.unreadable += 1
        self._warned += 1
        if self._warned <= _WARN_LINES:
            log.warning("%s: skipped the line at byte %d: it %s.%s", self.files[file_id], offset, why,
                        " Further such lines are counted, not named." if self._warned == _WARN_LINES else "")
        return 0

    def _append(self, file_id: int, status: int, offset: int, length: int, fields: tuple) -> int:
        tools, toolsets, end, filters, error, turns, duration, tokens, key, texts, prompt, reward, verdict = fields
        cols = self.columns
        text = " ".join((texts[0], clip(texts[1]), "\x1f", clip(texts[-1]))).casefold() if len(texts) == 3 else ""
        data_bytes = text.replace("\n", " ").replace("\r", " ").encode("utf-8", "replace") + b"\n"
        cols.text.append(self.text.append(data_bytes))  # first: a write that fails adds no part of the row
        cols.file.append(file_id)
        cols.offset.append(offset)
        cols.length.append(min(length, 0xFFFFFFFF))
        cols.prompt.append(prompt)
        cols.status.append(status)
        cols.turns.append(turns)
        cols.duration.append(duration)
        cols.tokens.append(tokens)
        cols.tools.append(tools)
        cols.toolsets.append(toolsets)
        cols.end.append(end)
        cols.filters.append(filters)
        cols.error.append(error)
        cols.reward.append(reward)
        cols.verdict.append(verdict)
        cols.key.append(key_digest(str(key)))  # last: len(columns) counts whole rows only
        # the duration as the column holds it (a 32-bit float), so the tallies say what the rows say
        self.tallies.add(status, status != FAILED, status == DISCARDED, end, turns, cols.duration[-1], toolsets,
                         filters)
        self.tallies.scored += verdict != 0
        return 1

    # -- the cache ------------------------------------------------------------------------

    def save(self) -> None:
        """Write what was added since the last load or save to the cache (see cache.py)."""
        if self.persist:
            with self._lock:
                cache.save(self)

    # -- reading --------------------------------------------------------------------------

    def read(self, i: int) -> dict:
        """The parsed record ``i`` (one positioned read of one line)."""
        cols = self.columns
        path = self.run_dir / self.files[cols.file[i]]
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            raw = os.pread(fd, cols.length[i], cols.offset[i])
        finally:
            os.close(fd)
        return loads(raw)  # ValueError for what is not JSON now, or nested too deep to decode

    def read_ref(self, ref: str) -> tuple[str, dict]:
        """``(status, record)`` of a link's ``FILE:OFFSET``; only record files of this run, only at a line start."""
        name, _, offset_text = str(ref).rpartition(":")
        status = _source_status(name)
        if status is None or name not in self.files or not offset_text.isdigit():
            raise LookupError(f"no record {ref!r} in this run")
        offset = int(offset_text)
        try:
            fh = readback.open_reader(self.run_dir / name)
        except RunFolderError as exc:
            raise LookupError(str(exc)) from None
        if fh is None:
            raise LookupError(f"no record {ref!r} in this run")
        with fh:
            if offset:
                fh.seek(offset - 1)
                if fh.read(1) != b"\n":
                    raise LookupError(f"no record starts at {ref!r}")
            fh.seek(offset)
            line = fh.readline(MAX_LINE_BYTES + 1)
        if not line.endswith(b"\n"):
            raise LookupError(f"no record {ref!r} in this run (or it is longer than {MAX_LINE_BYTES >> 20} MiB)")
        try:
            return STATUSES[status], loads(line)
        except ValueError as exc:
            raise LookupError(f"the line at {ref!r} is no record ({exc})") from None

    def search(self, query: str, within: Optional[int] = None) -> Iterator[int]:
        """Record numbers whose prompt, answer or id contains ``query`` (case-insensitive), in index order."""
        needle = query.casefold().replace("\n", " ").encode("utf-8")
        count = len(self.columns) if within is None else within
        if needle and count:
            yield from self.text.find(needle, self.columns.text, count)

    def tallies_now(self) -> Tallies:
        """A copy of the tallies taken between two refreshes (the viewer summarizes in one thread, refreshes in another)."""
        with self._lock:
            return self.tallies.copy()

    # -- picking records (sampling.py) ------------------------------------------------------

    def rows_of(self, status: int) -> Iterator[int]:
        """The record numbers of one status, in order."""
        return sampling.rows_of(self.columns, status)

    def spread(self, status: int, k: int, max_length: int) -> list:
        """``k`` records of ``status`` no longer than ``max_length``, spread evenly; the same choice every time."""
        return sampling.spread(self.columns, status, k, max_length)

    def still_failed(self) -> set:
        """Record numbers of failures whose prompt has no finished record (a later retry did not succeed)."""
        return sampling.still_failed(self.columns)
