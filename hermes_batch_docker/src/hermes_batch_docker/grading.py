"""A verifier's tests in a prompt's container, apart from what the agent left (``Sandbox.run_tests``).

The tests run under hermes-batch's static namespace helper as their supervisor
(``-G``, ``grading.h`` in hermes_batch's local sandbox), started by an exec as the
container's root with the container's own capabilities, so that no file mode or
read-only folder the agent left stops them:

- strict mode (a container per prompt): the helper is copied into the container
  for each grading (one archive, with the tests' script when it is too long for
  an argument) into a fresh folder only root may enter, and run from there;
- ``-S reuse=namespace``: the exec joins the prompt's view as root (the helper's
  ``-J`` without the prompt's user, with the container's capabilities and the
  view's seccomp filter) and runs the helper's own program, ``/proc/self/exe``
  (the view does not show the bound helper); a long script is written into the
  view first.

The supervisor makes the grading folder GRADE at a random path beneath ``/``,
which is beneath none of the folders the agent's code may write (its working
folder, HOME, /tmp, /var/tmp, /dev/shm), and runs the tests with the environment
of :func:`hermes_batch.grading.tests_environment`.  ``$HERMES_RUN_UNTRUSTED``
runs the agent's code as the agent's user, with no capabilities, no new
privileges and Landlock (writes only beneath those folders, no signal to the
tests): Docker's seccomp profile refuses it the namespaces it would use
elsewhere.  The report of the reward comes on the exec's standard error, which
no process of the tests holds; their output is its standard output.
"""

from __future__ import annotations

import io
import posixpath
import secrets
import tarfile
import time
from typing import Iterable, Mapping, Optional

from hermes_batch import grading

# reward/'s owner: neither root (the tests) nor any user an image gives its agent, so the agent's code cannot read it.
REWARD_OWNER = grading.GRADE_OWNER
GRADE_PREFIX = "/" + grading.GRADE_PREFIX
STAGE_PREFIX = "/.hermes-batch-tests-"  # the helper (strict mode) and a long script, root's alone
# The agent's writable folders besides its working folder and HOME: run-untrusted lets its code write only there.
TEMPORARY_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm")
# The agent's user and environment, as its commands have them: "UID GID", a newline, then the shell's environment
# as the exec gave it (entries ended by NUL).
IDENTITY_SCRIPT = (
    'while read -r key real _; do case "$key" in Uid:) u=$real;; Gid:) g=$real;; esac; done < /proc/self/status; '
    'printf "%s %s\\n" "$u" "$g"; cat "/proc/$$/environ"'
)
# Scripts longer than this go through a file: one argument may hold at most 128 KiB (MAX_ARG_STRLEN).
MAX_SCRIPT_ARGUMENT = 96 * 1024
MAX_ITEM = 64 * 1024  # an environment entry longer than this is not passed (argv's limit again)
MAX_ITEMS = 256  # of -w, -x and -v each: the supervisor refuses more (GRADE_MAX_ITEMS)
MAX_AGENT_ENV_BYTES = 512 * 1024  # of the -x entries in all, well inside the kernel's limit on a command line
# A timed-out strict container's tests: every process but the container's first (as root, unlike stop_processes).
KILL_EVERYTHING = "for round in 1 2 3 4 5; do kill -9 -1 2>/dev/null || break; done; exit 0"
TESTS_KILL_WAIT_S = 10.0  # a timed-out supervisor's exec ends by then, once every process of the tests was killed


def new_grade() -> str:
    """A grading folder's path: random, beneath ``/`` (no folder the agent may write holds it)."""
    return GRADE_PREFIX + secrets.token_hex(16)


def new_stage() -> str:
    return STAGE_PREFIX + secrets.token_hex(16)


def parse_identity(output: bytes) -> tuple:
    """(uid, gid, environment) from what IDENTITY_SCRIPT printed; ValueError when it is not that."""
    head, newline, rest = output.partition(b"\n")
    if not newline:
        raise ValueError("no identity line")
    uid, gid = (int(part) for part in head.decode("ascii").split())
    env = {}
    for entry in rest.split(b"\0"):
        key, equals, value = entry.decode("utf-8", "surrogateescape").partition("=")
        if equals and key and key not in env:
            env[key] = value
    return uid, gid, env


