"""Which addresses the model may make the toolbox reach: http(s) only, no private addresses.

The model is treated as hostile: a URL that points at loopback, a private
network, link-local metadata services and the like is refused unless the
toolset's ``allow_private`` option is set, or its ``allow_addresses`` names
that address (an intranet host on purpose, or a test's local server).  The
decision is made on the address actually connected to, after resolving: by
the fetchers' resolver (:mod:`.net`) and by the browser's proxy (:mod:`.proxy`);
:func:`check_url` only refuses early what is refused anyway.  No aiohttp here,
so that the browser and a plain run do not pay for importing it.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Optional, Union
from urllib.parse import urlsplit

import attrs

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]

_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052: the IPv4 address is the last 32 bits
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215: local-use translation, never public
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated ::a.b.c.d
_IPV4_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")  # RFC 2765 SIIT ::ffff:0:a.b.c.d


class FetchError(Exception):
    """A page could not be fetched; the message is one sentence meant for the model."""


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> Optional[ipaddress.IPv4Address]:
    """The IPv4 address an IPv6 address stands for (mapped, compatible, NAT64, 6to4, SIIT), if any."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64 or ip in _IPV4_COMPATIBLE or ip in _IPV4_TRANSLATED:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_blocked(address: Union[str, IPAddress]) -> bool:
    """True for loopback, private, link-local, multicast, reserved and unspecified addresses.

    An IPv6 address that carries an IPv4 address (``::ffff:127.0.0.1``, ``::127.0.0.1``,
    ``64:ff9b::7f00:1``, ``2002:7f00:1::``) is judged by that IPv4 address too.
    """
    ip = address if not isinstance(address, str) else ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64_LOCAL:
            return True
        inner = _embedded_ipv4(ip)
        if inner is not None and address_blocked(inner):
            return True
        if ip.ipv4_mapped is not None:
            return False  # judged by its IPv4 address (is_global is False for the whole ::ffff:0:0/96)
    return not ip.is_global or ip.is_multicast


def is_localhost_name(host: str) -> bool:
    """``localhost`` and its subdomains, with or without the final dot (RFC 6761: always loopback)."""
    name = host.rstrip(".").lower()
    return name == "localhost" or name.endswith(".localhost")


def allowed_entry(entry: Any) -> tuple:
    """``10.0.0.5``, ``10.0.0.0/24``, ``127.0.0.1:8080``, ``[::1]:8080`` -> (network, port or None)."""
    if not isinstance(entry, str) or not entry.strip():
        raise ValueError(f"allow_addresses entries must be addresses such as 10.0.0.5:8080, got {entry!r}")
    text, port = entry.strip(), None
    if text.startswith("["):  # [v6]:port
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"allow_addresses entry {entry!r} is not ADDRESS[:PORT]")
            port = rest[1:]
        text = host
    elif text.count(":") == 1:  # v4:port (a bare v6 address has several colons)
        text, port = text.split(":")
    try:
        network = ipaddress.ip_network(text, strict=False)
        port = int(port) if port is not None else None
    except ValueError:
        raise ValueError(
            f"allow_addresses entry {entry!r} is not an address, a network or ADDRESS:PORT "
            "(names are not accepted: the check is made on the address connected to)"
        ) from None
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"allow_addresses entry {entry!r} has a port outside 1-65535")
    return network, port


def allowed_addresses(value: Any) -> tuple:
    """attrs converter of ``allow_addresses``: comma-separated or a JSON list -> its entries, each checked."""
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"allow_addresses must be addresses, comma-separated or a JSON list, got {value!r}")
    for entry in value:
        allowed_entry(entry)
    return tuple(entry.strip() for entry in value)


@attrs.frozen
class AddressPolicy:
    """Which addresses a toolset may connect to: public ones, plus ``allowed`` (or all with ``allow_private``)."""

    allow_private: bool = False
    allowed: tuple = ()  # ((ip_network, port or None), ...) from allow_addresses

    @classmethod
    def of(cls, config) -> "AddressPolicy":
        """The policy of a toolset's config (its ``allow_private`` and ``allow_addresses``)."""
        return cls(config.allow_private, tuple(allowed_entry(e) for e in getattr(config, "allow_addresses", ())))

    def permits(self, address: Union[str, IPAddress], port: int) -> bool:
        """Whether a connection to ``address``:``port`` may be made."""
        if self.allow_private:
            return True
        ip = address if not isinstance(address, str) else ipaddress.ip_address(address.split("%", 1)[0])
        for network, allowed_port in self.allowed:
            if ip.version == network.version and ip in network and allowed_port in (None, port):
                return True
        return not address_blocked(ip)

    def refusal(self, host: str) -> str:
        """The sentence for the model when ``host`` may not be reached."""
        return f"{host} is a private or local address; only public addresses can be fetched."


def _policy(policy: Union[AddressPolicy, bool]) -> AddressPolicy:
    return policy if isinstance(policy, AddressPolicy) else AddressPolicy(allow_private=bool(policy))


def default_port(parts) -> int:
    """The port a split http(s) URL connects to."""
    try:
        port = parts.port
    except ValueError:
        port = None
    return port or (443 if parts.scheme == "https" else 80)


def check_url(url: str, policy: Union[AddressPolicy, bool]) -> str:
    """``url`` if it is an http(s) URL the toolset may reach as far as the URL tells; raises FetchError otherwise.

    Literal addresses and localhost names are judged here; other names are judged
    by the address they resolve to, when connecting.
    """
    policy = _policy(policy)
    if not isinstance(url, str) or not url.strip():
        raise FetchError("The URL is empty.")
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise FetchError(f"Only http and https URLs can be fetched, not {parts.scheme or 'a URL without a scheme'!r}.")
    if not parts.hostname:
        raise FetchError(f"The URL {url!r} has no host.")
    host, port = parts.hostname, default_port(parts)
    try:
        literal = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        literal = None
    if literal is not None:
        if not policy.permits(literal, port):
            raise FetchError(policy.refusal(host))
    elif is_localhost_name(host) and not any(policy.permits(a, port) for a in ("127.0.0.1", "::1")):
        raise FetchError(policy.refusal(host))
    return url
