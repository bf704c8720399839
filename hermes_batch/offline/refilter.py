"""``hermes-batch refilter``: judge a finished run's records again, without any model call.

Records move between the kept set (the ``batch_N.jsonl`` files) and the
discarded set (``discarded.jsonl``); nothing is ever deleted, so a later
``--resume`` still counts every finished prompt and never pays for one twice.
Each move is appended to ``refilter_audit.jsonl`` with the filters and reasons.

Durability (SIGKILL at any moment): the files that change are written anew
into ``.refilter/``; ``PLAN.json`` written last (atomically) is the commit point.
Before it, an interrupted refilter changed nothing and its staging is dropped;
after it, the switch (renames, then the merged outputs and statistics.json) is
finished by the next ``refilter`` or ``run --resume``, since renaming a staged
file that is already in place is a no-op.  Lines of records that stay where
they are are copied byte for byte.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import logging
import os
import secrets
import shutil
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import attrs

from ..contract.run_filters import Verdict, iter_discarded, iter_kept, judge
from ..folder.lock import RunFolderLock
from ..formats.records import SCHEMA_VERSION
from ..folder.reindex import _Writers
from ..folder.durable import AppendLog, _fsync_dir, atomic_write_text
from ..folder.runfolder import RunFolder
from ..folder.unfinished import AUDIT, PLAN, STAGING, _move_files, recover_files  # noqa: F401 (AUDIT, recover_files: this module's names too)

log = logging.getLogger(__name__)



@attrs.frozen
class Move:
    """A record whose place or reasons change: ``to`` is "kept" or "discarded"."""

    where: tuple  # (file name, line number) now
    to: str
    prompt_index: int
    content_key: str
    batch_num: int
    verdict: Optional[Verdict]  # the new filters and reasons (None: now kept)


@attrs.frozen
class RefilterResult:
    """What a refilter changed (or, with ``dry_run``, would change)."""

    id: str
    filters: tuple[str, ...]
    moves: tuple[Move, ...]  # kept -> discarded and back
    reasons_changed: int  # discarded records that stay discarded, for other reasons now
    kept: int
    discarded: int
    by_filter: dict  # filter name -> records it rejects now
    dry_run: bool = False

    @property
    def to_discarded(self) -> int:
        return sum(1 for m in self.moves if m.to == "discarded")

    @property
    def to_kept(self) -> int:
        return sum(1 for m in self.moves if m.to == "kept")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None).isoformat(timespec="seconds")


def _entries(folder: RunFolder):
    return itertools.chain(iter_kept(folder), iter_discarded(folder, ordered=False))


def decide_moves(folder: RunFolder, filters: Sequence, specs: Sequence[str], dry_run: bool = False) -> tuple[RefilterResult, list]:
    """Judge every finished record; (result, changes) where changes also hold the records whose reasons change."""
    verdicts = judge(lambda: _entries(folder), filters)
    changes: list[Move] = []
    kept = discarded = reasons_changed = 0
    by_filter: Counter = Counter({f.name: 0 for f in filters})
    for entry in _entries(folder):
        verdict = verdicts.get(entry.where)
        traj = entry.trajectory
        move = Move(entry.where, "discarded" if verdict else "kept", traj.prompt_index,
                    traj.metadata.content_key, traj.metadata.batch_num, verdict)
        if verdict:
            discarded += 1
            by_filter.update(set(verdict.filters))
            if entry.kept:
                changes.append(move)
            elif (entry.discarded.filters, entry.discarded.reasons) != (verdict.filters, verdict.reasons):
                changes.append(attrs.evolve(move, to="discarded-again"))
                reasons_changed += 1
        else:
            kept += 1
            if not entry.kept:
                changes.append(move)
    moves = tuple(sorted((m for m in changes if m.to != "discarded-again"), key=lambda m: m.prompt_index))
    result = RefilterResult(
        id=f"{_now()}-{secrets.token_hex(3)}", filters=tuple(specs), moves=moves, reasons_changed=reasons_changed,
        kept=kept, discarded=discarded, by_filter=dict(sorted(by_filter.items())), dry_run=dry_run,
    )
    return result, changes


def refilter(folder: RunFolder, filters: Sequence, specs: Sequence[str], *, dry_run: bool = False,
             writers: Sequence = (), after_stage=None) -> RefilterResult:
    """Apply ``filters`` to every finished record of ``folder`` (the caller holds the run folder's lock).

    A refilter a crash interrupted is finished first.  ``writers`` rebuild the
    merged outputs afterwards; ``after_stage`` is called between the staging and
    the switch (tests kill the process there).
    """
    finish_pending(folder, writers)
    result, changes = decide_moves(folder, filters, specs, dry_run)
    run_json = _run_json(folder, filters, specs)
    if dry_run or not changes:
        if not dry_run:
            if run_json is not None:
                atomic_write_text(folder.run_json, run_json)
            _rebuild(folder, writers, specs)  # the filters in force are recorded even when nothing moves
            _append_audit_summary(folder, result)
        return result
    staging = folder.dir / STAGING
    _stage(folder, staging, result, changes, run_json)
    if after_stage is not None:
        after_stage()
    _switch(folder, staging, writers)
    return result


# --- staging -------------------------------------------------------------------------------------------------


def _line(data) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n"


def _raw_lines(path: Path):
    """(line number, raw bytes) of each complete line, numbered as read_records numbers them."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    with fh:
        for number, raw in enumerate(fh, start=1):
            if raw.endswith(b"\n") and raw.strip():  # a torn last line was never a record
                yield number, raw


def _run_json(folder: RunFolder, filters: Sequence, specs: Sequence[str]) -> Optional[str]:
    """run.json with the refilter's per-sample filters as the run's, so a resume judges new prompts by them."""
    from ..contract.run_filters import RunFilter
    from ..run.run_settings import read_run_json, with_filters

    data = read_run_json(folder)
    if not data:
        return None
    sample_specs = [spec for spec, f in zip(specs, filters) if not isinstance(f, RunFilter)]
    return json.dumps(with_filters(data, sample_specs), indent=2) + "\n"


def _stage(folder: RunFolder, staging: Path, result: RefilterResult, changes: list,
           run_json: Optional[str] = None) -> None:
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    if run_json is not None:  # switched in with the records: the filters they are judged by
        atomic_write_text(staging / "run.json", run_json)
    by_where = {m.where: m for m in changes}
    discarded_name = folder.discarded.name
    affected = {m.where[0] for m in changes if m.to == "discarded"}
    affected |= {f"batch_{m.batch_num}.jsonl" for m in changes if m.to == "kept"}
    affected.add(discarded_name)
    for name in affected:  # every affected file is replaced, even if it ends up empty
        (staging / name).touch()
    writers = _Writers(staging)
    try:
        for number, raw in _raw_lines(folder.discarded):
            move = by_where.get((discarded_name, number))
            if move is None:
                writers.write(discarded_name, raw.decode("utf-8"))
                continue
            record = json.loads(raw)
            if move.to == "kept":
                writers.write(f"batch_{move.batch_num}.jsonl", _line(record["trajectory"]))
            else:
                record.update(filters=list(move.verdict.filters), reasons=list(move.verdict.reasons))
                writers.write(discarded_name, _line(record))
        for _num, path in folder.iter_batch_files():
            if path.name not in affected:
                continue
            for number, raw in _raw_lines(path):
                move = by_where.get((path.name, number))
                if move is None:
                    writers.write(path.name, raw.decode("utf-8"))
                    continue
                discarded = {"trajectory": json.loads(raw), "filters": list(move.verdict.filters),
                             "reasons": list(move.verdict.reasons), "schema_version": SCHEMA_VERSION}
                writers.write(discarded_name, _line(discarded))
    finally:
        writers.close()
    audit = staging / AUDIT
    with open(audit, "wb") as fh:
        for _number, raw in _raw_lines(folder.dir / AUDIT):  # a torn last line is left behind
            fh.write(raw)
    with open(audit, "a", encoding="utf-8") as fh:
        for move in result.moves:
            fh.write(_line({
                "type": "move", "refilter": result.id, "prompt_index": move.prompt_index,
                "content_key": move.content_key, "from": "discarded" if move.to == "kept" else "kept", "to": move.to,
                "filters": list(move.verdict.filters) if move.verdict else [],
                "reasons": list(move.verdict.reasons) if move.verdict else [],
            }))
        fh.write(_summary_line(result))
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(staging)
    names = sorted(p.name for p in staging.iterdir())
    atomic_write_text(staging / PLAN, json.dumps({"refilter": result.id, "filters": list(result.filters),
                                                   "files": names}) + "\n")


def _summary_line(result: RefilterResult) -> str:
    return _line({
        "type": "refilter", "refilter": result.id, "at": _now(), "filters": list(result.filters),
        "moved_to_discarded": result.to_discarded, "moved_to_kept": result.to_kept,
        "reasons_changed": result.reasons_changed, "kept": result.kept, "discarded": result.discarded,
        "by_filter": result.by_filter,
    })


def _append_audit_summary(folder: RunFolder, result: RefilterResult) -> None:
    # nothing moved: no staging needed, one line says the refilter happened and with which filters
    log_ = AppendLog(folder.dir / AUDIT)
    try:
        log_.append_sync(_summary_line(result))
    finally:
        log_.close()


# --- switching -----------------------------------------------------------------------------------------------


def _switch(folder: RunFolder, staging: Path, writers: Sequence) -> None:
    plan_data = _move_files(folder, staging)
    _rebuild(folder, writers, plan_data["filters"])
    (staging / PLAN).unlink()
    shutil.rmtree(staging, ignore_errors=True)


def _rebuild(folder: RunFolder, writers: Sequence, specs: Sequence[str]) -> None:
    from .folder_info import rebuild_statistics
    from ..folder.merge import merge_run

    if writers:
        merge_run(folder, writers)
    rebuild_statistics(folder, tuple(specs))
    try:
        from ..view import write_report

        write_report(folder.dir)
    except Exception as exc:  # the records are switched; a report that cannot be written must not fail that
        log.warning("Could not write report.html (%s); run `hermes-batch report %s` to retry.", exc, folder.dir)


def pending(folder: RunFolder) -> bool:
    """True when a refilter was interrupted after its commit point and must still be finished."""
    return (folder.dir / STAGING / PLAN).exists()


def finish_pending(folder: RunFolder, writers: Sequence = ()) -> bool:
    """Finish a refilter a crash interrupted after its commit point; drop one that had not reached it."""
    staging = folder.dir / STAGING
    if not staging.is_dir():
        return False
    if (staging / PLAN).exists():
        log.warning("%s: finishing the refilter an interrupted command left half done.", folder.dir)
        _switch(folder, staging, writers)
        return True
    shutil.rmtree(staging)
    return False


def last_refilter(folder: RunFolder) -> Optional[dict]:
    """The summary line of the last refilter recorded in the audit file, or None."""
    last = None
    try:
        fh = open(folder.dir / AUDIT, "rb")
    except FileNotFoundError:
        return None
    with fh:
        for raw in fh:
            if b'"type":"refilter"' not in raw or not raw.endswith(b"\n"):
                continue
            try:
                data = json.loads(raw)
            except ValueError:
                continue
            if isinstance(data, dict) and isinstance(data.get("filters"), list):
                last = data
    return last


@contextlib.contextmanager
def locked(folder: RunFolder, command: str):
    """Hold the run folder's lock (the one a run holds) for a command that changes the folder."""
    lock = RunFolderLock(folder.dir)
    lock.acquire(command=command)
    try:
        yield
    finally:
        lock.release()
