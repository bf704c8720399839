"""A container's command runner: one long-lived ``/bin/sh`` that runs each of a prompt's commands.

Starting a process in a container through its engine (a ``docker exec``, an
``apptainer exec instance://``) costs the engine far more than the command
itself, often more than the model's tool call.  The runner is one such process,
started once per prompt, whose stdin takes requests and whose stdout carries
their output: a command through it costs the engine nothing.  This module is the
part that does not depend on how the runner's stdin and stdout are carried (the
Docker plugin reads them from an exec's socket, the singularity plugin from a
subprocess's pipes): the script, the request lines and the parsing of what comes
back.

The script is POSIX ``/bin/sh`` (busybox ash, dash, bash; it needs ``setsid``,
``cat`` and ``printf %b``), so it needs nothing else in the image.  Each command
runs exactly as an exec would run it: started by ``setsid`` (its own session and
process group, whose pid the command's wrapper prints first), stdin from
/dev/null, stderr merged into stdout, in the sandbox's working folder, with the
runner's environment.  Its output goes through a pipe to ``cat`` and on to the
runner's stdout, so, as with an exec, the command is over when every process
holding its output has closed it; then the runner prints ``\\036<nonce> <status>``
(a nonce new for each request, so no output can end a request early by chance).
Timeouts, the output cap and kills stay on the caller's side, as for an exec.

A runner serves one request at a time.  Its commands run beside it, as its user,
and can write to its output or kill it: so nothing that must not be forged by the
prompt (a verifier's checks after ``Sandbox.stop_processes``) may go through it.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from typing import Optional

from ..session.command_output import BoundedOutput

# The runner: $1 is the working folder.  Each request is one line: a nonce, an operation and at most
# seven arguments, each "x" followed by its bytes with everything but [A-Za-z0-9._,:=+%@/-] as \0ooo.
# X runs its arguments (an argv) as an exec would; I likewise, but with the runner's stdin, from which the
# command must read exactly the bytes the line announces (a file's content follows its line); E exports its
# arguments (NAME=value).  A command's status comes back on fd 4 and its output through cat to fd 3 (the
# runner's stdout), which the command does not inherit: POSIX sh (busybox ash, dash, bash) with no pipefail.
# It prints its pid first.  Its own variables are named RESERVED_PREFIX..., so a prompt's variables of any other
# name (w, s, n, ...) reach its commands as the prompt set them.  Exit 98: the image has no setsid or cat (the sandbox then uses execs).
AGENT_SCRIPT = r"""set -f
exec 3>&1
_hbr_s=$(command -v setsid) && _hbr_c=$(command -v cat) || exit 98
_hbr_w=$1
echo "$$"
while IFS=' ' read -r _hbr_n _hbr_o _hbr_1 _hbr_2 _hbr_3 _hbr_4 _hbr_5 _hbr_6 _hbr_7; do
set --
for _hbr_v in "$_hbr_1" "$_hbr_2" "$_hbr_3" "$_hbr_4" "$_hbr_5" "$_hbr_6" "$_hbr_7"; do
[ -n "$_hbr_v" ] || break
_hbr_v=$(printf '%bx' "${_hbr_v#x}"); set -- "$@" "${_hbr_v%x}"
done
case $_hbr_o in
X) cd "$_hbr_w" 2>/dev/null
_hbr_r=$( { { "$_hbr_s" "$@" </dev/null 2>&1 3>&- 4>&-; echo "$?" >&4; } | "$_hbr_c" >&3 3>&- 4>&-; } 4>&1 ) ;;
I) cd "$_hbr_w" 2>/dev/null
_hbr_r=$( { { "$_hbr_s" "$@" 2>&1 3>&- 4>&-; echo "$?" >&4; } | "$_hbr_c" >&3 3>&- 4>&-; } 4>&1 ) ;;
E) for _hbr_v do export "$_hbr_v"; done; _hbr_r=0 ;;
*) _hbr_r=99 ;;
esac
printf '\036%s %s\n' "$_hbr_n" "${_hbr_r:-255}"
done
"""
NO_SETSID_OR_CAT = 98  # the runner's exit status when the image lacks setsid or cat
NO_STATUS = 255  # what the runner says when the command's subshell gave no status (it could not fork)
MAX_ARGS = 7
MAX_LINE = 64 * 1024  # longer requests run as execs: the shell reads a line a byte at a time
_SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._,:=+%@/-")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED_PREFIX = "_hbr_"  # the runner's own variables: a prompt's variable named so is not given through it


def exportable(name: str) -> bool:
    """Whether the runner can export a prompt's variable of this name (its ``E`` operation) to its commands."""
    return bool(ENV_NAME.match(name)) and not name.startswith(RESERVED_PREFIX)
_MAX_PID_LINE = 32


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


def first_line(held: bytearray, data: bytes) -> Optional[tuple]:
    """The runner's first line, its pid, once it is whole: ``(pid, what came after it)``; None until then (``held``
    keeps the start).  ValueError when the runner printed something else: it did not start."""
    held += data
    newline = held.find(b"\n")
    if newline < 0 and len(held) <= 32:  # a pid's line is shorter
        return None
    line, rest = bytes(held[:newline]), bytes(held[newline + 1:])
    held.clear()
    if newline < 0 or not line.isdigit():
        raise ValueError(f"the command runner did not start: {line[:200]!r}")
    return int(line), rest


def tell(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value) -> None:
    """From any thread: set ``future``'s result on ``loop`` (unless it is done, or the loop is gone)."""
    try:
        loop.call_soon_threadsafe(_set, future, value)
    except RuntimeError:  # the event loop is gone (the process is exiting)
        pass


def _set(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


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


class Request:
    """One request's output and end, fed with what the runner prints: ``done`` gets its status.

    ``done``'s result is the status the runner printed, or None when the runner died first (``lost``).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, nonce: str, stdout, stderr=None):
        self.marker = b"\x1e" + nonce.encode() + b" "
        self.parser = OutputParser(loop, stdout, stderr)
        self.done = loop.create_future()
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
            self.parser.tell(self.done, int(status) if status.isdigit() else NO_STATUS)
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


async def until_started(runner, timeout: float) -> bool:
    """Wait for a runner's first line (its pid): ``runner.started`` is a future set to its pid, or None when it
    died first.  False when it died or did not answer in ``timeout`` (then it is closed with ``runner.close()``)."""
    try:
        await asyncio.wait_for(asyncio.shield(runner.started), timeout)
    except asyncio.TimeoutError:
        runner.close()
        return False
    return runner.pid is not None
