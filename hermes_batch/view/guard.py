"""Who may read a running viewer: requests for the address it listens on, that carry this start's token.

A page on any web site can make the browser ask for ``http://127.0.0.1:8765/``
under a name of its own (DNS rebinding), and a tool-using model with a
browser can try the same from the run's sandbox.  So the viewer answers only
requests whose ``Host`` is the address it listens on (for 127.0.0.1 or ::1
also ``localhost``), with its port, and that carry the token made at each
start, as Jupyter does: the printed URL holds it (``/?token=...``); opening
that URL sets a cookie for this port, so the page's own calls carry it; a
script may send it as ``?token=`` or ``Authorization: token ...``.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
from typing import Optional
from urllib.parse import quote

from aiohttp import web

_LOOPBACK_NAMES = {"localhost"}  # not "localhost." nor "*.localhost": a resolver may send those on to DNS
_WILDCARDS = {"", "0.0.0.0", "::"}


def _ip(name: str) -> Optional[ipaddress._BaseAddress]:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def split_host(value: str) -> tuple[str, Optional[int]]:
    """``(name, port)`` of a Host header (``[::1]:8765``, ``localhost:8765``, ``example``); port None when absent."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ("" if not rest else "x")
    elif value.count(":") == 1:
        name, _, port_text = value.partition(":")
    else:
        name, port_text = value, ""
    if not port_text:
        return name, None
    return (name, int(port_text)) if port_text.isdigit() else ("", -1)


def url_host(host: str) -> str:
    """``host`` as it is written in a URL (an IPv6 address in brackets)."""
    ip = _ip(host)
    return f"[{host}]" if ip is not None and ip.version == 6 else host


class Guard:
    """The Host check and the token of one viewer start."""

    def __init__(self, host: str, token: Optional[str] = None):
        self.host = host
        self.token = token or secrets.token_urlsafe(32)
        self.port = 0
        self.names: set = set()
        self.any_address = False

    def listening(self, port: int) -> None:
        """Set once the socket is bound: the Host names the requests may carry, with ``port``."""
        self.port = port
        host = self.host.strip("[]").lower()
        self.names = {host}
        ip = _ip(host)
        if host in _LOOPBACK_NAMES or (ip is not None and ip.is_loopback):
            self.names |= _LOOPBACK_NAMES
        if host in _WILDCARDS:  # every address of the machine: its IP addresses and its own names
            self.any_address = True
            self.names |= _LOOPBACK_NAMES | {socket.gethostname().lower(), socket.getfqdn().lower()}

    @property
    def cookie(self) -> str:
        return f"hermes-batch-view-{self.port}"  # cookies are not told apart by port: the port is in the name

    def url(self, shown_host: Optional[str] = None) -> str:
        """The URL to print: the address, the port and the token."""
        return f"http://{url_host(shown_host or self.host)}:{self.port}/?token={quote(self.token)}"

    def host_allowed(self, value: Optional[str]) -> bool:
        name, port = split_host(value or "")
        if port is None:
            port = 80
        if port != self.port or not name:
            return False
        return name in self.names or (self.any_address and _ip(name) is not None)

    def _token_of(self, request: web.Request) -> tuple[Optional[str], bool]:
        """The token a request carries and whether it came in its URL."""
        if "token" in request.query:
            return request.query["token"], True
        auth = request.headers.get("Authorization", "")
        if auth[:6].lower() == "token ":
            return auth[6:].strip(), False
        return request.cookies.get(self.cookie), False

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if not self.host_allowed(request.headers.get("Host")):
            return web.Response(status=403, text="hermes-batch view answers only requests for the address it "
                                                 "listens on; open the URL it printed.\n")
        token, in_url = self._token_of(request)
        if token is None or not secrets.compare_digest(token.encode(), self.token.encode()):
            return web.Response(status=403, text="hermes-batch view needs the token of this start; open the URL it "
                                                 "printed (each start prints a new one).\n")
        if in_url and request.method == "GET" and request.path == "/":
            # the page itself: keep the token out of its address (history, shared links); the cookie carries it
            rest = request.rel_url.with_query([(k, v) for k, v in request.query.items() if k != "token"])
            response = web.Response(status=302, headers={"Location": str(rest)})
        else:
            response = await handler(request)
        if in_url:
            response.set_cookie(self.cookie, self.token, httponly=True, samesite="Strict", path="/")
        return response
