"""``hermes-batch import``: a run folder of Hermes Agent's batch_runner.py becomes a hermes-batch run folder.

batch_runner.py writes ``batch_N.jsonl`` records without a content key, and
matches finished prompts to dataset rows by their text.  A ``--resume`` over
such a folder would find no finished prompt and pay for every one again, so
the import converts the folder once, in place:

* each record is matched to a row of the dataset by its prompt (the text of its
  first ``human`` turn), as batch_runner.py matches: the row at the record's own
  ``prompt_index`` when it has that text, else the first such row not yet
  claimed; its ``prompt_index``, content key, ``id`` and other fields then come
  from that row, and the record goes to the batch file of its index;
* what the record does not say is marked unknown: ``metadata.sandbox`` and
  ``metadata.end_reason`` are ``"unknown"``; usage, calls, duration and seed are
  zero or empty; ``tools_offered`` are the tools of its ``toolsets_used``;
* the run's filters (by default ``no-reasoning`` and ``hallucinated-tools``,
  whose check batch_runner.py made at its merge) judge each record: kept ones go
  to the batch files, others to ``discarded.jsonl``; a record whose prompt no
  row has, or that cannot be read, goes to ``unmatched.jsonl`` as a re-index
  leaves it (matched again, without a model call, if the row comes back);
* batch_runner.py's own files (``batch_*.jsonl``, ``trajectories.jsonl``,
  ``checkpoint.json``, ``statistics.json``) move, unchanged, into
  ``batch_runner/`` in the folder; ``run.json`` records the import and what is
  known of the run's settings (the records' model, the distribution and batch
  size of batch_runner.py's statistics.json).

Everything is written into ``.import/`` first; a marker file makes the switch
finish on the next ``hermes-batch import`` if a crash interrupts it.

A seed folder comes from elsewhere, so every file of it is untrusted: its
batch files and batch_runner.py's own files must be plain files (a link to a
file elsewhere is refused, not read); lines are read at most
``MAX_LINE_BYTES`` long (a longer one is skipped and counted, never held);
its JSON is type-checked where it is read; and a ``.import/`` it carries is
finished only if an interrupted import of this very folder left it (its
marker names the staging folder's inode, and only files an import writes),
never moving a file its marker names outside the folder.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

import attrs

from .. import __version__
from ..formats import dataset, hermes_format
from ..run import distributions, selection
from ..folder import reindex
from ..errors import RunFolderError, UsageError
from ..session.processor import now_iso
from ..formats.records import (
    Checkpoint, Discarded, Metadata, SessionInfo, ToolCallRecord, ToolStat, Trajectory, Turn, content_key,
)
from ..folder import readback
from ..folder.runfolder import RunFolder, record_kind
from ..folder.durable import _fsync_dir, atomic_write_text, write_error
from ..formats.lines import TOO_LONG, loads, read_lines
from ..formats.serialization import to_json_line

log = logging.getLogger(__name__)

SEED_FOLDER = "batch_runner"  # where batch_runner.py's own files are kept, unchanged
STAGING = ".import"
_COMPLETE = "COMPLETE"
SEED_FILES = ("trajectories.jsonl", "checkpoint.json", "statistics.json")
UNKNOWN = "unknown"
MAX_LINE_BYTES = 64 * 1024 * 1024
"""Longest record line of batch_runner.py that is imported; a longer one is skipped (counted), never held."""
MAX_JSON_BYTES = 64 * 1024 * 1024  # batch_runner.py's checkpoint.json and statistics.json, the marker
_STAGED = frozenset({"run.json", "checkpoint.json", "discarded.jsonl", "unmatched.jsonl", _COMPLETE})


@attrs.frozen
class ImportResult:
    """What an import found and did."""

    records: int = 0  # lines of batch_runner.py's batch files
    kept: int = 0
    discarded: int = 0
    unmatched: int = 0  # a record whose prompt no row of the dataset has (or has no more)
    unreadable: int = 0
    too_long: int = 0  # lines longer than MAX_LINE_BYTES: skipped
    checkpoint_only: int = 0  # prompts its checkpoint.json calls completed without a record: they run again
    finished_interrupted: bool = False


# --- reading batch_runner.py's records -----------------------------------------------------------------------


def _tool_calls(turn: dict) -> Optional[tuple]:
    """The structured calls of a ``gpt`` turn: its ``tool_calls`` list, else its ``<tool_call>`` blocks."""
    calls = []
    raw = turn.get("tool_calls")
    if isinstance(raw, list):
        for item in raw:
            if not isinstance(item, dict):
                continue
            function = item.get("function") if isinstance(item.get("function"), dict) else {}
            name = item.get("name", function.get("name"))
            arguments = item.get("arguments", function.get("arguments", {}))
            calls.append(ToolCallRecord(str(item.get("id", "")), str(name), arguments))
    elif turn.get("from") == "gpt" and isinstance(turn.get("value"), str):
        for block in hermes_format.call_texts(turn["value"]):
            try:
                call = json.loads(block)
            except ValueError:
                continue
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                calls.append(ToolCallRecord("", call["name"], call.get("arguments", {})))
    return tuple(calls) or None


def _turns(record: dict) -> Optional[tuple]:
    conversations = record.get("conversations")
    if not isinstance(conversations, list):
        return None
    turns = []
    for turn in conversations:
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str):
            return None
        value = turn.get("value")
        turns.append(Turn(turn["from"], value if isinstance(value, str) else json.dumps(value, ensure_ascii=False),
                          _tool_calls(turn) if turn["from"] == "gpt" else None))
    return tuple(turns)


def _count(value: Any) -> int:
    return value if type(value) is int and 0 <= value < 2**63 else 0


def _tool_stats(record: dict) -> tuple[dict, dict]:
    raw = record.get("tool_stats") if isinstance(record.get("tool_stats"), dict) else {}
    stats = {
        str(name): ToolStat(_count(s.get("count")), _count(s.get("success")), _count(s.get("failure")))
        for name, s in raw.items() if isinstance(s, dict)
    }
    errors_raw = record.get("tool_error_counts")
    if isinstance(errors_raw, dict):
        errors = {str(name): _count(n) for name, n in errors_raw.items()}
    else:
        errors = {name: stat.failure for name, stat in stats.items()}
    return stats, errors


def _prompt_digest(prompt: str) -> bytes:
    return hashlib.blake2b(prompt.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def seed_lines(path: Path):
    """``raw`` for each whole line of one of batch_runner.py's batch files (TOO_LONG for one past MAX_LINE_BYTES);
    a plain file only."""
    handle = readback.open_reader(path, advice=_LINK_ADVICE)
    if handle is None:
        return
    with handle:
        for _offset, raw in read_lines(handle, MAX_LINE_BYTES):
            yield raw


_LINK_ADVICE = "the import reads only the files of the folder itself; put the file there instead, then import again"


def _record_prompts(seed_files) -> set:
    """Digests of the prompts of batch_runner.py's records: only the rows that have one are kept in memory."""
    found = set()
    for path in seed_files:
        for raw in seed_lines(path):
            try:
                record = loads(raw) if raw is not TOO_LONG else None
            except ValueError:
                continue
            turns = record.get("conversations") if isinstance(record, dict) else None
            for turn in turns if isinstance(turns, list) else ():
                if isinstance(turn, dict) and turn.get("from") == "human" and isinstance(turn.get("value"), str):
                    found.add(_prompt_digest(turn["value"]))
                    break
    return found


