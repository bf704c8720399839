"""Opening the files a command reads back (a journal, a seed folder's files, a cache): regular files only.

What a run wrote can be replaced before the next command reads it: a symbolic
link to a file elsewhere (a resume would cut that file's last line and append to
it), a FIFO (``open`` would wait for a writer for ever, deaf to Ctrl-C), a device
(``/dev/zero`` reads without end), a hard link to another file.  Every such file
is opened here without following a link or waiting on a pipe, and refused in one
sentence unless it is a plain file; lines are then read with the bounds of
:mod:`hermes_batch.formats.lines`.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Optional, Union

from ..errors import RunFolderError

PathLike = Union[str, os.PathLike]

_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def kind_of(mode: int) -> str:
    """What a file of this mode is, for a sentence ("a named pipe (FIFO)")."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def refusal(path: PathLike, what: str, advice: str = "move it away and run the same command again") -> RunFolderError:
    """The one-sentence error for ``path``, which is ``what`` ("a symbolic link") where a plain file must be."""
    return RunFolderError(f"{path} is {what}, not a file hermes-batch wrote or reads; {advice}.")


def open_file(path: PathLike, flags: int = os.O_RDONLY, *, advice: Optional[str] = None,
              mode: int = 0o666) -> Optional[int]:
    """A descriptor of the regular file ``path`` (None when it does not exist and ``flags`` do not create it).

    Never follows a symbolic link or waits on a FIFO; anything but a plain file is refused with RunFolderError,
    and so is a file opened for writing that has another name too (a hard link: a write would change that file).
    Other errors (permissions, a full disk) are raised as the OSError they are.
    """
    args = {} if advice is None else {"advice": advice}
    try:
        fd = os.open(path, flags | _FLAGS, mode)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a link
            raise refusal(path, "a symbolic link", **args) from None
        if exc.errno in (errno.ENXIO, errno.EISDIR, errno.ENODEV):  # a FIFO without a reader, a folder, a socket
            try:
                what = kind_of(os.lstat(path).st_mode)
            except OSError:
                what = "not a regular file"
            raise refusal(path, what, **args) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refusal(path, kind_of(st.st_mode), **args)
        if flags & (os.O_WRONLY | os.O_RDWR) and st.st_nlink > 1:
            raise refusal(path, "a hard link to another file", **args)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_reader(path: PathLike, *, advice: Optional[str] = None):
    """``open_file`` for reading, as a buffered binary file object; None when ``path`` does not exist."""
    fd = open_file(path, advice=advice)
    return None if fd is None else os.fdopen(fd, "rb")


def check_file(path: PathLike, *, advice: Optional[str] = None, written: bool = True) -> bool:
    """True when ``path`` is a plain file, False when it does not exist; RunFolderError for anything else, and
    (``written``: a file a run appends to) for a file with another name too."""
    args = {} if advice is None else {"advice": advice}
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise refusal(path, kind_of(st.st_mode), **args)
    if written and st.st_nlink > 1:
        raise refusal(path, "a hard link to another file", **args)
    return True


def read_small(path: PathLike, limit: int, *, advice: Optional[str] = None) -> Optional[bytes]:
    """The bytes of the plain file ``path`` (None when missing); ValueError when it holds more than ``limit``."""
    handle = open_reader(path, advice=advice)
    if handle is None:
        return None
    with handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{Path(path).name} is larger than {limit} bytes")
    return data
