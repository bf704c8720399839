"""The run folder: its paths, durable line appends, atomic replacement and tolerant reading.

Every record is a whole line, written and fsynced before the prompt counts as
done (records that end at once share one write and one fsync); a torn last
line left by a crash is cut off before anything is appended, and readers skip
it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import json
import logging
import os
import re
import secrets
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, TypeVar, Union

from ..errors import RunFolderError, RunFolderWriteError, UsageError
from ..formats.serialization import describe_structure_error, from_json

log = logging.getLogger(__name__)

T = TypeVar("T")
PathLike = Union[str, os.PathLike]

MAX_RUN_NAME_LENGTH = 128
_RUN_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_BATCH_RE = re.compile(r"batch_(\d+)\.jsonl")
_TAIL_CHUNK = 64 * 1024
TEMP_MARK = ".hermes-batch-"
"""In the name of every temporary file of an atomic replace: ``.<name>.hermes-batch-<random>.tmp``."""
_TEMP_RE = re.compile(r"\..+" + re.escape(TEMP_MARK) + r"[0-9a-f]{16}\.tmp")
_IO_THREADS = 4

_io_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_io_pool_lock = threading.Lock()


def io_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that write the run folder, apart from the pool sandboxes and tools use.

    A tool blocked for ever (a FIFO, a hung mount) can take every thread of that
    pool; the records of the prompts that do finish must still be written.
    """
    global _io_pool
    with _io_pool_lock:
        if _io_pool is None:
            _io_pool = concurrent.futures.ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="hermes-batch-io")
        return _io_pool


class Stopped(Exception):
    """Work started by :func:`run_off_loop` was cancelled (Ctrl-C) and stopped, its files as they were."""


_off_loop = threading.local()


def check_stop() -> None:
    """Raise Stopped if the :func:`run_off_loop` call running in this thread was cancelled; cheap, call it often."""
    stop = getattr(_off_loop, "stop", None)
    if stop is not None and stop.is_set():
        raise Stopped()


async def run_off_loop(fn, *args):
    """``fn(*args)`` on the run folder's threads, where the event loop does not wait for it.

    Cancelling it (Ctrl-C) makes :func:`check_stop` raise Stopped in ``fn``'s thread
    (``read_records`` and the merge call it as they go) and still waits for ``fn``
    to end, so whatever it was replacing is left whole and its temporary file
    removed; the process could not exit before that thread ends anyway.  The
    cancellation is then raised.
    """
    stop = threading.Event()

    def call():
        _off_loop.stop = stop
        try:
            return fn(*args)
        finally:
            _off_loop.stop = None

    future = asyncio.get_running_loop().run_in_executor(io_executor(), call)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        stop.set()
        while not future.done():
            try:
                await asyncio.wait((future,))
            except asyncio.CancelledError:  # a second Ctrl-C: still wait, the files come first
                pass
        if not future.cancelled():
            future.exception()  # retrieved: Stopped is expected
        raise


def stoppable(items: Iterable[T], every: int = 1024) -> Iterator[T]:
    """``items``, calling :func:`check_stop` every ``every`` of them."""
    for count, item in enumerate(items):
        if count % every == 0:
            check_stop()
        yield item


def is_temp_file(name: str) -> bool:
    """True for a temporary file an atomic replace of ours left behind (interrupted, killed)."""
    return _TEMP_RE.fullmatch(name) is not None


_ADVICE = {
    errno.ENOSPC: "free some space on that disk",
    errno.EDQUOT: "free some space or raise your disk quota",
    errno.EFBIG: "the file reached the largest size the file system or 'ulimit -f' allows; raise that limit",
    errno.EIO: "check the disk and its kernel log",
    errno.EROFS: "the file system is read-only; remount it writable or choose another --output_dir",
    errno.EACCES: "check the run folder's permissions",
    errno.EPERM: "check the run folder's permissions",
}


