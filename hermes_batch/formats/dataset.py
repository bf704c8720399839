"""Reading the prompt dataset: streaming validation and the valid rows, one JSON object per line."""

from __future__ import annotations

import json
import os
import stat
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import attrs

from ..errors import DatasetError, UsageError
from .jsonguard import MAX_DEPTH, value_problem
from .records import PromptRow
from . import task_folders

PathLike = Union[str, "os.PathLike[str]"]

MAX_PROBLEMS = 50
"""How many problem lines a report keeps; the counts stay exact beyond it."""

MAX_LINE_BYTES = 16 << 20
"""Longest line of one row; a longer one is reported without ever being held in memory whole."""

_KNOWN_FIELDS = frozenset({"prompt", "image", "docker_image", "cwd", "id"})
_NOT_RANGE_CHECKED = frozenset({"id"})  # saved as a string, so any integer is fine
_BUFFER = 1 << 20
_BOM = b"\xef\xbb\xbf"
_MISSING = object()
_OPTIONAL_STRINGS = ("image", "docker_image", "cwd")
# A task row's build context: a key no JSON line can hold, so a row never names a folder to build from itself.
_BUILD = object()
# What a task row takes from its task folder, so the row may not give it too.
_FROM_TASK = ("prompt", "image", "docker_image", "cwd", "tests", "test_files", "tests_timeout", "task_metadata")


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON can hold; use null or a string")


_decode_json = json.JSONDecoder(parse_constant=_refuse_constant).decode

_TYPE_NAMES = {
    type(None): "null",
    bool: "bool",
    int: "int",
    float: "float",
    str: "string",
    list: "array",
    dict: "object",
}


@attrs.frozen
class DatasetReport:
    """What validating a dataset found: counts, the first problems, and the images valid rows need."""

    path: str
    valid: int
    invalid: int
    problems: tuple[str, ...]  # the first MAX_PROBLEMS, each "FILE:LINE: reason"
    total: int  # non-blank lines considered
    images: tuple[str, ...]  # sorted, distinct

    @property
    def ok(self) -> bool:
        """True when every line considered is valid."""
        return self.invalid == 0


def validate_dataset(
    path: PathLike, *, max_samples: Optional[int] = None, on_valid: Optional[Callable[[int, dict], None]] = None
) -> DatasetReport:
    """Check every non-blank line (up to ``max_samples``) without holding the file in memory.

    ``on_valid(prompt_index, row)`` is called with each valid row, in order, as it is read.
    """
    name = os.fspath(path)
    check_arguments(name, max_samples)
    valid = invalid = total = 0
    problems: list[str] = []
    images: set[str] = set()
    for line_number, index, row, reason in _scan(name, max_samples):
        total += 1
        if reason is None:
            valid += 1
            if on_valid is not None:
                on_valid(index, row)
            image = row.get("image") or row.get("docker_image")
            if image is not None:
                images.add(image)
        else:
            invalid += 1
            if len(problems) < MAX_PROBLEMS:
                problems.append(f"{name}:{line_number}: {reason}")
    return DatasetReport(name, valid, invalid, tuple(problems), total, tuple(sorted(images)))


def iter_rows(
    path: PathLike, *, max_samples: Optional[int] = None, only: Optional[Sequence[int]] = None
) -> Iterator[PromptRow]:
    """Stream the valid rows as PromptRow, skipping invalid ones; indices count every non-blank line.

    With ``only`` (ascending prompt indexes), just those rows: the others are
    counted but not decoded, and the file is read no further than the last.
    """
    name = os.fspath(path)
    check_arguments(name, max_samples)
    return _rows(name, max_samples, only)


def iter_problems(path: PathLike, *, max_samples: Optional[int] = None) -> Iterator[str]:
    """Every invalid line as ``FILE:LINE: reason``, streaming (a report keeps only the first MAX_PROBLEMS)."""
    name = os.fspath(path)
    check_arguments(name, max_samples)
    for line_number, _index, _row, reason in _scan(name, max_samples):
        if reason is not None:
            yield f"{name}:{line_number}: {reason}"


