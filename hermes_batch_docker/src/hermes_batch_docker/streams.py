"""Reading the multiplexed output stream of a Docker exec in a thread of its own."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from typing import Optional

from hermes_batch import BoundedOutput

_HEADER = struct.Struct(">BxxxL")  # stream (1 stdout, 2 stderr), 3 bytes padding, payload size
_STDERR = 2
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
        try:
            self.loop.call_soon_threadsafe(_set, future, value)
        except RuntimeError:  # the event loop is gone (the process is exiting)
            pass


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

    def _recv(self, size: int) -> bytes:
        if hasattr(self.sock, "recv"):
            return self.sock.recv(size)
        return self.sock.read(size)

    def _run(self) -> None:
        try:
            if hasattr(self.raw, "settimeout"):
                self.raw.settimeout(None)  # the API timeout must not cut a quiet command short
            pending = bytearray()
            while True:
                chunk = self._recv(65536)
                if not chunk:
                    break
                pending += chunk
                offset = 0
                while len(pending) - offset >= _HEADER.size:
                    kind, size = _HEADER.unpack_from(pending, offset)
                    end = offset + _HEADER.size + size
                    if len(pending) < end:
                        break
                    self._payload(kind, bytes(pending[offset + _HEADER.size:end]))
                    offset = end
                del pending[:offset]
        except (OSError, ValueError) as exc:  # a shut down or reset connection
            self.error = exc
        finally:
            self.parser.flush()
            for closable in (self.sock, self.raw):
                try:
                    closable.close()
                except OSError:
                    pass
            self.parser.tell(self.done, None)

    @property
    def pid(self) -> Optional[int]:
        return self.parser.pid

    @property
    def pid_known(self) -> asyncio.Future:
        return self.parser.pid_known

    def _payload(self, kind: int, data: bytes) -> None:
        if kind == _STDERR:
            self.parser.stderr.add(data)
        else:
            self.parser.add(data)


def _set(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
