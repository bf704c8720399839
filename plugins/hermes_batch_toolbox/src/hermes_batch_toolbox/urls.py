"""Which URLs the model may make the toolbox reach: http(s) only, no private addresses.

The model is treated as hostile: a URL that points at loopback, a private
network, link-local metadata services and the like is refused unless the
toolset's ``allow_private`` option is set (tests against local servers, or an
intranet on purpose).  No aiohttp here, so that the browser and a plain run
do not pay for importing it.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


class FetchError(Exception):
    """A page could not be fetched; the message is one sentence meant for the model."""


def address_blocked(address: str) -> bool:
    """True for loopback, private, link-local, multicast, reserved and unspecified addresses."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not ip.is_global or ip.is_multicast


def check_url(url: str, allow_private: bool) -> str:
    """``url`` if it is an http(s) URL the toolset may reach; raises FetchError otherwise."""
    if not isinstance(url, str) or not url.strip():
        raise FetchError("The URL is empty.")
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise FetchError(f"Only http and https URLs can be fetched, not {parts.scheme or 'a URL without a scheme'!r}.")
    if not parts.hostname:
        raise FetchError(f"The URL {url!r} has no host.")
    if not allow_private:
        host = parts.hostname
        try:
            literal = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if (literal is not None and address_blocked(host)) or host == "localhost" or host.endswith(".localhost"):
            raise FetchError(f"{host} is a private or local address; only public addresses can be fetched.")
    return url