def write_error(path: PathLike, exc: OSError, *, started: bool = True, doing: str = "Writing") -> RunFolderWriteError:
    """The one-sentence error for a failed change of ``path`` in the run folder (``started``: by a run under way)."""
    what = exc.strerror or str(exc)
    name = errno.errorcode.get(exc.errno, "")
    advice = _ADVICE.get(exc.errno, "fix the cause")
    if not started:
        return RunFolderWriteError(f"{doing} {path} failed: {what}{f' ({name})' if name else ''}; {advice}.")
    return RunFolderWriteError(
        f"{doing} {path} failed: {what}{f' ({name})' if name else ''}; finished prompts are saved, so {advice}, "
        "then run the same command with --resume to continue."
    )


RECORD_BYTES = 64 * 1024
"""What one prompt's record is taken to need on disk before a run has written any (they are 10 to 100 KB)."""


def free_bytes(path: PathLike) -> Optional[int]:
    """Bytes free for this user on the disk of ``path`` (or of its nearest existing parent); None if unknown."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_free_space(folder: "RunFolder", needed: int) -> None:
    """Raise RunFolderWriteError (exit 74) when the run folder's disk has less than ``needed`` bytes free.

    Called before any prompt is leased: a run that cannot write its records would pay for them and lose them.
    """
    free = free_bytes(folder.dir)
    if free is not None and free < needed:
        raise RunFolderWriteError(
            f"The disk of {folder.dir} has only {_size(free)} free, less than the {_size(needed)} the records of "
            "the prompts that run at once need; free some space on it or choose another --output_dir, then run the "
            "same command again."
        )


def _size(count: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


def validate_run_name(name: str) -> str:
    """Return ``name`` if it is a plain folder name, else raise UsageError."""
    if not isinstance(name, str) or not name:
        raise UsageError("The run name is empty; pass --run_name with letters, digits, '.', '_' or '-'.")
    if len(name) > MAX_RUN_NAME_LENGTH:
        raise UsageError(f"The run name is longer than {MAX_RUN_NAME_LENGTH} characters; choose a shorter --run_name.")
    if not _RUN_NAME_RE.fullmatch(name):
        raise UsageError(
            f"Invalid run name {name!r}: use only letters, digits, '.', '_' and '-', not starting with '.'."
        )
    return name


class RunFolder:
    """The paths of ``<output_dir>/<run_name>/`` and what is in it."""

    def __init__(self, output_dir: PathLike, run_name: str):
        self.run_name = validate_run_name(run_name)
        self.dir = Path(output_dir) / run_name

    def __repr__(self) -> str:
        return f"RunFolder({str(self.dir)!r})"

    def batch_path(self, batch_num: int) -> Path:
        """The file of batch ``batch_num``."""
        return self.dir / f"batch_{batch_num}.jsonl"

    @property
    def trajectories(self) -> Path:
        return self.dir / "trajectories.jsonl"

    @property
    def discarded(self) -> Path:
        return self.dir / "discarded.jsonl"

    @property
    def failed(self) -> Path:
        return self.dir / "failed.jsonl"

    @property
    def checkpoint(self) -> Path:
        return self.dir / "checkpoint.json"

    @property
    def statistics(self) -> Path:
        return self.dir / "statistics.json"

    @property
    def run_json(self) -> Path:
        return self.dir / "run.json"

    @property
    def scratch(self) -> Path:
        return self.dir / "scratch"

    def iter_batch_files(self) -> Iterator[tuple[int, Path]]:
        """``(batch_num, path)`` of every ``batch_N.jsonl``, in batch-number order."""
        if not self.dir.is_dir():
            return iter(())
        found = []
        for entry in os.scandir(self.dir):
            match = _BATCH_RE.fullmatch(entry.name)
            if match and entry.is_file():
                found.append((int(match.group(1)), Path(entry.path)))
        return iter(sorted(found))

    def has_outputs(self) -> bool:
        """True when the folder already holds any output file of a run."""
        fixed = (self.trajectories, self.discarded, self.failed, self.checkpoint, self.statistics, self.run_json)
        return any(p.exists() for p in fixed) or next(self.iter_batch_files(), None) is not None

    def create(self) -> None:
        """Create the folder (and its parents) if needed."""
        self.dir.mkdir(parents=True, exist_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (os.write may take only part of it)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def repair_torn_tail(path: PathLike) -> int:
    """Cut a file back to just after its last newline; return the number of bytes dropped.

    Raises RunFolderWriteError if the file cannot be opened for writing or cut (a read-only disk).
    """
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise write_error(path, exc) from exc
    try:
        return _cut_after_last_newline(fd)
    except OSError as exc:
        raise write_error(path, exc) from exc
    finally:
        os.close(fd)


def _cut_after_last_newline(fd: int) -> int:
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return 0
    end = size
    keep = 0
    while end > 0:
        start = max(0, end - _TAIL_CHUNK)
        pos = os.pread(fd, end - start, start).rfind(b"\n")
        if pos >= 0:
            keep = start + pos + 1
            break
        end = start
    os.ftruncate(fd, keep)
    os.fsync(fd)
    return size - keep


class AppendLog:
    """Durable whole-line appends to one JSONL file, opened lazily and repaired before the first append."""

    def __init__(self, path: PathLike, on_error: Optional[Callable[[RunFolderWriteError], None]] = None):
        self.path = Path(path)
        self.on_error = on_error  # told of a failed write at once, in the writing thread (the run stops calls)
        self.dropped_bytes = 0  # total cut off torn tails, for the runner to report
        self._fd: Optional[int] = None
        self._size = 0  # where the next record starts, to cut off a record a failed write left half written
        self._thread_lock = threading.Lock()
        self._waiting: list = []  # (line, future) of appends for the next write
        self._writing = False

    def __repr__(self) -> str:
        return f"AppendLog({str(self.path)!r})"

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def open(self) -> int:
        """Repair a torn tail, then open for appending; return the bytes dropped (0 if already open)."""
        with self._thread_lock:
            return self._open_locked()

    def _open_locked(self) -> int:
        if self._fd is not None:
            return 0
        existed = self.path.exists()
        dropped = repair_torn_tail(self.path)
        if dropped:
            log.warning("%s: dropped %d bytes of a torn last line left by an interrupted write.", self.path, dropped)
            self.dropped_bytes += dropped
        # 0o666: the user's umask decides, as for every file of the run folder
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        self._size = os.fstat(self._fd).st_size
        if not existed:
            _fsync_dir(self.path.parent)  # so the new file itself survives a crash
        return dropped

    def append_sync(self, line: str) -> None:
        """Write ``line`` (one record, with or without its newline) as one write, then fsync.

        Raises RunFolderWriteError when the disk is full (or any write fails), after
        cutting off what part of the record was written, so the file stays whole lines.
        """
        self.write_sync([self._encode(line)])

    def _encode(self, line: str) -> bytes:
        data = line.encode("utf-8") if line.endswith("\n") else (line + "\n").encode("utf-8")
        if data.count(b"\n") != 1:
            raise ValueError(f"{self.path}: a record must be a single line")
        return data

    def write_sync(self, records: list) -> None:
        """Append the encoded ``records`` (whole lines) in one write, then fsync; all or none of them stay."""
        data = b"".join(records)
        with self._thread_lock:
            try:
                self._open_locked()
                write_all(self._fd, data)
                os.fsync(self._fd)
            except OSError as exc:
                error = write_error(self.path, exc)
                if self.on_error is not None:
                    self.on_error(error)
                self._cut_back()
                raise error from exc
            self._size += len(data)

    def _cut_back(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, self._size)  # shrinking needs no space
        except OSError:
            log.warning("%s: could not cut off a half-written record; the next start repairs it.", self.path)
            fd, self._fd = self._fd, None  # reopened (and repaired) by the next append
            os.close(fd)

    async def append(self, line: str) -> None:
        """Like :meth:`append_sync`, on the run folder's own threads.

        Appends made while a write of this file is under way wait for it, then go
        together in the next write and fsync: hundreds of prompts ending at once cost
        a few fsyncs, not one each, and a thread hop per write, not per record.  A
        cancelled append is still written.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.append((self._encode(line), future))
        if not self._writing:
            self._write_waiting(loop)
        await future

    def _write_waiting(self, loop: asyncio.AbstractEventLoop) -> None:
        # Driven by the write's own callback, not a task: nothing can cancel a write half way through its group.
        group, self._waiting = self._waiting, []
        self._writing = True
        written = loop.run_in_executor(io_executor(), self.write_sync, [data for data, _ in group])
        written.add_done_callback(lambda done: self._written(loop, group, done))

    def _written(self, loop: asyncio.AbstractEventLoop, group: list, done: asyncio.Future) -> None:
        error = RunFolderWriteError(f"Writing {self.path} was cut short.") if done.cancelled() else done.exception()
        for _, future in group:
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
        self._writing = False
        if self._waiting:
            self._write_waiting(loop)

    def close(self) -> None:
        """Close the file; a later append opens it again. Safe to call more than once."""
        with self._thread_lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                os.close(fd)