class _Rows:
    """The dataset's rows by prompt text (those some record has), each claimed by at most one record."""

    def __init__(self, rows, wanted: set):
        self.by_prompt: dict[str, list] = collections.defaultdict(list)
        for row in rows:
            if _prompt_digest(row.prompt) in wanted:
                self.by_prompt[row.prompt].append(row)

    def claim(self, prompt: str, index: Any):
        free = self.by_prompt.get(prompt)
        if not free:
            return None
        at = next((i for i, row in enumerate(free) if row.prompt_index == index), 0)
        return free.pop(at)


# --- the import ----------------------------------------------------------------------------------------------


def seed_batch_size(folder: RunFolder) -> Optional[int]:
    """The batch size batch_runner.py's statistics.json recorded, if any."""
    value = _seed_json(folder.statistics).get("batch_size")
    return value if isinstance(value, int) and value > 0 else None


def _seed_json(path: Path) -> dict:
    """batch_runner.py's checkpoint.json or statistics.json, {} when missing, too large or not a JSON object."""
    try:
        data = loads(readback.read_small(path, MAX_JSON_BYTES, advice=_LINK_ADVICE) or b"{}")
    except (OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s); the import goes on without it.", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def _seed_files(folder: RunFolder) -> list:
    """batch_runner.py's batch files, each a plain file of the folder (RunFolderError for a link, a FIFO...)."""
    found = []
    for entry in os.scandir(folder.dir):
        if record_kind(entry.name) == "kept" or entry.name in SEED_FILES:
            readback.check_file(entry.path, written=False, advice=_LINK_ADVICE)
    for _num, path in folder.iter_batch_files():
        found.append(path)
    return found


