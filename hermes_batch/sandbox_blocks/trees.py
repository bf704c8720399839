"""Removing a folder a sandbox's commands made, however deep, wide or unwritable, without recursion.

``shutil.rmtree`` (before Python 3.13) and ``os.walk`` recurse once per level:
a command that makes a tree 2,500 folders deep made them raise ``RecursionError``,
and a path that deep is also past ``PATH_MAX``.  :func:`remove_tree` holds one
folder open at a time and works relative to it, goes down into each folder
and back up through its ``..``, checked against the folder it came from (so a
folder moved away meanwhile never leads it outside the tree), and makes each
folder its owner's to write and enter before it empties it (a command may have
taken those rights away: ``chmod 000``).  Memory follows the number of folders
still to visit, not the depth.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path) -> bool:
    """Remove ``path`` (a file, a link or a folder with all it holds); True once nothing is left there.

    Never raises for what it finds: what cannot be removed is logged and left.
    """
    path = Path(path)
    try:
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError as exc:
        log.warning("Could not remove %s: %s.", path, exc.strerror or exc)
        return False
    try:
        _remove_in(parent, path.name)
        return True
    except FileNotFoundError:
        return True
    except OSError as exc:
        log.warning("Could not remove every file of %s: %s.", path, exc.strerror or exc)
        return False
    finally:
        os.close(parent)


def _remove_in(parent: int, name: str) -> None:
    """Remove ``name`` in the folder open as ``parent``."""
    try:
        os.unlink(name, dir_fd=parent)
        return
    except IsADirectoryError:
        pass
    current = _enter(parent, name)
    # One frame per folder on the way down: its name in its parent, its identity, the subfolders still to visit.
    # The top frame is ``name``, whose parent stays open (the caller's).
    frames = [[name, os.fstat(current), None]]
    try:
        while frames:
            frame = frames[-1]
            if frame[2] is None:
                frame[2] = _empty_but_folders(current)
            if frame[2]:
                child = frame[2].pop()
                try:
                    below = _enter(current, child)
                except FileNotFoundError:
                    continue
                os.close(current)
                current = below
                frames.append([child, os.fstat(current), None])
                continue
            frames.pop()
            if not frames:
                break
            above = os.open("..", _OPEN, dir_fd=current)
            seen, expected = os.fstat(above), frames[-1][1]
            os.close(current)
            current = above
            if (seen.st_dev, seen.st_ino) != (expected.st_dev, expected.st_ino):
                raise OSError(f"a folder in it was moved while it was removed ({frame[0]})")
            os.rmdir(frame[0], dir_fd=current)
    finally:
        os.close(current)
    os.rmdir(name, dir_fd=parent)


def _enter(parent: int, name: str) -> int:
    """The folder ``name`` in ``parent`` opened, never through a link, made its owner's to enter and write first."""
    handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        mode = os.fstat(handle).st_mode
        if mode & stat.S_IRWXU != stat.S_IRWXU:
            os.chmod(f"/proc/self/fd/{handle}", stat.S_IMODE(mode) | stat.S_IRWXU)  # the folder held, not a path
        return os.open(".", _OPEN, dir_fd=handle)
    finally:
        os.close(handle)


def _empty_but_folders(folder: int) -> list:
    """Remove everything in ``folder`` but its subfolders, whose names it returns."""
    folders = []
    with os.scandir(folder) as entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(entry.name)
                else:
                    os.unlink(entry.name, dir_fd=folder)
            except FileNotFoundError:
                continue
    return folders


def walk(path):
    """Every entry under the folder ``path``, depth first, as (the open folder it is in, its ``os.DirEntry``), with
    one folder open at a time and no recursion, however deep; links are not followed.  Nothing is changed.

    Raises OSError for a folder that cannot be read, or that was moved while it was walked (a command may be
    rearranging the tree meanwhile): what it held could not be told.
    """
    current = os.open(path, _OPEN)
    frames = [[None, os.fstat(current), None]]  # (name in its parent, identity, subfolders still to visit)
    try:
        while frames:
            frame = frames[-1]
            if frame[2] is None:
                frame[2] = []
                with os.scandir(current) as entries:
                    for entry in entries:
                        yield current, entry
                        try:
                            if entry.is_dir(follow_symlinks=False):
                                frame[2].append(entry.name)
                        except FileNotFoundError:
                            continue
            if frame[2]:
                child = frame[2].pop()
                try:
                    below = os.open(child, _OPEN, dir_fd=current)
                except FileNotFoundError:
                    continue  # removed meanwhile
                os.close(current)
                current = below
                frames.append([child, os.fstat(current), None])
                continue
            frames.pop()
            if not frames:
                break
            above = os.open("..", _OPEN, dir_fd=current)
            os.close(current)
            current = above
            seen, expected = os.fstat(current), frames[-1][1]
            if (seen.st_dev, seen.st_ino) != (expected.st_dev, expected.st_ino):
                raise OSError(errno.ESTALE, "a folder was moved while it was read")
    finally:
        os.close(current)
