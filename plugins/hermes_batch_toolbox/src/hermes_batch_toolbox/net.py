"""Fetching what a model asks for, safely: checked URLs (see :mod:`.urls`), bounded size and time.

Redirects are followed by hand so that each hop is checked again, and the
resolver drops private addresses from DNS answers (DNS rebinding).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Optional
from urllib.parse import urljoin, urlsplit

import aiohttp
import attrs
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from .urls import AddressPolicy, FetchError, address_blocked, check_url, is_localhost_name

__all__ = [
    "AddressPolicy", "FetchError", "Fetched", "PublicOnlyResolver", "address_blocked", "check_url", "client_session",
    "fetch",
]

USER_AGENT = "Mozilla/5.0 (compatible; hermes-batch-toolbox/0.1; +https://github.com/NousResearch/hermes-agent)"
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class PublicOnlyResolver(AbstractResolver):
    """Resolves like aiohttp's default resolver but drops every address the policy refuses (DNS rebinding)."""

    def __init__(self, policy: AddressPolicy = AddressPolicy()):
        self._resolver = DefaultResolver()
        self.policy = policy

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        if is_localhost_name(host):  # loopback whatever a resolver says (RFC 6761), as browsers treat it
            answers = [{"hostname": host, "host": "127.0.0.1", "port": port, "family": socket.AF_INET,
                        "proto": 0, "flags": socket.AI_NUMERICHOST}]
        else:
            answers = await self._resolver.resolve(host, port, family)
        public = [a for a in answers if self.policy.permits(a["host"], port)]
        if not public:
            raise OSError(f"{host} resolves only to private or local addresses, which cannot be fetched")
        return public

    async def close(self) -> None:
        await self._resolver.close()


def client_session(policy: AddressPolicy, limit: int = 64) -> aiohttp.ClientSession:
    """An aiohttp session for fetching pages for the model: it connects only to addresses ``policy`` permits."""
    resolver = None if policy.allow_private else PublicOnlyResolver(policy)
    connector = aiohttp.TCPConnector(limit=limit, resolver=resolver, ttl_dns_cache=60)
    return aiohttp.ClientSession(connector=connector, headers={"User-Agent": USER_AGENT}, trust_env=False)


@attrs.frozen
class Fetched:
    """A fetched response: final URL after redirects, status, content type, at most ``max_bytes`` of body."""

    url: str
    status: int
    content_type: str
    charset: Optional[str]
    body: bytes
    truncated: bool
    redirects: tuple = ()

    def text(self) -> str:
        return self.body.decode(self.charset or "utf-8", errors="replace")


async def fetch(
    session: aiohttp.ClientSession,
    url: str,
    *,
    max_bytes: int,
    timeout: float,
    policy: AddressPolicy,
    max_redirects: int = 5,
    accept: str = "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.5",
) -> Fetched:
    """GET ``url`` following up to ``max_redirects`` checked redirects; raises FetchError with a sentence for the model."""
    current = check_url(url, policy)
    hops: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            while True:
                async with session.get(current, allow_redirects=False, headers={"Accept": accept}) as response:
                    if response.status in _REDIRECTS and "Location" in response.headers:
                        if len(hops) >= max_redirects:
                            raise FetchError(f"{url} redirects more than {max_redirects} times.")
                        hops.append(current)
                        current = check_url(urljoin(current, response.headers["Location"]), policy)
                        continue
                    body, truncated = await _read_limited(response, max_bytes)
                    return Fetched(
                        url=current,
                        status=response.status,
                        content_type=response.content_type or "",
                        charset=response.charset,
                        body=body,
                        truncated=truncated,
                        redirects=tuple(hops),
                    )
    except TimeoutError:
        raise FetchError(f"{url} did not answer within {timeout:g} s.") from None
    except aiohttp.ClientConnectorError as exc:
        raise FetchError(f"Could not connect to {urlsplit(current).hostname}: {exc.os_error or exc}.") from None
    except aiohttp.ClientError as exc:
        raise FetchError(f"Fetching {current} failed: {type(exc).__name__}: {exc}.") from None
    except OSError as exc:  # the resolver's refusal of private addresses
        raise FetchError(f"Could not fetch {current}: {exc}.") from None
    except (ValueError, UnicodeError) as exc:  # a URL aiohttp cannot encode (lone surrogates, bad ports)
        raise FetchError(f"{url!r} is not a valid URL ({type(exc).__name__}).") from None


async def _read_limited(response: aiohttp.ClientResponse, max_bytes: int) -> tuple[bytes, bool]:
    chunks, size = [], 0
    async for chunk in response.content.iter_chunked(64 * 1024):
        room = max_bytes - size
        if len(chunk) > room:
            chunks.append(chunk[:room])
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), False
