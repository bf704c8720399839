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
import secrets
import shlex
from typing import Iterable, Mapping, Optional

from ..formats.records import ExecResult, TestsRun

__all__ = ["TestsRun", "checked_files", "read_report", "tests_environment", "tests_script", "REPORT_PREFIX",
           "REWARD_MAX_BYTES", "IDLE_FIRST_PROCESS", "MAX_TEST_FILES", "MAX_TEST_FILES_BYTES", "STANDARD_PATH", "launcher", "tests_run",
           "landlock_abi", "GRADE_OWNER"]

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


# --- backends that send the helper along: one command, its standard input the helper and the tests' script -------

GRADE_OWNER = "2147480000:2147480000"  # -o, when the tests run as root: reward/'s owner, neither root nor an agent's
GRADE_PREFIX = ".hermes-grade-"  # the grading folder's name, with random hexadecimal after it
# Run with ``/bin/sh -c LAUNCHER sh NAME SIZE WORKDIR USER N AGENT_ENV(N)... [-v KEY=VALUE]...``, as the tests'
# identity, once every process of the session has ended; its standard input is SIZE bytes of the static helper
# followed by the tests' script.  It prints its pid (which the supervisor keeps: exec), makes NAME.in at / (else
# /run: never beneath a folder of the agent's) with the helper and the script in it, and runs the supervisor with
# GRADE = NAME beside it, the agent's user (USER, or its own), its writable folders (the working folder, HOME and
# the temporary folders, resolved, never / or GRADE's parent), its environment (the sandbox's, with AGENT_ENV
# exported as its commands had them) and the tests' PATH (the sandbox's without entries in those folders).  The
# reward folder gets GRADE_OWNER when the tests run as root with CAP_DAC_OVERRIDE (so they can still write it).
# Only builtins, /proc and cat, head, tail, env: busybox has them.
LAUNCHER = r'''echo "$$"
hb_name=$1 hb_size=$2 hb_workdir=$3 hb_user=$4 hb_n=$5
shift 5
while [ "$hb_n" -gt 0 ]; do export "$1"; shift; hb_n=$((hb_n - 1)); done
hb_fail() { echo "hermes-batch: the tests cannot start: $1"; exit 125; }
umask 077
hb_dir=
for hb_base in "" /run; do
    if mkdir "$hb_base/$hb_name.in" 2>/dev/null; then hb_dir=$hb_base/$hb_name.in; hb_grade=$hb_base/$hb_name; break; fi
done
[ -n "$hb_dir" ] || hb_fail "no folder can be made at / or /run for the grading folder"
cat > "$hb_dir/bundle" && head -c "$hb_size" "$hb_dir/bundle" > "$hb_dir/helper" &&
    tail -c +"$((hb_size + 1))" "$hb_dir/bundle" > "$hb_dir/tests.sh" && rm -f "$hb_dir/bundle" &&
    chmod 700 "$hb_dir/helper" || hb_fail "the helper and the tests' script cannot be written into $hb_dir"
hb_caps=0
while read -r hb_key hb_value hb_rest; do
    case $hb_key in Uid:) hb_uid=$hb_value;; Gid:) hb_gid=$hb_value;; CapEff:) hb_caps=$hb_value;; esac
done < /proc/self/status
[ -n "$hb_user" ] || hb_user=$hb_uid:$hb_gid
hb_folders=
for hb_w in "$hb_workdir" "$HOME" /tmp /var/tmp /dev/shm; do
    case $hb_w in /*) ;; *) continue;; esac
    hb_folders="$hb_folders$hb_w
"
    hb_real=$(cd -P -- "$hb_w" 2>/dev/null && pwd -P) || continue
    case $hb_real in /|/run|"${hb_grade%/*}") continue;; esac
    hb_folders="$hb_folders$hb_real
"
    set -- "$@" -w "$hb_real"
done
hb_ifs=$IFS
set -f
IFS=:
hb_path=
for hb_e in $PATH; do
    case $hb_e in /*) ;; *) continue;; esac
    case $hb_e/ in */./*|*/../*) continue;; esac
    IFS='
'
    for hb_a in $hb_folders; do
        case $hb_e/ in "${hb_a%/}"/*) IFS=:; continue 2;; esac
    done
    IFS=:
    case :$hb_path: in *:"$hb_e":*) continue;; esac
    hb_path=${hb_path:+$hb_path:}$hb_e
done
set -- "$@" -v "PATH=${hb_path:-@STANDARD_PATH@}"
IFS='
'
hb_seen=' ' hb_count=0
for hb_line in $(env); do
    [ "$hb_count" -lt 250 ] || break  # the supervisor takes 256 of each option
    hb_key=${hb_line%%=*}
    case $hb_key in ''|[0-9]*|*[!A-Za-z0-9_]*|PWD|OLDPWD|SHLVL|_) continue;; esac
    case $hb_seen in *" $hb_key "*) continue;; esac
    eval "[ -n \"\${$hb_key+x}\" ]" || continue
    eval "hb_value=\${$hb_key}"
    hb_seen="$hb_seen$hb_key " hb_count=$((hb_count + 1))
    set -- "$@" -x "$hb_key=$hb_value"
done
IFS=$hb_ifs
set +f
if [ "$hb_uid" = 0 ] && [ $((0x$hb_caps & 2)) != 0 ]; then set -- -o @GRADE_OWNER@ "$@"; fi
exec "$hb_dir/helper" -G "$hb_grade" -i "$hb_user" "$@" -- /bin/sh "$hb_dir/tests.sh"
'''.replace("@STANDARD_PATH@", STANDARD_PATH).replace("@GRADE_OWNER@", GRADE_OWNER)


