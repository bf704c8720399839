"""``hermes-batch ctl``: a running run steered through a unix socket in its run folder.

The run listens on ``RUN_DIR/control/socket`` (the folder mode 0700, the socket 0600) while its prompts
run, and answers each connection from a process of its own user (SO_PEERCRED; any other is refused) with
one JSON line.  A request is one JSON line of at most ``MAX_REQUEST`` bytes, read within
``REQUEST_TIMEOUT_S``: ``{"command": "status" | "pause" | "resume" | "workers" | "max_cost" | "stop",
"value": ...}``.  Unix socket paths are limited to 107 bytes, so both sides reach the socket through the
folder's descriptor (``/proc/self/fd/N/socket``), whatever the run folder's path.  A socket left by a run
that was killed is removed when the next run of the folder starts (it holds the folder's lock, so no
other run can be listening), and ``ctl`` says no run is listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import stat
import struct
from pathlib import Path
from typing import Callable, Optional

from ..errors import HermesBatchError
from ..folder.control_socket import COMMANDS, CONTROL_DIR, MAX_REQUEST, REQUEST_TIMEOUT_S, SOCKET_NAME, open_folder, through

log = logging.getLogger("hermes_batch.run")


class RunControl:
    """The live settings ``ctl`` changes, and what the run's parts wait on.

    ``paused``: no prompt starts and no model call goes out (running commands go on).  ``workers``: prompts
    that may run at once, between 1 and the run's ``--num_workers`` (its executor's sessions and the limits
    of the machine were sized for that).  The budget and the stop are the engine's (``status``, ``set_max_cost``,
    ``stop`` callbacks).
    """

    def __init__(self, workers: int, *, limiter=None, status: Callable[[], dict] = dict,
                 set_max_cost: Callable[[float], None] = lambda _cost: None, stop: Callable[[], None] = lambda: None,
                 gates_prompts: bool = True):
        self.max_workers = self.workers = workers
        self.limiter = limiter
        self.paused = False
        self.running = 0  # prompts past the gate
        self.gates_prompts = gates_prompts  # the executor's prompts pass through ``gate`` (the local executor)
        self._status, self._set_max_cost, self._stop = status, set_max_cost, stop
        self._changed = asyncio.Event()

    # --- what the prompts wait on ---------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def gate(self):
        """Held while a prompt runs: it starts only unpaused and with fewer than ``workers`` running."""
        while self.paused or self.running >= self.workers:
            self._changed.clear()
            await self._changed.wait()
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._wake()

    def _wake(self) -> None:
        self._changed.set()

    # --- the commands -------------------------------------------------------------------------

    def handle(self, request) -> dict:
        """The answer to one request (already parsed JSON, not trusted)."""
        if not isinstance(request, dict) or request.get("command") not in COMMANDS:
            return _error(f"The request names no command; send one of {', '.join(COMMANDS)}.")
        command, value = request["command"], request.get("value")
        if command in ("pause", "resume", "workers") and not self.gates_prompts:
            return _error(f"{command} needs the local executor, which runs the prompts in the run's own process; "
                          "this run's executor runs them elsewhere.")
        if command == "pause":
            self.paused = True
            if self.limiter is not None:
                self.limiter.pause()
            log.warning("Paused by hermes-batch ctl: no prompt starts and no model call goes out until resume.")
        elif command == "resume":
            self.paused = False
            if self.limiter is not None:
                self.limiter.resume()
            self._wake()
            log.warning("Resumed by hermes-batch ctl.")
        elif command == "workers":
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= self.max_workers:
                return _error(f"workers takes a whole number from 1 to {self.max_workers} (the run's --num_workers).")
            self.workers = value
            self._wake()
            log.warning("hermes-batch ctl: at most %d prompt(s) run at once now.", value)
        elif command == "max_cost":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                return _error("max_cost takes a number of dollars, 0 or more.")
            self._set_max_cost(float(value))
            log.warning("hermes-batch ctl: the cost budget --max_cost is %g now.", value)
        elif command == "stop":
            log.warning("Stopped by hermes-batch ctl; run the same command with --resume to continue.")
            self._stop()
        return {"ok": True, "status": self.status()}

    def status(self) -> dict:
        return {"paused": self.paused, "workers": self.workers, "max_workers": self.max_workers,
                "running": self.running, **self._status()}


def _error(message: str) -> dict:
    return {"ok": False, "error": message}


# --- the socket ---------------------------------------------------------------------------------


class ControlServer:
    """The run's end of ``ctl``: ``await start()``, ``await close()``."""

    def __init__(self, run_dir: Path, control: RunControl):
        self.run_dir, self.control = Path(run_dir), control
        self._server: Optional[asyncio.AbstractServer] = None
        self._fd: Optional[int] = None

    async def start(self) -> None:
        fd = self._fd = open_folder(self.run_dir, create=True)
        with contextlib.suppress(FileNotFoundError):
            # the run holds the folder's lock: a socket here was left by a run that was killed
            if not stat.S_ISSOCK(os.stat(SOCKET_NAME, dir_fd=fd, follow_symlinks=False).st_mode):
                raise HermesBatchError(f"{self.run_dir / CONTROL_DIR / SOCKET_NAME} is not a socket; move it away.")
            os.unlink(SOCKET_NAME, dir_fd=fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)  # made 0600, never briefly wider
            try:
                sock.bind(through(fd))
            finally:
                os.umask(old)
            sock.listen(16)
            sock.setblocking(False)
            self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=MAX_REQUEST)
        except BaseException:
            sock.close()
            raise

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(SOCKET_NAME, dir_fd=self._fd)
            os.close(self._fd)
            self._fd = None
            with contextlib.suppress(OSError):
                os.rmdir(self.run_dir / CONTROL_DIR)  # only when empty

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sock = writer.get_extra_info("socket")
            _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                  struct.calcsize("3i")))
            if uid != os.geteuid():
                answer = _error("This run belongs to another user.")
            else:
                answer = self._answer(await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT_S))
            writer.write(json.dumps(answer).encode() + b"\n")
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (asyncio.TimeoutError, ValueError, OSError):  # ValueError: a line past MAX_REQUEST
            pass
        finally:
            writer.close()

    def _answer(self, line: bytes) -> dict:
        try:
            request = json.loads(line.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError):
            return _error("The request is not one line of JSON.")
        return self.control.handle(request)


class GatedProcessor:
    """The prompt processor as the executor sees it under ``ctl``: each prompt passes the control's gate."""

    def __init__(self, processor, control: RunControl):
        self._processor, self._control = processor, control

    def __getattr__(self, name):
        return getattr(self._processor, name)

    async def process(self, job):
        async with self._control.gate():
            return await self._processor.process(job)
