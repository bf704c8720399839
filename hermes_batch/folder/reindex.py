"""Keep ``prompt_index`` meaning "this row of the dataset file" when a resume runs over a changed file.

Resume matches finished prompts to dataset rows by content, so rows may be
inserted, removed or reordered between sessions.  Their records, though, carry
the index the row had when they were written: after a row is inserted at the
top, an old record and a new one would share ``prompt_index`` 0 and batch 0
would hold more than ``batch_size`` rows.  So run.json keeps the dataset's
fingerprint (and the batch size), and a resume that finds either changed
renumbers every record by content against the current file:

* each finished record (kept or discarded) takes the index of a row with its
  content key, duplicates in the order of their old indexes, so indexes stay
  unique and join back to the current file, and it moves to the batch file of
  its new index;
* a finished record whose row is gone is set aside in ``unmatched.jsonl``:
  kept (it was paid for), not merged, and matched again if the row comes back;
* failure records follow their row, or go to ``unmatched.jsonl`` with it.

The files are rewritten into a staging folder first; a marker file makes the
switch to the new files finish on the next start if a crash interrupts it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

import attrs

from ..formats import dataset
from .record_index import RecordIndex
from ..formats.jsonguard import scrub_text
from ..formats.records import sample_key
from .runfolder import RunFolder
from .durable import _fsync_dir, write_error
from .offloop import stoppable

log = logging.getLogger(__name__)

STAGING = ".reindex"
UNMATCHED = "unmatched.jsonl"
_COMPLETE = "COMPLETE"  # the staging folder holds every new file
_DELETED = "DELETED"  # the files it replaces are gone
_OPEN_FILES = 64


@attrs.frozen
class ReindexResult:
    """What a re-index did: records renumbered, set aside, and brought back from unmatched.jsonl."""

    renumbered: int = 0
    unmatched: int = 0
    restored: int = 0
    rewritten: bool = False
    moved: int = 0  # records given the batch of another --batch_size, their prompt_index unchanged


def recorded_dataset(folder: RunFolder) -> dict:
    """What run.json recorded of the dataset and batch size of the previous session ({} if nothing)."""
    try:
        data = json.loads(folder.run_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    recorded = data.get("dataset") if isinstance(data, dict) else None
    out = dict(recorded) if isinstance(recorded, dict) else {}
    config = data.get("config") if isinstance(data, dict) else None
    if isinstance(config, dict) and isinstance(config.get("batch_size"), int):
        out.setdefault("batch_size", config["batch_size"])
    return out


def fingerprint(dataset_file) -> str:
    """A hash of the dataset file's bytes: read at disk speed, it changes whenever any row may have moved."""
    digest = hashlib.sha256()
    with open(dataset_file, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:32]


def needs_check(folder: RunFolder, dataset_fingerprint: str, batch_size: int) -> bool:
    """True when the dataset or the batch size may have changed since the records were written."""
    recorded = recorded_dataset(folder)
    return recorded.get("fingerprint") != dataset_fingerprint or recorded.get("batch_size") != batch_size


def same_dataset(folder: RunFolder, dataset_fingerprint: str) -> bool:
    """True when the records were written for these very dataset bytes (their prompt_index still holds)."""
    return recorded_dataset(folder).get("fingerprint") == dataset_fingerprint


# --- reading the records as they are ---------------------------------------------------------------------


@attrs.define
class _Entry:
    kind: str  # "kept", "discarded", "failed" or "unreadable"
    data: object  # the decoded record, or the raw line of an unreadable one
    aside: bool = False  # read from unmatched.jsonl

    @property
    def record(self) -> dict:
        # the part that holds prompt_index and metadata
        return self.data["trajectory"] if self.kind == "discarded" else self.data

    @property
    def key(self) -> Optional[str]:
        if self.kind == "failed":
            return self.data.get("content_key")
        return (self.record.get("metadata") or {}).get("content_key")

    @property
    def sample(self) -> int:
        """Which of its row's samples the record is (--samples_per_prompt); 0 for records from before samples."""
        holder = self.data if self.kind == "failed" else (self.record.get("metadata") or {})
        value = holder.get("sample_index")
        return value if type(value) is int and value > 0 else 0

    @property
    def index(self) -> int:
        value = self.record.get("prompt_index")
        return value if isinstance(value, int) else -1

    @property
    def batch(self) -> int:
        holder = self.record if self.kind == "failed" else (self.record.get("metadata") or {})
        value = holder.get("batch_num")
        return value if isinstance(value, int) else -1

    def renumber(self, index: int, batch_size: int) -> None:
        record = self.record
        record["prompt_index"] = index
        if self.kind == "failed":
            record["batch_num"] = index // batch_size
        else:
            record.setdefault("metadata", {})["batch_num"] = index // batch_size


