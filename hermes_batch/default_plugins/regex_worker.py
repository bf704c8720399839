"""Regular expressions matched off the event loop, in child processes that a time limit really stops.

A row's pattern comes from the dataset and the text from the model: ``(a+)+$``
against 27 ``a`` and a ``!`` backtracks for many seconds, and ``re`` holds the
GIL while it does, so neither the event loop's timeouts nor a thread could
stop it (a thread cannot be killed).  Each match runs in a small child process
(regex_child.py, started once and reused for the next matches); when the
match is cancelled (its verifier's time ran out, or Ctrl-C) that process is
killed and the next match starts another.  The child gets no environment (no
key of the run's) and dies with the run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Optional

log = logging.getLogger("hermes_batch.prompt")

CHILD = Path(__file__).with_name("regex_child.py")
MAX_WORKERS = 16  # matches at once (each a process); more wait for one, within their own time limit
MAX_IDLE = 2  # processes kept for the next matches
MAX_REPLY_BYTES = 4096


class RegexError(ValueError):
    """The pattern is not a valid regular expression, or matching it failed; the message says why."""


class _Worker:
    """One child process and its pipes."""

    def __init__(self, process: asyncio.subprocess.Process):
        self.process = process

    async def ask(self, payload: bytes) -> dict:
        self.process.stdin.write(struct.pack(">I", len(payload)) + payload)
        await self.process.stdin.drain()
        (size,) = struct.unpack(">I", await self.process.stdout.readexactly(4))
        if size > MAX_REPLY_BYTES:
            raise RuntimeError(f"the regex worker answered {size} bytes")
        reply = json.loads(await self.process.stdout.readexactly(size))
        if not isinstance(reply, dict):
            raise RuntimeError("the regex worker answered something else than an object")
        return reply

    def kill(self) -> None:
        try:
            os.kill(self.process.pid, signal.SIGKILL)  # also from another loop than the one that started it
        except ProcessLookupError:
            pass


class RegexWorkers:
    """``re.search`` in reusable child processes; a match that is cancelled kills its process."""

    def __init__(self, max_workers: int = MAX_WORKERS, max_idle: int = MAX_IDLE):
        self.max_workers, self.max_idle = max_workers, max_idle
        self._idle: list[_Worker] = []
        self._slots: Optional[asyncio.Semaphore] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._reaping: set = set()
        self._waiting = 0  # matches waiting for a process
        self.started = self.killed = 0  # processes started, and killed with a match under way

    async def search(self, pattern: str, text: str) -> bool:
        """Whether ``pattern`` is found in ``text`` (``re.search``); RegexError for a pattern ``re`` refuses.

        Cancelling it (a timeout around it) kills the process the match runs in, at once.
        """
        payload = json.dumps({"pattern": pattern, "text": text}).encode()  # ASCII: any str travels whole
        self._bind()
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            worker = self._idle.pop() if self._idle else await self._start()
            try:
                reply = await worker.ask(payload)
            except BaseException as exc:  # cancelled mid-match (the verifier's timeout), or the process died
                self._retire(worker)
                if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)):
                    self.killed += 1
                    log.info("a regular expression still matching when its time ran out: its process was killed")
                    raise
                if isinstance(exc, (OSError, EOFError, asyncio.IncompleteReadError, ValueError)):
                    raise RuntimeError(f"the regex worker process failed while matching ({exc!r})") from None
                raise
            self._keep(worker)
        finally:
            self._slots.release()
        if "error" in reply:
            raise RegexError(str(reply["error"])[:300])
        return reply.get("match") is True

    async def aclose(self) -> None:
        """End every process (idle ones, and any still being killed)."""
        ours = self._loop is asyncio.get_running_loop()
        idle, self._idle = self._idle, []
        for worker in idle:
            if ours:
                self._retire(worker)
            else:  # started under a loop that is gone: its process is only killed
                worker.kill()
        if ours and self._reaping:
            await asyncio.gather(*self._reaping, return_exceptions=True)

    def _bind(self) -> None:
        """Use the running loop; processes started under another one (closed since) are killed."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        for worker in self._idle:
            worker.kill()
        self._idle, self._reaping = [], set()
        self._loop, self._slots = loop, asyncio.Semaphore(self.max_workers)

    async def _start(self) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", str(CHILD), str(os.getpid()),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={}, start_new_session=True,  # no key of the run's; a terminal's Ctrl-C is the run's to handle
        )
        self.started += 1
        return _Worker(process)

    def _keep(self, worker: _Worker) -> None:
        if len(self._idle) < max(self.max_idle, self._waiting):  # a match waiting takes it: none started for it
            self._idle.append(worker)
        else:
            self._retire(worker)

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        reaping = asyncio.ensure_future(worker.process.wait())
        self._reaping.add(reaping)
        reaping.add_done_callback(self._reaping.discard)
