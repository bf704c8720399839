"""``hermes-batch export``: a run folder's trajectories as training files, split stably.

Any :class:`~hermes_batch.contract.writers.FileWriter` is a format (``sharegpt``, ``openai``,
``parquet`` from hermes-batch-parquet, ...).  A record's split is decided by a
hash of its content key (prompt, image, cwd), so exporting again, after a
resume or a refilter, puts every prompt in the same split, and copies of one
prompt never straddle train and validation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from pathlib import Path
from typing import Iterator, Optional, Sequence

import attrs

from ..errors import HermesBatchError, UsageError
from ..contract.plugin_options import parse_spec
from .export_files import TRAIN, locked, other_data_files, prepare, publish, remove_if_empty, target_for
from ..contract.run_filters import INCLUDE, Entry, iter_entries, judge
from ..folder.runfolder import RunFolder
from ..folder.token_files import SideIndex
from ..formats.token_ids import record_digest
from ..formats.row_identity import row_key
from ..folder.durable import write_error
from ..contract.writers import FileWriter, report_skipped

log = logging.getLogger(__name__)
_SPLIT_SALT = b"hermes-batch split\0"

# Fields of a dataset row that only the verifiers read (the tests, their files, the expected answer, the rubric):
# training on them teaches the model the grader's answers, so no export carries them unless asked.
VERIFIER_FIELDS = ("tests", "test_files", "answer", "rubric")
# Options of the run's verifiers that name another row field they read (answer:field=, command:files_field=).
_FIELD_OPTIONS = ("field", "files_field")


def verifier_fields(folders: Sequence[RunFolder]) -> frozenset:
    """VERIFIER_FIELDS and the row fields the runs' --verifier options named."""
    from .folder_info import read_run_json

    names = set(VERIFIER_FIELDS)
    for folder in folders:
        run_json = read_run_json(folder)
        specs = list((run_json.get("config") or {}).get("verifiers") or ()) if isinstance(run_json.get("config"), dict) else []
        for entry in run_json.get("settings_history") or ():
            settings = entry.get("settings") if isinstance(entry, dict) else None
            if isinstance(settings, dict) and isinstance(settings.get("verifiers"), list):
                specs += settings["verifiers"]
        for spec in specs:
            if not isinstance(spec, str):
                continue
            try:
                options = parse_spec(spec, "--verifier").options
            except HermesBatchError:  # an options file that is gone: the fixed names still go
                continue
            names.update(v for k, v in options.items() if k in _FIELD_OPTIONS and isinstance(v, str))
    return frozenset(names)


def without_fields(traj, fields: frozenset):
    """``traj`` without the ``fields`` of its ``metadata.row`` (itself when it has none of them)."""
    row = traj.metadata.row
    if not row or not fields.intersection(row):
        return traj
    kept = {name: value for name, value in row.items() if name not in fields}
    return attrs.evolve(traj, metadata=attrs.evolve(traj.metadata, row=kept))


def parse_splits(items: Sequence[str]) -> dict:
    """``("validation=0.05", "test=0.1")`` -> ``{"test": 0.1, "validation": 0.05}``; the rest is ``train``."""
    splits: dict = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        try:
            share = float(raw)
        except ValueError:
            share = math.nan
        if not sep or not name or not math.isfinite(share) or not 0 < share < 1:
            raise UsageError(f"--split {item!r} must be NAME=SHARE with a share between 0 and 1, e.g. validation=0.05.")
        if name == TRAIN:
            raise UsageError("--split train=... is not needed: train is what the other splits leave; name the others.")
        if name in splits:
            raise UsageError(f"--split {name} is given twice; give each split once.")
        if not name.replace("-", "").replace("_", "").isalnum():
            raise UsageError(f"--split name {name!r} must be letters, digits, '-' or '_', since it names a file.")
        splits[name] = share
    if sum(splits.values()) >= 1:
        raise UsageError("The --split shares add up to 1 or more, leaving nothing for train; make them smaller.")
    return dict(sorted(splits.items()))  # sorted: the same shares give the same split whatever the order typed


def split_of(content_key: str, splits: dict) -> str:
    """The split of a record: where the hash of its content key falls among the shares (sorted by name)."""
    digest = hashlib.sha256(_SPLIT_SALT + content_key.encode("utf-8")).digest()
    point = int.from_bytes(digest[:8], "big") / 2**64
    edge = 0.0
    for name, share in splits.items():
        edge += share
        if point < edge:
            return name
    return TRAIN


