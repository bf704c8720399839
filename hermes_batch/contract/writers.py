"""Writers that write a file anywhere: the run's merged output, ``hermes-batch export`` and its splits.

A :class:`FileWriter` opens a :class:`Sink` on a path, hands it trajectories one
at a time and commits it; the file appears whole under its name only on commit
(temporary file, fsync, rename), so a reader never sees half an export and a
killed export leaves the previous file as it was.  Being push-based, one pass
over a run can feed several sinks (the train and validation splits).
"""

from __future__ import annotations

import abc
import logging
import os
import secrets
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Iterable, Optional

from .interfaces import Writer
from ..formats.jsonguard import scrub_text
from ..formats.records import Trajectory
from ..folder.durable import TEMP_MARK, _fsync_dir

log = logging.getLogger(__name__)


class Sink(abc.ABC):
    """One output file being written; ``with`` commits it on success and removes it on an error."""

    def __init__(self, path: os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # named like the run folder's other atomic replaces, so the cleanup of an interrupted session
        # recognises it; 0o666: the user's umask decides the mode
        self.tmp = self.path.with_name(f".{self.path.name}{TEMP_MARK}{secrets.token_hex(8)}.tmp")
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self.file: BinaryIO = os.fdopen(fd, "wb")
        self.count = 0  # trajectories written
        self.skipped = 0  # trajectories the format cannot hold (see the writer's docs)
        self.repaired = 0  # trajectories written with U+FFFD for text that is not Unicode (see scrub)
        self.notes: dict = {}  # what the format counts besides its lines (dpo: rows that give no pair), for export
        self._done = False
        self._sealed = False

    @abc.abstractmethod
    def add(self, trajectory: Trajectory) -> None:
        """Write one trajectory (count it in ``count``, or in ``skipped`` if the format cannot hold it)."""

    @staticmethod
    def scrub(value: Any) -> Any:
        """``value`` with each lone surrogate in its strings (keys too) replaced by U+FFFD, as the run repairs text.

        Records written by older versions may hold one (an escaped ``\\ud800``), which no UTF-8 encoder
        takes; a sink whose encoding fails with UnicodeEncodeError writes the scrubbed value and counts it
        in ``repaired``.
        """
        if isinstance(value, str):
            return scrub_text(value)
        if isinstance(value, dict):
            return {Sink.scrub(key): Sink.scrub(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(Sink.scrub(item) for item in value)
        return value

    def write_line(self, line: str) -> None:
        """Write one line of text and count it, with lone surrogates replaced (and counted in ``repaired``) when
        it holds any (see scrub)."""
        try:
            data = line.encode("utf-8")
        except UnicodeEncodeError:
            data = self.scrub(line).encode("utf-8")
            self.repaired += 1
        self.file.write(data)
        self.count += 1

    def finish(self) -> None:
        """Write what the format needs at the end (a footer); called once before the file is committed."""

    def seal(self) -> Path:
        """Finish the temporary file and return it, complete on disk, for the caller to move into place (an export
        switches several files at once); on an error it is removed."""
        if not self._sealed:
            try:
                self.finish()
                self.file.flush()
                os.fsync(self.file.fileno())
                self.file.close()
            except BaseException:
                self.abort()
                raise
            self._sealed = True
        return self.tmp

    def commit(self) -> None:
        """Finish the file and move it to ``path`` atomically."""
        if self._done:
            return
        self.seal()
        try:
            os.replace(self.tmp, self.path)
            _fsync_dir(self.path.parent)
        except BaseException:
            self.abort()
            raise
        self._done = True

    def abort(self) -> None:
        """Drop the temporary file; ``path`` stays as it was."""
        if self._done:
            return
        self._done = True
        try:
            self.file.close()
        except Exception:  # the file is being thrown away
            pass
        try:
            self.tmp.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> "Sink":
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class LineSink(Sink):
    """A JSON Lines file: ``encode`` turns a trajectory into one line, or None when the format cannot hold it."""

    def __init__(self, path: os.PathLike, encode):
        super().__init__(path)
        self.encode = encode

    def add(self, trajectory: Trajectory) -> None:
        line: Optional[str] = self.encode(trajectory)
        if line is None:
            self.skipped += 1
            return
        self.write_line(line)


class FileWriter(Writer):
    """A writer whose output is one file: ``filename`` in the run folder, or any path (``export``)."""

    filename: ClassVar[str]  # its file in the run folder, for --writer
    suffix: ClassVar[str]  # ".jsonl", ".parquet": export names its files with it
    include: ClassVar[str] = "kept"  # the records export writes unless --include says: kept, discarded or all
    unit: ClassVar[str] = "trajectories"  # what one of its lines is, in export's summary (pairs, rows)

    @abc.abstractmethod
    def open(self, path: os.PathLike) -> Sink:
        """A sink writing this format to ``path``."""

    def write(self, run_dir, trajectories: Iterable[Trajectory]) -> str:
        """Replace ``run_dir/filename`` with ``trajectories``."""
        with self.open(Path(run_dir) / self.filename) as sink:
            for trajectory in trajectories:
                sink.add(trajectory)
        report_skipped(self, sink)
        return self.filename


class LibraryWriter(FileWriter):
    """A writer whose file a library writes by path (SQLite, Arrow, a database file): no file object, no counting.

    The run (or ``export``) calls :meth:`begin` with a temporary path beside
    the output, :meth:`add` once per trajectory with what ``begin`` returned,
    then :meth:`end`; the base counts, fsyncs the file and renames it over the
    output, so a reader never sees half a file.  When anything fails the
    temporary file is removed (after :meth:`discard`) and the output stays as it
    was.  Set ``name``, ``filename`` and ``suffix`` as for any FileWriter.
    """

    @abc.abstractmethod
    def begin(self, path: Path) -> Any:
        """Start the output at ``path`` (an empty file the base created; a library may open or replace it) and
        return what :meth:`add` and :meth:`end` are handed: a connection, the library's writer."""

    @abc.abstractmethod
    def add(self, handle: Any, trajectory: Trajectory) -> bool:
        """Write one trajectory; False when the format cannot hold it (counted in ``skipped``; say which in
        the class's ``skips``)."""

    def end(self, handle: Any) -> None:
        """Finish the file and close it (commit, write the footer); after it the file must be complete."""

    def discard(self, handle: Any) -> None:
        """Close what :meth:`begin` opened after an error; the file is removed after it.  Calls
        ``handle.close()`` when it has one."""
        close = getattr(handle, "close", None)
        if callable(close):
            close()

    def open(self, path: os.PathLike) -> Sink:
        return _LibrarySink(self, path)


class _LibrarySink(Sink):
    """The Sink of a LibraryWriter: the library writes ``tmp`` by path; this counts and commits."""

    def __init__(self, writer: LibraryWriter, path: os.PathLike):
        super().__init__(path)
        self.file.close()  # the name is reserved (created exclusively); the library opens it by path
        self.writer = writer
        self._handle = None
        self._begun = False

    def add(self, trajectory: Trajectory) -> None:
        if not self._begun:
            self._begun = True
            self._handle = self.writer.begin(self.tmp)
        if self.writer.add(self._handle, trajectory) is False:
            self.skipped += 1
        else:
            self.count += 1

    def finish(self) -> None:
        if not self._begun:  # no trajectory: the library still writes its empty file (a table, a schema)
            self._begun = True
            self._handle = self.writer.begin(self.tmp)
        handle, self._handle = self._handle, None
        self.writer.end(handle)

    def seal(self) -> Path:
        if not self._sealed:
            try:
                self.finish()
                fd = os.open(self.tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except BaseException:
                self.abort()
                raise
            self._sealed = True
        return self.tmp

    def abort(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None and not self._done:
            try:
                self.writer.discard(handle)
            except Exception:  # the file is being thrown away
                log.debug("%s: closing the discarded output failed", self.writer.name, exc_info=True)
        super().abort()


def report_skipped(writer: Any, sink: Sink, path: Optional[os.PathLike] = None) -> None:
    """One warning when a format had to leave trajectories out (the writer's docs say which), one when it repaired
    some; ``path`` names the file where the sink's own path was only where it was built."""
    path = path or sink.path
    if sink.skipped:
        log.warning(
            "%s: %d trajectory(ies) left out, since the %s format cannot hold them (%s).",
            path, sink.skipped, writer.name, getattr(writer, "skips", "see its documentation"),
        )
    if sink.repaired:
        log.warning(
            "%s: %d trajectory(ies) held text that is not Unicode (a lone surrogate, in records of older versions); "
            "written with U+FFFD in its place, as the run writes such text.", path, sink.repaired,
        )
