"""Worker processes that start warm: forked from one process that has already imported what they need.

A fresh ``python -m hermes_batch.executors.pipe_worker`` spent about 2 s of CPU importing the
engine, the plugins and the model SDK before its first prompt, once per worker:
on a 2-core machine a seventh of a 1000-prompt run's CPU.  The processes
executor starts one forkserver instead (``python -m hermes_batch.executors.forkserver``),
which imports the packages the driver had imported when the run started (the
engine and the plugins) and the model client's SDK (``ModelClient.packages``)
once, while the driver checks the sandbox engine and sends the preflight
request, then forks each worker on request.  It has no threads and no event loop, so
a forked worker starts clean; the worker then runs ``pipe_worker.main`` as a
spawned one would.

The driver and the forkserver talk over a SOCK_SEQPACKET socket pair, one
pickled message per packet:

- driver to forkserver (after the names of the packages to import, pickled on
  its standard input): ``("spawn", env)`` with the worker's input and output pipe ends attached
  (``env`` is ``PromptWorker.environment``: the API key, which the worker takes
  out of its environment at once, as before) and ``("kill", pid)``;
- forkserver to driver: ``("pid", pid)`` for each spawn, in order, and
  ``("exit", pid, returncode)`` when a worker ended.  The forkserver is the
  workers' parent: it signals a worker only before it reaped it, so a kill
  never reaches a process that took the number over.

The forkserver leads a session of its own (Ctrl-C reaches only the driver) and
ends when the driver's end of the socket closes, also when the driver is
killed; each worker hears of that on its own input, as before.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import traceback
from typing import Optional

_MAX_MESSAGE = 1 << 20


class ForkedWorker:
    """A worker process forked by the forkserver, with what PipeLink uses of an asyncio subprocess."""

    def __init__(self, server: "Forkserver", pid: int, exited: asyncio.Future,
                 stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader):
        self._server = server
        self._exited = exited  # its exit status, or None when the forkserver ended first
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout

    @property
    def returncode(self) -> Optional[int]:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> Optional[int]:
        return await asyncio.shield(self._exited)

    def kill(self) -> None:
        """SIGKILL the worker, through the forkserver (its parent); nothing once it ended or the forkserver did:
        then only the end of its input stops it."""
        if not self._exited.done():
            try:
                self._server.send(("kill", self.pid))
            except OSError:
                pass


class Forkserver:
    """The driver's end: starts the forkserver, asks it for workers, hears when they end."""

    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket):
        self.proc = proc
        self.sock = sock
        self._answers: collections.deque = collections.deque()  # futures of the spawns asked, in order
        self._exits: dict[int, asyncio.Future] = {}  # of the workers not yet ended
        self._closed = False
        asyncio.get_running_loop().add_reader(sock.fileno(), self._on_message)

    @classmethod
    async def start(cls, packages: tuple = ()) -> "Forkserver":
        """Start the forkserver and have it import what this process has imported so far, and ``packages``."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "hermes_batch.executors.forkserver", str(theirs.fileno()),
                stdin=subprocess.PIPE, pass_fds=(theirs.fileno(),), start_new_session=True,
            )
        finally:
            theirs.close()
        # The packages to import, on its input (a list too long for one packet under a test runner):
        # importing a package brings most of what its modules need.
        imports = sorted({name.partition(".")[0] for name in sys.modules} - {"__main__"} | set(packages))
        server = cls(proc, ours)
        try:
            proc.stdin.write(pickle.dumps(imports, protocol=pickle.HIGHEST_PROTOCOL))
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            server._lost()  # it ended already: spawn() says so
        return server

    def send(self, message: tuple, fds: tuple = ()) -> None:
        if self._closed:
            raise OSError("the forkserver has ended")
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if fds:
            socket.send_fds(self.sock, [data], list(fds))
        else:
            self.sock.send(data)

    async def spawn(self, env: dict) -> ForkedWorker:
        """A new worker process whose environment gains ``env``; raises OSError when the forkserver is gone."""
        loop = asyncio.get_running_loop()
        input_read, input_write = os.pipe()
        output_read, output_write = os.pipe()
        ours = (input_write, output_read)
        try:
            try:
                self.send(("spawn", env), (input_read, output_write))
            finally:
                os.close(input_read)  # the worker's ends: the forkserver has its own copies now
                os.close(output_write)
            answer = loop.create_future()
            self._answers.append(answer)
            pid = await answer
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        stdout = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), os.fdopen(output_read, "rb", 0))
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(input_write, "wb", 0)
        )
        stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        return ForkedWorker(self, pid, self._exits[pid], stdin, stdout)

    def _on_message(self) -> None:
        try:
            data = self.sock.recv(_MAX_MESSAGE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._lost()
            return
        message = pickle.loads(data)
        if message[0] == "exit":
            exited = self._exits.pop(message[1], None)
            if exited is not None and not exited.done():
                exited.set_result(message[2])
            return
        answer = self._answers.popleft()  # "pid" or "error", for the oldest spawn asked
        if message[0] == "pid":
            # made here, not in spawn(): the worker's end may be heard before spawn() resumes
            self._exits[message[1]] = asyncio.get_running_loop().create_future()
            if answer.cancelled():
                self.send(("kill", message[1]))
            else:
                answer.set_result(message[1])
        elif not answer.done():
            answer.set_exception(OSError(message[1]))

    def _lost(self) -> None:
        """The forkserver ended, or we closed it: nothing more will be heard of its workers."""
        if self._closed:
            return
        self._closed = True
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
        for answer in self._answers:
            if not answer.done():
                answer.set_exception(OSError("the forkserver ended"))
        self._answers.clear()
        for exited in self._exits.values():
            if not exited.done():
                exited.set_result(None)
        self._exits.clear()

    async def close(self) -> None:
        """Stop the forkserver (its workers were stopped before); it exits at the end of its input."""
        self._lost()
        self.sock.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()


# --- the forkserver --------------------------------------------------------------------------


def _preload(names: list) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module that cannot be imported here is the worker's to report
            pass


def _fork(sock: socket.socket, selector, wakeup: tuple, fds: list, env: dict) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 70
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        selector.close()
        sock.close()
        for fd in wakeup:
            os.close(fd)
        os.dup2(fds[0], 0)
        os.dup2(fds[1], 1)
        for fd in fds:
            os.close(fd)
        os.environ.update(env)
        from .pipe_worker import main as worker_main

        code = worker_main()
    except BaseException:  # noqa: BLE001 - the worker's end, whatever it was
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(sock: socket.socket) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's
    wakeup = os.pipe()
    for fd in wakeup:
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wakeup[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wakeup[0], selectors.EVENT_READ)
    live: set[int] = set()
    while True:
        for key, _ in selector.select():
            if key.fileobj is sock:
                data, fds, _flags, _address = socket.recv_fds(sock, _MAX_MESSAGE, 2)
                if not data:
                    return 0  # the driver is gone, or done
                message = pickle.loads(data)
                if message[0] == "spawn":
                    try:
                        pid = _fork(sock, selector, wakeup, fds, message[1])
                    except OSError as exc:
                        sock.send(pickle.dumps(("error", f"could not fork a worker: {exc}")))
                    else:
                        live.add(pid)
                        sock.send(pickle.dumps(("pid", pid)))
                    finally:
                        for fd in fds:
                            os.close(fd)
                elif message[0] == "kill" and message[1] in live:
                    os.kill(message[1], signal.SIGKILL)  # not reaped yet: the pid is still the worker's
            else:
                try:
                    os.read(wakeup[0], 4096)
                except BlockingIOError:
                    pass
                while live:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    live.discard(pid)
                    sock.send(pickle.dumps(("exit", pid, os.waitstatus_to_exitcode(status))))


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    _preload(pickle.loads(sys.stdin.buffer.read()))
    from .worker import plugin_registry

    plugin_registry()  # each worker would load the entry points again
    try:
        code = serve(sock)
    except (BrokenPipeError, ConnectionResetError):
        code = 0  # the driver is gone
    # Nothing to flush or clean up: skip the interpreter's teardown of everything it imported (a fifth of a
    # second the driver waited at the end of every run).
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
