"""Command output kept within a size limit, for sandbox backends."""

from __future__ import annotations


class BoundedOutput:
    """Keeps the first and last ``limit // 2`` bytes of what it is given, counting what it drops."""

    def __init__(self, limit: int):
        self.half = limit // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
            if not data:
                return
        self.tail += data
        # Trim only at twice the allowance, so trimming stays amortised O(1).
        if len(self.tail) > 2 * self.half:
            self._trim()

    def _trim(self) -> None:
        excess = len(self.tail) - self.half
        if excess > 0:
            del self.tail[:excess]
            self.dropped += excess

    def value(self) -> bytes:
        """The kept bytes, head then tail."""
        self._trim()
        return bytes(self.head) + bytes(self.tail)

    def text(self) -> str:
        """The kept output as text, with a notice where bytes were dropped."""
        data = self.value()
        if not self.dropped:
            return data.decode("utf-8", errors="replace")
        head = bytes(self.head).decode("utf-8", errors="replace")
        tail = bytes(self.tail).decode("utf-8", errors="replace")
        return f"{head}\n[... {self.dropped} bytes of output omitted ...]\n{tail}"


class FirstBytes:
    """Keeps the first ``limit`` bytes of what it is given and counts the rest; for bounded file reads."""

    def __init__(self, limit: int):
        self.limit = limit
        self.data = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.limit - len(self.data)
        if room > 0:
            self.data += data[:room]
        self.dropped += max(len(data) - max(room, 0), 0)

    def value(self) -> bytes:
        return bytes(self.data)

    def text(self) -> str:
        return self.value().decode("utf-8", errors="replace")
