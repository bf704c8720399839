"""Where a namespace's helper finds each command and sends its output: a private folder in memory.

Each command of a prompt's namespace is a script and an output FIFO in a
control folder (see ``launchers.HELPER``).  On a journaling disk file
system, making and removing them held the event loop about 2 ms a command with
256 prompts at once (the journal's locks, and the GIL other threads took
meanwhile); on a memory file system it takes microseconds.  So a backend keeps
its sandboxes' control folders in a private folder of its own under
``/dev/shm`` (``-S control_dir=``), ``hermes-batch-<uid>/<run key>-<random>``,
and beside the prompt folders only where that cannot be had, or for a command
longer than SPILL_BYTES, which memory should not hold.

A backend holds a lock on its folder while it lives.  The next backend to
start on the machine removes the folders in ``hermes-batch-<uid>`` whose lock is
free: their process was killed (a killed run's namespaces die with it, so
nothing uses them).  A backend still alive keeps its lock, so its folder is
never touched, and nothing outside that folder of the user's own ever is.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Optional

from ..sandbox_blocks.trees import remove_tree

log = logging.getLogger(__name__)

DEFAULT_BASE = "/dev/shm"
# A command longer than this goes to a script beside the prompt folder, not into memory.
SPILL_BYTES = 64 * 1024
_NEW = ".new-"  # a folder being made, not yet locked: swept only once this old (its maker was killed)
_NEW_GRACE_S = 600.0


def run_key(scratch_dir: Path) -> str:
    """A short name for the run folder whose sandboxes these are (its scratch folder's real path)."""
    return hashlib.sha256(os.fsencode(os.path.realpath(scratch_dir))).hexdigest()[:16]


def _user_folder(base: str) -> Optional[str]:
    """``base/hermes-batch-<uid>``, made if needed; None unless it is a real folder of ours, closed to others."""
    path = os.path.join(base, f"hermes-batch-{os.geteuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        # someone else's folder, or a link to one, in a folder all users share: not ours to write in
        return None if not_ours_alone(path, stat.S_ISDIR, 0o077) else path
    except OSError:
        return None


def not_ours_alone(path, is_kind, closed: int) -> Optional[str]:
    """Why ``path`` is not a file of the kind ``is_kind`` tests (``stat.S_ISDIR``...) that this user owns with
    the mode bits ``closed`` clear; None if it is.  Never follows a link; OSError when it cannot be read."""
    info = os.lstat(path)
    if not is_kind(info.st_mode):
        return "is not what it should be (a link, or another kind of file)"
    if info.st_uid != os.geteuid():
        return "belongs to another user"
    if info.st_mode & closed:
        return "may be written to by other users" if closed & 0o022 == closed else "is open to other users"
    return None


class ControlRoot:
    """A backend's private folder for the control folders of its sandboxes, locked while it lives."""

    def __init__(self, path: str, lock_fd: int):
        self.path = path
        self._lock_fd: Optional[int] = lock_fd

    @classmethod
    def make(cls, base: str, key: str) -> Optional["ControlRoot"]:
        """A new locked folder for run ``key`` under ``base``; None where ``base`` cannot hold one."""
        parent = _user_folder(base)
        if parent is None:
            return None
        sweep(parent)
        try:
            # made under a name the sweep ignores, locked, then renamed: a sweep never sees it unlocked
            new = tempfile.mkdtemp(prefix=_NEW, dir=parent)
            fd = os.open(new, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path = os.path.join(parent, key + "-" + os.path.basename(new)[len(_NEW):])
            os.rename(new, path)
        except OSError:
            os.close(fd)
            shutil.rmtree(new, ignore_errors=True)
            return None
        return cls(path, fd)

    def folder(self, name: str) -> str:
        return os.path.join(self.path, name)

    def remove(self) -> None:
        """Remove the folder and everything in it, then let go of the lock; safe to call more than once."""
        if self._lock_fd is None:
            return
        remove_tree(self.path)
        os.close(self._lock_fd)
        self._lock_fd = None


def sweep(parent: str) -> int:
    """Remove the folders in ``parent`` whose backend is gone (their lock is free); how many went."""
    removed = 0
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return 0
    now = time.time()
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        if entry.name.startswith(_NEW):
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime < _NEW_GRACE_S:
                    continue  # being made now, most likely
            except OSError:
                continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its backend is alive
        else:
            remove_tree(entry.path)
            removed += 1
        finally:
            os.close(fd)
    if removed:
        log.info("Removed %d control folder(s) that killed sessions left in %s.", removed, parent)
    return removed