@attrs.frozen
class ExportResult:
    """What an export wrote: per split its file and count, what the filters left out and what the format could not hold."""

    files: dict  # split -> path
    counts: dict  # split -> trajectories written
    filtered: dict  # filter name -> records it left out
    skipped: int  # records the format cannot hold
    repaired: int = 0  # records written with U+FFFD for text that is not Unicode
    removed: tuple = ()  # files of the previous export here that the new set lacks, removed
    unit: str = "trajectories"  # what a line of the format is (dpo: pairs, rollouts: rows)
    notes: dict = attrs.Factory(dict)  # what the format counts besides its lines (rows that gave no pair)


_TOOL_STATS = re.compile(rb'"tool_stats"\s*:\s*\{')
_DECODER = json.JSONDecoder()


def _tool_names(folder: RunFolder, include: str) -> set:
    """The tools any record of the export lists: every line then lists them all (with zeros), so Arrow
    readers see one schema.  Only each line's ``tool_stats`` object is decoded: the key cannot occur inside
    a JSON string (its quotes would be escaped), and this pass would otherwise cost as much as the export."""
    paths = []
    if include in ("kept", "all"):
        paths += [path for _num, path in folder.iter_batch_files()]
    if include in ("discarded", "all"):
        paths.append(folder.discarded)
    names: set = set()
    for path in paths:
        try:
            fh = open(path, "rb")
        except FileNotFoundError:
            continue
        with fh:
            for raw in fh:
                match = _TOOL_STATS.search(raw)
                if match is None or not raw.endswith(b"\n"):
                    continue
                try:
                    stats, _end = _DECODER.raw_decode(raw[match.end() - 1 :].decode("utf-8"))
                except ValueError:
                    continue  # a line read_records skips too
                names.update(stats)
    return names


def export(folders, writer: FileWriter, *, output: Optional[Path] = None, include: Optional[str] = None,
           splits: Optional[dict] = None, filters: Sequence = (), force: bool = False,
           keep_verifier_fields: bool = False) -> ExportResult:
    """Write the records ``include`` selects that pass ``filters``, one file per split, replacing the export's
    previous files there (export_files.py says which it owns and how they are switched).

    ``include`` defaults to the writer's ``include`` (``all`` for the formats made of a row's samples together,
    dpo and rollouts, whose failing samples a ``verified`` filter may have discarded), else ``kept``.

    ``folders`` is one RunFolder or several, merged into one dataset: run by run, each in prompt_index order,
    every line listing the tools of all of them.  Whole-run filters (near-duplicates) compare across runs.

    The rows' verifier-only fields (``verifier_fields``) are left out of ``metadata.row`` unless
    ``keep_verifier_fields``.
    """
    folders = [folders] if isinstance(folders, RunFolder) else list(folders)
    include = include or writer.include
    if include not in INCLUDE:
        raise UsageError(f"--include {include!r} is not one of {', '.join(INCLUDE)}; choose one of them.")
    from .refilter import pending

    seen: set = set()
    for folder in folders:
        if pending(folder):
            raise UsageError(
                f"{folder.dir} has a refilter that was interrupted; run 'hermes-batch refilter' on it again to finish "
                "it, then export."
            )
        if folder.dir.resolve() in seen:
            raise UsageError(f"The run {folder.dir} is given twice; give each run once.")
        seen.add(folder.dir.resolve())
    splits = splits or {}
    target = target_for([f.dir for f in folders], writer.name, writer.suffix, output, splits)
    with locked(target) as created:
        try:
            hidden = frozenset() if keep_verifier_fields else verifier_fields(folders)
            return _export(folders, writer, target, include, splits, filters, force, hidden)
        except BaseException:
            if created:
                remove_if_empty(target.folder)
            raise


def _entries(folders: Sequence[RunFolder], include: str) -> Iterator[Entry]:
    """The records of every run, run by run; with several, ``where`` leads with the run's place in ``folders``."""
    if len(folders) == 1:
        yield from iter_entries(folders[0], include)
        return
    for number, folder in enumerate(folders):
        for entry in iter_entries(folder, include):
            yield Entry((number, *entry.where), entry.trajectory, entry.discarded)


