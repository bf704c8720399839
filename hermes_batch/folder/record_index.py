"""The run's index: what each record file holds, so a resume and the statistics never read every record.

For each record file (``batch_N.jsonl``, ``discarded.jsonl``, ``failed.jsonl``)
``index/<name>.json`` holds the 8-byte digest of the content key and the time
of every finished record, and the statistics totals of all its records
(aggregate.py), for the first ``covered`` bytes of the file.  ``index/calls.json``
holds the journal's totals the same way.  An index is written whole and
atomically, like checkpoint.json, when its batch completes and when a session
ends; the records stay the truth:

* a file longer than its index covers (a session killed before it saved the
  index) has only its new lines read and added;
* an index that is missing, does not parse, or whose file changed under it
  (shorter, or other bytes where it ended: a re-index, a hand edit) is built
  again from the file, so a run folder of an older version still resumes.

A million finished prompts cost 8 MB of digests at the start of a resume,
never a Python string per prompt.
"""

from __future__ import annotations

import array
import hashlib
import json
import logging
import os
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Union

import attrs

from .aggregate import Aggregate, ExactSum, epoch, pack_array, unpack_array
from ..formats.endpoint_numbers import CALLS_PER_RECORD, MAX_CALL_COST, MAX_CALL_TOKENS, stored_cost, stored_usage
from ..formats.jsonguard import finite_dumps
from .journal import JournalTotals, finish_totals, journal_path, scan_journal
from ..formats.records import Discarded, Failure, Trajectory, Usage, key_digest
from .runfolder import RunFolder, read_records, record_order
from .durable import _fsync_dir, atomic_write_text
from .offloop import check_stop

log = logging.getLogger(__name__)

INDEX_DIR = "index"
VERSION = 1
_EDGE = 4096  # bytes hashed at each end of what an index covers
_KINDS = {"kept": Trajectory, "discarded": Discarded, "failed": Failure}
_BATCH_INDEX_RE = re.compile(r"batch_(\d+)\.json")
_RECORD_INDEX_RE = re.compile(r"(batch_\d+|discarded|failed|merged)\.json")
_INDEX_FILE_RE = re.compile(r"(batch_\d+|discarded|failed|merged|calls|dataset)\.json")


def is_index_file(name: str) -> bool:
    """True for the name of a file a run writes in index/ (temporary files aside)."""
    return _INDEX_FILE_RE.fullmatch(name) is not None


def covered_end(path: Path) -> int:
    """Where the whole lines of a file end (a torn last line is never covered); 0 if it does not exist."""
    try:
        with open(path, "rb") as handle:
            end = handle.seek(0, os.SEEK_END)
            step = 4096  # a whole file ends with its newline: one small read, at every load of a thousand indexes
            while end > 0:
                start = max(0, end - step)
                handle.seek(start)
                pos = handle.read(end - start).rfind(b"\n")
                if pos >= 0:
                    return start + pos + 1
                end, step = start, min(step * 4, 1 << 20)
            return 0
    except FileNotFoundError:
        return 0


def edges(path: Path, covered: int) -> str:
    """A hash of the first and last bytes of what an index covers: it changes when the file is rewritten."""
    digest = hashlib.blake2b(str(covered).encode(), digest_size=12)
    if covered:
        with open(path, "rb") as handle:
            digest.update(handle.read(min(_EDGE, covered)))
            handle.seek(max(0, covered - _EDGE))
            digest.update(handle.read(min(_EDGE, covered)))
    return digest.hexdigest()