def launcher(helper: bytes, command: str, files: Iterable, workdir: str, agent_env: Optional[Mapping] = None,
             user: str = "") -> tuple:
    """``(argv, stdin)`` of one command that runs a verifier's tests apart (see LAUNCHER) in a sandbox that has
    no copy of the static ``helper`` (its bytes): ``argv`` (``/bin/sh -c ...``) runs as the tests' identity, with
    ``stdin`` on its standard input; its first line of output is its pid, the rest the tests' output, and its
    standard error the supervisor's report (:func:`tests_run`).  ``agent_env``: variables the sandbox gives every
    command besides its own environment; ``user``: the agent's user (``UID:GID``) where it is not the tests'."""
    exports = [f"{k}={v}" for k, v in (agent_env or {}).items()]
    tests = [part for k, v in tests_environment(None).items() if k != "PATH" for part in ("-v", f"{k}={v}")]
    argv = ["/bin/sh", "-c", LAUNCHER, "sh", GRADE_PREFIX + secrets.token_hex(16), str(len(helper)), workdir, user,
            str(len(exports)), *exports, *tests]
    return argv, bytes(helper) + tests_script(command, files, workdir).encode("utf-8", "surrogatepass")


def tests_run(result: ExecResult, errors: str) -> TestsRun:
    """The tests' :class:`TestsRun` from their ``result`` and the supervisor's standard error (``errors``)."""
    found = report_in(errors)
    if found is None:
        return TestsRun(result, None, "the tests ended without a report")
    reward, problem = read_report(found)
    return TestsRun(result, reward, problem)


def landlock_abi() -> int:
    """The Landlock ABI this machine's kernel offers (0: none), which a container on it shares, seccomp allowing."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return max(0, int(libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))))  # landlock_create_ruleset
    except (OSError, AttributeError):
        return 0


# The first process of a container sandbox (PID 1, a shell that idles and reaps orphans): it starts no program once
# the session may have run.  stop_processes leaves it alone, and a `sleep` it started afresh would be whatever a
# root agent put on its PATH, running beside a verifier's tests, able to write their reward.  So it waits on a copy
# of itself (a fork, no exec) that reads a FIFO nobody writes, made before any command; only without mkfifo does it
# fall back to `sleep`.
IDLE_FIRST_PROCESS = (
    "trap 'exit 0' TERM INT; hb_fd=; "
    "for hb_d in /tmp /dev/shm /run; do hb_f=$hb_d/.hermes-batch-pid1-$$; "
    'mkfifo "$hb_f" 2>/dev/null && exec 3<>"$hb_f" && rm -f "$hb_f" && hb_fd=3 && break; done; '
    'if [ -n "$hb_fd" ]; then while :; do { read -r _ <&3; } & wait; done; fi; '
    "while :; do sleep 3600; done"
)