def _lines(path: Path) -> Iterator[bytes]:
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        return
    with handle:
        for raw in handle:
            if raw.endswith(b"\n") and raw.strip():  # a torn last line was never a record
                yield raw


def _unreadable(raw: bytes) -> _Entry:
    return _Entry("unreadable", raw.decode("utf-8", "replace").rstrip("\n"), aside=True)


def _decode(raw: bytes, kind: str) -> _Entry:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return _unreadable(raw)
    aside = kind == "unmatched"
    if aside:
        if not isinstance(data, dict):
            return _unreadable(raw)
        if data.get("kind") == "unreadable":
            return _Entry("unreadable", str(data.get("line", "")), aside=True)
        kind, data = data.get("kind"), data.get("record")
        if kind not in ("kept", "discarded", "failed"):
            return _unreadable(raw)
    entry = _Entry(kind, data, aside)
    try:
        if not isinstance(entry.record, dict) or not isinstance(entry.key, str):
            return _unreadable(raw)
    except (KeyError, TypeError, AttributeError):
        return _unreadable(raw)
    return entry


def _sources(folder: RunFolder) -> list[tuple[Path, str]]:
    paths = [(path, "kept") for _num, path in folder.iter_batch_files()]
    return paths + [(folder.discarded, "discarded"), (folder.failed, "failed"), (folder.dir / UNMATCHED, "unmatched")]


def _entries(folder: RunFolder) -> Iterator[tuple[int, _Entry]]:
    """Every record of the run, numbered in a fixed order (so a second pass finds them again)."""
    number = 0
    for path, kind in _sources(folder):
        for raw in stoppable(_lines(path)):  # Ctrl-C stops a re-index: the next start drops its staging
            yield number, _decode(raw, kind)
            number += 1


# --- planning ----------------------------------------------------------------------------------------------


