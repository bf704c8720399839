"""Reading the multiplexed output stream of a Docker exec in a thread of its own."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from typing import Callable, Optional

from hermes_batch import BoundedOutput

_HEADER = struct.Struct(">BxxxL")  # stream (1 stdout, 2 stderr), 3 bytes padding, payload size
STDERR_STREAM = 2
_MAX_PID_LINE = 32


class OutputParser:
    """A command's output after its wrapper's first line, the process id of its group (``pid``).

    What came before a newline or too long to be a pid is output (the wrapper never ran).
    ``add`` and ``flush`` may be called from any thread; the futures are set on ``loop``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, stdout: BoundedOutput, stderr: Optional[BoundedOutput] = None):
        self.loop = loop
        self.stdout = stdout
        self.stderr = stderr if stderr is not None else stdout  # None: stderr merged into stdout
        self.pid: Optional[int] = None
        self.pid_known = loop.create_future()
        self._pid_line = bytearray()

    def add(self, data: bytes) -> None:
        if self._pid_line is not None:
            newline = data.find(b"\n")
            if newline < 0:
                self._pid_line += data
                if len(self._pid_line) > _MAX_PID_LINE:
                    self.flush()
                return
            self._pid_line += data[:newline]
            data = data[newline + 1:]
            line, self._pid_line = bytes(self._pid_line), None
            if line.isdigit():
                self.pid = int(line)
            else:
                self.stdout.add(line + b"\n")
            self.tell(self.pid_known, self.pid)
            if not data:
                return
        self.stdout.add(data)

    def flush(self) -> None:
        # The wrapper never printed its pid (the exec failed to start): what came is output.
        if self._pid_line is None:
            return
        if self._pid_line:
            self.stdout.add(bytes(self._pid_line))
        self._pid_line = None
        self.tell(self.pid_known, self.pid)

    def tell(self, future: asyncio.Future, value) -> None:
        tell(self.loop, future, value)


class ExecStream:
    """Collects an exec's output until the engine closes the stream or ``interrupt`` is called.

    The command runs under a wrapper whose first line of stdout is its process id
    (the leader of the command's process group, used to kill the group).
    A thread of its own, not the run's pool: a read lasts as long as its command,
    and pool threads held by reads could starve the very call that kills it.
    """

    def __init__(self, sock, loop: asyncio.AbstractEventLoop, stdout: BoundedOutput, stderr: Optional[BoundedOutput] = None):
        self.sock = sock
        self.raw = getattr(sock, "_sock", sock)
        self.loop = loop
        self.parser = OutputParser(loop, stdout, stderr)
        self.done = loop.create_future()
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="hermes-batch-docker-exec", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def interrupt(self) -> None:
        """Stop reading now (the reader sees end of stream)."""
        try:
            self.raw.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _run(self) -> None:
        try:
            read_frames(self.sock, self._payload)
        except (OSError, ValueError) as exc:  # a shut down or reset connection
            self.error = exc
        finally:
            self.parser.flush()
            close_quietly(self.sock)
            self.parser.tell(self.done, None)

    @property
    def pid(self) -> Optional[int]:
        return self.parser.pid

    @property
    def pid_known(self) -> asyncio.Future:
        return self.parser.pid_known

    def _payload(self, kind: int, data: bytes) -> None:
        if kind == STDERR_STREAM:
            self.parser.stderr.add(data)
        else:
            self.parser.add(data)


def read_frames(sock, on_frame: Callable[[int, bytes], None]) -> None:
    """Blocking: read an exec's multiplexed stream to its end, calling ``on_frame(stream, payload)`` per frame.

    Raises OSError when the connection is shut down or reset (and what ``on_frame`` raises).
    """
    raw = getattr(sock, "_sock", sock)
    if hasattr(raw, "settimeout"):
        raw.settimeout(None)  # the API timeout must not cut a quiet command short
    recv = sock.recv if hasattr(sock, "recv") else sock.read
    pending = bytearray()
    while True:
        chunk = recv(65536)
        if not chunk:
            return
        pending += chunk
        offset = 0
        while len(pending) - offset >= _HEADER.size:
            kind, size = _HEADER.unpack_from(pending, offset)
            end = offset + _HEADER.size + size
            if len(pending) < end:
                break
            on_frame(kind, bytes(pending[offset + _HEADER.size:end]))
            offset = end
        del pending[:offset]


def close_quietly(sock) -> None:
    """Close an exec's socket and the raw socket under it."""
    for closable in (sock, getattr(sock, "_sock", sock)):
        try:
            closable.close()
        except OSError:
            pass


def tell(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value) -> None:
    """From any thread: set ``future``'s result on ``loop`` (unless it is done, or the loop is gone)."""
    try:
        loop.call_soon_threadsafe(_set, future, value)
    except RuntimeError:  # the event loop is gone (the process is exiting)
        pass


def _set(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
