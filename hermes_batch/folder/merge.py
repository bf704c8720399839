"""Merge the batch files of a run into the writers' outputs, in prompt_index order, doing only what changed.

The merged output is the batches' kept trajectories one batch after another,
each line listing every tool name of the run.  ``index/merged.json`` records
which batches (as their indexes saw them: record_index.BatchState), which tool
names, and, for a writer that can append, where each batch's lines end in its
file.  The next merge compares:

* nothing changed: the outputs stay as they are;
* batches were added after the merged ones: an appending writer gets only
  those, added to the end of its file;
* an earlier batch changed (prompts that failed ran again, an interrupted
  batch was finished): an appending writer's file is cut back to the end of
  the last unchanged batch and the rest appended; other writers write all;
* the tool names changed (a tool first used): every line changes, so all is
  written again.

A full write goes to a temporary file renamed over the output, as before.  An
append or cut is made in place: a merge cut off there leaves the output whole
up to the batch it was at, possibly with part of a line at the end, which
index/merged.json does not vouch for, so the next merge cuts it off first.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Sequence

import attrs

from .record_index import INDEX_DIR, BatchState, RecordIndex, edges
from ..formats.records import Trajectory
from .runfolder import RunFolder, read_records
from .durable import _create_temp, _fsync_dir, atomic_write_text
from .offloop import Stopped, check_stop
from ..errors import HermesBatchError, PluginError

if TYPE_CHECKING:  # the writers are the contract's, a layer above the run folder
    from ..contract.interfaces import Writer

log = logging.getLogger(__name__)

STATE = "merged.json"
VERSION = 1


@attrs.frozen
class MergeResult:
    """What a merge wrote: the number of kept trajectories, the tool names every line lists, each writer's file."""

    trajectories: int
    tool_names: tuple[str, ...]
    outputs: dict  # writer name -> main file name it returned
    appended: int = 0  # batches added to appending writers' outputs
    rewritten: int = 0  # batches written again (all of them for a full write)


def batch_trajectories(path: Path, tool_names: frozenset) -> list[Trajectory]:
    """One batch's kept trajectories in prompt_index order, each listing all ``tool_names``."""
    batch = sorted((traj for _line, traj in read_records(path, Trajectory)), key=lambda t: t.prompt_index)
    return [traj.with_tools(tool_names) for traj in batch]


def iter_merged(folder: RunFolder, tool_names: Iterable[str] = (), batches: Optional[Sequence[int]] = None
                ) -> Iterator[Trajectory]:
    """Kept trajectories of every batch (or of ``batches``) in prompt_index order; one batch in memory."""
    tool_names = frozenset(tool_names)
    previous_max: Optional[int] = None
    wanted = None if batches is None else set(batches)
    for num, path in folder.iter_batch_files():
        if wanted is not None and num not in wanted:
            continue
        batch = batch_trajectories(path, tool_names)
        if not batch:
            continue
        if previous_max is not None and batch[0].prompt_index < previous_max:
            # batches are fixed ranges of prompt_index, so this means the batch size changed between sessions
            log.warning("%s: prompt indexes overlap earlier batches; the merged file is not fully ordered.", path)
        previous_max = batch[-1].prompt_index
        for traj in batch:
            check_stop()  # Ctrl-C: the writer consuming this gives up its temporary file
            yield traj


def _load_state(folder: RunFolder) -> dict:
    try:
        state = json.loads((folder.dir / INDEX_DIR / STATE).read_text(encoding="utf-8"))
        if state.get("version") == VERSION and isinstance(state.get("writers"), dict):
            return state
    except (OSError, ValueError, AttributeError):
        pass
    return {}


def _usable(saved, names: frozenset) -> bool:
    try:
        return (saved["tools"] == sorted(names) and isinstance(saved["batches"], list)
                and isinstance(saved["size"], int) and isinstance(saved["edges"], str)
                and len(saved["ends"]) == len(saved["edges_at"])
                and all(isinstance(end, int) for end in saved["ends"]))
    except (KeyError, TypeError):
        return False


def _same_prefix(previous: list, current: list) -> int:
    """How many batches at the start are unchanged since the last merge."""
    same = 0
    for old, new in zip(previous, current):
        if old != new:
            break
        same += 1
    return same


def _intact(path: Path, size: int, mark: str) -> bool:
    """True when ``path`` still holds what the last merge wrote in its first ``size`` bytes."""
    try:
        return os.path.getsize(path) >= size and edges(path, size) == mark
    except OSError:
        return False