def dataset_error(report: DatasetReport) -> DatasetError:
    """The DatasetError that stops a run over an invalid dataset: a summary line, then the problems."""
    return DatasetError(format_problems(report), report.problems)


def format_problems(report: DatasetReport) -> str:
    """A summary sentence followed by one ``FILE:LINE: reason`` line per kept problem."""
    noun = "line" if report.invalid == 1 else "lines"
    lines = [f"{report.path} has {report.invalid} invalid {noun}; fix them or pass --skip_invalid to skip them."]
    lines.extend(report.problems)
    hidden = report.invalid - len(report.problems)
    if hidden > 0:
        lines.append(f"... and {hidden} more.")
    return "\n".join(lines)


def _rows(name: str, max_samples: Optional[int], only: Optional[Sequence[int]] = None) -> Iterator[PromptRow]:
    for line_number, index, row, reason in _scan(name, max_samples, only):
        if reason is not None:
            continue
        yield PromptRow(
            prompt_index=index,
            prompt=row["prompt"],
            line_number=line_number,
            image=row.get("image") or row.get("docker_image"),
            cwd=row.get("cwd"),
            id=row.get("id"),
            extra={key: value for key, value in row.items() if key not in _KNOWN_FIELDS and key is not _BUILD},
            task_options=row.get(_BUILD),
        )


def check_arguments(name: str, max_samples: Optional[int]) -> None:
    """DatasetError or UsageError, with the fix, for a path that is no readable JSONL file or a bad --max_samples."""
    # Checked eagerly so a bad path fails when the caller asks, not at the first row.
    if max_samples is not None and max_samples < 0:
        raise UsageError(f"--max_samples must be 0 or more, got {max_samples}.")
    if os.path.isdir(name):
        raise DatasetError(f"The dataset {name} is a folder; pass the path of a JSONL file to --dataset_file.")
    if not os.path.exists(name):
        raise DatasetError(f"The dataset file {name} does not exist; check the --dataset_file path.")
    if not stat.S_ISREG(os.stat(name).st_mode):  # opening a FIFO would wait for a writer, and it is read twice
        raise DatasetError(f"The dataset {name} is not a regular file (a pipe, socket or device); pass a JSONL file.")
    if not os.access(name, os.R_OK):
        raise DatasetError(f"The dataset file {name} cannot be read; check its permissions.")


def _scan(
    name: str, max_samples: Optional[int], only: Optional[Sequence[int]] = None
) -> Iterator[tuple[int, int, Any, Optional[str]]]:
    """(line number, prompt index, decoded row, problem or None) for each non-blank line (of ``only``'s, if given).

    A row ``{"task": PATH}`` stands for the Harbor task folder at PATH (relative to the dataset's folder, and
    inside it; or absolute): it is read and checked here, and becomes the row the task describes."""
    base = os.path.dirname(os.path.abspath(name))
    if max_samples == 0 or (only is not None and not len(only)):
        return
    try:
        handle = open(name, "rb", buffering=_BUFFER)
    except OSError as exc:
        raise DatasetError(f"The dataset file {name} cannot be opened: {exc.strerror or exc}.") from exc
    index = line_number = taken = 0
    try:
        with handle:
            while raw := handle.readline(MAX_LINE_BYTES + 1):
                line_number += 1
                if line_number == 1 and raw.startswith(_BOM):
                    raw = raw[len(_BOM) :]
                too_long = len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n")
                if too_long:
                    _skip_rest_of_line(handle)
                elif raw.isspace():
                    continue
                if only is None or index == only[taken]:
                    if too_long:
                        row, reason = None, f"the line is longer than {MAX_LINE_BYTES >> 20} MiB, the limit for one row"
                    else:
                        row, reason = _parse(raw)
                        if reason is None and "task" in row:
                            row, reason = _task_row(row, base)
                    yield line_number, index, row, reason
                    if only is not None:
                        taken += 1
                        if taken == len(only):
                            return
                index += 1
                if max_samples is not None and index >= max_samples:
                    return
    except OSError as exc:
        raise DatasetError(f"Reading the dataset file {name} failed: {exc.strerror or exc}.") from exc