def _plan(folder: RunFolder, rows, batch_size: int) -> tuple[dict, ReindexResult]:
    """entry number -> new index (None: set aside) for every record, and what changes."""
    finished: dict[str, list] = collections.defaultdict(list)  # key -> [(old index, entry number)]
    failed: dict[str, list] = collections.defaultdict(list)
    where: dict[int, tuple] = {}  # entry number -> (old index, batch file or -1, aside)
    samples: set = set()  # the sample indexes above 0 the records hold: their keys are the rows' sample keys
    for number, entry in _entries(folder):
        if entry.kind == "unreadable":
            continue
        (failed if entry.kind == "failed" else finished)[entry.key].append((entry.index, number))
        if entry.sample:
            samples.add(entry.sample)
        where[number] = (entry.index, entry.batch if entry.kind == "kept" else -1, entry.aside)
    if not where:
        return {}, ReindexResult()  # nothing to renumber: no need to read the dataset

    # the current rows of every key the records need: one per finished record, and one for its failures
    wanted = {key: len(entries) for key, entries in finished.items()}
    for key in failed:
        wanted[key] = wanted.get(key, 0) + 1
    positions: dict[str, list[int]] = collections.defaultdict(list)
    samples = sorted(samples)
    for row in rows:
        key = row.content_key
        if len(positions[key]) < wanted.get(key, 0):
            positions[key].append(row.prompt_index)
        for sample in samples:
            other = sample_key(key, sample)
            if len(positions[other]) < wanted.get(other, 0):
                positions[other].append(row.prompt_index)

    assignment: dict[int, Optional[int]] = {}
    for key, entries in finished.items():
        free = positions.get(key, ())
        # duplicates keep the order of their old indexes
        for i, (_old, number) in enumerate(sorted(entries)):
            assignment[number] = free[i] if i < len(free) else None
    for key, entries in failed.items():
        free = positions.get(key, ())
        taken = len(finished.get(key, ()))
        row = free[taken] if taken < len(free) else (free[-1] if free else None)
        for _old, number in entries:
            assignment[number] = row

    renumbered = unmatched = restored = 0
    for number, new in assignment.items():
        old, batch, aside = where[number]
        if new is None:
            unmatched += not aside
        elif aside:
            restored += 1
        elif new != old or (batch != -1 and batch != new // batch_size):
            renumbered += 1
    return assignment, ReindexResult(renumbered, unmatched, restored, bool(renumbered or unmatched or restored))


def _own_places(folder: RunFolder, batch_size: int) -> tuple[dict, ReindexResult]:
    """entry number -> its own prompt_index for every record (a dataset unchanged, a batch size changed)."""
    assignment: dict[int, Optional[int]] = {}
    moved = 0
    for number, entry in _entries(folder):
        if entry.kind == "unreadable" or entry.aside or entry.index < 0:
            assignment[number] = None  # stays where it is: unmatched.jsonl
            continue
        assignment[number] = entry.index
        moved += entry.batch != entry.index // batch_size
    return assignment, ReindexResult(moved=moved, rewritten=bool(moved))


# --- rewriting -----------------------------------------------------------------------------------------------


class _Writers:
    """Appends lines to the staging files, keeping at most a few open; fsyncs each as it closes it."""

    def __init__(self, staging: Path):
        self.staging = staging
        self.open: collections.OrderedDict = collections.OrderedDict()

    def write(self, name: str, line: str) -> None:
        handle = self.open.pop(name, None)
        if handle is None:
            if len(self.open) >= _OPEN_FILES:
                _name, oldest = self.open.popitem(last=False)
                self._close(oldest)
            handle = open(self.staging / name, "a", encoding="utf-8")
        self.open[name] = handle
        try:
            handle.write(line)
        except OSError as exc:  # a write error names the file it was writing
            raise write_error(handle.name, exc, doing="Re-indexing") from exc

    @staticmethod
    def _close(handle) -> None:
        try:
            handle.flush()
            os.fsync(handle.fileno())
        except OSError as exc:
            raise write_error(handle.name, exc, doing="Re-indexing") from exc
        finally:
            try:
                handle.close()
            except OSError:
                pass  # the write that failed was reported above

    def close(self) -> None:
        while self.open:
            _name, handle = self.open.popitem(last=False)
            self._close(handle)


def _line(data) -> str:
    # records of older versions or other tools may hold \ud83d escapes: written back as U+FFFD, as to_json_line does
    return scrub_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n")


def _target(entry: _Entry, index: Optional[int], batch_size: int) -> tuple[str, str]:
    """(file name, line) of an entry at its new place."""
    if entry.kind == "unreadable":
        return UNMATCHED, _line({"kind": "unreadable", "line": entry.data})
    if index is None:
        return UNMATCHED, _line({"kind": entry.kind, "record": entry.data})
    entry.renumber(index, batch_size)
    if entry.kind == "kept":
        return f"batch_{index // batch_size}.jsonl", _line(entry.data)
    return f"{entry.kind}.jsonl", _line(entry.data)


def _replaced(folder: RunFolder) -> list[Path]:
    """The files a re-index rewrites."""
    names = [path for _num, path in folder.iter_batch_files()]
    return names + [p for p in (folder.discarded, folder.failed, folder.dir / UNMATCHED) if p.exists()]


def reindex(folder: RunFolder, dataset_file, batch_size: int) -> ReindexResult:
    """Renumber the run's records by content against the current dataset file (see the module docstring).

    A failed write (disk full) raises RunFolderWriteError; the next start drops the unfinished staging.
    """
    try:
        return _reindex(folder, dataset_file, batch_size)
    except OSError as exc:
        raise write_error(exc.filename or folder.dir, exc, doing="Re-indexing") from exc


def refile(folder: RunFolder, batch_size: int) -> ReindexResult:
    """Move each record to the batch file its own prompt_index has at ``batch_size``; no index changes.

    For a resume over the same dataset bytes with another --batch_size: nothing
    is matched again (the dataset is not read), nothing renumbered.
    """
    try:
        assignment, result = _own_places(folder, batch_size)
        return _rewrite(folder, batch_size, assignment, result)
    except OSError as exc:
        raise write_error(exc.filename or folder.dir, exc, doing="Re-indexing") from exc


def _reindex(folder: RunFolder, dataset_file, batch_size: int) -> ReindexResult:
    assignment, result = _plan(folder, dataset.iter_rows(dataset_file), batch_size)
    return _rewrite(folder, batch_size, assignment, result)


def _rewrite(folder: RunFolder, batch_size: int, assignment: dict, result: ReindexResult) -> ReindexResult:
    if not result.rewritten:
        return result
    staging = folder.dir / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    writers = _Writers(staging)
    try:
        for number, entry in _entries(folder):
            name, line = _target(entry, assignment.get(number), batch_size)
            writers.write(name, line)
    finally:
        writers.close()
    replaces = [path.name for path in _replaced(folder)]
    (staging / _COMPLETE).write_text(json.dumps({"batch_size": batch_size, "replaces": replaces}) + "\n")
    _fsync_dir(staging)
    _switch(folder, staging)
    return result


def recover(folder: RunFolder) -> bool:
    """Finish a re-index a crash interrupted after its staging was complete (True); drop one that was not."""
    try:
        return _recover(folder)
    except OSError as exc:
        raise write_error(exc.filename or folder.dir, exc, doing="Re-indexing") from exc


def _recover(folder: RunFolder) -> bool:
    staging = folder.dir / STAGING
    if not staging.is_dir():
        return False
    if (staging / _COMPLETE).exists():
        log.warning("%s: finishing the re-index an interrupted session left half done.", folder.dir)
        _switch(folder, staging)
        return True
    shutil.rmtree(staging)
    return False


def _switch(folder: RunFolder, staging: Path) -> None:
    # Old files first, all of them, then the new ones in: a crash in between is finished by recover().
    try:
        replaced = json.loads((staging / _COMPLETE).read_text(encoding="utf-8"))["replaces"]
    except (ValueError, KeyError, TypeError):  # a staging of an older version: it replaces what is there
        replaced = None
    if not (staging / _DELETED).exists():
        paths = _replaced(folder)
        replaced = [path.name for path in paths] if replaced is None else replaced
        for path in paths:
            path.unlink()
        _fsync_dir(folder.dir)
        (staging / _DELETED).write_text("")
        _fsync_dir(staging)
    for path in sorted(staging.iterdir()):
        if path.name not in (_COMPLETE, _DELETED):
            os.replace(path, folder.dir / path.name)
    _fsync_dir(folder.dir)
    # The indexes of the old files go before the staging does, so a kill here drops them on the next start.
    # They must: a batch file rewritten with the same length and the same first and last 4 KB (records
    # that begin with one long system prompt) passes the index's own check.
    RecordIndex(folder).drop(replaced or ())
    shutil.rmtree(staging)


def count_unmatched(folder: RunFolder) -> int:
    """Records set aside in unmatched.jsonl."""
    return sum(1 for _ in _lines(folder.dir / UNMATCHED))


def warn(result: ReindexResult) -> None:
    """One warning saying what a re-index changed."""
    if not result.rewritten:
        return
    parts = []
    if result.renumbered:
        parts.append(f"{result.renumbered} record(s) renumbered to their rows in the current file")
    if result.unmatched:
        parts.append(f"{result.unmatched} whose rows are gone set aside in {UNMATCHED}")
    if result.restored:
        parts.append(f"{result.restored} from {UNMATCHED} matched to rows again")
    log.warning("The dataset changed since the last session: %s.", "; ".join(parts))