def merge_run(folder: RunFolder, writers: Sequence[Writer], tool_names: Iterable[str] = (),
              batches: Optional[Sequence[BatchState]] = None, who: Optional[Callable[[str], str]] = None) -> MergeResult:
    """Bring every writer's output up to date with the run's kept trajectories (see the module docstring).

    ``batches`` is what the run's index says of each batch file (record_index.RecordIndex.totals); without it
    the index is brought up to date here.  A writer's own exception (not an OSError) is a PluginError naming
    it, ``who(name)`` saying whose it is; the batch files it was writing from are untouched.
    """
    if batches is None:
        _total, _times, batches = RecordIndex(folder).totals()
    names = set(tool_names)
    for batch in batches:
        names.update(batch.tools)
    names = frozenset(names)
    current = [[b.num, b.covered, b.edges] for b in batches if b.kept]
    deleted = {num for num, _covered, _edges in current if not folder.batch_path(num).exists()}
    saved_states = _load_state(folder).get("writers", {})
    outputs, states = {}, {}
    appended = rewritten = 0
    for writer in writers:
        saved = saved_states.get(writer.name)
        if not _usable(saved, names):
            saved = None  # none, damaged, or of other tool names (a new tool name changes every line)
        try:
            filename, state, counts = _merge_writer(folder, writer, names, current, deleted, saved)
        except (OSError, HermesBatchError, Stopped):
            raise
        except Exception as exc:  # the writer plugin's own bug
            whose = who(writer.name) if who else f"the writer {writer.name!r}"
            log.error("%s raised %s: %s; the traceback follows.", whose, type(exc).__name__, exc, exc_info=exc)
            raise PluginError(
                f"{whose[0].upper()}{whose[1:]} raised {type(exc).__name__}: {exc} (the traceback is in the log); "
                "every finished prompt is saved in the batch files: fix the writer or leave out its --writer, "
                "and run again with --resume to write the output."
            ) from exc
        outputs[writer.name] = filename
        if state is not None:
            states[writer.name] = state
        appended, rewritten = appended + counts[0], rewritten + counts[1]
    (folder.dir / INDEX_DIR).mkdir(exist_ok=True)
    atomic_write_text(folder.dir / INDEX_DIR / STATE, json.dumps({"version": VERSION, "writers": states}) + "\n")
    kept = sum(b.kept for b in batches)
    return MergeResult(trajectories=kept, tool_names=tuple(sorted(names)), outputs=outputs, appended=appended,
                       rewritten=rewritten)


def _merge_writer(folder: RunFolder, writer: Writer, names: frozenset, current: list, deleted: set,
                  saved: Optional[dict]) -> tuple:
    """Bring one writer's output up to date: (its file name, its new state, (batches appended, written))."""
    previous = saved["batches"] if saved else []
    same = _same_prefix(previous, current)
    filename = saved and saved.get("file")
    path = folder.dir / filename if isinstance(filename, str) else None
    ends = saved.get("ends", []) if saved else []
    if path is not None and same == len(previous) == len(current) and _intact(path, saved["size"], saved["edges"]) \
            and os.path.getsize(path) == saved["size"]:
        return filename, saved, (0, 0)
    can_append = getattr(writer, "can_append", False)
    appending = path is not None and can_append and same > 0 and len(ends) == len(previous) \
        and _intact(path, ends[same - 1], saved["edges_at"][same - 1])
    missing = sorted(deleted & {b[0] for b in current[same if appending else 0:]})
    if missing:
        # batch files deleted once the run was final: what they held exists only in the output
        log.warning("%s is left as it was: it would have to be written again from batch_%d.jsonl, which was "
                    "deleted; the trajectories of this session stay in their batch files.",
                    filename or writer.name, missing[0])
        return filename, saved, (0, 0)
    if appending:
        ends = ends[:same]
        _cut(path, ends[-1])
        _append(writer, folder, path, names, current[same:], ends)
        counts = (len(current) - same, 0)
    elif can_append:
        filename = writer.filename
        path = folder.dir / filename
        ends = _write_appending(writer, folder, path, names, current)
        counts = (0, len(current))
    else:
        filename = writer.write(folder.dir, iter_merged(folder, names, [b[0] for b in current]))
        path = folder.dir / filename if isinstance(filename, str) else None
        ends, counts = [], (0, len(current))
    return filename, _writer_state(path, filename, ends, names, current), counts


def _writer_state(path: Optional[Path], filename, ends: list, names: frozenset, current: list) -> dict:
    state = {"file": filename, "tools": sorted(names), "batches": current, "size": -1, "edges": "", "ends": [],
             "edges_at": []}
    if path is not None and path.exists():
        size = os.path.getsize(path)
        state.update(size=size, edges=edges(path, size), ends=ends, edges_at=[edges(path, end) for end in ends])
    return state


def _cut(path: Path, size: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(size)
        os.fsync(handle.fileno())


def _append(writer: Writer, folder: RunFolder, path: Path, names: frozenset, batches: list, ends: list) -> None:
    """Append each batch's lines in turn, noting where each ends."""
    for num, _covered, _edges in batches:
        check_stop()  # Ctrl-C: stop between batches; the next merge goes on from the last whole one
        writer.append(path, batch_trajectories(folder.batch_path(num), names))
        ends.append(os.path.getsize(path))


def _write_appending(writer: Writer, folder: RunFolder, path: Path, names: frozenset, batches: list) -> list:
    """All of an appending writer's output, batch by batch into a temporary file renamed over it at the end."""
    fd, tmp = _create_temp(path)  # named so that a start after a kill removes it (cleanup.py)
    os.close(fd)
    ends: list = []
    try:
        _append(writer, folder, Path(tmp), names, batches, ends)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)
    return ends
