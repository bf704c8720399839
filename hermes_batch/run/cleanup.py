"""Removing what runs wrote to a run folder, and never anything else.

A run folder may also hold the user's own files (notes, the dataset itself), so
nothing here removes a folder whole: ``--overwrite`` and a fresh run that fails
at once remove the files a run writes by name, and each start removes what a
killed session left behind (temporary files of an atomic replace, working
folders of local sandboxes).  Call these only while holding the folder's lock.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Iterable

from ..folder import unfinished
from ..folder.token_files import side_files
from ..folder.record_index import INDEX_DIR, is_index_file
from ..folder.batch_journal import BATCH_JOURNAL_NAME
from ..folder.journal import JOURNAL_NAME
from ..folder.replay_journal import REPLAY_JOURNAL_NAME
from .forecast import FORECAST_NAME
from .notices import SKIPPED_LINES
from .provider_exclusions import GUARD_FILE
from ..folder.reindex import STAGING, UNMATCHED
from ..folder.runfolder import RunFolder
from ..folder.durable import is_temp_file, write_error
from ..sandbox_blocks.trees import remove_tree
from ..view.report import REPORT_NAME

log = logging.getLogger(__name__)

# The working folders the local sandbox makes under scratch/ (``p<index>-<content key>-<mkdtemp suffix>``), and
# the ``kept-`` name a folder kept with ``-S keep=true`` gets at close, and ``.ctl`` beside each for the commands'
# scripts and output FIFOs.  tests/test_run_folder_safety.py checks that the local sandbox's folders match.
_SANDBOX_FOLDER_RE = re.compile(r"(kept-)?p\d+-[0-9a-f]{8}-[a-z0-9_]{8}(\.ctl)?")


def is_sandbox_folder(name: str, *, kept: bool = True) -> bool:
    """True for the name of a prompt's working folder under scratch/ (with ``kept``: also a kept one)."""
    match = _SANDBOX_FOLDER_RE.fullmatch(name)
    return match is not None and (kept or match.group(1) is None)


# Outputs named outside runfolder.py.  Each must go with the rest: a journal left behind would count the old
# run's calls in the new run's totals, and unmatched records would come back into it at a later resume.
_OTHER_OUTPUTS = (JOURNAL_NAME, REPLAY_JOURNAL_NAME, UNMATCHED, SKIPPED_LINES, REPORT_NAME, unfinished.AUDIT,
                  BATCH_JOURNAL_NAME, GUARD_FILE, FORECAST_NAME)


def output_files(folder: RunFolder, writer_files: Iterable[str] = ()) -> list[Path]:
    """The files of ``folder`` that a run writes: batch files, the fixed outputs, the writers' files."""
    fixed = [folder.trajectories, folder.discarded, folder.failed, folder.checkpoint, folder.statistics,
             folder.run_json]
    fixed += [folder.dir / name for name in (*_OTHER_OUTPUTS, *writer_files)]
    batches = [path for _num, path in folder.iter_batch_files()] + side_files(folder.dir)
    return batches + [p for p in fixed if os.path.lexists(p)]


def remove_outputs(folder: RunFolder, writer_files: Iterable[str] = (), *, kept: bool = True) -> int:
    """Remove every file a run writes and its sandbox folders (with ``kept``: kept ones too); return how many went."""
    removed = 0
    for path in output_files(folder, writer_files) + _temp_files(folder):
        removed += _unlink(path)
    removed += _remove_staging(folder, STAGING) + _remove_staging(folder, unfinished.STAGING)
    removed += _remove_index(folder)
    removed += _remove_sandbox_folders(folder, kept=kept)
    return removed


def _remove_index(folder: RunFolder) -> int:
    """index/ (record_index.py): its files and temporary files, and the folder if nothing else is in it."""
    index = folder.dir / INDEX_DIR
    if index.is_symlink() or not index.is_dir():
        return 0
    removed = sum(_unlink(Path(entry.path)) for entry in os.scandir(index)
                  if is_index_file(entry.name) or is_temp_file(entry.name))
    try:
        index.rmdir()  # only when empty: anything else in it stays
    except OSError:
        pass
    return removed


def _remove_staging(folder: RunFolder, name: str) -> int:
    """The staging folder of an interrupted re-index (reindex.py) or refilter: every file in it is ours."""
    staging = folder.dir / name
    if staging.is_symlink() or staging.is_file():
        return _unlink(staging)
    if not staging.is_dir():
        return 0
    for entry in os.scandir(staging):
        if entry.is_dir(follow_symlinks=False):
            log.warning("Left %s alone: it is a folder, not a file a run writes.", entry.path)
        else:
            _unlink(Path(entry.path))
    try:
        staging.rmdir()
    except OSError:
        pass
    return 1


def remove_leftovers(folder: RunFolder) -> None:
    """Remove what a killed session left: temporary files of an atomic replace and unkept sandbox folders."""
    temps = sum(_unlink(path) for path in _temp_files(folder))
    index = folder.dir / INDEX_DIR
    if index.is_dir() and not index.is_symlink():
        temps += sum(_unlink(Path(entry.path)) for entry in os.scandir(index) if is_temp_file(entry.name))
    sandboxes = _remove_sandbox_folders(folder, kept=False)
    if temps or sandboxes:
        log.warning(
            "Removed what an interrupted session left in %s: %d temporary file(s), %d sandbox folder(s).",
            folder.dir, temps, sandboxes,
        )


def _temp_files(folder: RunFolder) -> list[Path]:
    if not folder.dir.is_dir():
        return []
    return [Path(entry.path) for entry in os.scandir(folder.dir) if is_temp_file(entry.name)]


def _unlink(path: Path) -> int:
    try:
        os.unlink(path)  # a symlink goes, never what it points to
    except FileNotFoundError:
        return 0
    except IsADirectoryError:
        log.warning("Left %s alone: it is a folder, not a file a run writes.", path)
        return 0
    except OSError as exc:
        raise write_error(path, exc, started=False, doing="Removing") from exc
    return 1


def _remove_sandbox_folders(folder: RunFolder, *, kept: bool) -> int:
    scratch = folder.scratch
    if scratch.is_symlink() or not scratch.is_dir():
        return 0
    removed = 0
    for entry in os.scandir(scratch):
        if not is_sandbox_folder(entry.name, kept=kept):
            continue
        if entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
            removed += _unlink(Path(entry.path))
        else:
            remove_tree(entry.path)  # copes with folders a command made deep or unreadable
            removed += 1
    try:
        scratch.rmdir()  # only when empty: anything else in it stays
    except OSError:
        pass
    return removed