class FileIndex:
    """The index of one record file: digests and times of its finished records, totals of all of them."""

    def __init__(self, source: Path, kind: str):
        self.source, self.kind = source, kind
        self.covered = 0
        self.edges = edges(source, 0)
        self.aggregate = Aggregate()
        self.digests = array.array("Q")
        self.epochs = array.array("d")
        self.implausible = False  # its saved usage totals are none its records could sum to (see from_json)

    def add(self, record: Union[Trajectory, Discarded, Failure]) -> None:
        """Count a record just appended to the file."""
        self.aggregate.add(record)
        if self.kind != "failed":
            meta = (record.trajectory if isinstance(record, Discarded) else record).metadata
            self.digests.append(key_digest(meta.content_key))
            self.epochs.append(epoch(meta.timestamp))

    def catch_up(self, stop: Optional[int] = None) -> int:
        """Read the records the index does not cover yet (up to byte ``stop``); return how many."""
        stop = covered_end(self.source) if stop is None else stop
        count = 0
        for _line, record in read_records(self.source, _KINDS[self.kind], start=self.covered, stop=stop):
            self.add(record)
            count += 1
        self.covered = stop
        return count

    def seal(self) -> None:
        """Cover the file as it is now: call when every record appended to it has been added."""
        self.covered = covered_end(self.source)
        self.edges = edges(self.source, self.covered)

    def to_json(self) -> str:
        return finite_dumps({
            "version": VERSION, "source": self.source.name, "kind": self.kind, "covered": self.covered,
            "edges": self.edges, "aggregate": self.aggregate.to_state(),
            "digests": pack_array(self.digests), "epochs": pack_array(self.epochs),
        }, separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, source: Path, kind: str, text: str) -> "FileIndex":
        """The index saved in ``text``; raises ValueError (or KeyError, TypeError) when it is damaged."""
        data = json.loads(text)
        if data["version"] != VERSION or data["source"] != source.name or data["kind"] != kind:
            raise ValueError("the index is of another file or version")
        index = cls(source, kind)
        index.covered, index.edges = int(data["covered"]), str(data["edges"])
        index.aggregate = Aggregate.from_state(data["aggregate"])
        if kind == "discarded" and "reasons" not in data["aggregate"]:
            index.implausible = True  # saved before the reasons were counted: read again from the records
        elif not _plausible_usage(index.aggregate):
            # saved by a version that took any number an endpoint sent (10**30 tokens, 1e308 dollars): the
            # records are read again with today's checks, or, where they are gone, the totals are not reported
            index.implausible = True
            _forget_usage(index.aggregate)
        if not index.aggregate.rewards.plausible():
            # rewards outside [0, 1] (an older version took 1e308 from a reward file): read again as not verified
            index.implausible = True
            index.aggregate.rewards.forget_reward_sum()
        index.digests, index.epochs = unpack_array("Q", data["digests"]), unpack_array("d", data["epochs"])
        if len(index.digests) != len(index.epochs):
            raise ValueError("the index's arrays differ in length")
        return index


@attrs.frozen
class BatchState:
    """What the merge needs to know of one batch file: its number, what its index covers, its tool names."""

    num: int
    covered: int
    edges: str
    kept: int
    tools: frozenset