def _create_temp(path: Path) -> tuple[int, Path]:
    # Not mkstemp: its files are 0600, and these replace files that must get the user's umask like the others.
    while True:
        tmp = path.parent / f".{path.name}{TEMP_MARK}{secrets.token_hex(8)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


def atomic_write_lines(path: PathLike, lines: Iterable[str]) -> int:
    """Replace ``path`` with ``lines`` (each with its newline) so readers see the old or the new file, never part.

    A failed write (disk full) raises RunFolderWriteError and leaves the old file and no temporary file.
    """
    path = Path(path)
    tmp = None
    count = 0
    try:
        fd, tmp = _create_temp(path)
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            for line in lines:
                fh.write(line)
                count += 1
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if isinstance(exc, OSError):
            raise write_error(path, exc) from exc
        raise
    return count


def atomic_write_text(path: PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (temp file, fsync, rename, fsync the folder)."""
    atomic_write_lines(path, (text,))


def read_records(path: PathLike, cls: type[T], start: int = 0, stop: Optional[int] = None) -> Iterator[tuple[int, T]]:
    """Yield ``(line_no, record)`` for each good line of a JSONL file; bad and torn lines are logged and skipped.

    With ``start`` and ``stop``, only the lines that begin between those byte offsets (``start`` must begin a
    line; line numbers then count from it).
    """
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise RunFolderError(
            f"{path} cannot be read ({exc.strerror or exc}); it must be a file a run wrote, so move it away."
        ) from None
    with fh:
        fh.seek(start)
        offset = start
        for line_no, raw in enumerate(fh, start=1):
            if not line_no & 0xFF:
                check_stop()
            if stop is not None and offset >= stop:
                return
            offset += len(raw)
            if not raw.endswith(b"\n"):
                # an unterminated last line is a torn write: AppendLog.open cuts it, so never count it
                log.warning("%s:%d: ignored an incomplete last line (interrupted write).", path, line_no)
                return
            if not raw.strip():
                continue
            try:
                data = json.loads(raw)
            except ValueError as exc:
                log.warning("%s:%d: skipped a line that is not valid JSON (%s).", path, line_no, exc)
                continue
            try:
                record = from_json(data, cls)
            except Exception as exc:  # cattrs raises several exception types
                log.warning("%s:%d: skipped a line that is not a %s: %s", path, line_no, cls.__name__,
                            describe_structure_error(exc))
                continue
            yield line_no, record
