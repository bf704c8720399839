"""``hermes-batch export``: a run folder's trajectories as training files, split stably.

Any :class:`~hermes_batch.writers.FileWriter` is a format (``sharegpt``, ``openai``,
``parquet`` from hermes-batch-parquet, ...).  A record's split is decided by a
hash of its content key (prompt, image, cwd), so exporting again, after a
resume or a refilter, puts every prompt in the same split, and copies of one
prompt never straddle train and validation.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Optional, Sequence

import attrs

from .errors import UsageError
from .filtering import INCLUDE, iter_entries, judge
from .runfolder import RunFolder
from .writers import FileWriter, report_skipped

TRAIN = "train"
_SPLIT_SALT = b"hermes-batch split\0"


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


def output_paths(folder: RunFolder, writer: FileWriter, output: Optional[Path], splits: dict) -> dict:
    """split name -> file.  ``output`` ending in the format's suffix is a file (``name.<split><suffix>`` with
    splits); any other ``output`` is a folder of ``<split><suffix>`` files; the default folder is
    ``RUN_DIR/exports/<format>/``."""
    names = [TRAIN, *splits]
    if output is not None and output.suffix == writer.suffix and not output.is_dir():
        if not splits:
            return {TRAIN: output}
        stem = output.name[: -len(writer.suffix)]
        return {name: output.with_name(f"{stem}.{name}{writer.suffix}") for name in names}
    base = output if output is not None else folder.dir / "exports" / writer.name
    return {name: base / f"{name}{writer.suffix}" for name in names}


@attrs.frozen
class ExportResult:
    """What an export wrote: per split its file and count, what the filters left out and what the format could not hold."""

    files: dict  # split -> path
    counts: dict  # split -> trajectories written
    filtered: dict  # filter name -> records it left out
    skipped: int  # records the format cannot hold
    repaired: int = 0  # records written with U+FFFD for text that is not Unicode


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


def export(folder: RunFolder, writer: FileWriter, *, output: Optional[Path] = None, include: str = "kept",
           splits: Optional[dict] = None, filters: Sequence = ()) -> ExportResult:
    """Write the records ``include`` selects that pass ``filters``, in prompt_index order, one file per split."""
    if include not in INCLUDE:
        raise UsageError(f"--include {include!r} is not one of {', '.join(INCLUDE)}; choose one of them.")
    from .refilter import pending

    if pending(folder):
        raise UsageError(
            f"{folder.dir} has a refilter that was interrupted; run 'hermes-batch refilter' on it again to finish it, "
            "then export."
        )
    splits = splits or {}
    paths = output_paths(folder, writer, output, splits)
    for path in paths.values():
        if path.exists() and path.is_dir():
            raise UsageError(f"{path} is a folder; pass --output a file name ending in {writer.suffix} or a folder.")
    rejected = judge(lambda: iter_entries(folder, include), filters) if filters else {}
    filtered: dict = {f.name: 0 for f in filters}
    for verdict in rejected.values():
        for name in set(verdict.filters):
            filtered[name] += 1
    names = _tool_names(folder, include)
    sinks = {name: writer.open(path) for name, path in paths.items()}
    try:
        for entry in iter_entries(folder, include):
            if entry.where in rejected:
                continue
            traj = entry.trajectory
            sinks[split_of(traj.metadata.content_key, splits)].add(traj.with_tools(names))
        for sink in sinks.values():
            sink.commit()
    except BaseException:
        for sink in sinks.values():
            sink.abort()
        raise
    for sink in sinks.values():
        report_skipped(writer, sink)
    return ExportResult(
        files={name: str(sink.path) for name, sink in sinks.items()},
        counts={name: sink.count for name, sink in sinks.items()},
        filtered=filtered,
        skipped=sum(sink.skipped for sink in sinks.values()),
        repaired=sum(sink.repaired for sink in sinks.values()),
    )


def describe(result: ExportResult) -> str:
    """The lines ``hermes-batch export`` prints."""
    lines = [f"{name}: {result.counts[name]} trajectories -> {path}" for name, path in result.files.items()]
    for name, count in result.filtered.items():
        lines.append(f"left out by {name}: {count}")
    if result.skipped:
        lines.append(f"left out as the format cannot hold them: {result.skipped}")
    if result.repaired:
        lines.append(f"repaired: {result.repaired} (text that is not Unicode, a lone surrogate of an older record, "
                     "written as U+FFFD as the run writes it)")
    return "\n".join(lines)


def as_json(result: ExportResult) -> str:
    return json.dumps(attrs.asdict(result), indent=2)

