"""Lines read back from files and answers nobody vouches for: bounded in length, decoded without crashing.

A journal, a seed folder's record file or a batch's results are untrusted: a
line may be hundreds of megabytes long, or nested so deep that the JSON decoder
overflows.  These readers never hold more than ``limit`` bytes of one line
(a longer one is reported as ``TOO_LONG`` and skipped without being kept), and
:func:`loads` turns every way a line can fail to decode into ValueError.
"""

from __future__ import annotations

import json
from typing import Any, BinaryIO, Iterator, Optional, Union

class _TooLong:
    def __repr__(self) -> str:
        return "TOO_LONG"


TOO_LONG: Any = _TooLong()
"""What the readers give in place of a line longer than their limit (the caller counts and skips it)."""

_CHUNK = 1 << 20


def loads(raw: Union[bytes, str]) -> Any:
    """``json.loads(raw)``, with every failure a ValueError: invalid JSON or UTF-8, NaN/Infinity, nesting that
    would overflow the decoder's recursion, an integer of more digits than Python converts."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError("nested too deep to decode") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON can hold")


def read_lines(handle: BinaryIO, limit: int, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """``(offset, line)`` of each whole line of the binary file ``handle`` from byte ``start`` on, newline kept.

    A line longer than ``limit`` bytes comes as ``(offset, TOO_LONG)``, read past in pieces, never held whole; an
    unterminated last line (a torn write, or one still being written) is not given.
    """
    handle.seek(start)
    offset = start
    while True:
        raw = handle.readline(limit + 1)
        if not raw:
            return
        if raw.endswith(b"\n"):
            yield offset, raw
            offset += len(raw)
            continue
        if len(raw) <= limit:
            return  # the file ends inside this line
        skipped = len(raw)
        while True:
            piece = handle.readline(_CHUNK)
            skipped += len(piece)
            if not piece:
                return  # a too-long line the file ends in: torn, as any unterminated last line
            if piece.endswith(b"\n"):
                break
        yield offset, TOO_LONG
        offset += skipped


class LineSplitter:
    """Whole lines out of a stream of chunks (a download), each at most ``limit`` bytes; longer ones are
    ``TOO_LONG``.  ``feed`` each chunk, then ``end`` for the last line if it has no newline."""

    def __init__(self, limit: int):
        self.limit = limit
        self._pending: list = []
        self._size = 0
        self._skipping = False

    def feed(self, chunk: bytes) -> list:
        """The lines ``chunk`` completes, without their newlines."""
        out = []
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if not self._skipping:
                self._size += len(piece)
                if self._size > self.limit:
                    self._pending, self._skipping = [], True  # dropped at once: a line is never held past the limit
                elif piece:
                    self._pending.append(piece)
            if end < 0:
                return out
            out.append(TOO_LONG if self._skipping else b"".join(self._pending))
            self._pending, self._size, self._skipping = [], 0, False
            start = end + 1

    def end(self) -> Optional[bytes]:
        """The last line if the stream did not end with a newline (TOO_LONG if it was too long), else None."""
        if self._skipping:
            return TOO_LONG
        line = b"".join(self._pending)
        self._pending, self._size = [], 0
        return line or None
