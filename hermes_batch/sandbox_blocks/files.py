"""Reading and writing files of a sandbox's folder without ever leaving it: :class:`SandboxFolder`.

A public building block for sandbox backends whose files are a folder of this
machine (the local backend's prompt folder; a bubblewrap or chroot backend's
root bind-mounted from the host).  Paths are resolved one component at a time
from a descriptor of the folder held for the sandbox's life (``openat`` with ``O_NOFOLLOW`` on every
step): a symbolic link is followed by reading it and walking its target the
same way, so one that leads out of the folder is refused, and a command that
swaps a link while a path is being resolved (a race a ``realpath`` check and a
later ``open`` would lose) can only make the call fail, never reach outside.
Only regular files are opened, without blocking (``O_NONBLOCK``), after an
``lstat`` and checked again with ``fstat``: FIFOs, sockets and devices are
refused at once with EINVAL.
"""

from __future__ import annotations

import collections
import errno
import os
import posixpath
import stat
from typing import Optional

MAX_LINKS = 40  # as the kernel's own limit on links followed in one lookup
MAX_RACES = 8  # a path swapped under us this many times in a row is refused
READ_CHUNK = 1024 * 1024

_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class _Swapped(Exception):
    """A component changed between its lstat and its open: resolve the path again."""


def outside_error(path: str) -> PermissionError:
    return PermissionError(
        f"{path!r} is outside this prompt's sandbox folder; the sandbox's file API only reads and writes files inside it."
    )


def not_regular_error(path: str, mode: int) -> OSError:
    kind = (
        "FIFO (named pipe)" if stat.S_ISFIFO(mode)
        else "socket" if stat.S_ISSOCK(mode)
        else "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "special file"
    )
    return OSError(
        errno.EINVAL,
        f"{path} is a {kind}, not a regular file; the file tools only read and write regular files "
        "(use the terminal for anything else).",
    )


def _parts(path: str) -> list:
    return [part for part in path.split("/") if part not in ("", ".")]


