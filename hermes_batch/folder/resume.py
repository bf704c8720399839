"""Resume: find the finished prompts of a run folder and drop them from the dataset, by content."""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Iterator, Union

from ..formats.records import Discarded, PromptRow, Trajectory
from .runfolder import RunFolder, read_records


def iter_finished(folder: RunFolder) -> Iterator[Union[Trajectory, Discarded]]:
    """Every finished record of the run: kept trajectories of all batch files, then discarded ones."""
    for _num, path in folder.iter_batch_files():
        for _line, traj in read_records(path, Trajectory):
            yield traj
    for _line, discarded in read_records(folder.discarded, Discarded):
        yield discarded


def scan_finished(folder: RunFolder) -> Counter[str]:
    """content_key -> number of finished prompts (kept or discarded); failures do not count."""
    finished: Counter[str] = Counter()
    for record in iter_finished(folder):
        traj = record.trajectory if isinstance(record, Discarded) else record
        finished[traj.metadata.content_key] += 1
    return finished


class ResumePlan:
    """Iterates the rows still to run; a row is skipped while its content key has finished records left."""

    def __init__(self, rows: Iterable[PromptRow], finished: Counter[str]):
        self._rows = iter(rows)
        self._remaining = Counter(finished)  # a copy: matching consumes it
        self.finished_total = sum(finished.values())
        self.skipped = 0  # rows dropped as already finished
        self.to_run = 0  # rows yielded so far

    def __iter__(self) -> "ResumePlan":
        return self

    def __next__(self) -> PromptRow:
        for row in self._rows:
            key = row.content_key
            if self._remaining[key] > 0:
                self._remaining[key] -= 1
                self.skipped += 1
                continue
            self.to_run += 1
            return row
        raise StopIteration

    @property
    def unmatched(self) -> int:
        """Finished records no dataset row claimed (so far): the dataset no longer holds those prompts."""
        return sum(n for n in self._remaining.values() if n > 0)


def plan_resume(rows: Iterable[PromptRow], finished: Counter[str]) -> ResumePlan:
    """The rows of ``rows`` that still have to run, as an iterator that also counts what it skipped."""
    return ResumePlan(rows, finished)
