"""A verifier's tests, run apart from what the graded agent left: the building blocks every backend shares.

``Sandbox.run_tests`` runs a row's tests once every process of the session has
ended, under an identity of their own, in a grading folder the agent never had,
with a clean environment; code of the agent's that the tests run goes through
``$HERMES_RUN_UNTRUSTED`` (docs/verification.md).  The compiled helper does that
inside the sandbox (``-G``, see the local sandbox's ``grading.h``); what is the
same for every backend is here: the shell script the tests' supervisor runs
(:func:`tests_script`), their environment (:func:`tests_environment`), the row's
hidden files checked (:func:`checked_files`) and the supervisor's report read
(:func:`read_report`).
"""

from __future__ import annotations

import os
import posixpath
import shlex
from typing import Iterable, Mapping, Optional

from ..formats.records import TestsRun

__all__ = ["TestsRun", "checked_files", "read_report", "tests_environment", "tests_script", "REPORT_PREFIX",
           "REWARD_MAX_BYTES", "MAX_TEST_FILES", "MAX_TEST_FILES_BYTES", "STANDARD_PATH"]

REWARD_MAX_BYTES = 256  # a reward file longer than this is refused (the supervisor reads one byte more)
MAX_TEST_FILES = 10_000
MAX_TEST_FILES_BYTES = 64 << 20
REPORT_PREFIX = "hermes-batch-reward "
# The tests' PATH where the sandbox gives none: the usual system folders, never one the agent chose.
STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Variables that make a shell or an interpreter run code at its start: never given to the tests.
START_UP_HOOKS = frozenset({
    "BASH_ENV", "ENV", "PROMPT_COMMAND", "PS4", "SHELLOPTS", "BASHOPTS", "CDPATH", "GLOBIGNORE", "IFS",
    "PYTHONSTARTUP", "PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONINSPECT", "PYTHONBREAKPOINT",
    "PERL5OPT", "PERL5LIB", "PERLLIB", "RUBYOPT", "RUBYLIB", "NODE_OPTIONS", "NODE_PATH",
    "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "GCONV_PATH", "PYTEST_ADDOPTS", "PYTEST_PLUGINS",
    "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM", "GIT_EXEC_PATH", "ZDOTDIR",
})


def checked_files(files: object, field: str = "test_files") -> tuple:
    """The row's hidden files as ((relative path, text), ...); ValueError with one sentence for anything else.

    Paths are relative, normalised, inside the tests' folder (no ``..``, no
    absolute path, no NUL); the contents are text without NUL characters.
    """
    if files is None:
        return ()
    if not isinstance(files, Mapping) or not all(isinstance(v, str) for v in files.values()):
        raise ValueError(f"the row's `{field}` must be an object of path -> file content (text)")
    if len(files) > MAX_TEST_FILES:
        raise ValueError(f"the row's `{field}` holds more than {MAX_TEST_FILES} files")
    out, total = [], 0
    for path, content in files.items():
        path = str(path)
        normal = posixpath.normpath(path) if path else ""
        if (not normal or normal in (".", "..") or normal.startswith(("/", "../")) or "\0" in path
                or "\0" in content):
            raise ValueError(f"the row's `{field}` names {path[:80]!r}: paths must be relative, inside the tests' "
                             "folder, and files must hold text without NUL characters")
        total += len(content.encode("utf-8", "surrogatepass"))
        if total > MAX_TEST_FILES_BYTES:
            raise ValueError(f"the row's `{field}` holds more than {MAX_TEST_FILES_BYTES >> 20} MiB")
        out.append((normal, content))
    return tuple(out)


def tests_script(command: str, files: Iterable, workdir: str) -> str:
    """The script the tests' supervisor runs with ``/bin/sh -c``: the hidden ``files`` (from :func:`checked_files`)
    written into ``$HERMES_TESTS_DIR``, then ``command`` in the sandbox's working folder ``workdir``."""
    lines = ['cd "$HERMES_TESTS_DIR" || exit 125']
    failed = "|| { echo 'hermes-batch: the tests'\\'' files could not be written' >&2; exit 125; }"
    for path, content in files:
        parent = posixpath.dirname(path)
        make = f"mkdir -p -- {shlex.quote(parent)} && " if parent else ""
        lines.append(f"{make}printf '%s' {shlex.quote(content)} > {shlex.quote(path)} {failed}")
    lines.append(f"cd -- {shlex.quote(workdir)} || {{ echo 'hermes-batch: the tests cannot enter "
                 f"'{shlex.quote(workdir)} >&2; exit 125; }}")
    return "\n".join(lines) + "\n" + command + "\n"


def _inside(path: str, folders: Iterable[str]) -> bool:
    path = posixpath.normpath(path)
    return any(folder and (path == folder or path.startswith(folder.rstrip("/") + "/")) for folder in folders)


def tests_environment(path: Optional[str], agent_folders: Iterable[str] = (), extra: Optional[Mapping] = None) -> dict:
    """The tests' environment: ``path`` without the agent's folders (nor relative entries), C.UTF-8, Python with no
    user site-packages, no current folder on its path and no bytecode written, and ``extra`` (the backend's, the
    row's) without variables that run code at a program's start.  The supervisor adds HOME, TMPDIR and the
    HERMES_ variables."""
    folders = [posixpath.normpath(folder) for folder in agent_folders if folder and folder.startswith("/")]
    kept = [entry for entry in (path or STANDARD_PATH).split(":")
            if entry.startswith("/") and not _inside(entry, folders)]
    env = {str(k): str(v) for k, v in (extra or {}).items()
           if str(k) not in START_UP_HOOKS and not str(k).startswith(("HERMES_", "BASH_FUNC_")) and "=" not in str(k)}
    env.update({
        "PATH": ":".join(dict.fromkeys(kept)) or STANDARD_PATH,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONNOUSERSITE": "1",
        "PYTHONSAFEPATH": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    })
    return env


def environment_block(env: Mapping) -> bytes:
    """``env`` as KEY=VALUE entries each ended by a NUL (entries holding a NUL are left out)."""
    return b"".join(os.fsencode(f"{k}={v}") + b"\0" for k, v in env.items() if "\0" not in f"{k}{v}")


def read_report(hex_text: str) -> tuple:
    """(reward bytes or None, problem) of the supervisor's report (the hexadecimal after ``REPORT_PREFIX``).

    ``None, ""``: the tests wrote no reward file; ``None, why``: the report or
    the file could not be read.
    """
    try:
        blob = bytes.fromhex(hex_text.strip())
    except ValueError:
        return None, "the tests' supervisor gave no readable report"
    kind, data = blob[:1], blob[1:]
    if kind == b"n":
        return None, ""
    if kind == b"f":
        return data, ""
    if kind == b"b":
        return None, f"the reward file cannot be read ({data.decode('utf-8', 'replace')[:100]})"
    return None, "the tests' supervisor gave no readable report"


def report_in(text: str) -> Optional[str]:
    """The hexadecimal of the last report line in ``text`` (the supervisor's standard error), or None."""
    found = None
    for line in text.splitlines():
        if line.startswith(REPORT_PREFIX):
            found = line[len(REPORT_PREFIX):]
    return found
