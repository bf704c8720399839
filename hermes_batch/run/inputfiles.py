"""Reading the small files a run is configured with (prefill messages, distributions), or one sentence why not."""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Union

from ..errors import HermesBatchError, UsageError
from ..formats.jsonguard import value_problem
from ..formats.records import Message

PathLike = Union[str, "os.PathLike[str]"]


def read_text_file(path: PathLike, what: str, option: str, error: type = HermesBatchError) -> str:
    """The UTF-8 text of ``path``; ``error`` (one sentence) if it is missing, a folder, a pipe, unreadable or not UTF-8.

    ``what`` names the file for the user ("prefill messages file"), ``option`` is the option that gave it.
    """
    name = os.fspath(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below like any non-file
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise error(f"The {what} {name} does not exist; check the {option} path.") from None
    except IsADirectoryError:
        raise error(f"The {what} {name} is a folder; pass a file to {option}.") from None
    except OSError as exc:
        raise _unreadable(error, what, name, exc) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise error(f"The {what} {name} is a folder; pass a file to {option}.")
        if not stat.S_ISREG(mode):
            raise error(f"The {what} {name} is not a regular file (a pipe, socket or device); pass a file to {option}.")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            raw = handle.read()
    except OSError as exc:
        raise _unreadable(error, what, name, exc) from None
    finally:
        os.close(fd)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"The {what} {name} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "save it as UTF-8."
        ) from None


def _unreadable(error: type, what: str, name: str, exc: OSError) -> HermesBatchError:
    fix = "check its permissions" if exc.errno in (errno.EACCES, errno.EPERM) else "check the path"
    return error(f"The {what} {name} cannot be read ({exc.strerror or exc}); {fix}.")


def load_prefill(path) -> tuple:
    """The few-shot messages of --prefill_messages_file: a JSON list of {role, content}."""
    if path is None:
        return ()
    text = read_text_file(path, "prefill messages file", "--prefill_messages_file", UsageError)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"The prefill messages file {path} is not valid JSON ({exc}).") from None
    problem = value_problem(data, int_range=False)
    if problem is not None:
        raise UsageError(f"The prefill messages file {path} cannot be sent: {problem}.")
    if not isinstance(data, list):
        raise UsageError(f"The prefill messages file {path} must hold a JSON list of {{role, content}} objects.")
    out = []
    for i, item in enumerate(data):
        if (
            not isinstance(item, dict)
            or item.get("role") not in ("system", "user", "assistant")
            or not isinstance(item.get("content"), str)
        ):
            raise UsageError(
                f"{path}: message {i} must be an object with role system, user or assistant and a string content."
            )
        out.append(Message(item["role"], item["content"]))
    return tuple(out)