class SandboxFolder:
    """A sandbox's folder, reached through a descriptor held until :meth:`close`.

    ``root`` is the folder (an absolute path of this machine), ``cwd`` the folder
    inside it where relative paths start.  Absolute paths are taken as paths of
    this machine and must lie under ``root``.  :meth:`read` and :meth:`write`
    block (call them in a thread, e.g. ``asyncio.to_thread``), never on a FIFO
    or device: those are refused with ``OSError(EINVAL)``; a path that leads
    out of ``root``, through ``..`` or a link however swapped, raises
    ``PermissionError``.  With ``owner`` (uid, gid), what they create (files
    and folders) is given to that user, the one the sandbox's commands run as
    when it differs from the runner's.
    """

    def __init__(self, root: str, cwd: Optional[str] = None, owner: Optional[tuple] = None):
        self.owner = owner
        self.root = root = os.fspath(root)
        cwd = root if cwd is None else os.fspath(cwd)
        self.fd = os.open(root, _DIR_FLAGS)
        self.cwd_parts = _parts(os.path.relpath(cwd, root)) if cwd != root else []

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    # --- resolution ------------------------------------------------------------------

    def _start(self, path: str) -> list:
        if path.startswith("/"):
            if not (path == self.root or path.startswith(self.root + "/")):
                raise outside_error(path)
            parts = path[len(self.root):].split("/")
        else:
            parts = self.cwd_parts + path.split("/")
        # Refused even where a missing folder would stop the walk first: the path itself points outside.
        if posixpath.normpath("/".join(["."] + parts)).startswith(".."):
            raise outside_error(path)
        return parts

    def _resolve(self, path: str, create_parents: bool) -> tuple[list, Optional[str]]:
        """Descriptors of the folders from the root to the parent of ``path``, and its last name.

        The name is None when ``path`` is a folder reached through ``..`` or ``.``.
        Links inside the folder are followed, the last one too, so the name
        returned is never a link when this returns (it may not exist).
        """
        todo = collections.deque(self._start(path))
        chain = [os.dup(self.fd)]
        links = 0
        try:
            while todo:
                name = todo.popleft()
                if name in ("", "."):
                    continue
                if name == "..":
                    if len(chain) == 1:
                        raise outside_error(path)
                    os.close(chain.pop())
                    continue
                last = not any(part not in ("", ".") for part in todo)
                try:
                    info = os.stat(name, dir_fd=chain[-1], follow_symlinks=False)
                except FileNotFoundError:
                    if last:
                        return chain, name
                    if not create_parents:
                        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from None
                    try:
                        os.mkdir(name, 0o777, dir_fd=chain[-1])
                        if self.owner is not None:  # a link swapped in meanwhile is changed itself, not followed
                            os.chown(name, *self.owner, dir_fd=chain[-1], follow_symlinks=False)
                    except FileExistsError:
                        pass
                    todo.appendleft(name)
                    continue
                if stat.S_ISLNK(info.st_mode):
                    links += 1
                    if links > MAX_LINKS:
                        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                    target = os.readlink(name, dir_fd=chain[-1])
                    if target.startswith("/"):
                        if not (target == self.root or target.startswith(self.root + "/")):
                            raise outside_error(path)
                        while len(chain) > 1:
                            os.close(chain.pop())
                        target = target[len(self.root):]
                    todo.extendleft(reversed(target.split("/")))
                    continue
                if last:
                    return chain, name
                if not stat.S_ISDIR(info.st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
                try:
                    chain.append(os.open(name, _DIR_FLAGS, dir_fd=chain[-1]))
                except (OSError) as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                        raise _Swapped() from exc
                    raise
            return chain, None
        except BaseException:
            _close_all(chain)
            raise

    # --- the file API ------------------------------------------------------------------

    def read(self, path: str, max_bytes: Optional[int] = None) -> bytes:
        """At most ``max_bytes`` bytes from the start of the regular file ``path`` (None: all)."""
        fd = self._open_existing(path, os.O_RDONLY)
        try:
            chunks = []
            left = max_bytes
            while left is None or left > 0:
                chunk = os.read(fd, READ_CHUNK if left is None else min(READ_CHUNK, left))
                if not chunk:
                    break
                chunks.append(chunk)
                if left is not None:
                    left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def write(self, path: str, data: bytes) -> None:
        """Replace the content of ``path`` (a regular file, or a new one), creating parent folders."""
        for _ in range(MAX_RACES):
            try:
                chain, name = self._resolve(path, create_parents=True)
            except _Swapped:
                continue
            try:
                if name is None:
                    raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
                fd = self._open_for_write(chain[-1], name, path)
            except _Swapped:
                continue
            finally:
                _close_all(chain)
            try:
                os.ftruncate(fd, 0)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            return
        raise outside_error(path)

    def _open_existing(self, path: str, flags: int) -> int:
        for _ in range(MAX_RACES):
            try:
                chain, name = self._resolve(path, create_parents=False)
            except _Swapped:
                continue
            try:
                if name is None:
                    raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
                info = _lstat(chain[-1], name, path)
                if info is None:
                    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
                require_regular_file(info.st_mode, path)
                return _open_checked(chain[-1], name, flags, path)
            except _Swapped:
                continue
            finally:
                _close_all(chain)
        raise outside_error(path)

    def _open_for_write(self, parent: int, name: str, path: str) -> int:
        info = _lstat(parent, name, path)
        if info is None:
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o666, dir_fd=parent)
            except FileExistsError:
                raise _Swapped() from None
            if self.owner is not None:
                try:
                    os.fchown(fd, *self.owner)
                except BaseException:
                    os.close(fd)
                    raise
            return fd
        require_regular_file(info.st_mode, path)
        return _open_checked(parent, name, os.O_WRONLY, path)


def _lstat(parent: int, name: str, path: str) -> Optional[os.stat_result]:
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):  # swapped in after the resolution followed the old entry
        raise _Swapped()
    return info


def require_regular_file(mode: int, path: str) -> None:
    """Raise unless ``mode`` (an ``st_mode``) is a regular file's: ``IsADirectoryError`` for a folder,
    ``OSError(EINVAL)`` naming the kind for a FIFO, socket or device, whose open or read could block."""
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if not stat.S_ISREG(mode):
        raise not_regular_error(path, mode)


def _open_checked(parent: int, name: str, flags: int, path: str) -> int:
    try:
        fd = os.open(name, flags | _OPEN_FLAGS, dir_fd=parent)
    except OSError as exc:
        # ELOOP: a link swapped in; ENXIO: a FIFO without reader swapped in (O_NONBLOCK write)
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.ENOENT):
            raise _Swapped() from exc
        raise
    try:
        require_regular_file(os.fstat(fd).st_mode, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _close_all(fds: list) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