def _export(folders, writer, target, include, splits, filters, force, hidden: frozenset) -> ExportResult:
    plan = prepare(target, force=force)
    rejected = judge(lambda: _entries(folders, include), filters) if filters else {}
    filtered: dict = {f.name: 0 for f in filters}
    for verdict in rejected.values():
        for name in set(verdict.filters):
            filtered[name] += 1
    names: set = set()
    for folder in folders:
        names |= _tool_names(folder, include)
    final = {split: target.path(name) for split, name in target.names.items()}
    sides = _side_index(folders) if getattr(writer, "token_ids", False) else None
    sinks: dict = {}
    try:
        for split, name in target.names.items():
            sinks[split] = _write(final[split], writer.open, plan.staging / name)
        for entry in _entries(folders, include):
            if entry.where in rejected:
                continue
            traj = entry.trajectory
            split = split_of(row_key(traj), splits)  # a row's samples (--samples_per_prompt) in one split
            out = without_fields(traj.with_tools(names), hidden)
            if sides:  # --logprobs: the side entry of this record, found by its key and conversation
                side = sides.get(traj.metadata.content_key, record_digest(traj.conversations))
                out = attrs.evolve(out, tokens=side)
            _write(final[split], sinks[split].add, out)
        written = {target.names[split]: _write(final[split], sink.seal) for split, sink in sinks.items()}
    except BaseException:
        for sink in sinks.values():
            sink.abort()
        if plan.staging != target.folder:
            remove_if_empty(plan.staging)
        raise
    unit = writer.unit
    notes: dict = {}
    for sink in sinks.values():
        for what, count in sink.notes.items():
            notes[what] = notes.get(what, 0) + count
    info = {
        "format": writer.name,
        "runs": [str(folder.dir.resolve()) for folder in folders],
        "include": include,
        "splits": splits,
        "filters": [f.name for f in filters],
        "counts": {target.names[split]: {unit: sink.count} for split, sink in sinks.items()},
    }
    if notes:
        info["notes"] = dict(sorted(notes.items()))
    _write(target.folder, publish, plan, written, info)
    for split, sink in sinks.items():
        report_skipped(writer, sink, final[split])
    for name in plan.left_alone:
        log.warning("%s: left alone, since it was changed after the previous export wrote it.", target.path(name))
    others = other_data_files(target, writer.suffix)
    if others:
        log.warning("%s also holds %s, which this export did not write: load_dataset(..., data_dir=) reads every "
                    "such file too.", target.shown, ", ".join(others))
    return ExportResult(
        files={split: str(target.path(name)) for split, name in target.names.items()},
        counts={split: sink.count for split, sink in sinks.items()},
        filtered=filtered,
        skipped=sum(sink.skipped for sink in sinks.values()),
        repaired=sum(sink.repaired for sink in sinks.values()),
        removed=tuple(sorted(plan.stale)),
        unit=unit,
        notes=dict(sorted(notes.items())),
    )


def _side_index(folders) -> SideIndex:
    """The side files (batch_N.tokens.jsonl) of every run, indexed: a later run's entry of a key wins."""
    index = SideIndex()
    for folder in folders:
        index.add_folder(folder.dir)
    return index


def _write(path: Path, fn, *args):
    """``fn(*args)``; a failed write (disk full, quota, file size limit) becomes one sentence with exit status 74."""
    try:
        return fn(*args)
    except OSError as exc:
        raise write_error(path, exc, started=False) from exc


def describe(result: ExportResult) -> str:
    """The lines ``hermes-batch export`` prints."""
    lines = [f"{name}: {result.counts[name]} {result.unit} -> {path}" for name, path in result.files.items()]
    empty = [name for name in result.files if not result.counts[name]]
    if empty and len(result.files) > 1:  # datasets: 'Instruction "validation" corresponds to no data!'
        lines.append(f"warning: {', '.join(empty)} got no {result.unit}, and datasets.load_dataset refuses an empty "
                     "split file; give it a larger --split share, or leave its file out when loading.")
    for name, count in result.filtered.items():
        lines.append(f"left out by {name}: {count}")
    for what, count in result.notes.items():
        lines.append(f"{what}: {count}")
    if result.skipped:
        lines.append(f"left out as the format cannot hold them: {result.skipped}")
    if result.removed:
        lines.append(f"removed from the previous export here: {', '.join(result.removed)}")
    if result.repaired:
        lines.append(f"repaired: {result.repaired} (text that is not Unicode, a lone surrogate of an older record, "
                     "written as U+FFFD as the run writes it)")
    return "\n".join(lines)


def as_json(result: ExportResult) -> str:
    return json.dumps(attrs.asdict(result), indent=2)

