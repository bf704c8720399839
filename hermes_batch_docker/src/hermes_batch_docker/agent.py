"""A container's command runner: one long-lived shell that runs each of its prompt's commands.

Each ``docker exec`` costs the engine a create, a start (a ``runc exec``) and an
inspect: about 40 ms of engine CPU and 65 ms of waiting on 2 cores, and for a
prompt of a few commands more than the model's tool calls themselves.  The
runner is one exec, started with its container, whose stdin takes requests and
whose stdout carries their output: a command through it costs no call to the
engine.  It is ``/bin/sh`` (POSIX: busybox ash or dash; with ``setsid``, ``cat``
and ``printf %b``), so it needs nothing in the image.

Each command runs exactly as an exec would run it: the same wrapper, started by
``setsid`` (its own session and process group, whose pid the wrapper prints
first), stdin from /dev/null, stderr merged into stdout, in the sandbox's
working folder, with the container's and the prompt's environment.  Its output
goes through a pipe to ``cat`` and on to the runner's stdout, so, as with an
exec, the command is over when every process holding its output has closed it;
then the runner prints ``\\036<nonce> <status>`` (a nonce new for each request,
so no output can end a request early by chance).  Timeouts, the output cap and
kills stay on the runner's side of the sandbox, as for an exec.

A runner serves one command at a time: commands that come while it is busy run
as execs, as do commands too long for one request line.  It lives in the
prompt's own container and dies with it; nothing of it is shared.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Optional

from hermes_batch import command_runner


from .streams import STDERR_STREAM, close_quietly, read_frames, tell

log = logging.getLogger("hermes_batch.docker")

# The runner's script, its requests and the parsing of its output are hermes_batch's (the singularity plugin's too).
AGENT_SCRIPT, NO_STATUS, exportable = command_runner.AGENT_SCRIPT, command_runner.NO_STATUS, command_runner.exportable
MAX_ARGS, MAX_LINE = command_runner.MAX_ARGS, command_runner.MAX_LINE
Request, encode_arg = command_runner.Request, command_runner.encode_arg
new_nonce, request_line = command_runner.new_nonce, command_runner.request_line


class Agent:
    """The runner of one container, over the socket of its exec; one request at a time."""

    def __init__(self, sock, loop: asyncio.AbstractEventLoop, exec_id: str):
        self.sock = sock
        self.raw = getattr(sock, "_sock", sock)
        self.loop = loop
        self.exec_id = exec_id
        self.pid: Optional[int] = None
        self.ready = threading.Event()  # its first line (its pid) came, or it died
        self.started = loop.create_future()  # the same, for the event loop: its pid, or None when it died
        self.dead = False
        self.busy = False  # a request is out (set and cleared on the event loop)
        self._request: Optional[Request] = None
        self._first = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, name="hermes-batch-docker-agent", daemon=True)
        self._thread.start()

    def usable(self) -> bool:
        return not self.dead and not self.busy and self.pid is not None

    def submit(self, nonce: str, stdout, stderr=None) -> Request:
        """A new request of ``nonce`` (the runner becomes busy until its end)."""
        request = Request(self.loop, nonce, stdout, stderr)
        self.busy = True
        with self._lock:
            self._request = request
            dead = self.dead
        if dead:
            request.lost()
        request.done.add_done_callback(self._finished)
        return request

    def _finished(self, _future) -> None:
        self.busy = False

    def send(self, line: bytes) -> None:
        """Blocking: write a request line (OSError when the runner is gone)."""
        self.raw.sendall(line)

    def close(self) -> None:
        """Close its stdin and stream: the runner reads end of input and exits (or dies with its container)."""
        try:
            self.raw.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def finish(self, timeout: float) -> bool:
        """Blocking: close its stdin only and wait up to ``timeout`` for its exec's stream to end; True when it did.

        In a reused container (see views.py) the stream ends once every process of the prompt's view is gone.
        """
        try:
            self.raw.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self._thread.join(timeout)
        ended = not self._thread.is_alive()
        self.close()
        return ended

    def wait_ready(self, timeout: float) -> bool:
        return self.ready.wait(timeout) and self.pid is not None

    def _read(self) -> None:
        try:
            read_frames(self.sock, self._payload)
        except (OSError, ValueError):
            pass
        finally:
            with self._lock:
                self.dead = True
                request, self._request = self._request, None
            self.ready.set()
            tell(self.loop, self.started, self.pid)
            if request is not None:
                request.lost()
            close_quietly(self.sock)

    async def until_started(self, timeout: float) -> bool:
        """Wait until its first line came; False when it died or did not answer in ``timeout``."""
        return await command_runner.until_started(self, timeout)

    def _payload(self, kind: int, data: bytes) -> None:
        if kind == STDERR_STREAM:  # the runner's own complaints (its commands' stderr goes to stdout)
            said = data[:500].decode(errors="replace").strip()
            # the namespace helper of a view (-S reuse=namespace) says why it could not make or keep it
            (log.warning if said.startswith("hermes-batch-namespace:") else log.debug)("docker command runner: %s", said)
            return
        if self.pid is None:
            started = command_runner.first_line(self._first, data)
            if started is None:
                return
            self.pid, data = started
            self.ready.set()
            tell(self.loop, self.started, self.pid)
        while data:
            with self._lock:
                request = self._request
            if request is None:
                return  # nothing asked: written by a process of the prompt through the runner's stdout
            rest = request.feed(data)
            if rest is None:
                return
            with self._lock:
                if self._request is request:
                    self._request = None
            data = rest