def agent_folders(workdir: str, home: Optional[str]) -> tuple:
    """The folders the agent's code may write through run-untrusted: its working folder, HOME and the temporary ones.

    ``/`` is never one: GRADE lies beneath it (the supervisor's run-untrusted gives no rule to a folder that holds
    GRADE either, whatever link the agent left).
    """
    folders = [workdir, home or "", *TEMPORARY_FOLDERS]
    out = []
    for folder in folders:
        if folder.startswith("/") and "\0" not in folder:
            folder = posixpath.normpath(folder)
            if folder != "/" and folder not in out:
                out.append(folder)
    return tuple(out)


def image_environment(image_info: Mapping) -> dict:
    """The image's own environment (``Config.Env``): the tests get it, cleaned, besides their PATH."""
    env = {}
    for entry in (image_info.get("Config") or {}).get("Env") or ():
        key, equals, value = str(entry).partition("=")
        if equals and key:
            env[key] = value
    return env


def _entries(env: Mapping, budget: Optional[int] = None) -> list:
    out, used = [], 0
    for key, value in env.items():
        entry = f"{key}={value}"
        if "\0" in entry or len(entry.encode("utf-8", "surrogateescape")) > MAX_ITEM or len(out) == MAX_ITEMS:
            continue
        used += len(entry) + 1
        if budget is not None and used > budget:
            break
        out.append(entry)
    return out


def supervisor_argv(program: str, grade: str, user: str, folders: Iterable[str], agent_env: Mapping,
                    tests_env: Mapping, command: list) -> list:
    """The helper's ``-G`` command line: GRADE, reward/'s owner, the agent's user (``UID:GID``), its folders and
    environment for run-untrusted, the tests' environment, then ``command``."""
    argv = [program, "-G", grade, "-o", REWARD_OWNER, "-i", user]
    for folder in list(folders)[:MAX_ITEMS]:
        argv += ["-w", folder]
    for entry in _entries(agent_env, MAX_AGENT_ENV_BYTES):
        argv += ["-x", entry]
    for entry in _entries(tests_env):
        argv += ["-v", entry]
    return [*argv, "--", *command]


def script_command(script: str, stage: str) -> tuple:
    """(the command the supervisor runs, the script's file in ``stage`` or None): ``/bin/sh -c SCRIPT``, or
    ``/bin/sh FILE`` for a script too long for one argument."""
    if len(script.encode("utf-8", "surrogateescape")) <= MAX_SCRIPT_ARGUMENT:
        return ["/bin/sh", "-c", script], None
    path = f"{stage}/tests.sh"
    return ["/bin/sh", path], path


def stage_archive(stage: str, helper: Optional[bytes], script_path: Optional[str], script: str) -> bytes:
    """A tar of ``stage`` (mode 0700, root's) holding the helper (as ``helper``) and the script's file, if any."""
    buffer = io.BytesIO()
    now = int(time.time())
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        folder = tarfile.TarInfo(stage.lstrip("/"))
        folder.type, folder.mode, folder.mtime = tarfile.DIRTYPE, 0o700, now
        tar.addfile(folder)
        files = []
        if helper is not None:
            files.append(("helper", helper, 0o700))
        if script_path is not None:
            files.append((posixpath.basename(script_path), script.encode("utf-8", "surrogateescape"), 0o600))
        for name, data, mode in files:
            info = tarfile.TarInfo(f"{stage.lstrip('/')}/{name}")
            info.size, info.mode, info.mtime = len(data), mode, now
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def tests_environment(image_info: Mapping, folders: Iterable[str]) -> dict:
    """The tests' environment: the image's, cleaned by :func:`hermes_batch.grading.tests_environment`, its PATH without
    the agent's folders."""
    env = image_environment(image_info)
    return grading.tests_environment(env.pop("PATH", None), folders, env)
