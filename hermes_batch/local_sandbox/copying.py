"""A prompt folder copied into a fresh one, for ``--verifier command:clean=true`` and ``--branch_at`` (each
branch a copy of its row's prefix): a file is cloned (FICLONE, copy-on-write) where the filesystem can
(Btrfs, XFS, bcachefs), read and written otherwise.

Only once every process of the prompt has ended (nothing changes the tree
meanwhile), without recursion (however deep the tree), without following a
link and without opening anything but regular files (a FIFO never blocks).
"""

from __future__ import annotations

import fcntl
import os
import stat
from typing import Optional

CHUNK = 1 << 20
FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)


def empty_folder(path: str) -> None:
    """Remove what ``path`` holds (the folder stays), whatever the modes the prompt left on it."""
    stack, folders = [path], []
    while stack:
        folder = stack.pop()
        folders.append(folder)
        os.chmod(folder, stat.S_IRWXU)
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    os.unlink(entry.path)
    for folder in reversed(folders[1:]):
        os.rmdir(folder)


def copy_folder(source: str, target: str, owner: Optional[tuple] = None) -> None:
    """Make the empty folder ``target`` hold what ``source`` holds: folders, regular files and links as they are, with
    their modes (and ``owner``'s uid and gid where given); FIFOs, sockets and devices are left out."""
    modes = []
    stack = [(source, target)]
    while stack:
        here, there = stack.pop()
        os.chmod(here, stat.S_IMODE(os.lstat(here).st_mode) | stat.S_IRWXU)  # a folder the prompt made unreadable
        with os.scandir(here) as entries:
            for entry in entries:
                seen = entry.stat(follow_symlinks=False)
                made = os.path.join(there, entry.name)
                if stat.S_ISDIR(seen.st_mode):
                    os.mkdir(made, 0o700)
                    modes.append((made, stat.S_IMODE(seen.st_mode)))
                    stack.append((entry.path, made))
                elif stat.S_ISREG(seen.st_mode):
                    _copy_file(entry.path, made, stat.S_IMODE(seen.st_mode))
                elif stat.S_ISLNK(seen.st_mode):
                    os.symlink(os.readlink(entry.path), made)
                else:
                    continue
                if owner is not None:
                    os.lchown(made, owner[0], owner[1])
    for folder, mode in reversed(modes):  # last: a folder the prompt made read-only still took its files
        os.chmod(folder, mode)


def _copy_file(source: str, target: str, mode: int) -> None:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        reading = os.open(source, flags)
    except PermissionError:  # a file the prompt made unreadable: its owner may read it again
        os.chmod(source, mode | stat.S_IRUSR, follow_symlinks=False)
        reading = os.open(source, flags)
    try:
        if not stat.S_ISREG(os.fstat(reading).st_mode):
            return
        writing = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if not _clone(reading, writing):
                while chunk := os.read(reading, CHUNK):
                    os.write(writing, chunk)
            os.fchmod(writing, mode)
        finally:
            os.close(writing)
    finally:
        os.close(reading)


def _clone(reading: int, writing: int) -> bool:
    """Make ``writing`` share ``reading``'s blocks (copy-on-write); False where the filesystem cannot."""
    try:
        fcntl.ioctl(writing, FICLONE, reading)
    except OSError:  # EOPNOTSUPP, EXDEV, EINVAL: ext4, tmpfs, two filesystems
        return False
    return True
