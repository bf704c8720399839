"""Filters over a finished run folder: the records as they stand, and the verdict of filters on them.

Used by ``hermes-batch export`` (which narrows what it writes) and
``hermes-batch refilter`` (which moves records between the kept and discarded
sets).  Filters that judge a trajectory against the rest of the run (near
duplicates) subclass :class:`RunFilter`; they see every trajectory that passed
the per-record filters, so they only run where the whole run is at hand.
"""

from __future__ import annotations

import abc
import heapq
import json
import logging
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

import attrs

from ..errors import UsageError
from .interfaces import Filter
from ..formats.records import Discarded, Trajectory
from ..folder.runfolder import RunFolder, read_records
from ..formats.serialization import describe_structure_error, from_json

log = logging.getLogger(__name__)

INCLUDE = ("kept", "discarded", "all")


class RunFilter(Filter):
    """A filter that needs the whole run: ``select`` sees every candidate at once.

    ``check`` keeps everything, so a RunFilter passed to ``hermes-batch run`` would
    do nothing; the run refuses it and says to use ``export`` or ``refilter``.
    """

    def check(self, trajectory: Trajectory) -> Optional[str]:
        return None

    @abc.abstractmethod
    def select(self, candidates: Iterable[tuple[object, Trajectory]]) -> dict:
        """``key -> reason`` for the candidates to discard; ``candidates`` are ``(key, trajectory)`` pairs.

        Candidates come in no particular order; where the filter must choose one
        of several (the original among duplicates), it keeps the lowest
        ``prompt_index``.  Hold only what the decision needs: a run may have a
        million trajectories.
        """


def refuse_run_filters(filters: Sequence[Filter]) -> None:
    """UsageError if a whole-run filter was given to ``hermes-batch run``."""
    for f in filters:
        if isinstance(f, RunFilter):
            raise UsageError(
                f"The filter {f.name!r} compares trajectories across the whole run, so it cannot run while "
                "prompts finish; apply it afterwards with 'hermes-batch refilter' or 'hermes-batch export --filter'."
            )


@attrs.frozen
class Entry:
    """A finished record where it stands: ``where`` is (file name, line number), ``discarded`` its discarded.jsonl form."""

    where: tuple
    trajectory: Trajectory
    discarded: Optional[Discarded] = None

    @property
    def kept(self) -> bool:
        return self.discarded is None


def iter_kept(folder: RunFolder) -> Iterator[Entry]:
    """Kept records of every batch file, in prompt_index order within each batch (one batch in memory)."""
    for _num, path in folder.iter_batch_files():
        batch = [Entry((path.name, line), traj) for line, traj in read_records(path, Trajectory)]
        batch.sort(key=lambda e: e.trajectory.prompt_index)
        yield from batch


def iter_discarded(folder: RunFolder, ordered: bool = True) -> Iterator[Entry]:
    """Records of discarded.jsonl; ``ordered``: by prompt_index, holding only their offsets in memory."""
    name = folder.discarded.name
    if not ordered:
        for line, record in read_records(folder.discarded, Discarded):
            yield Entry((name, line), record.trajectory, record)
        return
    offsets = []
    for line, offset, record in _with_offsets(folder.discarded):
        offsets.append((record.trajectory.prompt_index, line, offset))
    offsets.sort()
    if not offsets:
        return
    with open(folder.discarded, "rb") as fh:
        for _index, line, offset in offsets:
            fh.seek(offset)
            record = from_json(json.loads(fh.readline()), Discarded)
            yield Entry((name, line), record.trajectory, record)


def _with_offsets(path: Path) -> Iterator[tuple[int, int, Discarded]]:
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    with fh:
        offset = 0
        for line, raw in enumerate(fh, start=1):
            start, offset = offset, offset + len(raw)
            if not raw.endswith(b"\n") or not raw.strip():
                continue  # a torn last line (read_records says so) or a blank one
            try:
                record = from_json(json.loads(raw), Discarded)
            except Exception as exc:  # cattrs and json raise several types; read_records logs the same lines
                log.debug("%s:%d: %s", path, line, describe_structure_error(exc))
                continue
            yield line, start, record


def iter_entries(folder: RunFolder, include: str = "kept") -> Iterator[Entry]:
    """The records ``include`` selects (kept, discarded or all), in prompt_index order."""
    if include not in INCLUDE:
        raise UsageError(f"--include {include!r} is not one of {', '.join(INCLUDE)}; choose one of them.")
    if include == "kept":
        return iter_kept(folder)
    if include == "discarded":
        return iter_discarded(folder)
    return heapq.merge(iter_kept(folder), iter_discarded(folder), key=lambda e: e.trajectory.prompt_index)


@attrs.frozen
class Verdict:
    """Filter names and reasons of one rejected record."""

    filters: tuple[str, ...]
    reasons: tuple[str, ...]


def judge(entries: Callable[[], Iterable[Entry]], filters: Sequence[Filter]) -> dict:
    """``where -> Verdict`` for every record the filters reject; records not in it pass.

    ``entries`` returns a fresh iterator of the records each time it is called.
    Per-record filters run first, in order, and every one that rejects a record
    is named; each whole-run filter then reads the records again and sees those
    that passed all of the per-record ones (never the whole run in memory).
    """
    per_record = [f for f in filters if not isinstance(f, RunFilter)]
    whole_run = [f for f in filters if isinstance(f, RunFilter)]
    rejected: dict = {}
    if per_record:
        for entry in entries():
            found = [(f.name, reason) for f in per_record if (reason := f.check(entry.trajectory)) is not None]
            if found:
                rejected[entry.where] = Verdict(tuple(n for n, _ in found), tuple(r for _, r in found))
    before = frozenset(rejected)
    for f in whole_run:
        candidates = ((e.where, e.trajectory) for e in entries() if e.where not in before)
        for where, reason in f.select(candidates).items():
            old = rejected.get(where, Verdict((), ()))
            rejected[where] = Verdict(old.filters + (f.name,), old.reasons + (reason,))
    return rejected