def import_run(folder: RunFolder, dataset_file, batch_size: Optional[int], registry, filter_specs: Sequence[str],
               skip_invalid: bool = False) -> ImportResult:
    """Convert the batch_runner.py run folder ``folder`` in place (see the module docstring); the caller holds its lock."""
    staging = folder.dir / STAGING
    if os.path.lexists(staging / _COMPLETE):
        log.warning("%s: finishing the import an interrupted command left half done.", folder.dir)
        _switch(folder, staging)
        return ImportResult(finished_interrupted=True)
    if staging.is_symlink() or (os.path.lexists(staging) and not staging.is_dir()):
        staging.unlink()  # not ours: a link is removed, never what it points to
    elif staging.exists():
        shutil.rmtree(staging)
    if os.path.lexists(folder.run_json):
        raise RunFolderError(
            f"{folder.dir} is a hermes-batch run folder already (it has run.json); continue it with "
            "'hermes-batch run ... --resume'."
        )
    seed_files = _seed_files(folder)
    if not seed_files:
        raise RunFolderError(f"{folder.dir} holds no batch_N.jsonl of batch_runner.py; pass the folder of its run.")
    if os.path.lexists(folder.dir / SEED_FOLDER):
        raise RunFolderError(
            f"{folder.dir / SEED_FOLDER} exists, where the import would keep batch_runner.py's files; move it away first."
        )
    batch_size = batch_size or seed_batch_size(folder)
    if batch_size is None:
        raise UsageError(
            f"batch_runner.py's statistics.json in {folder.dir} does not say the batch size; pass --batch_size."
        )

    report = dataset.validate_dataset(dataset_file)
    if report.invalid and not skip_invalid:
        raise dataset.dataset_error(report)
    if report.valid == 0:
        raise UsageError(f"{dataset_file} holds no valid prompt; pass the dataset the run was made from.")
    filters = selection.filters(registry, tuple(filter_specs))
    tools_of = {name: tuple(t.name for t in tools)
                for name, tools in selection.toolset_tools(registry, registry.names("toolsets")).items()}

    staging.mkdir()
    try:
        result, models = _stage(folder, staging, seed_files, dataset_file, batch_size, filters, tools_of)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    seed_stats = _seed_json(folder.statistics)
    seed_checkpoint = _seed_json(folder.checkpoint)
    completed = seed_checkpoint.get("completed_prompts")
    if isinstance(completed, list):  # prompt indexes; anything else in it names no prompt
        indexes = {index for index in completed if type(index) is int}
        result = attrs.evolve(result, checkpoint_only=max(0, len(indexes) - result.records))

    settings: dict = {"filters": list(selection.filter_specs(tuple(filter_specs)))}
    config: dict = {"run_name": folder.run_name, "dataset_file": str(dataset_file), "batch_size": batch_size,
                    "filters": list(filter_specs), "skip_invalid": skip_invalid}
    if len(models) == 1:
        settings["model"] = config["model"] = models[0]
    if isinstance(seed_stats.get("distribution"), str):
        settings["distribution"] = config["distribution"] = seed_stats["distribution"]
    run_json = {
        "schema_version": 1,
        "hermes_batch_version": __version__,
        "config": config,
        "dataset": {"path": str(dataset_file), "fingerprint": reindex.fingerprint(dataset_file),
                    "lines": report.total, "valid": report.valid},
        "imported": {"from": "batch_runner.py", "at": now_iso(), "originals": SEED_FOLDER + "/",
                     "models": models, **attrs.asdict(result, filter=lambda a, _v: a.name != "finished_interrupted")},
        "settings_history": [{"session": 0, "imported": True, "settings": settings}],
    }
    started = now_iso()
    checkpoint = Checkpoint(run_name=folder.run_name, batch_size=batch_size, prompts_finished=result.kept + result.discarded,
                            sessions=(SessionInfo(started_at=started, invalid_skipped=report.invalid),),
                            updated_at=started, last_updated=started)
    try:
        atomic_write_text(staging / "run.json", json.dumps(run_json, indent=2) + "\n")
        atomic_write_text(staging / "checkpoint.json", to_json_line(checkpoint))
        moved = [path.name for path in seed_files] + [name for name in SEED_FILES if (folder.dir / name).exists()]
        # the staging folder's identity: only a .import/ this very import made is finished by the next one
        st = os.stat(staging)
        (staging / _COMPLETE).write_text(json.dumps({"originals": moved, "staging": [st.st_dev, st.st_ino]}) + "\n")
        _fsync_dir(staging)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise write_error(exc.filename or staging, exc, doing="Importing") from exc
    _switch(folder, staging)
    return result


