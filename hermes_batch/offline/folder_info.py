"""A run folder given on the command line (``RUN_DIR``), what its run was, and its statistics rebuilt.

The commands over a run folder (``export``, ``refilter``, ``stats``) never call a
model; what they need to know of the run they read from ``run.json`` and
``checkpoint.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

from ..errors import RunFolderError, UsageError
from ..formats.jsonguard import finite_dumps
from ..formats.records import Checkpoint
from ..run.run_settings import HISTORY, distinct
from ..folder.runfolder import RunFolder, read_records
from ..folder.durable import atomic_write_text
from ..folder.statistics import RunInfo, build_statistics


def open_run_folder(path: os.PathLike) -> RunFolder:
    """The RunFolder at ``path``; RunFolderError if it is not a folder a run wrote."""
    path = Path(path)
    if not path.is_dir():
        raise RunFolderError(f"{path} is not a folder; pass the run folder, e.g. data/<run_name>.")
    try:
        folder = RunFolder(path.resolve().parent, path.resolve().name)
    except UsageError:
        raise RunFolderError(f"{path} is not a run folder (its name is not a run name); pass data/<run_name>.") from None
    if not (folder.run_json.exists() or folder.checkpoint.exists() or next(folder.iter_batch_files(), None)
            or folder.discarded.exists()):
        raise RunFolderError(
            f"{path} holds no run (no run.json, checkpoint.json or batch files); pass the folder a run wrote, "
            "e.g. data/<run_name>."
        )
    return folder


def read_run_json(folder: RunFolder) -> dict:
    """run.json as a dict ({} when it is missing or unreadable)."""
    try:
        data = json.loads(folder.run_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_checkpoint(folder: RunFolder) -> Optional[Checkpoint]:
    for _line, checkpoint in read_records(folder.checkpoint, Checkpoint):
        return checkpoint
    return None


def run_info(folder: RunFolder) -> RunInfo:
    """The run-level statistics fields, as run.json recorded them."""
    data = read_run_json(folder)
    config = data.get("config") if isinstance(data.get("config"), dict) else {}
    dataset = data.get("dataset") if isinstance(data.get("dataset"), dict) else {}
    distribution = data.get("distribution") if isinstance(data.get("distribution"), dict) else {}

    def integer(value):
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return RunInfo(
        model=config.get("model") if isinstance(config.get("model"), str) else None,
        distribution=distribution.get("name") if isinstance(distribution.get("name"), str) else None,
        batch_size=integer(config.get("batch_size")),
        total_prompts=integer(dataset.get("valid")),
        total_lines=integer(dataset.get("lines")),
        models=tuple(distinct(history, "model")) if isinstance(history := data.get(HISTORY), list) else (),
        distributions=tuple(distinct(history, "distribution")) if isinstance(history, list) else (),
    )


def run_filters(folder: RunFolder) -> Optional[tuple]:
    """The ``--filter`` specs the records were judged by: the last refilter's, else the run's (None: the defaults)."""
    from .refilter import last_refilter

    last = last_refilter(folder)
    if last is not None:
        return tuple(last["filters"])
    config = read_run_json(folder).get("config")
    filters = config.get("filters") if isinstance(config, dict) else None
    return tuple(filters) if isinstance(filters, list) else None


def rebuild_statistics(folder: RunFolder, filters: Optional[Sequence[str]] = None, *, write: bool = True) -> dict:
    """statistics.json built again from the folder's records (as a run's end builds it), written atomically.

    ``filters`` are the filter specs now in force (a refilter's); by default the
    ones recorded.  The per-filter counts list each of them, with 0 for none.
    """
    from ..contract.plugin_options import parse_spec
    from ..run.selection import DEFAULT_FILTERS

    checkpoint = read_checkpoint(folder)
    sessions = checkpoint.sessions if checkpoint else ()
    if filters is None:
        filters = run_filters(folder)
        if filters is None:
            filters = DEFAULT_FILTERS
    stats = build_statistics(
        folder,
        filters_run=tuple(parse_spec(f, "--filter").name for f in filters),
        sessions=sessions,
        invalid_skipped_total=sessions[-1].invalid_skipped if sessions else 0,
        run=run_info(folder),
    )
    if write:
        atomic_write_text(folder.statistics, finite_dumps(stats, indent=2) + "\n")
    return stats


def current_statistics(folder: RunFolder) -> tuple[dict, bool]:
    """(statistics, rebuilt): statistics.json if it is newer than every record file, else rebuilt (not written)."""
    record_files = [path for _num, path in folder.iter_batch_files()] + [folder.discarded, folder.failed]
    newest = max((p.stat().st_mtime for p in record_files if p.exists()), default=0.0)
    try:
        if folder.statistics.stat().st_mtime >= newest:
            stats = json.loads(folder.statistics.read_text(encoding="utf-8"))
            if isinstance(stats, dict) and "prompts" in stats:
                return stats, False
    except (OSError, ValueError):
        pass
    return rebuild_statistics(folder, write=False), True
