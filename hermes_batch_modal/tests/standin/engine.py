"""The stand-in's executor: one container of the local Docker engine per sandbox, driven through its HTTP API.

Asynchronous over the engine's Unix socket (aiohttp for plain calls, a raw
connection for exec, whose output and stdin share one hijacked stream), so the
stand-in's event loop never blocks on the engine.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Optional
from urllib.parse import quote

import aiohttp

LABEL = "org.hermes-batch.modal-standin"  # every container the stand-in makes carries it (value: the stand-in's id)
LABEL_ISSUE = "org.hermes-batch.issue"  # and the issue it was written for, so a neighbour can tell whose it is


class EngineError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def socket_path() -> str:
    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if not host.startswith("unix://"):
        raise RuntimeError(f"the Modal stand-in needs a local Docker engine on a Unix socket, not DOCKER_HOST={host}")
    return host[len("unix://"):]


class Engine:
    """The few Docker Engine API calls the stand-in makes."""

    def __init__(self):
        self.path = socket_path()
        self._session: Optional[aiohttp.ClientSession] = None

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.UnixConnector(path=self.path, limit=64)
            self._session = aiohttp.ClientSession(connector=connector, base_url="http://docker")
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def call(self, method: str, path: str, body=None, ok=(200, 201, 204, 304)):
        session = await self._http()
        async with session.request(method, path, json=body) as response:
            data = await response.read()
            if response.status not in ok:
                try:
                    message = json.loads(data).get("message", "")
                except ValueError:
                    message = data.decode(errors="replace")
                raise EngineError(response.status, message)
            if data and response.content_type == "application/json":
                return json.loads(data)
            return None

    async def ping(self) -> None:
        await self.call("GET", "/_ping")

    async def image_exists(self, name: str) -> bool:
        try:
            await self.call("GET", f"/images/{quote(name, safe='')}/json")
            return True
        except EngineError as exc:
            if exc.status == 404:
                return False
            raise

    async def run_container(
        self, name: str, image: str, command: list, env: dict, labels: dict, host_config: dict, workdir: str = ""
    ) -> str:
        created = await self.call(
            "POST",
            f"/containers/create?name={quote(name)}",
            {
                "Image": image,
                "Entrypoint": [],
                "Cmd": command,
                "Env": [f"{k}={v}" for k, v in env.items()],
                "Labels": labels,
                "HostConfig": host_config,
                "WorkingDir": workdir,
                "AttachStdin": False,
                "Tty": False,
            },
        )
        container_id = created["Id"]
        try:
            await self.call("POST", f"/containers/{container_id}/start")
        except BaseException:
            await self.remove(container_id)
            raise
        return container_id

    async def remove(self, container_id: str) -> None:
        try:
            await self.call("DELETE", f"/containers/{container_id}?force=1&v=1")
        except EngineError as exc:
            if exc.status not in (404, 409):
                raise

    async def kill(self, container_id: str) -> None:
        try:
            await self.call("POST", f"/containers/{container_id}/kill")
        except EngineError as exc:
            if exc.status not in (404, 409):
                raise

    async def running(self, container_id: str) -> bool:
        try:
            info = await self.call("GET", f"/containers/{container_id}/json")
        except EngineError as exc:
            if exc.status == 404:
                return False
            raise
        return bool(info["State"].get("Running"))

    async def containers(self, label: str) -> list:
        filters = quote(json.dumps({"label": [label]}))
        return await self.call("GET", f"/containers/json?all=1&filters={filters}")

    async def exec_create(self, container_id: str, argv: list, workdir: str, env: dict) -> str:
        body = {
            "Cmd": argv,
            "AttachStdin": True,
            "AttachStdout": True,
            "AttachStderr": True,
            "Tty": False,
            "Env": [f"{k}={v}" for k, v in env.items()],
        }
        if workdir:
            body["WorkingDir"] = workdir
        created = await self.call("POST", f"/containers/{container_id}/exec", body)
        return created["Id"]

    async def exec_inspect(self, exec_id: str) -> dict:
        return await self.call("GET", f"/exec/{exec_id}/json")

    async def exec_start(self, exec_id: str) -> "ExecConnection":
        reader, writer = await asyncio.open_unix_connection(self.path, limit=1 << 20)
        body = b'{"Detach":false,"Tty":false}'
        writer.write(
            (
                f"POST /exec/{exec_id}/start HTTP/1.1\r\nHost: docker\r\nContent-Type: application/json\r\n"
                f"Connection: Upgrade\r\nUpgrade: tcp\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        await writer.drain()
        status_line = await reader.readline()
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        parts = status_line.split()
        if len(parts) < 2 or parts[1] not in (b"101", b"200"):
            writer.close()
            raise EngineError(int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 500, status_line.decode(errors="replace"))
        return ExecConnection(reader, writer)


class ExecConnection:
    """The hijacked stream of one exec: multiplexed stdout/stderr frames (8-byte headers) in, stdin out."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def close_stdin(self) -> None:
        try:
            if self.writer.can_write_eof():
                self.writer.write_eof()
        except (OSError, RuntimeError):
            pass

    def close(self) -> None:
        self.writer.close()
