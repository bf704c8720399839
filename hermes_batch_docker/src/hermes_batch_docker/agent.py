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
import re
import secrets
import socket
import threading
from typing import Optional

from .streams import STDERR_STREAM, OutputParser, close_quietly, read_frames, tell

log = logging.getLogger("hermes_batch.docker")

# The runner: $1 is the working folder.  Each request is one line: a nonce, an operation and at most
# seven arguments, each "x" followed by its bytes with everything but [A-Za-z0-9._,:=+%@/-] as \0ooo.
# X runs its arguments (an argv) as an exec would; I likewise, but with the runner's stdin, from which the
# command must read exactly the bytes the line announces (a file's content follows its line); E exports its arguments (NAME=value).
# (Sandbox.stop_processes does not use it: its kill is an exec that ends the runner too.)  A command's status comes back on fd 4 and its output through cat to fd 3 (the runner's stdout),
# which the command does not inherit: POSIX sh (busybox ash, dash, bash) with no pipefail.
# Exit 98: the image has no setsid or cat (the sandbox then uses execs).
AGENT_SCRIPT = r"""set -f
exec 3>&1
s=$(command -v setsid) && c=$(command -v cat) || exit 98
w=$1
echo "$$"
while IFS=' ' read -r n o f1 f2 f3 f4 f5 f6 f7; do
set --
for v in "$f1" "$f2" "$f3" "$f4" "$f5" "$f6" "$f7"; do
[ -n "$v" ] || break
v=$(printf '%bx' "${v#x}"); set -- "$@" "${v%x}"
done
case $o in
X) cd "$w" 2>/dev/null
r=$( { { "$s" "$@" </dev/null 2>&1 3>&- 4>&-; echo "$?" >&4; } | "$c" >&3 3>&- 4>&-; } 4>&1 ) ;;
I) cd "$w" 2>/dev/null
r=$( { { "$s" "$@" 2>&1 3>&- 4>&-; echo "$?" >&4; } | "$c" >&3 3>&- 4>&-; } 4>&1 ) ;;
E) for v do export "$v"; done; r=0 ;;
*) r=99 ;;
esac
printf '\036%s %s\n' "$n" "${r:-255}"
done
"""
NO_STATUS = 255  # what the runner says when the command's subshell gave no status (it could not fork)
MAX_ARGS = 7
MAX_LINE = 64 * 1024  # longer requests run as execs: the shell reads a line a byte at a time
_SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._,:=+%@/-")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def new_nonce() -> str:
    return secrets.token_hex(8)


def encode_arg(value: str) -> str:
    """One argument of a request line: ``x`` then its bytes, the unsafe ones as ``\\0ooo`` for printf %b."""
    out = ["x"]
    for byte in value.encode("utf-8", "surrogateescape"):
        out.append(chr(byte) if byte in _SAFE else "\\0%03o" % byte)
    return "".join(out)


def request_line(nonce: str, op: str, args: list) -> Optional[bytes]:
    """The request's line, or None when it cannot be one (too many or too long arguments, a NUL byte)."""
    if len(args) > MAX_ARGS or any("\0" in arg for arg in args):
        return None
    line = " ".join([nonce, op, *(encode_arg(arg) for arg in args)]) + "\n"
    return line.encode() if len(line) <= MAX_LINE else None


class Request:
    """One request's output and end: what ``DockerSandbox`` waits on, shaped like an ``ExecStream``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, nonce: str, stdout, stderr=None):
        self.marker = b"\x1e" + nonce.encode() + b" "
        self.parser = OutputParser(loop, stdout, stderr)
        self.done = loop.create_future()  # the status the runner printed; None when the runner died first
        self.error: Optional[BaseException] = None
        self._held = bytearray()

    @property
    def pid(self) -> Optional[int]:
        return self.parser.pid

    @property
    def pid_known(self) -> asyncio.Future:
        return self.parser.pid_known

    def interrupt(self) -> None:
        """Nothing to stop: the runner stays busy until the command's end, then serves again."""

    def feed(self, data: bytes) -> Optional[bytes]:
        """Output of this request; returns what came after its end marker (b"" at the end), None before it."""
        self._held += data
        at = self._held.find(self.marker)
        if at >= 0:
            newline = self._held.find(b"\n", at)
            if newline < 0:
                return None
            status = self._held[at + len(self.marker):newline]
            if at:
                self.parser.add(bytes(self._held[:at]))
            self.parser.flush()
            rest = bytes(self._held[newline + 1:])
            self._held.clear()
            self.parser.tell(self.done, int(status) if status.isdigit() else 255)
            return rest
        # Hold back only a tail that may be the start of the marker; the rest is output now.
        start = self._held.rfind(b"\x1e", max(0, len(self._held) - len(self.marker)))
        keep = start if start >= 0 and self.marker.startswith(bytes(self._held[start:])) else len(self._held)
        if keep:
            self.parser.add(bytes(self._held[:keep]))
            del self._held[:keep]
        return None

    def lost(self) -> None:
        """The runner died before this request's end."""
        if self._held:
            self.parser.add(bytes(self._held))
            self._held.clear()
        self.parser.flush()
        self.parser.tell(self.done, None)


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
        try:
            await asyncio.wait_for(asyncio.shield(self.started), timeout)
        except asyncio.TimeoutError:
            self.close()
            return False
        return self.pid is not None

    def _payload(self, kind: int, data: bytes) -> None:
        if kind == STDERR_STREAM:  # the runner's own complaints (its commands' stderr goes to stdout)
            said = data[:500].decode(errors="replace").strip()
            # the namespace helper of a view (-S reuse=namespace) says why it could not make or keep it
            (log.warning if said.startswith("hermes-batch-namespace:") else log.debug)("docker command runner: %s", said)
            return
        if self.pid is None:
            self._first += data
            newline = self._first.find(b"\n")
            if newline < 0:
                return
            line = bytes(self._first[:newline])
            data = bytes(self._first[newline + 1:])
            self._first.clear()
            if not line.isdigit():
                raise ValueError(f"the command runner did not start: {line[:200]!r}")
            self.pid = int(line)
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
