"""Merge the batch files of a run into the writers' outputs, in prompt_index order."""

from __future__ import annotations

import logging
from typing import Iterable, Iterator, Optional, Sequence

import attrs

from .interfaces import Writer
from .records import Trajectory
from .runfolder import RunFolder, check_stop, read_records

log = logging.getLogger(__name__)


@attrs.frozen
class MergeResult:
    """What a merge wrote: the number of kept trajectories, the tool names every line lists, each writer's file."""

    trajectories: int
    tool_names: tuple[str, ...]
    outputs: dict  # writer name -> main file name it returned


def collect_tool_names(folder: RunFolder) -> tuple[set[str], int]:
    """The tool names in any kept trajectory's stats, and the number of kept trajectories."""
    names: set[str] = set()
    count = 0
    for _num, path in folder.iter_batch_files():
        for _line, traj in read_records(path, Trajectory):
            names.update(traj.tool_stats)
            names.update(traj.tool_error_counts)
            count += 1
    return names, count


def iter_merged(folder: RunFolder, tool_names: Iterable[str] = ()) -> Iterator[Trajectory]:
    """Kept trajectories of every batch in prompt_index order, each listing all ``tool_names``; one batch in memory."""
    tool_names = frozenset(tool_names)
    previous_max: Optional[int] = None
    for num, path in folder.iter_batch_files():
        batch = sorted((traj for _line, traj in read_records(path, Trajectory)), key=lambda t: t.prompt_index)
        if not batch:
            continue
        if previous_max is not None and batch[0].prompt_index < previous_max:
            # batches are fixed ranges of prompt_index, so this means the batch size changed between sessions
            log.warning("%s: prompt indexes overlap earlier batches; the merged file is not fully ordered.", path)
        previous_max = batch[-1].prompt_index
        for traj in batch:
            check_stop()  # Ctrl-C: the writer consuming this gives up its temporary file
            yield traj.with_tools(tool_names)


def merge_run(folder: RunFolder, writers: Sequence[Writer], tool_names: Iterable[str] = ()) -> MergeResult:
    """Hand every writer the run's kept trajectories in prompt_index order with the union of tool names."""
    names, count = collect_tool_names(folder)
    names.update(tool_names)
    outputs = {}
    for writer in writers:
        # re-read per writer rather than tee: memory stays at one batch however many writers there are
        outputs[writer.name] = writer.write(folder.dir, iter_merged(folder, names))
    return MergeResult(trajectories=count, tool_names=tuple(sorted(names)), outputs=outputs)
