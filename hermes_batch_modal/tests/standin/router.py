"""The stand-in's task command router: exec, its output streams, stdin and exit status, run for real in the container."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from grpclib import GRPCError, Status
from modal_proto import task_command_router_grpc, task_command_router_pb2 as sr

from .control import unimplemented
from .engine import EngineError
from .state import Exec, Output, Sandbox

if TYPE_CHECKING:
    from . import ModalStandIn

CHUNK = 64 * 1024
_STDOUT, _STDERR = 1, 2


class CommandRouter(task_command_router_grpc.TaskCommandRouterBase):
    def __init__(self, standin: "ModalStandIn"):
        self.standin = standin

    def _authorized(self, stream, task_id: str) -> Sandbox:
        sandbox = self.standin.tasks.get(task_id)
        if sandbox is None:
            raise GRPCError(Status.NOT_FOUND, f"task {task_id} not found")
        authorization = dict(stream.metadata or {}).get("authorization", "")
        if authorization != f"Bearer {sandbox.jwt}":
            raise GRPCError(Status.UNAUTHENTICATED, "bad or missing command router token")
        return sandbox

    def _task(self, stream, task_id: str) -> Sandbox:
        sandbox = self._authorized(stream, task_id)
        if not sandbox.running:
            raise GRPCError(Status.NOT_FOUND, f"task {task_id} has finished")
        return sandbox

    def _exec(self, stream, task_id: str, exec_id: str) -> Exec:
        process = self._authorized(stream, task_id).execs.get(exec_id)
        if process is None:
            raise GRPCError(Status.NOT_FOUND, f"exec {exec_id} not found")
        return process

    async def TaskExecStart(self, stream):
        request = await stream.recv_message()
        sandbox = self._task(stream, request.task_id)
        if request.timeout_secs:
            raise GRPCError(Status.INVALID_ARGUMENT, "the stand-in does not implement exec timeouts")
        if request.pty_info.pty_type:
            raise GRPCError(Status.INVALID_ARGUMENT, "the stand-in does not implement PTYs")
        if request.exec_id in sandbox.execs:  # an idempotent retry
            await stream.send_message(sr.TaskExecStartResponse())
            return
        env = {}
        for source in request.secret_sources:
            env.update(source.env.contents)
        engine = self.standin.engine
        try:
            engine_exec = await engine.exec_create(sandbox.container_id, list(request.command_args), request.workdir, env)
            connection = await engine.exec_start(engine_exec)
        except EngineError as exc:
            if not await engine.running(sandbox.container_id):
                raise GRPCError(Status.NOT_FOUND, f"task {request.task_id} is not running") from exc
            raise GRPCError(Status.FAILED_PRECONDITION, exc.message) from exc
        process = Exec(request.exec_id, sandbox, engine_exec, connection)
        sandbox.execs[request.exec_id] = process
        self.standin.exec_count += 1
        if request.stdout_config == sr.TASK_EXEC_STDOUT_CONFIG_DEVNULL:
            await process.stdout.close()
        if request.stderr_config == sr.TASK_EXEC_STDERR_CONFIG_DEVNULL:
            await process.stderr.close()
        process.tasks.append(asyncio.ensure_future(self._pump(process, request)))
        process.tasks.append(asyncio.ensure_future(self._watch_exit(process)))
        await stream.send_message(sr.TaskExecStartResponse())

    async def _pump(self, process: Exec, request) -> None:
        keep = {
            _STDOUT: None if request.stdout_config == sr.TASK_EXEC_STDOUT_CONFIG_DEVNULL else process.stdout,
            _STDERR: None if request.stderr_config == sr.TASK_EXEC_STDERR_CONFIG_DEVNULL else process.stderr,
        }
        queue: asyncio.Queue = asyncio.Queue(maxsize=16)
        closing = lambda: not process.sandbox.running  # noqa: E731

        async def feed() -> None:
            while True:
                item = await queue.get()
                if item is None:
                    return
                kind, data = item
                output = keep.get(kind)
                if output is not None:
                    await output.add(data, closing)

        feeder = asyncio.ensure_future(feed())
        try:
            await self._read_frames(process, queue)
            await queue.put(None)
            await feeder
        finally:
            feeder.cancel()
            await process.stdout.close()
            await process.stderr.close()

    async def _read_frames(self, process: Exec, queue: asyncio.Queue) -> None:
        # The queue is bounded: a slow reader stalls the engine stream, and so the command's writes.
        reader = process.connection.reader
        try:
            while True:
                header = await reader.readexactly(8)
                kind, size = header[0], int.from_bytes(header[4:8], "big")
                data = await reader.readexactly(size) if size else b""
                await queue.put((kind, data))
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    async def _watch_exit(self, process: Exec) -> None:
        delay = 0.005
        engine = self.standin.engine
        while True:
            try:
                info = await engine.exec_inspect(process.engine_exec_id)
            except EngineError:
                info = {"Running": False, "ExitCode": 137}
            if not info.get("Running") and info.get("ExitCode") is not None:
                process.exit_code = int(info["ExitCode"])
                process.exited.set()
                return
            if not process.sandbox.running:
                process.exit_code = 137
                process.exited.set()
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def TaskExecStdioRead(self, stream):
        request = await stream.recv_message()
        process = self._exec(stream, request.task_id, request.exec_id)
        output: Output = process.stdout if request.file_descriptor == sr.TASK_EXEC_STDIO_FILE_DESCRIPTOR_STDOUT else process.stderr
        offset = request.offset
        while True:
            async with output.changed:
                await output.changed.wait_for(lambda: output.end > offset or output.eof or not process.sandbox.running)
                if offset < output.base:
                    raise GRPCError(Status.OUT_OF_RANGE, f"output before offset {output.base} is gone")
                chunk = bytes(output.data[offset - output.base: offset - output.base + CHUNK])
                done = not chunk and (output.eof or not process.sandbox.running)
            if done:
                return
            await stream.send_message(sr.TaskExecStdioReadResponse(data=chunk))
            offset += len(chunk)
            async with output.changed:
                output.read_offset = max(output.read_offset, offset)
                output.forget_before(output.read_offset)
                output.changed.notify_all()

    async def TaskExecStdinWrite(self, stream):
        request = await stream.recv_message()
        process = self._exec(stream, request.task_id, request.exec_id)
        if request.offset != process.stdin_written:
            # A retried write: only the bytes not yet written go through.
            skip = process.stdin_written - request.offset
            if skip < 0:
                raise GRPCError(Status.OUT_OF_RANGE, f"stdin gap: at {process.stdin_written}, got {request.offset}")
            data = request.data[skip:]
        else:
            data = request.data
        if data and not process.stdin_closed:
            try:
                await process.connection.write(data)
            except (ConnectionError, OSError):
                pass  # the command exited; a real pipe would say EPIPE to it, not to the writer
            process.stdin_written += len(data)
        if request.eof and not process.stdin_closed:
            process.stdin_closed = True
            process.connection.close_stdin()
        await stream.send_message(sr.TaskExecStdinWriteResponse())

    async def TaskExecWait(self, stream):
        request = await stream.recv_message()
        process = self._exec(stream, request.task_id, request.exec_id)
        await process.exited.wait()
        await stream.send_message(sr.TaskExecWaitResponse(code=process.exit_code))

    async def TaskExecPoll(self, stream):
        request = await stream.recv_message()
        process = self._exec(stream, request.task_id, request.exec_id)
        response = sr.TaskExecPollResponse()
        if process.exited.is_set():
            response.code = process.exit_code
        await stream.send_message(response)


unimplemented(CommandRouter, task_command_router_grpc.TaskCommandRouterBase)