def _skip_rest_of_line(handle) -> None:
    while (chunk := handle.readline(_BUFFER)) and not chunk.endswith(b"\n"):
        pass


def _parse(raw: bytes) -> tuple[Any, Optional[str]]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
    text = text.rstrip("\r\n")  # else an error at the end of the line is placed on the next one, at column 1
    try:
        row = _decode_json(text)
    except json.JSONDecodeError as exc:
        if exc.pos >= len(text) or exc.msg.startswith("Unterminated string"):
            return None, f"invalid JSON: the line ends at column {len(text)} before the JSON does (cut short?)"
        return None, f"invalid JSON: {exc.msg.removesuffix(' at')} at column {exc.pos + 1}"
    except RecursionError:
        return None, f"$: is nested more than {MAX_DEPTH} levels deep; flatten the field"
    except ValueError as exc:  # NaN or Infinity; an integer of more than 4300 digits
        text = str(exc)
        if "integer string conversion" in text:
            text = "an integer has more than 4300 digits; quote it as a string"
        return None, f"invalid JSON: {text}"
    if type(row) is not dict:
        return None, f"expected a JSON object, got {_type_name(row)}"
    # every row is checked alike at validation and at run time, so a row that passed is never skipped later
    if "task" in row:  # a task row: its prompt comes from the task folder (_task_row)
        return row, value_problem(row, any_int=_NOT_RANGE_CHECKED)
    return row, _check_row(row) or value_problem(row, any_int=_NOT_RANGE_CHECKED)


def _task_row(row: dict, base: str) -> tuple[Any, Optional[str]]:
    """The row of the task folder a ``{"task": PATH}`` row names, or the problem with it."""
    path = row["task"]
    if type(path) is not str or not path.strip() or "\0" in path:
        return None, f"$.task: expected the path of a task folder, got {_type_name(path)}"
    given = [key for key in _FROM_TASK if key in row]
    if given:
        return None, f"$.{given[0]}: a task row takes it from its task folder; leave it out"
    if not os.path.isabs(path):
        real_base = os.path.realpath(base)
        resolved = os.path.realpath(os.path.join(base, path))
        if resolved != real_base and not resolved.startswith(real_base.rstrip("/") + "/"):
            return None, f"$.task: {path!r} leads outside the dataset's folder; give an absolute path or move the task"
        path = os.path.join(base, path)
    try:
        task = task_folders.read_task(path)
    except task_folders.TaskError as exc:
        return None, f"$.task: {exc}"
    expanded = task_folders.task_row(task)
    expanded.update((key, value) for key, value in row.items() if key != "task")
    expanded["task"] = task.name
    expanded[_BUILD] = task_folders.options_of(task)
    problem = value_problem({k: v for k, v in expanded.items() if k is not _BUILD}, any_int=_NOT_RANGE_CHECKED)
    return (None, problem) if problem else (expanded, None)


def _check_row(row: dict) -> Optional[str]:
    prompt = row.get("prompt", _MISSING)
    if type(prompt) is not str:
        if prompt is _MISSING:
            return 'missing "prompt" (every line needs a non-empty "prompt" string)'
        return f"$.prompt: expected a string, got {_type_name(prompt)}"
    if not prompt or prompt.isspace():
        return "$.prompt: is empty"
    if len(row) == 1:
        return None
    for key in _OPTIONAL_STRINGS:
        value = row.get(key)
        if value is None:  # absent or null: the backend's default
            continue
        if type(value) is not str:
            return f"$.{key}: expected a string, got {_type_name(value)}"
        if not value or value.isspace():
            return f"$.{key}: is empty (leave it out to use the default)"
    image, docker_image = row.get("image"), row.get("docker_image")
    if image is not None and docker_image is not None and image != docker_image:
        return f"$.image ({image!r}) and $.docker_image ({docker_image!r}) differ; give only one"
    return None


def _type_name(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)
