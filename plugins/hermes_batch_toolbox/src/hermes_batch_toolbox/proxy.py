"""The browser's only way out: an HTTP proxy that resolves names itself and connects only where the policy permits.

Chromium is told to send every request of a prompt's context here (Playwright
adds ``<-loopback>`` so that loopback is proxied too, and WebRTC may not send
UDP around it).  Each plain-HTTP request and each CONNECT tunnel (https,
WebSockets) names a host; the proxy resolves it, keeps only the addresses
:class:`~.urls.AddressPolicy` permits and connects to one of those by address,
so a DNS answer cannot change between check and connection.  Redirects,
frames, scripts' requests and popups all arrive here one by one, so every hop
is judged on the address actually connected to.

A refused request gets ``403`` with the sentence for the model in the
``X-Hermes-Batch-Refused`` header and in the page; a refused tunnel gets
``403`` (Chromium shows ERR_TUNNEL_CONNECTION_FAILED) and the proxy keeps the
sentence (:meth:`GuardedProxy.latest`), as it keeps why a connection failed.  One proxy serves one browser
context and holds at most ``max_connections`` client connections, each with at
most one connection onwards: ``1 + 2 * max_connections`` descriptors.
"""

from __future__ import annotations

import asyncio
import collections
import html
import ipaddress
import logging
import socket
from typing import Optional
from urllib.parse import urlsplit

from .urls import AddressPolicy, is_localhost_name

log = logging.getLogger("hermes_batch_toolbox.proxy")

REFUSED_HEADER = "X-Hermes-Batch-Refused"
MAX_CONNECTIONS = 32  # Chromium's own limit of connections to one proxy per profile
HEAD_LIMIT = 64 * 1024  # bytes of a request line and headers
HEAD_TIMEOUT_S = 30.0
CHUNK = 64 * 1024
_HOP_HEADERS = frozenset({b"proxy-connection", b"proxy-authorization", b"connection", b"keep-alive", b"te", b"trailer",
                          b"upgrade"})


def descriptors(max_connections: int = MAX_CONNECTIONS) -> int:
    """Most descriptors one proxy holds: its listening socket, and per client connection one onwards."""
    return 1 + 2 * max_connections


class Refused(Exception):
    """The request may not go where it asks; the message is the sentence for the model."""