def _stage(folder: RunFolder, staging: Path, seed_files, dataset_file, batch_size: int, filters,
           tools_of: dict) -> tuple[ImportResult, list]:
    from ..folder.reindex import UNMATCHED, _Writers

    rows = _Rows(dataset.iter_rows(dataset_file), _record_prompts(seed_files))
    writers = _Writers(staging)
    counts: collections.Counter = collections.Counter()
    models: list[str] = []
    missing_toolsets: set[str] = set()
    try:
        for path in seed_files:
            # the torn last line of a killed write is never given: never a record
            for raw in seed_lines(path):
                if raw is TOO_LONG:
                    counts["too_long"] += 1  # no record of a run is that long: not read, not copied
                    continue
                if not raw.strip():
                    continue
                counts["records"] += 1
                kind, name, line = _convert(raw, rows, batch_size, filters, tools_of, models, missing_toolsets)
                counts[kind] += 1
                writers.write(name if name else UNMATCHED, line)
    except OSError as exc:
        raise write_error(exc.filename or staging, exc, doing="Importing") from exc
    finally:
        writers.close()
    if missing_toolsets and any(f.name == "hallucinated-tools" for f in filters):
        raise UsageError(
            f"The records used toolsets that are not installed ({', '.join(sorted(missing_toolsets))}), so their "
            f"tools are unknown and the hallucinated-tools filter would discard their calls: "
            f"{distributions.where_to_get(sorted(missing_toolsets))}; install it and import again, or pass "
            "--no_filters (or filters without hallucinated-tools)."
        )
    if missing_toolsets:
        log.warning("The records used toolsets that are not installed (%s): their tools are not in the records' "
                    "metadata.tools_offered.", ", ".join(sorted(missing_toolsets)))
    if counts["too_long"]:
        log.warning("%d line(s) of the batch files are longer than %d MiB, more than any record: skipped.",
                    counts["too_long"], MAX_LINE_BYTES >> 20)
    return ImportResult(counts["records"], counts["kept"], counts["discarded"], counts["unmatched"],
                        counts["unreadable"], counts["too_long"]), models


def _unreadable(raw: bytes) -> tuple[str, Optional[str], str]:
    return "unreadable", None, reindex._line({"kind": "unreadable", "line": raw.decode("utf-8", "replace").rstrip("\n")})


def _convert(raw: bytes, rows: _Rows, batch_size: int, filters, tools_of: dict, models: list,
             missing: set) -> tuple[str, Optional[str], str]:
    """(kind, file name or None for unmatched.jsonl, line) of one line of batch_runner.py."""
    try:
        record = json.loads(raw)  # as batch_runner.py wrote it (NaN included)
    except (ValueError, RecursionError):
        record = None
    try:
        return _converted(raw, record, rows, batch_size, filters, tools_of, models, missing)
    except (TypeError, ValueError, AttributeError, RecursionError):  # fields no record of batch_runner.py has
        return _unreadable(raw)


def _converted(raw: bytes, record, rows: _Rows, batch_size: int, filters, tools_of: dict, models: list,
               missing: set) -> tuple[str, Optional[str], str]:
    turns = _turns(record) if isinstance(record, dict) else None
    prompt = next((t.value for t in turns if t.from_ == "human"), None) if turns else None
    if prompt is None:
        return _unreadable(raw)
    metadata = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
    if "content_key" in metadata:
        raise RunFolderError("The batch files hold hermes-batch records (with metadata.content_key), not batch_runner.py's; "
                             "continue the run with 'hermes-batch run ... --resume'.")
    model = metadata.get("model") if isinstance(metadata.get("model"), str) else UNKNOWN
    if model not in models:
        models.append(model)
    toolsets = tuple(str(t) for t in record.get("toolsets_used") or () if isinstance(t, str))
    missing.update(t for t in toolsets if t not in tools_of)
    row = rows.claim(prompt, record.get("prompt_index"))
    index = row.prompt_index if row is not None else _count(record.get("prompt_index"))
    stats, errors = _tool_stats(record)
    completed = record.get("completed") is True
    trajectory = Trajectory(
        prompt_index=index,
        conversations=turns,
        metadata=Metadata(
            batch_num=index // batch_size,
            timestamp=metadata.get("timestamp") if isinstance(metadata.get("timestamp"), str) else "",
            model=model,
            content_key=row.content_key if row is not None else content_key(prompt, None, None),
            id="" if row is None or row.id is None else str(row.id),
            row=dict(row.extra) if row is not None else {},
            sandbox=UNKNOWN,
            tools_offered=tuple(sorted({tool for t in toolsets for tool in tools_of.get(t, ())})),
            end_reason=UNKNOWN,
        ),
        completed=completed,
        partial=record["partial"] if isinstance(record.get("partial"), bool) else not completed,
        api_calls=_count(record.get("api_calls")),
        toolsets_used=toolsets,
        tool_stats=stats,
        tool_error_counts=errors,
    )
    if row is None:
        from ..formats.serialization import record_converter

        return "unmatched", None, reindex._line({"kind": "kept", "record": record_converter.unstructure(trajectory)})
    rejected = [(f.name, reason) for f in filters if (reason := f.check(trajectory)) is not None]
    if rejected:
        discarded = Discarded(trajectory, tuple(n for n, _ in rejected), tuple(r for _, r in rejected))
        return "discarded", "discarded.jsonl", to_json_line(discarded)
    return "kept", f"batch_{index // batch_size}.jsonl", to_json_line(trajectory)


