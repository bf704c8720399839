"""Reading Harbor task folders (task.toml, instruction.md, environment/, tests/, solution/) as untrusted input.

A task folder comes from whoever wrote the suite: every file is opened without following links and must be a
regular file of bounded size, task.toml's values are type-checked, and what hermes-batch cannot honour
(docker-compose services, GPUs) is refused by name, all before any model call.  The environment's build
context is hashed by content (names, modes, bytes) so that each distinct environment is one image, named
by :func:`image_reference`, which a sandbox backend builds once (``SandboxBackend.build_image``).
"""

from __future__ import annotations

import hashlib
import math
import os
import posixpath
import re
import shlex
import stat
import tomllib
from datetime import date, datetime, time
from typing import Iterator, Optional

import attrs

from ..errors import DatasetError

MAX_TOML_BYTES = 1 << 20
MAX_INSTRUCTION_BYTES = 1 << 20
MAX_SCRIPT_BYTES = 1 << 20
MAX_TESTS_FILES = 1000
MAX_TESTS_BYTES = 16 << 20
MAX_CONTEXT_FILES = 50_000
MAX_CONTEXT_BYTES = 2 << 30
MAX_DEPTH = 32
MAX_TASKS = 100_000
IMAGE_REPOSITORY = "hermes-batch-task"
# Where Harbor's tests expect to be and to write: replaced with fresh folders just before the tests run.
TESTS_PATH = "/tests"
LOGS_PATH = "/logs"
_COMPOSE_NAMES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_SIZE_MB = {"": 1 / (1 << 20), "k": 1 / 1024, "m": 1, "g": 1024, "t": 1 << 20}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class TaskError(DatasetError):
    """A task folder that cannot be read or honoured (one sentence naming the file and the fix)."""


@attrs.frozen
class TaskFolder:
    """One Harbor task, read and checked: what a run needs of it, nothing read later from the folder but the
    environment's build context (whose content key is ``context_digest``)."""

    name: str
    path: str  # absolute
    instruction: str
    agent_timeout: Optional[float] = None
    verifier_timeout: Optional[float] = None
    build_timeout: Optional[float] = None
    cpus: Optional[float] = None
    memory_mb: Optional[int] = None
    storage_mb: Optional[int] = None
    allow_internet: Optional[bool] = None
    docker_image: Optional[str] = None  # a prebuilt image named by task.toml, used instead of a Dockerfile
    verifier_env: tuple = ()  # ((name, value), ...) from [verifier].env
    metadata: dict = attrs.field(factory=dict)  # [metadata], JSON-able
    tests: tuple = ()  # ((relative path, text), ...) of tests/
    solution: tuple = ()  # ((relative path, text), ...) of solution/
    environment: Optional[str] = None  # the absolute path of environment/, when it holds a Dockerfile
    context_digest: Optional[str] = None  # sha256 of the build context's names, modes and bytes

    @property
    def image(self) -> Optional[str]:
        """The image the task's prompts run in: the content-keyed build of its environment, else task.toml's."""
        if self.context_digest is not None:
            return image_reference(self.context_digest)
        return self.docker_image


@attrs.frozen
class TaskOptions:
    """What a task's prompts need besides their row: its image's build context, its limits and sandbox options."""

    image: Optional[str] = None  # the content-keyed reference built from ``context``, or task.toml's docker_image
    context: Optional[str] = None  # the absolute path of environment/ (the build context), when it has a Dockerfile
    digest: Optional[str] = None  # the content key of ``context``
    build_timeout: Optional[float] = None
    agent_timeout: Optional[float] = None
    cpus: Optional[float] = None
    memory_mb: Optional[int] = None
    storage_mb: Optional[int] = None
    allow_internet: Optional[bool] = None


    @property
    def limits_sandbox(self) -> bool:
        """True when the task sets its sandbox's CPUs, memory or network, which a container started ahead (for
        any prompt of the image) would not have."""
        return bool(self.cpus or self.memory_mb or self.allow_internet is False)


def options_of(task: TaskFolder) -> TaskOptions:
    """The TaskOptions of a task read with its digest."""
    return TaskOptions(task.image, task.environment, task.context_digest, task.build_timeout, task.agent_timeout,
                       task.cpus, task.memory_mb, task.storage_mb, task.allow_internet)


