"""The view index's search text: one casefolded line per record, found with ``mmap.find``.

The text of the rows loaded from the cache stays in the cache segments' files (kept open, so a segment
another process removes can still be searched); the rows this process adds go to a file of its own.
"""

from __future__ import annotations

import itertools
import mmap
import os
from bisect import bisect_right
from pathlib import Path
from typing import Iterator, Sequence

_WORK_FILES = itertools.count()


class SearchText:
    """The search text of an index's rows: the loaded segments' files, then this process's own file."""

    def __init__(self, cache_dir: Path):
        # This process's own file, new for each SearchText (an index makes one at each reset): never one
        # another process appends to, and never the old one cut short under a search that has it mapped
        # (that would be a SIGBUS).
        self.path = cache_dir / f"work-{os.getpid()}-{next(_WORK_FILES)}.search"
        self.path.write_bytes(b"")
        self.parts: list = []  # [(open file, first byte, bytes)] of the loaded segments
        self.base = 0  # where this process's file starts in the whole text
        self.size = 0  # bytes of the whole text
        self._fd = -1

    def use_parts(self, parts: list) -> None:
        """The text before this process's own file: the open search files of the loaded segments."""
        for fh, _base, _size in self.parts:
            fh.close()
        self.parts = parts
        self.base = self.size = sum(size for _fh, _base, size in parts)

    def open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY)

    def close_file(self) -> None:
        os.close(self._fd)
        self._fd = -1

    def append(self, data: bytes) -> int:
        """Write a row's text at its place; return where it starts.

        Bytes a failed write left beyond it are written over next time: a write that fails (a full disk)
        adds no part of the row.
        """
        start = self.size
        view, at = memoryview(data), start - self.base
        while view:
            done = os.pwrite(self._fd, view, at)
            view, at = view[done:], at + done
        self.size += len(data)
        return start

    def find(self, needle: bytes, starts: Sequence[int], count: int) -> Iterator[int]:
        """The rows among the first ``count`` whose text holds ``needle`` (``starts``: where each row's text starts)."""
        end = self.size if count == len(starts) else starts[count]
        with open(self.path, "rb") as work:
            # each part holds whole lines and a needle holds no newline: no match spans two parts
            for fh, base, size in [*self.parts, (work, self.base, end - self.base)]:
                stop = min(size, end - base)
                if stop <= 0 or os.fstat(fh.fileno()).st_size == 0:
                    continue
                with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as blob:
                    pos = 0
                    while True:
                        hit = blob.find(needle, pos, stop)
                        if hit < 0:
                            break
                        i = bisect_right(starts, base + hit, 0, count) - 1
                        yield i
                        pos = (starts[i + 1] if i + 1 < count else end) - base

    def close(self) -> None:
        """Close the segments' files and remove this process's own."""
        self.use_parts([])
        self.path.unlink(missing_ok=True)