def _switch(folder: RunFolder, staging: Path) -> None:
    """batch_runner.py's files into batch_runner/, then the staged ones in; finished by the next import if cut off."""
    try:
        originals = _staged_originals(folder, staging)
        keep = folder.dir / SEED_FOLDER
        if not os.path.lexists(keep):
            keep.mkdir()
        elif keep.is_symlink() or not keep.is_dir():  # the originals go into the folder itself, nowhere else
            raise RunFolderError(f"{keep} is not a folder; move it away, then run the import again.")
        for name in originals:
            if os.path.lexists(folder.dir / name) and not os.path.lexists(keep / name):
                os.replace(folder.dir / name, keep / name)
        _fsync_dir(keep)
        _fsync_dir(folder.dir)
        for path in sorted(staging.iterdir()):
            if path.name != _COMPLETE:
                os.replace(path, folder.dir / path.name)
        _fsync_dir(folder.dir)
        shutil.rmtree(staging)
    except OSError as exc:
        raise write_error(exc.filename or folder.dir, exc, doing="Importing") from exc


def _staged_originals(folder: RunFolder, staging: Path) -> list:
    """The names of batch_runner.py's files the marker of ``staging`` says to move, after checking that an
    import of this folder made it: RunFolderError for a ``.import/`` that came with the folder or was edited
    (a marker naming a path out of the folder, a run.json an import does not write, a link)."""

    def refuse(why: str) -> RunFolderError:
        return RunFolderError(
            f"{staging} was not left by an interrupted 'hermes-batch import' of this folder ({why}); "
            f"remove it, then run the import again."
        )

    if staging.is_symlink() or not staging.is_dir():
        raise refuse("it is not a folder")
    try:
        marker = loads(readback.read_small(staging / _COMPLETE, MAX_JSON_BYTES) or b"null")
    except (ValueError, RunFolderError) as exc:
        raise refuse(f"its marker cannot be read: {exc}") from None
    st = os.stat(staging)
    if not isinstance(marker, dict) or marker.get("staging") != [st.st_dev, st.st_ino]:
        raise refuse("its marker names another folder")
    originals = marker.get("originals")
    if not isinstance(originals, list) or not all(
            isinstance(name, str) and (record_kind(name) == "kept" or name in SEED_FILES) for name in originals):
        raise refuse("its marker names files an import never moves")
    for entry in os.scandir(staging):
        if not (entry.name in _STAGED or record_kind(entry.name) == "kept") or not entry.is_file(follow_symlinks=False):
            raise refuse(f"it holds {entry.name!r}, which an import does not write")
    try:
        run_json = loads(readback.read_small(staging / "run.json", MAX_JSON_BYTES) or b"null")
    except (ValueError, RunFolderError) as exc:
        raise refuse(f"its run.json cannot be read: {exc}") from None
    config = run_json.get("config") if isinstance(run_json, dict) else None
    imported = run_json.get("imported") if isinstance(run_json, dict) else None
    if not isinstance(config, dict) or not set(config) <= _IMPORT_CONFIG or not isinstance(imported, dict) \
            or imported.get("from") != "batch_runner.py":
        raise refuse("its run.json is not one an import writes")
    return originals


_IMPORT_CONFIG = frozenset({"run_name", "dataset_file", "batch_size", "filters", "skip_invalid", "model", "distribution"})