class RecordIndex:
    """The indexes of one run folder as a session uses them: loaded, brought up to date, added to, saved."""

    def __init__(self, folder: RunFolder, read_only: bool = False):
        self.folder = folder
        self.read_only = read_only  # a reader beside the run (the report, the viewer): index/ stays the run's
        self._held: dict[str, FileIndex] = {}  # read only: the indexes as last brought up to date, kept in memory
        self.dir = folder.dir / INDEX_DIR
        self.open: dict[str, FileIndex] = {}  # indexes of files this session appends to, by file name
        self.rebuilt = 0  # indexes built again from their records this session

    # --- files ---------------------------------------------------------------------------------

    def sources(self) -> list[tuple[Path, str]]:
        """Every record file of the run with its kind, batch files in batch order.

        A batch file deleted once the run was final (its trajectories are in the merged output) is still
        listed while its index is there: its prompts stay finished.
        """
        files = self.folder.record_files()
        if self.dir.is_dir():
            listed = {path.name for path, _kind in files}
            for entry in os.scandir(self.dir):
                if _BATCH_INDEX_RE.fullmatch(entry.name) and entry.name + "l" not in listed:
                    files.append((self.folder.dir / (entry.name + "l"), "kept"))
        return sorted(files, key=lambda file: record_order(file[0].name))

    def path_of(self, source: Path) -> Path:
        return self.dir / (source.stem + ".json")

    def load(self, source: Path, kind: str) -> FileIndex:
        """The index of ``source``, brought up to date (and saved if that changed it), built again if damaged."""
        if source.name in self.open:
            return self.open[source.name]
        index, changed = self._read(source, kind), False
        if index is not None and index.implausible and source.exists():
            index = None  # built again below, its records read with today's checks
        if index is not None and kind == "kept" and not source.exists():
            return index  # a batch file deleted once the run was final: what it held is in the merged output
        end = covered_end(source)
        if index is None or index.covered > end or index.edges != edges(source, index.covered):
            if index is not None or end:
                if index is not None:
                    log.warning("%s: the index does not match the file; building it again from the records.", source)
                self.rebuilt += 1
            index, changed = FileIndex(source, kind), bool(end)
        if index.covered < end:
            index.catch_up(end)
            changed = True
        if changed:
            index.seal()
            self.save(index)
        if self.read_only:  # the next load reads only what is appended meanwhile
            self._held[source.name] = index
        return index

    def _read(self, source: Path, kind: str) -> Optional[FileIndex]:
        if source.name in self._held:
            return self._held[source.name]
        try:
            text = self.path_of(source).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):  # missing or unreadable: built again from the records
            return None
        try:
            return FileIndex.from_json(source, kind, text)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def save(self, index: FileIndex) -> None:
        if self.read_only:
            return
        if not self.dir.is_dir():
            self.dir.mkdir(exist_ok=True)
            _fsync_dir(self.dir.parent)
        atomic_write_text(self.path_of(index.source), index.to_json())

    def drop(self, removed: Iterable[str] = ()) -> None:
        """Forget the indexes of the record files and the merge's state (the records were rewritten, so the
        merged output is too): they are built again from the records when next needed.

        The index of a batch file that is gone stays (its prompts stay finished, see sources), unless the
        file is named in ``removed``: the caller deleted it in the rewrite.
        """
        self.open.clear()
        removed = {Path(name).stem + ".json" for name in removed}
        if self.dir.is_dir():
            for entry in os.scandir(self.dir):
                deleted_batch = _BATCH_INDEX_RE.fullmatch(entry.name) and entry.name not in removed \
                    and not self.folder.batch_path(int(entry.name[6:-5])).exists()
                if _RECORD_INDEX_RE.fullmatch(entry.name) and not deleted_batch \
                        and entry.is_file(follow_symlinks=False):
                    os.unlink(entry.path)

    # --- a session -------------------------------------------------------------------------------

    def finished_digests(self) -> array.array:
        """The digests of every finished prompt (kept or discarded): the multiset a resume matches."""
        digests = array.array("Q")
        for source, kind in self.sources():
            check_stop()  # a resume reads these off the event loop: Ctrl-C stops it between files
            if kind != "failed":
                digests.extend(self.load(source, kind).digests)
        return digests

    def touch(self, kind: str, batch_num: int) -> FileIndex:
        """The index of the file a record of ``kind`` goes to; call before appending the record, so the
        index covers what the file held before, then ``add`` the record to what this returns."""
        source = self.folder.batch_path(batch_num) if kind == "kept" else getattr(self.folder, kind)
        index = self.open.get(source.name)
        if index is None:
            index = self.open[source.name] = self.load(source, kind)
        return index

    def close_batch(self, batch_num: int) -> None:
        """Every record of the batch this session will write is written: save its index."""
        index = self.open.pop(self.folder.batch_path(batch_num).name, None)
        if index is not None:
            index.seal()
            self.save(index)

    def close(self) -> None:
        """Save the index of every file this session appended to (each record added since)."""
        for index in self.open.values():
            index.seal()
            self.save(index)
        self.open.clear()

    # --- totals ------------------------------------------------------------------------------------

    def totals(self) -> tuple[Aggregate, Callable[[set], Iterable[tuple[int, float]]], list[BatchState]]:
        """The run's totals, a way to find when the prompts that failed finished, and each batch's state."""
        total = Aggregate()
        batches = []
        for source, kind in self.sources():
            index = self.load(source, kind)
            total.merge(index.aggregate)
            if kind == "kept":
                batches.append(BatchState(int(source.stem.split("_")[1]), index.covered, index.edges,
                                          index.aggregate.kept.samples, frozenset(index.aggregate.merge_tools)))
        return total, self._finish_times, batches

    def _finish_times(self, wanted: set) -> Iterator[tuple[int, float]]:
        for source, kind in self.sources():
            if kind == "failed":
                continue
            index = self.load(source, kind)
            for digest, seconds in zip(index.digests, index.epochs):
                if digest in wanted:
                    yield digest, seconds

    def journal_totals(self) -> JournalTotals:
        """calls.jsonl's totals: the saved ones, plus the lines written since."""
        path = journal_path(self.folder.dir)
        saved = self.dir / "calls.json"
        raw, covered = None, 0
        try:
            data = json.loads(saved.read_text(encoding="utf-8"))
            covered = int(data["covered"])
            if data["version"] == VERSION and covered <= covered_end(path) and data["edges"] == edges(path, covered):
                raw = _journal_from_state(data["totals"], covered)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raw = None
        if raw is None:
            raw, covered = JournalTotals(), 0
        end = scan_journal(path, raw, covered)
        if path.exists() and (end != covered or not saved.exists()):
            if not self.dir.is_dir():
                self.dir.mkdir(exist_ok=True)
            atomic_write_text(saved, finite_dumps({"version": VERSION, "covered": end, "edges": edges(path, end),
                                                 "totals": _journal_state(raw)}) + "\n")
        return finish_totals(raw)


