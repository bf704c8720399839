"""An index of a run folder's records, built by streaming: where each record is, plus a few small fields.

The report and the viewer never hold the run in memory.  One pass over the
record files (``batch_*.jsonl``, ``discarded.jsonl``, ``failed.jsonl``) keeps,
per record, its file and byte offset and the handful of fields the viewer
filters and sorts on, each in a compact ``array`` column (about 60 bytes a
record); strings that repeat (end reasons, tool sets, filters, error kinds)
are interned.  The prompt and final answer (with a discarded sample's filter reasons, a
failure's error message), casefolded, go to a search file
that is scanned with ``mmap.find``.  Run-wide aggregates (tool calls, reasoning
turns, latencies, discard reasons, providers) are summed in the same pass.

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
import itertools
import json
import logging
import mmap
import os
import re
import shutil
import tempfile
import threading
from bisect import bisect_right
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator, Optional

from .. import hermes_format
from ..liveness import owner_alive
from ..records import key_digest
from . import cache
from .cache import _Columns
from .aggregates import Aggregates, Tallies, Vocabulary

log = logging.getLogger(__name__)

CACHE_DIR_NAME = ".hermes-batch-view"
STATUSES = ("kept", "discarded", "failed")
KEPT, DISCARDED, FAILED = range(3)
SEARCH_FIELD_CHARS = 4096  # of the prompt and of the answer: what the search looks at
_BATCH_RE = re.compile(r"batch_(\d+)\.jsonl")
_HEAD_BYTES = 256
_CHUNK = 4 * 1024 * 1024
_FEW = 4096  # of a status: fewer rows than this are listed one by one to pick samples from
_WARN_LINES = 10  # lines that are no record, named in the log one by one; the rest are only counted



def _clip(text, limit: int = SEARCH_FIELD_CHARS) -> str:
    return str(text or "")[:limit]


def _turns(traj: dict) -> list:
    turns = traj.get("conversations")
    return turns if isinstance(turns, list) else []


def prompt_of(traj: dict) -> str:
    for turn in _turns(traj):
        if isinstance(turn, dict) and turn.get("from") == "human":
            return str(turn.get("value", ""))
    return ""


def answer_of(traj: dict) -> str:
    for turn in reversed(_turns(traj)):
        if isinstance(turn, dict) and turn.get("from") == "gpt":
            return str(turn.get("value", ""))
    return ""


def unwrap(status: int, data) -> dict:
    """The trajectory (or failure) dict of a parsed record line; ``{}`` for a line of another shape."""
    rec = (data.get("trajectory") or {} if status == DISCARDED else data) if isinstance(data, dict) else None
    return rec if isinstance(rec, dict) else {}


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _names(value) -> tuple:
    """A list of names from a record (toolsets, filters, reasons) as a tuple of strings; () for anything else."""
    return tuple(map(str, value)) if isinstance(value, list) else ()


def _count(value, high: int = 0xFFFFFFFF) -> int:
    """A count from a record, 0 when it is not a finite number (an old or hand-edited line may hold 1e999)."""
    if type(value) is int and 0 <= value <= high:  # the usual case, first
        return value
    try:
        return min(high, max(0, int(value or 0)))
    except (TypeError, ValueError, OverflowError):
        return 0


def _prompt_index(value) -> int:
    if type(value) is int and -(2**63) <= value < 2**63:
        return value
    try:
        return max(-(2**63), min(2**63 - 1, int(value or 0)))
    except (TypeError, ValueError, OverflowError):
        return 0


def _seconds(value) -> float:
    try:
        seconds = float(value or 0.0)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return seconds if 0 <= seconds < 1e9 else 0.0  # NaN fails both tests


_SYSTEM_START = b'"conversations":[{"from":"system","value":"'
_SYSTEM_END = json.dumps(hermes_format.TOOLS_CLOSE)[1:-1].encode() + b'"}'  # the system turn's end, as JSON
_NEXT_TURN = b'"},{"from":"'


def _without_system_prompt(line: bytes) -> bytes:
    """The record with its system turn's text left out: often most of its bytes, and nothing the index needs.

    The system turn always ends with the ``<tools>`` list; inside a JSON string
    a quote is always escaped, so the first ``\\n</tools>"}`` after the turn's
    start ends it, and no ``"},{"from":"`` can lie in between.  Anything else
    (another writer's layout) is parsed whole.
    """
    start = line.find(_SYSTEM_START, 0, 200)
    if start < 0:
        return line
    start += len(_SYSTEM_START)
    end = line.find(_SYSTEM_END, start)
    if end < 0 or line.find(_NEXT_TURN, start, end) >= 0:
        return line
    return line[:start] + line[end + len(_SYSTEM_END) - 2:]


def _source_status(name: str) -> Optional[int]:
    if _BATCH_RE.fullmatch(name):
        return KEPT
    return {"discarded.jsonl": DISCARDED, "failed.jsonl": FAILED}.get(name)


def _source_order(name: str):
    match = _BATCH_RE.fullmatch(name)
    return (0, int(match.group(1))) if match else (1 if name == "discarded.jsonl" else 2, 0)


def _head(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read(_HEAD_BYTES)).hexdigest()[:16]


_WORK_FILES = itertools.count()


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
        self.aggregates = Aggregates()
        self.tallies = Tallies()
        self.columns = _Columns()
        # bumps when records are added or the index is rebuilt (never back: pages compare it)
        self.generation = getattr(self, "generation", -1) + 1
        # This process's own search file, new at each reset: never one another process appends to, and
        # never the old one cut short under a search that has it mapped (that would be a SIGBUS).
        old = getattr(self, "search_path", None)
        self.search_path = self.cache_dir / f"work-{os.getpid()}-{next(_WORK_FILES)}.search"
        self.search_path.write_bytes(b"")
        if old is not None:
            old.unlink(missing_ok=True)
        self._blob_size = 0
        self._use_parts([])
        self._segments: list[dict] = []  # the cache's segments that hold this index's first rows: {dir, rows, bytes}

    def _use_parts(self, parts: list) -> None:
        """The search text before this process's own search file: the open search files of the loaded segments.

        They stay open, so a segment that another process removes (it rebuilt
        the cache) can still be searched.
        """
        for fh, _base, _size in getattr(self, "_parts", ()):
            fh.close()
        self._parts = parts  # [(open file, first byte, bytes)]
        self._work_base = sum(size for _fh, _base, size in parts)  # where the search file's text starts

    def __len__(self) -> int:
        return len(self.columns)


    def close(self) -> None:
        self._use_parts([])
        self.search_path.unlink(missing_ok=True)
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
        return {name: found[name] for name in sorted(found, key=_source_order)}

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
                self._blob = os.open(self.search_path, os.O_WRONLY)
                try:
                    for name in grown:
                        self._index_file(name)
                        if progress is not None:
                            progress(len(self.columns))
                finally:
                    os.close(self._blob)
                    if len(self.columns) != before:  # also when a pass failed part way: what it added is listed
                        self.generation += 1
            return len(self.columns) - before

    def _index_file(self, name: str) -> int:
        path = self.run_dir / name
        status = _source_status(name)
        try:
            fh = open(path, "rb")
        except FileNotFoundError:
            return 0
        with fh:
            st = os.fstat(fh.fileno())
            state = self.sources.get(name)
            if state is None:
                if st.st_size == 0:
                    return 0
                state = {"ino": st.st_ino, "head": _head(path), "offset": 0}
            if st.st_size <= state["offset"]:
                return 0
            if name not in self.files:
                self.files.append(name)
            file_id = self.files.index(name)
            fh.seek(state["offset"])
            added, offset = 0, state["offset"]
            pending: list = []  # the pieces of a line that spans chunks: joined once, so a long line costs its length
            try:
                while True:
                    chunk = fh.read(_CHUNK)
                    if not chunk:
                        break
                    start = 0
                    if pending:
                        end = chunk.find(b"\n")
                        if end < 0:
                            pending.append(chunk)
                            continue
                        pending.append(chunk[:end])
                        line, pending = b"".join(pending), []
                        if line.strip():
                            added += self._add(file_id, status, offset, line)
                        offset += len(line) + 1
                        start = end + 1
                    lines = chunk[start:].split(b"\n") if start else chunk.split(b"\n")
                    rest = lines.pop()  # incomplete: the next chunk, or a line still being written
                    for line in lines:
                        if line.strip():
                            added += self._add(file_id, status, offset, line)
                        offset += len(line) + 1
                    if rest:
                        pending.append(rest)
            finally:
                # what was indexed stays indexed even if a write of the search file failed: the next pass goes on
                # from the first line not taken, and never counts a record twice
                state["offset"] = offset
                self.sources[name] = state
            state["size"] = st.st_size
            return added

    def _add(self, file_id: int, status: int, offset: int, line: bytes) -> int:
        try:
            data = json.loads(_without_system_prompt(line))
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or absurdly nested
            return self._skip(file_id, offset, "is not JSON")
        if not isinstance(data, dict) or (status == DISCARDED and not isinstance(data.get("trajectory") or {}, dict)):
            return self._skip(file_id, offset, "is not a record (a JSON object)")
        rec = unwrap(status, data)
        try:
            fields = self._fields(status, data, rec)
        except (TypeError, ValueError, AttributeError, OverflowError, RecursionError) as exc:
            # a record of an unexpected shape: list it anyway
            log.warning("%s: a record at byte %d has an unexpected shape (%s).", self.files[file_id], offset, exc)
            fields = (0, 0, 0, 0, 0, 0, 0.0, 0, "", ("", ""), 0)
        row = self._append(file_id, status, offset, len(line), fields)
        try:  # the sums come last, once the row is in: a value of an odd shape counts as not reported
            self._aggregate(status, data, rec)
        except (TypeError, ValueError, AttributeError, OverflowError, RecursionError) as exc:
            log.warning("%s: a record at byte %d has an unexpected shape (%s).", self.files[file_id], offset, exc)
        return row

    def _skip(self, file_id: int, offset: int, why: str) -> int:
        """Count a line that is no record (as ``stats`` and ``export`` skip it); the first few are named in the log."""
        self.tallies.unreadable += 1
        self._warned += 1
        if self._warned <= _WARN_LINES:
            log.warning("%s: skipped the line at byte %d: it %s.%s", self.files[file_id], offset, why,
                        " Further such lines are counted, not named." if self._warned == _WARN_LINES else "")
        return 0

    def _fields(self, status: int, data: dict, rec: dict) -> tuple:
        vocab = self.vocab
        if status == FAILED:
            meta, usage = {}, _dict(rec.get("usage"))
            texts = (str(rec.get("prompt", "")), str(rec.get("message", "")))
            key = rec.get("content_key", "")
            tools = toolsets = filters = 0
            end = 0
            error = vocab["error"].id(str(rec.get("error_kind") or rec.get("error_class") or "unknown"))
            duration = 0.0
        else:
            meta = _dict(rec.get("metadata"))
            usage = _dict(meta.get("usage"))
            texts = (prompt_of(rec), answer_of(rec))
            key = meta.get("content_key", "")
            tool_stats = rec.get("tool_stats")
            called = tuple(sorted(n for n, s in tool_stats.items() if isinstance(s, dict) and s.get("count"))) \
                if isinstance(tool_stats, dict) else ()
            tools = vocab["tools"].id(called)
            toolsets = vocab["toolsets"].id(_names(rec.get("toolsets_used")))
            end = vocab["end"].id(str(meta.get("end_reason") or ""))
            filters = vocab["filters"].id(_names(data.get("filters"))) if status == DISCARDED else 0
            error = 0
            duration = _seconds(meta.get("duration_s"))
            if status == DISCARDED:
                texts = (texts[0], " ".join(_names(data.get("reasons"))) + " " + _clip(texts[1]))
        ident = str(meta.get("id", "")) if meta else ""
        turns = _count(rec.get("api_calls"))
        tokens = min(0xFFFFFFFF, _count(usage.get("prompt_tokens")) + _count(usage.get("completion_tokens")))
        prompt = _prompt_index(rec.get("prompt_index"))
        return (tools, toolsets, end, filters, error, turns, duration, tokens, key, (ident,) + texts, prompt)

    def _aggregate(self, status: int, data: dict, rec: dict) -> None:
        agg = self.aggregates
        if status == FAILED:
            agg.add_calls(rec.get("calls"))
            agg.add_usage(rec.get("usage"))
            return
        meta = _dict(rec.get("metadata"))
        agg.add_finished(rec, kept=status == KEPT)
        agg.add_calls(meta.get("calls"))
        agg.add_usage(meta.get("usage"))
        if status == DISCARDED:
            agg.add_reasons(data.get("filters"), data.get("reasons"))

    def _append(self, file_id: int, status: int, offset: int, length: int, fields: tuple) -> int:
        tools, toolsets, end, filters, error, turns, duration, tokens, key, texts, prompt = fields
        cols = self.columns
        text = " ".join((texts[0], _clip(texts[1]), "\x1f", _clip(texts[-1]))).casefold() if len(texts) == 3 else ""
        data_bytes = text.replace("\n", " ").replace("\r", " ").encode("utf-8", "replace") + b"\n"
        self._write_text(data_bytes)  # first: a write that fails (a full disk) adds no part of the row
        cols.text.append(self._blob_size)
        self._blob_size += len(data_bytes)
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
        cols.key.append(key_digest(str(key)))  # last: len(columns) counts whole rows only
        # the duration as the column holds it (a 32-bit float), so the tallies say what the rows say
        self.tallies.add(status, status != FAILED, status == DISCARDED, end, turns, cols.duration[-1], toolsets,
                         filters)
        return 1

    def _write_text(self, data: bytes) -> None:
        """Write a row's search text at its place: bytes a failed write left beyond it are written over next time."""
        view, at = memoryview(data), self._blob_size - self._work_base
        while view:
            done = os.pwrite(self._blob, view, at)
            view, at = view[done:], at + done

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
        fd = os.open(path, os.O_RDONLY)
        try:
            raw = os.pread(fd, cols.length[i], cols.offset[i])
        finally:
            os.close(fd)
        return json.loads(raw)

    def read_ref(self, ref: str) -> tuple[str, dict]:
        """``(status, record)`` of a link's ``FILE:OFFSET``; only record files of this run, only at a line start."""
        name, _, offset_text = str(ref).rpartition(":")
        status = _source_status(name)
        if status is None or name not in self.files or not offset_text.isdigit():
            raise LookupError(f"no record {ref!r} in this run")
        offset = int(offset_text)
        with open(self.run_dir / name, "rb") as fh:
            if offset:
                fh.seek(offset - 1)
                if fh.read(1) != b"\n":
                    raise LookupError(f"no record starts at {ref!r}")
            fh.seek(offset)
            line = fh.readline()
        if not line.endswith(b"\n"):
            raise LookupError(f"no record {ref!r} in this run")
        return STATUSES[status], json.loads(line)

    def search(self, query: str, within: Optional[int] = None) -> Iterator[int]:
        """Record numbers whose prompt, answer or id contains ``query`` (case-insensitive), in index order."""
        needle = query.casefold().replace("\n", " ").encode("utf-8")
        count = len(self.columns) if within is None else within
        if not needle or not count:
            return
        texts = self.columns.text
        end = self._blob_size if count == len(texts) else texts[count]
        with open(self.search_path, "rb") as work:
            # each part holds whole lines and a needle holds no newline: no match spans two parts
            for fh, base, size in [*self._parts, (work, self._work_base, end - self._work_base)]:
                stop = min(size, end - base)
                if stop <= 0 or os.fstat(fh.fileno()).st_size == 0:
                    continue
                with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as blob:
                    pos = 0
                    while True:
                        hit = blob.find(needle, pos, stop)
                        if hit < 0:
                            break
                        i = bisect_right(texts, base + hit, 0, count) - 1
                        yield i
                        pos = (texts[i + 1] if i + 1 < count else end) - base

    def tallies_now(self) -> Tallies:
        """A copy of the tallies taken between two refreshes (the viewer summarizes in one thread, refreshes in another)."""
        with self._lock:
            return self.tallies.copy()

    def rows_of(self, status: int) -> Iterator[int]:
        """The record numbers of one status, in order (found in the column's bytes, not row by row)."""
        column = self.columns.status[:len(self.columns)].tobytes()
        code = bytes((status,))
        i = column.find(code)
        while i >= 0:
            yield i
            i = column.find(code, i + 1)

    def spread(self, status: int, k: int, max_length: int) -> list:
        """``k`` records of ``status`` no longer than ``max_length``, spread evenly (first and last included).

        The same choice every time.  A status with many records is not listed:
        the n-th record of it is found from counts of the status column's bytes
        by blocks (a record longer than ``max_length`` gives way to the next).
        """
        length = self.columns.length
        count = len(self.columns)
        column = self.columns.status[:count].tobytes()
        code = bytes((status,))
        total = column.count(code)
        if total <= max(k, _FEW):
            return _spread([i for i in self.rows_of(status) if length[i] <= max_length], k)
        block = 4096
        blocks = [column.count(code, start, start + block) for start in range(0, count, block)]
        step = (total - 1) / (k - 1) if k > 1 else 0
        chosen: list = []
        for j in range(k):
            nth, start = round(j * step), 0
            for n in blocks:  # the block that holds the nth record of the status
                if nth < n:
                    break
                nth, start = nth - n, start + block
            i = column.find(code, start)
            for _ in range(nth):
                i = column.find(code, i + 1)
            while i >= 0 and (length[i] > max_length or (chosen and i <= chosen[-1])):
                i = column.find(code, i + 1)
            if i < 0:
                break
            chosen.append(i)
        return chosen

    def still_failed(self) -> set:
        """Record numbers of failures whose prompt has no finished record (a later retry did not succeed)."""
        keys = self.columns.key
        failed = list(self.rows_of(FAILED))
        if not failed:
            return set()
        failed_keys = {keys[i] for i in failed}
        # rows of any status with one of those keys, counted in C; less the failures, the finished ones remain
        finished = Counter(filter(failed_keys.__contains__, keys[:len(self.columns)]))
        finished.subtract(keys[i] for i in failed)
        latest = {}  # a prompt that failed in several sessions counts once, by its last failure
        for i in failed:
            if not finished[keys[i]]:
                latest[keys[i]] = i
        return set(latest.values())


def _spread(items: list, k: int) -> list:
    """``k`` items spread evenly over ``items`` (first and last included): a sample that is the same every time."""
    if len(items) <= k:
        return items
    step = (len(items) - 1) / (k - 1) if k > 1 else 0
    return [items[round(j * step)] for j in range(k)]