class GuardedProxy:
    """A proxy on 127.0.0.1 for one browser context (see the module's docstring)."""

    def __init__(self, policy: AddressPolicy, *, connect_timeout: float, max_connections: int = MAX_CONNECTIONS):
        self.policy = policy
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self.port = 0
        self.notes: collections.deque = collections.deque(maxlen=20)  # refusals and failures, the latest last
        self.refusals = 0
        self.connections = 0  # client connections open now
        self.turned_away = 0  # client connections closed at once because max_connections were open
        self._server: Optional[asyncio.AbstractServer] = None
        self._tasks: set = set()

    @property
    def server(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> "GuardedProxy":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=HEAD_LIMIT, backlog=64)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        """Stop listening and cut every connection; safe to call again."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def latest(self) -> Optional[str]:
        """The sentence of the latest refused or failed connection, if any since :meth:`forget`."""
        return self.notes[-1] if self.notes else None

    def forget(self) -> None:
        self.notes.clear()

    def _refused(self, exc: "Refused") -> str:
        self.refusals += 1
        self.notes.append(str(exc))
        return str(exc)

    def _failed(self, host: str, exc: OSError) -> str:
        sentence = f"Could not connect to {host}: {exc.strerror or exc}."
        self.notes.append(sentence)
        return sentence

    # --- one client connection ---------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= self.max_connections or self._server is None:
            self.turned_away += 1
            writer.transport.abort()
            return
        task = asyncio.current_task()
        self._tasks.add(task)
        self.connections += 1
        upstream: Optional[asyncio.StreamWriter] = None
        cancelled = False
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                return
            method, target, version, headers = _parse(head)
            if method is None:
                await _answer(writer, 400, "The proxy could not read the request.")
                return
            if method == b"CONNECT":
                host, port = _authority(target.decode("latin-1"))
                try:
                    up_reader, upstream = await self._connect(host, port)
                except Refused as exc:
                    await _answer(writer, 403, self._refused(exc), body=False)
                    return
                except OSError as exc:
                    await _answer(writer, 502, self._failed(host, exc), body=False)
                    return
                writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
                await writer.drain()
                await _relay(reader, writer, up_reader, upstream)
                return
            parts = urlsplit(target.decode("latin-1"))
            if parts.scheme != "http" or not parts.hostname:
                await _answer(writer, 400, "The proxy takes absolute http:// URLs and CONNECT only.")
                return
            host = parts.hostname
            port = parts.port or 80
            try:
                up_reader, upstream = await self._connect(host, port)
            except Refused as exc:
                await _answer(writer, 403, self._refused(exc))
                return
            except OSError as exc:
                await _answer(writer, 502, self._failed(host, exc))
                return
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            kept = [(k, v) for k, v in headers if k.lower() not in _HOP_HEADERS]
            # one request per connection: simple, and every request is judged on its own
            upstream.write(b"%s %s %s\r\n" % (method, path.encode("latin-1"), version)
                           + b"".join(b"%s: %s\r\n" % kv for kv in kept) + b"Connection: close\r\n\r\n")
            await _relay(reader, writer, up_reader, upstream, until_upstream_ends=True)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:  # a bug here must not take the run down: drop the connection
            log.debug("proxy connection failed", exc_info=True)
        except asyncio.CancelledError:  # aclose: the task is this connection's own, so it may end quietly
            cancelled = True  # (asyncio.streams would log a cancelled handler as an error)
        finally:
            self.connections -= 1
            self._tasks.discard(task)
            for w in (writer, upstream):
                if w is not None:  # close() sends what is buffered first; a cancelled proxy cuts at once
                    w.transport.abort() if cancelled else w.close()

    async def _connect(self, host: str, port: int):
        """Resolve ``host``, keep the addresses the policy permits, connect to one of them (by address)."""
        name = host.strip("[]")
        if not name or port <= 0 or port > 65535:
            raise OSError(f"bad address {host}:{port}")
        try:
            candidates = [ipaddress.ip_address(name.split("%", 1)[0])]
        except ValueError:
            if is_localhost_name(name):
                candidates = [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
            else:
                loop = asyncio.get_running_loop()
                try:
                    infos = await asyncio.wait_for(
                        loop.getaddrinfo(name, port, type=socket.SOCK_STREAM), self.connect_timeout)
                except (socket.gaierror, UnicodeError) as exc:
                    raise OSError(f"the name {name} could not be resolved ({exc})") from None
                except TimeoutError:
                    raise OSError(f"the name {name} was not resolved within {self.connect_timeout:g} s") from None
                candidates = list(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos))
        permitted = [a for a in candidates if self.policy.permits(a, port)]
        if not permitted:
            if is_localhost_name(name) or (len(candidates) == 1 and str(candidates[0]) == name):
                raise Refused(self.policy.refusal(name))
            raise Refused(f"{name} resolves only to private or local addresses; only public addresses can be fetched.")
        error: Optional[OSError] = None
        for address in permitted:
            try:
                return await asyncio.wait_for(asyncio.open_connection(str(address), port, limit=CHUNK),
                                              self.connect_timeout)
            except TimeoutError:
                error = OSError(f"no answer within {self.connect_timeout:g} s")
            except OSError as exc:
                error = exc
        raise error


def _parse(head: bytes):
    """(method, target, version, [(name, value)]) of a request head; (None, ...) when it is not one."""
    lines = head.split(b"\r\n")
    request = lines[0].split(b" ")
    if len(request) != 3 or not request[2].startswith(b"HTTP/1."):
        return None, None, None, None
    headers = []
    for line in lines[1:]:
        if not line:
            continue
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            return None, None, None, None
        headers.append((name, value.strip()))
    return request[0].upper(), request[1], request[2], headers


def _authority(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` of a CONNECT -> (host, port); port 0 when it is not a number."""
    host, _, port = text.rpartition(":")
    try:
        return host, int(port)
    except ValueError:
        return text, 0


async def _answer(writer: asyncio.StreamWriter, status: int, sentence: str, *, body: bool = True) -> None:
    reason = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway"}[status]
    header = sentence.encode("ascii", "backslashreplace").replace(b"\r", b" ").replace(b"\n", b" ")
    page = b""
    if body:
        page = (f"<!doctype html><html><head><meta charset='utf-8'><title>Refused</title></head>"
                f"<body><h1>{reason}</h1><p>{html.escape(sentence)}</p></body></html>").encode()
    writer.write(
        b"HTTP/1.1 %d %s\r\n%s: %s\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n%s" % (status, reason.encode(), REFUSED_HEADER.encode(), header, len(page), page)
    )
    try:
        await writer.drain()
    except ConnectionError:
        pass


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        data = await reader.read(CHUNK)
        if not data:
            break
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        try:
            writer.write_eof()
        except OSError:
            pass


async def _relay(client_reader, client_writer, up_reader, up_writer, *, until_upstream_ends: bool = False) -> None:
    """Copy both ways until both sides are done (or, for plain HTTP, until the server has answered)."""
    onwards = asyncio.ensure_future(_pipe(client_reader, up_writer))
    back = asyncio.ensure_future(_pipe(up_reader, client_writer))
    try:
        if until_upstream_ends:
            await back
        else:
            done, _pending = await asyncio.wait({onwards, back}, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
    finally:
        for task in (onwards, back):
            task.cancel()
        await asyncio.gather(onwards, back, return_exceptions=True)