def image_reference(digest: str) -> str:
    """The image name a build context of this content digest gets: equal contexts, one image."""
    return f"{IMAGE_REPOSITORY}:{digest[:32]}"


# --- safe reading ---------------------------------------------------------------------------------


def _open_regular(path: str, what: str) -> int:
    """A descriptor of ``path``, a regular file reached without following a link at its last step."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise TaskError(f"{what} {path} is missing; every task folder needs it.") from None
    except OSError as exc:
        # O_NOFOLLOW on a link: ELOOP
        raise TaskError(f"{what} {path} cannot be opened ({exc.strerror or exc}); it must be a regular file, "
                        "not a link.") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise TaskError(f"{what} {path} is not a regular file (a folder, FIFO, socket or device); replace it.")
    return fd


def read_bounded(path: str, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path``; TaskError for a link, a special file or more than ``limit`` bytes."""
    fd = _open_regular(path, what)
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise TaskError(f"{what} {path} is larger than {_size_text(limit)}, the limit; make it smaller.")
    return data


def _text(path: str, limit: int, what: str) -> str:
    data = read_bounded(path, limit, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TaskError(f"{what} {path} is not UTF-8 text; save it as UTF-8.") from None
    if "\0" in text:
        raise TaskError(f"{what} {path} holds a NUL character; it must be text.")
    return text


def _size_text(limit: int) -> str:
    return f"{limit >> 30} GiB" if limit >= 1 << 30 else f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"


def _lstat(path: str):
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def walk_files(root: str, what: str, *, max_files: int, max_bytes: int) -> Iterator[tuple[str, str, os.stat_result]]:
    """(relative path, absolute path, lstat) of every regular file under the folder ``root``, sorted by path;
    TaskError for a link, a FIFO, socket or device, too many files or bytes, or folders nested too deep."""
    count = total = 0

    def visit(folder: str, relative: str, depth: int):
        nonlocal count, total
        if depth > MAX_DEPTH:
            raise TaskError(f"{what} {root} nests folders more than {MAX_DEPTH} deep; flatten it.")
        try:
            entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
        except OSError as exc:
            raise TaskError(f"{what} {folder} cannot be listed ({exc.strerror or exc}).") from None
        for entry in entries:
            rel = posixpath.join(relative, entry.name) if relative else entry.name
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                yield from visit(entry.path, rel, depth + 1)
            elif stat.S_ISREG(info.st_mode):
                count += 1
                total += info.st_size
                if count > max_files:
                    raise TaskError(f"{what} {root} holds more than {max_files} files, the limit.")
                if total > max_bytes:
                    raise TaskError(f"{what} {root} holds more than {_size_text(max_bytes)}, the limit.")
                yield rel, entry.path, info
            else:
                kind = "a link" if stat.S_ISLNK(info.st_mode) else "a FIFO, socket or device"
                raise TaskError(f"{what} {root} holds {rel}, {kind}; task folders may hold only regular files "
                                "and folders.")

    info = _lstat(root)
    if info is None or not stat.S_ISDIR(info.st_mode):
        raise TaskError(f"{what} {root} is not a folder (or is a link to one); make it a plain folder.")
    yield from visit(root, "", 0)


def _text_files(root: str, what: str) -> tuple:
    if _lstat(root) is None:
        return ()
    out = []
    for rel, path, _info in walk_files(root, what, max_files=MAX_TESTS_FILES, max_bytes=MAX_TESTS_BYTES):
        out.append((rel, _text(path, MAX_TESTS_BYTES, what[:1].upper() + what[1:] + " file")))
    return tuple(out)


_DIGESTS: dict = {}  # (root, every file's name, mode, size, mtime, inode) -> digest: a suite's rows share contexts
_MAX_REMEMBERED = 4096


def context_digest(root: str) -> str:
    """The content key of a build context: sha256 over each regular file's path, executable bit and bytes.

    Remembered for an unchanged listing (names, sizes, modification times, inodes), as every row of a suite
    that shares an environment would otherwise read it again."""
    files = list(walk_files(root, "The build context", max_files=MAX_CONTEXT_FILES, max_bytes=MAX_CONTEXT_BYTES))
    signature = (root, tuple((rel, i.st_mode, i.st_size, i.st_mtime_ns, i.st_ino) for rel, _p, i in files))
    known = _DIGESTS.get(signature)
    if known is not None:
        return known
    digest = hashlib.sha256(b"hermes-batch build context 1\0")
    for rel, path, info in files:
        fd = _open_regular(path, "The build context's file")
        mode = "x" if info.st_mode & 0o111 else "-"
        digest.update(f"{rel}\0{mode}\0{info.st_size}\0".encode("utf-8", "surrogateescape"))
        with os.fdopen(fd, "rb") as handle:
            seen = 0
            while chunk := handle.read(1 << 20):
                seen += len(chunk)
                digest.update(chunk)
        if seen != info.st_size:
            raise TaskError(f"The build context's file {path} changed while it was read; try again.")
    if len(_DIGESTS) >= _MAX_REMEMBERED:
        _DIGESTS.clear()
    _DIGESTS[signature] = digest.hexdigest()
    return _DIGESTS[signature]


def write_context_archive(root: str, handle) -> str:
    """Write the build context ``root`` as a tar to ``handle`` (regular files only, modes 0644/0755, owner 0,
    time 0, so that equal content gives equal archives) and return its content key, computed as
    :func:`context_digest` does from the very bytes archived: a context changed since it was hashed is seen."""
    import tarfile

    digest = hashlib.sha256(b"hermes-batch build context 1\0")
    with tarfile.open(fileobj=handle, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for rel, path, info in walk_files(root, "The build context", max_files=MAX_CONTEXT_FILES,
                                          max_bytes=MAX_CONTEXT_BYTES):
            fd = _open_regular(path, "The build context's file")
            executable = bool(info.st_mode & 0o111)
            digest.update(f"{rel}\0{'x' if executable else '-'}\0{info.st_size}\0".encode("utf-8", "surrogateescape"))
            member = tarfile.TarInfo(rel)
            member.size, member.mode, member.mtime = info.st_size, 0o755 if executable else 0o644, 0
            with os.fdopen(fd, "rb") as source:
                reader = _Hashing(source, digest, info.st_size)
                try:
                    archive.addfile(member, reader)
                except OSError:  # tarfile's "unexpected end of data"
                    pass
                if reader.seen != info.st_size:
                    raise TaskError(f"The build context's file {path} changed while it was read; try again.")
    return digest.hexdigest()


class _Hashing:
    """A file's reader for tarfile that hashes what it hands over, and no more than the size it was given."""

    def __init__(self, source, digest, size: int):
        self.source, self.digest, self.left, self.seen = source, digest, size, 0

    def read(self, size: int = -1) -> bytes:
        size = self.left if size is None or size < 0 else min(size, self.left)
        data = self.source.read(size)
        self.left -= len(data)
        self.seen += len(data)
        self.digest.update(data)
        if len(data) < size:  # shrunk since listed: tarfile raises, naming no file; say which below
            self.left = 0
        return data


# --- task.toml ------------------------------------------------------------------------------------


def _number(table: dict, key: str, where: str, path: str) -> Optional[float]:
    value = table.get(key)
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise TaskError(f"{path}: [{where}].{key} must be a number above 0, got {value!r}.")
    return float(value)


def _megabytes(table: dict, key: str, path: str) -> Optional[int]:
    """``memory``/``storage`` ("2G", "512M") or ``memory_mb``/``storage_mb`` (an integer) in MiB."""
    mb = table.get(f"{key}_mb")
    text = table.get(key)
    if mb is not None:
        if type(mb) is not int or mb <= 0:
            raise TaskError(f"{path}: [environment].{key}_mb must be an integer above 0, got {mb!r}.")
        return mb
    if text is None:
        return None
    match = _SIZE.match(text) if isinstance(text, str) else None
    if match is None:
        raise TaskError(f"{path}: [environment].{key} must be a size such as \"2G\" or \"512M\", got {text!r}.")
    value = math.ceil(float(match.group(1)) * _SIZE_MB[match.group(2).lower()])
    if value <= 0:
        raise TaskError(f"{path}: [environment].{key} must be above 0, got {text!r}.")
    return value


def _json_able(value, path: str, where: str):
    """TOML values as JSON: dates and times become ISO text."""
    if isinstance(value, dict):
        return {str(k): _json_able(v, path, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_able(v, path, where) for v in value]
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        raise TaskError(f"{path}: [{where}] holds {value!r}, which JSON cannot hold; quote it.")
    return value


def _table(data: dict, name: str, path: str) -> dict:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise TaskError(f"{path}: [{name}] must be a table, got {type(value).__name__}.")
    return value


def _parse_toml(path: str) -> dict:
    text = _text(path, MAX_TOML_BYTES, "The task's task.toml")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TaskError(f"{path} is not valid TOML ({exc}); fix it.") from None
    except RecursionError:
        raise TaskError(f"{path} nests tables too deep; flatten it.") from None


# --- a task folder --------------------------------------------------------------------------------


def is_task_folder(path: str) -> bool:
    """True when ``path`` is a folder holding a task.toml (not through a link)."""
    info = _lstat(os.path.join(path, "task.toml"))
    return info is not None and stat.S_ISREG(info.st_mode)


def read_task(path: str, *, with_digest: bool = True) -> TaskFolder:
    """The task of the folder ``path``, checked; TaskError naming the file and the fix for anything wrong.

    ``with_digest`` hashes the environment's build context (every byte of it is read).
    """
    root = os.path.abspath(path)
    info = _lstat(root)
    if info is None or not stat.S_ISDIR(info.st_mode):
        raise TaskError(f"The task {path} is not a folder (or is a link to one); pass a task folder.")
    toml_path = os.path.join(root, "task.toml")
    data = _parse_toml(toml_path)
    metadata = _json_able(_table(data, "metadata", toml_path), toml_path, "metadata")
    agent = _table(data, "agent", toml_path)
    verifier = _table(data, "verifier", toml_path)
    environment = _table(data, "environment", toml_path)
    _refuse(environment, toml_path)
    env_values = verifier.get("env", {})
    if not isinstance(env_values, dict) or not all(
            isinstance(k, str) and _ENV_NAME.match(k) and isinstance(v, str) and "\0" not in v
            for k, v in env_values.items()):
        raise TaskError(f"{toml_path}: [verifier].env must be a table of NAME = \"text\" entries.")
    internet = environment.get("allow_internet")
    if internet is not None and type(internet) is not bool:
        raise TaskError(f"{toml_path}: [environment].allow_internet must be true or false, got {internet!r}.")
    docker_image = environment.get("docker_image")
    if docker_image is not None and (not isinstance(docker_image, str) or not docker_image.strip()
                                     or any(c.isspace() or c == "\0" for c in docker_image)):
        raise TaskError(f"{toml_path}: [environment].docker_image must be an image name, got {docker_image!r}.")
    instruction = _text(os.path.join(root, "instruction.md"), MAX_INSTRUCTION_BYTES, "The task's instruction")
    if not instruction.strip():
        raise TaskError(f"{os.path.join(root, 'instruction.md')} is empty; write the task's instruction in it.")
    tests = _text_files(os.path.join(root, "tests"), "the task's tests")
    if not any(rel == "test.sh" for rel, _ in tests):
        raise TaskError(f"The task {root} has no tests/test.sh; Harbor tasks are graded by it.")
    env_dir = os.path.join(root, "environment")
    dockerfile = _lstat(os.path.join(env_dir, "Dockerfile"))
    context, digest = None, None
    if dockerfile is not None:
        if not stat.S_ISREG(dockerfile.st_mode):
            raise TaskError(f"{os.path.join(env_dir, 'Dockerfile')} is not a regular file; replace it.")
        context = env_dir
        digest = context_digest(env_dir) if with_digest else None
    elif docker_image is None:
        raise TaskError(f"The task {root} has neither environment/Dockerfile nor [environment].docker_image; "
                        "give it one.")
    return TaskFolder(
        name=_task_name(metadata, root), path=root, instruction=instruction,
        agent_timeout=_number(agent, "timeout_sec", "agent", toml_path),
        verifier_timeout=_number(verifier, "timeout_sec", "verifier", toml_path),
        build_timeout=_number(environment, "build_timeout_sec", "environment", toml_path),
        cpus=_number(environment, "cpus", "environment", toml_path),
        memory_mb=_megabytes(environment, "memory", toml_path),
        storage_mb=_megabytes(environment, "storage", toml_path),
        allow_internet=internet, docker_image=docker_image,
        verifier_env=tuple(sorted(env_values.items())), metadata=metadata, tests=tests,
        solution=_text_files(os.path.join(root, "solution"), "the task's solution"),
        environment=context, context_digest=digest,
    )


def _task_name(metadata: dict, root: str) -> str:
    return os.path.basename(root.rstrip("/")) or root


def _refuse(environment: dict, toml_path: str) -> None:
    """What hermes-batch cannot honour, refused by name before any model call."""
    gpus = environment.get("gpus")
    if gpus not in (None, 0):
        raise TaskError(f"{toml_path}: [environment].gpus = {gpus!r} asks for GPUs, which hermes-batch's sandboxes "
                        "do not give; drop the task or the field.")
    if environment.get("gpu_types"):
        raise TaskError(f"{toml_path}: [environment].gpu_types asks for GPUs, which hermes-batch's sandboxes do "
                        "not give; drop the task or the field.")
    env_dir = os.path.join(os.path.dirname(toml_path), "environment")
    for name in _COMPOSE_NAMES:
        if _lstat(os.path.join(env_dir, name)) is not None:
            raise TaskError(f"The task {os.path.dirname(toml_path)} has environment/{name}: docker-compose "
                            "services are not supported (one container per prompt); drop the task.")


def find_tasks(path: str) -> tuple[str, ...]:
    """The task folders ``path`` names: itself when it is one, else its sub-folders that are, sorted by name."""
    root = os.path.abspath(path)
    info = _lstat(root)
    if info is None or not stat.S_ISDIR(info.st_mode):
        raise TaskError(f"{path} is not a folder (or is a link to one); pass a folder of Harbor task folders.")
    if is_task_folder(root):
        return (root,)
    found = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False) and is_task_folder(entry.path):
            found.append(entry.path)
            if len(found) > MAX_TASKS:
                raise TaskError(f"{path} holds more than {MAX_TASKS} tasks; split the suite.")
    if not found:
        raise TaskError(f"{path} holds no task folder (a folder with a task.toml); check the path.")
    return tuple(found)


# --- a task as a dataset row ----------------------------------------------------------------------


def tests_command(task: TaskFolder) -> str:
    """The command verifier's command for a Harbor task: fresh /tests and /logs/verifier (whatever the agent left
    there is removed first), tests/test.sh run, then Harbor's reward.txt or reward.json handed to the verifier's
    own reward file, which the agent never had."""
    env = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in task.verifier_env)
    return (
        # /logs itself stays (an image may keep files there) unless it is a link or no folder
        f"if [ -L {LOGS_PATH} ] || [ ! -d {LOGS_PATH} ]; then rm -rf -- {LOGS_PATH} || exit 125; fi\n"
        f"rm -rf -- {TESTS_PATH} {LOGS_PATH}/verifier || exit 125\n"
        f"mkdir -p -- {LOGS_PATH}/verifier {LOGS_PATH}/agent && cp -R -- \"$HERMES_TESTS_DIR\" {TESTS_PATH} "
        "|| exit 125\n"
        f"{env}"
        f"if command -v bash >/dev/null 2>&1; then bash {TESTS_PATH}/test.sh; else sh {TESTS_PATH}/test.sh; fi\n"
        "status=$?\n"
        "[ $status -eq 0 ] || exit $status\n"
        f"for f in {LOGS_PATH}/verifier/reward.txt {LOGS_PATH}/verifier/reward.json; do\n"
        "  if [ -f \"$f\" ] && [ ! -L \"$f\" ]; then head -c 257 \"$f\" > \"$HERMES_REWARD_FILE\"; exit 0; fi\n"
        "done\n"
        "echo 'hermes-batch: tests/test.sh wrote neither /logs/verifier/reward.txt nor reward.json' >&2\n"
        "exit 3\n"
    )


def task_row(task: TaskFolder) -> dict:
    """The dataset row a task stands for (the fields a JSONL row would have), with the task's name and metadata."""
    row = {
        "prompt": task.instruction,
        "tests": tests_command(task),
        "test_files": dict(task.tests),
        "task": task.name,
        "task_metadata": task.metadata,
    }
    if task.image is not None:
        row["image"] = task.image
    if task.verifier_timeout is not None:
        row["tests_timeout"] = task.verifier_timeout
    return row
