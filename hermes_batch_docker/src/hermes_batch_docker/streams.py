"""Reading the multiplexed output stream of a Docker exec in a thread of its own."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from typing import Callable, Optional

from hermes_batch import BoundedOutput
from hermes_batch import command_runner

_HEADER = struct.Struct(">BxxxL")  # stream (1 stdout, 2 stderr), 3 bytes padding, payload size
STDERR_STREAM = 2
OutputParser, tell = command_runner.OutputParser, command_runner.tell  # shared with the singularity plugin


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