def _journal_state(totals: JournalTotals) -> dict:
    usage = totals.usage
    return {
        "first_session": totals.first_session, "sent": totals.sent, "done": totals.done, "errors": totals.errors,
        "rate_limited": totals.rate_limited,
        "usage": [usage.prompt_tokens, usage.completion_tokens, usage.reasoning_tokens, usage.cached_tokens, usage.cost],
        "cost_by_session": [[s, c] for s, c in totals.cost_by_session.items()],
        "requests_by_provider": dict(totals.requests_by_provider),
        "errors_by_provider": dict(totals.errors_by_provider),
        "latency_ms": {p: [[ms, n] for ms, n in h.items()] for p, h in totals.latency_ms.items()},
    }


def _plausible_usage(aggregate: Aggregate) -> bool:
    """True when the usage totals are sums that ``aggregate``'s records could hold (endpoint_numbers.py)."""
    records = aggregate.finished.samples + aggregate.failure_records
    tokens = MAX_CALL_TOKENS * CALLS_PER_RECORD * records
    if not all(0 <= getattr(aggregate, name) <= tokens for name in _TOKEN_TOTALS):
        return False
    return 0 <= aggregate.cost.scaled <= (int(MAX_CALL_COST) * CALLS_PER_RECORD * records) << _COST_SCALE


def _forget_usage(aggregate: Aggregate) -> None:
    for name in _TOKEN_TOTALS:
        setattr(aggregate, name, 0)
    aggregate.cost = ExactSum()


_TOKEN_TOTALS = ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens")
_COST_SCALE = 1074  # ExactSum's
_JOURNAL_LINE = 30  # bytes a line of calls.jsonl takes at least


def _journal_from_state(state: dict, covered: int) -> JournalTotals:
    """The saved totals; raises ValueError when their usage is none the lines they cover could sum to."""
    usage = Usage(*state["usage"])
    lines = covered // _JOURNAL_LINE + 1
    if stored_usage(attrs.asdict(usage), calls=lines) != usage or any(
        stored_cost(cost, calls=lines) is None for _session, cost in state["cost_by_session"]
    ):
        raise ValueError("the saved totals hold usage no call can report")
    latency: dict = defaultdict(Counter)
    for provider, pairs in state["latency_ms"].items():
        latency[provider] = Counter({int(ms): int(n) for ms, n in pairs})
    return JournalTotals(
        first_session=state["first_session"], sent=int(state["sent"]), done=int(state["done"]),
        errors=int(state["errors"]), rate_limited=int(state["rate_limited"]), usage=usage,
        cost_by_session={s: c for s, c in state["cost_by_session"]},
        requests_by_provider=Counter(state["requests_by_provider"]),
        errors_by_provider=Counter(state["errors_by_provider"]), latency_ms=latency,
    )
