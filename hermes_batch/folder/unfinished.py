"""What an offline command left half done in a run folder, for the run that resumes it to finish or recognise.

A refilter (offline/refilter.py) stages its rewritten record files in ``.refilter/`` with a ``PLAN.json``
naming them; once the plan is written the switch is committed, and a ``run --resume`` that finds it
moves the files in before anything reads the records.  A folder of batch_runner.py's batch files that was
never imported (offline/seed_import.py) is recognised here so that the run can say to import it first.
These live in the run folder's package because the run, a layer below the offline commands, needs them.
"""

from __future__ import annotations

import json
import os
import shutil

from ..errors import RunFolderError
from . import readback
from .durable import _fsync_dir
from .runfolder import RunFolder

MAX_FIRST_LINE = 64 * 1024 * 1024

AUDIT = "refilter_audit.jsonl"
STAGING = ".refilter"
PLAN = "PLAN.json"


def _move_files(folder: RunFolder, staging) -> dict:
    from .record_index import RecordIndex

    plan_data = json.loads((staging / PLAN).read_text(encoding="utf-8"))
    for name in plan_data["files"]:
        staged = staging / name
        if staged.exists():  # else an interrupted switch already moved it in
            os.replace(staged, folder.dir / name)
    _fsync_dir(folder.dir)
    # The record files were rewritten: their indexes (and the merge's state) are built again from them when next
    # needed.  A rewrite can keep a file's length and both ends (a discarded record's reasons of the same size),
    # which the index's own check would not see.  PLAN.json is still there, so a kill here drops them next time.
    RecordIndex(folder).drop()
    return plan_data


def recover_files(folder: RunFolder) -> None:
    """For ``run --resume``: finish moving the files of an interrupted refilter (the run rebuilds the rest)."""
    staging = folder.dir / STAGING
    if not staging.is_dir():
        return
    if not (staging / PLAN).exists():
        shutil.rmtree(staging)
        return
    _move_files(folder, staging)
    (staging / PLAN).unlink()
    shutil.rmtree(staging, ignore_errors=True)


def is_seed_folder(folder: RunFolder) -> bool:
    """True when ``folder`` holds batch_runner.py's batch files and was never imported (no run.json)."""
    if folder.run_json.exists():
        return False
    first = next(folder.iter_batch_files(), None)
    if first is None:
        return False
    try:
        handle = readback.open_reader(first[1])
        if handle is None:
            return False
        with handle:  # a plain file, and one line of it at most this long: it may be anything
            record = json.loads(handle.readline(MAX_FIRST_LINE))
    except (OSError, ValueError, RecursionError, RunFolderError):
        return False
    return (isinstance(record, dict) and isinstance(record.get("conversations"), list)
            and "content_key" not in (record.get("metadata") or {}))
