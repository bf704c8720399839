"""The run folder's lock: one run (or folder-changing command) at a time per folder.

An ``flock`` on ``<run folder>/.hermes-batch.lock``, held for the life of the
run.  The kernel drops it when the process dies however it dies, so a lock left
by a killed run is simply taken over; the file itself names the holder (pid,
host, start time) for the message the next run prints.  Where the file system
has no ``flock`` (some network file systems), the recorded pid decides: a live
process on this host keeps the folder, anything else is taken over.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from ..errors import RunFolderError
from .liveness import owner_alive
from .durable import write_error

log = logging.getLogger(__name__)

LOCK_NAME = ".hermes-batch.lock"
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


class RunFolderLock:
    """Held while a run writes to ``folder``; ``acquire`` refuses at once if another process holds it."""

    def __init__(self, folder: os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.created_folder = False  # the folder did not exist before: release removes it when left empty
        self._fd: Optional[int] = None

    def __repr__(self) -> str:
        return f"RunFolderLock({str(self.path)!r}, held={self.held})"

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunFolderLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self, command: str = "hermes-batch run") -> None:
        """Take the lock (creating the folder if needed); RunFolderError naming the holder if it is taken."""
        if self._fd is not None:
            return
        try:
            self.created_folder = not self.folder.exists()
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_error(self.folder, exc, started=False) from exc
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as exc:
                raise write_error(self.path, exc, started=False) from exc
            try:
                self._lock(fd)
                # the holder before us may have removed the file between our open and our lock
                if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                    raise FileNotFoundError
            except FileNotFoundError:
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            break
        self._fd = fd
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": datetime.now(timezone.utc).replace(tzinfo=None).isoformat(timespec="seconds"),
            "command": command,
        }
        data = (json.dumps(record) + "\n").encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except OSError as exc:  # the lock holds without its note; only the message would be less precise
            log.debug("could not write %s: %s", self.path, exc)

    def _lock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            raise self._busy(_read_holder(fd)) from None
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise write_error(self.path, exc, started=False) from exc
        holder = _read_holder(fd)
        if holder and holder.get("host") == socket.gethostname() and owner_alive(holder.get("pid")):
            raise self._busy(holder)
        if holder:
            log.warning("Taking over the lock of %s left by process %s, which is gone.", self.folder, holder.get("pid"))

    def _busy(self, holder: Optional[dict]) -> RunFolderError:
        holder = holder or {}
        pid, host = holder.get("pid", "?"), holder.get("host", "?")
        since = f", since {holder['started_at']} UTC" if holder.get("started_at") else ""
        return RunFolderError(
            f"The run folder {self.folder} is in use by another run (pid {pid} on host {host}{since}); "
            "wait for it to end or stop it, then run the command again."
        )

    def release(self) -> None:
        """Give the lock up and remove its file (and the folder, if this lock created it and it is empty)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.unlink(self.path)  # while still locked, so no other run holds a lock on the removed file
        except OSError:
            pass
        os.close(fd)
        if self.created_folder:
            try:
                self.folder.rmdir()
            except OSError:
                pass

    def __del__(self):
        if self._fd is not None:
            os.close(self._fd)


def _read_holder(fd: int) -> Optional[dict]:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None

