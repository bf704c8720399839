"""Worker processes on this machine: the pipe protocol, the driver's end of it, and the worker's ``main``.

Each worker runs ``main`` in a process forked by the run's forkserver
(``hermes_batch.executors.forkserver``), with its standard input and output as the two
pipes of the protocol (the worker moves them aside at once and points fd 1 at
stderr, so a stray print cannot corrupt a message).  A message
is a 4-byte big-endian length and a pickle; the worker batches everything that
happened in one turn of its event loop into one message (a list).  The first
message from the driver is a WorkerSetup, then ``("lease", [...])``,
``("return",)`` and ``("batched", id, outcome)`` messages and finally ``("stop",)``.  End of input means the
driver is gone (SIGKILL, say): the worker stops the same way, closing its
sandboxes.

Workers run in a session of their own, so a Ctrl-C at the terminal reaches the
driver only, which then stops them in order.  The API key comes in the
worker's environment (``PromptWorker.environment``, handed to the forkserver
with the request to fork), which the worker clears before any sandbox starts;
the pickled setup never holds it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import struct
import sys
from typing import Optional

from .dispatch import WorkerError, WorkerLink, WorkerLost
from ..formats.jsonguard import TerminalFormatter
from .worker import PromptWorker, WorkerSetup

log = logging.getLogger("hermes_batch.executors.worker")

_HEADER = struct.Struct(">I")
STOP_TIMEOUT_S = 60.0  # for a worker to cancel its prompts and close their sandboxes before it is killed


def frame(message) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader):
    """The next message; IncompleteReadError at the end of the stream."""
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return pickle.loads(await reader.readexactly(size))


# --- the driver's end ------------------------------------------------------------------------


class PipeLink(WorkerLink):
    """A worker process, forked by the run's forkserver (``hermes_batch.executors.forkserver``)."""

    def __init__(self, proc, index: int, concurrency: int):
        self.proc = proc  # a ForkedWorker: pid, stdin, stdout, wait(), returncode, kill()
        self.index = index
        self.concurrency = concurrency
        self.name = f"worker process {index + 1} (pid {proc.pid})"

    @classmethod
    async def spawn(cls, forkserver, setup: WorkerSetup, api_key: Optional[str]) -> "PipeLink":
        try:
            proc = await forkserver.spawn(PromptWorker.environment(api_key))
        except OSError as exc:
            raise WorkerError(f"Worker process {setup.index + 1} could not be started ({exc}); "
                              "see the errors above it.") from None
        link = cls(proc, setup.index, setup.concurrency)
        await link.send(("setup", setup))
        return link

    async def send(self, message: tuple) -> None:
        try:
            self.proc.stdin.write(frame(message))
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise WorkerLost(f"its input pipe broke: {exc}") from None

    async def receive(self) -> list:
        try:
            return await read_frame(self.proc.stdout)
        except (asyncio.IncompleteReadError, ConnectionResetError):
            status = await self.proc.wait()
            if status is None:
                how = "its forkserver ended"
            else:
                how = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
            raise WorkerLost(how) from None

    async def close(self) -> None:
        proc = self.proc
        try:
            if proc.returncode is None:
                try:
                    await self.send(("stop",))
                    proc.stdin.close()
                except (WorkerLost, OSError):
                    pass
                try:
                    await asyncio.wait_for(asyncio.shield(proc.wait()), STOP_TIMEOUT_S)
                except TimeoutError:
                    log.warning("%s did not stop within %g s; killing it.", self.name, STOP_TIMEOUT_S)
                    proc.kill()
            await proc.wait()
        except ProcessLookupError:
            pass
        except asyncio.CancelledError:  # a second Ctrl-C: no more waiting
            if proc.returncode is None:
                proc.kill()
            raise


# --- the worker's end ------------------------------------------------------------------------


class _Outbox:
    """Collects a turn's messages and writes them as one frame when the loop is next free."""

    def __init__(self, transport: asyncio.WriteTransport):
        self.transport = transport
        self.worker: Optional[PromptWorker] = None
        self.pending: list = []
        self.scheduled = False

    def emit(self, message: tuple) -> None:
        self.pending.append(message)
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.scheduled = False
        if not self.pending:
            return
        messages, self.pending = self.pending, []
        if self.worker is not None:
            messages.append(self.worker.limits())
        try:
            data = frame(messages)
        except Exception:  # noqa: BLE001 - an outcome that cannot be pickled is a bug: the driver re-leases
            log.exception("A message to the driver could not be encoded; this worker stops.")
            os._exit(70)
        if not self.transport.is_closing():
            self.transport.write(data)


def _setup_logging(setup: WorkerSetup) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        TerminalFormatter(f"%(asctime)s %(levelname)s [worker {setup.index + 1}] %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger("hermes_batch")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if setup.plan.config.verbose else logging.WARNING)
    root.propagate = False


async def serve(read_fd: int, write_fd: int, api_key: Optional[str]) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", 0))
    transport, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(write_fd, "wb", 0))
    outbox = _Outbox(transport)
    try:
        _kind, setup = await read_frame(reader)
    except asyncio.IncompleteReadError:
        return
    _setup_logging(setup)
    worker = outbox.worker = PromptWorker(setup, outbox.emit, api_key=api_key)
    try:
        await worker.start()
        while True:
            try:
                message = await read_frame(reader)
            except asyncio.IncompleteReadError:
                break  # the driver is gone
            if message[0] == "lease":
                worker.lease(message[1])
            elif message[0] == "batched":
                worker.batched(message[1], message[2])
            elif message[0] == "return":
                worker.take_back()
            elif message[0] == "stop":
                break
    finally:
        try:
            await asyncio.wait_for(worker.stop(), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            # Nothing may keep a worker alive once it is told to stop or its driver is gone: the driver kills
            # a stuck one, but a dead driver cannot.  Its namespaces end with it (their pipes close).
            log.warning("The worker did not stop within %g s; it exits now.", STOP_TIMEOUT_S)
            os._exit(1)
        outbox.flush()
        # wait for the last frame to leave before the process ends
        while transport.get_write_buffer_size() and not transport.is_closing():
            await asyncio.sleep(0.01)
        transport.close()


def main() -> int:
    import signal

    # Ctrl-C is the driver's to handle: it stops its workers in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    api_key = PromptWorker.take_api_key()  # gone from the environment before any sandbox or tool starts
    read_fd, write_fd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    # Not asyncio.run, which waits for every thread of the default pool: the forkserver ends the process
    # with os._exit, so a call stuck in a thread keeps no worker alive.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(serve(read_fd, write_fd, api_key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
