"""Durable writes to the run folder: fsynced line appends, atomic replacement, and a full disk said clearly.

Every record is a whole line, written and fsynced before the prompt counts as
done (records that end at once share one write and one fsync); a torn last
line left by a crash is cut off before anything is appended.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import secrets
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Union

from ..errors import RunFolderWriteError
from .offloop import io_executor
from .readback import open_file

if TYPE_CHECKING:
    from .runfolder import RunFolder

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]


_TAIL_CHUNK = 64 * 1024
TEMP_MARK = ".hermes-batch-"
"""In the name of every temporary file of an atomic replace: ``.<name>.hermes-batch-<random>.tmp``."""
_TEMP_RE = re.compile(r"\..+" + re.escape(TEMP_MARK) + r"[0-9a-f]{16}\.tmp")


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

    Raises RunFolderWriteError if the file cannot be opened for writing or cut (a read-only disk), and
    RunFolderError if it is no plain file (a symbolic link, a FIFO, a device: readback.open_file).
    """
    try:
        fd = open_file(path, os.O_RDWR)
    except OSError as exc:
        raise write_error(path, exc) from exc
    if fd is None:
        return 0
    try:
        return cut_torn_tail(fd)
    except OSError as exc:
        raise write_error(path, exc) from exc
    finally:
        os.close(fd)


def cut_torn_tail(fd: int) -> int:
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
        # 0o666: the user's umask decides, as for every file of the run folder; never through a link
        self._fd = open_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
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
