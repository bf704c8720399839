"""The HTTP side of the model clients: the transport of ``--http_backend`` and request bodies built once per message.

Both SDKs send through an httpx ``AsyncClient`` (httpx2's in recent SDKs); by
default its transport is aiohttp's (the SDKs' ``DefaultAioHttpClient``), whose
connection pool costs far less CPU than httpx's at hundreds of calls in flight.  ``--http_backend httpx``
keeps the SDKs' own default transport.

Request bodies are JSON we assemble ourselves: each message of a conversation
is serialized once, when first sent, and kept while the message lives, so a
call serializes only what the previous turn added.
"""

from __future__ import annotations

import json
import weakref
from typing import Any, Callable, Generic, TypeVar

from .config import HTTP_BACKENDS
from .errors import ConfigError

# The SDKs' own default: a server that closes idle connections sooner (uvicorn, vLLM: 5 s) must win the race.
KEEPALIVE_EXPIRY_S = 5.0
# The SDKs' default pool, for clients built without a concurrency (tests, plugins).
DEFAULT_MAX_CONNECTIONS = 1000

T = TypeVar("T")

_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def json_bytes(value: Any) -> bytes:
    """``value`` as the SDKs serialize a request body: compact UTF-8 JSON, no NaN."""
    return _encoder.encode(value).encode()


def connection_limits(sdk, settings):
    """One kept-alive connection per model call the run may have in flight, as the SDK's own ``Limits`` type."""
    size = settings.max_concurrent_requests or DEFAULT_MAX_CONNECTIONS
    limits = type(sdk.DEFAULT_CONNECTION_LIMITS)  # httpx's or httpx2's, whichever this SDK is built on
    return limits(max_connections=size, max_keepalive_connections=size, keepalive_expiry=KEEPALIVE_EXPIRY_S)


def http_client(sdk, settings):
    """The HTTP client for an ``openai`` or ``anthropic`` SDK client, on the transport of ``settings.http_backend``."""
    options = {"limits": connection_limits(sdk, settings), "timeout": settings.request_timeout}
    if settings.http_backend == "httpx":
        return sdk.DefaultAsyncHttpxClient(**options)
    if settings.http_backend != "aiohttp":
        raise ConfigError(f"Unknown --http_backend {settings.http_backend!r}; pass one of {', '.join(HTTP_BACKENDS)}.")
    try:
        return sdk.DefaultAioHttpClient(event_hooks={"request": [_credentials_out_of_url]}, **options)
    except RuntimeError:  # the SDK says its aiohttp extra is missing
        raise ConfigError(
            f"The aiohttp transport of the {sdk.__name__} SDK is not installed; "
            f"run pip install '{sdk.__name__}[aiohttp]' or pass --http_backend httpx."
        ) from None


async def _credentials_out_of_url(request) -> None:
    # httpx has already sent the URL's user and password as the Authorization header (as it does on
    # its own transport); aiohttp refuses a URL that still holds them next to that header.
    if request.url.userinfo:
        request.url = request.url.copy_with(userinfo=b"")


def transport_error_text(exc: BaseException) -> str:
    """The error underneath an SDK's connection error: "Request timed out." may mean a dropped connection."""
    root, cause = None, exc.__cause__
    while cause is not None:
        if str(cause).strip():
            root = cause
        cause = cause.__cause__
    return f"{type(root).__name__}: {root}" if root is not None else str(exc)


class WireCache(Generic[T]):
    """``convert(obj)`` computed once per live object, found again by identity.

    The records are frozen, so an object's wire form never changes; an entry is
    dropped when its object is garbage, so a finished session leaves nothing.
    """

    def __init__(self, convert: Callable[[Any], T]):
        self._convert = convert
        self._entries: dict = {}  # id(obj) -> (weakref to obj, value)

    def __call__(self, obj) -> T:
        entry = self._entries.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1]
        value = self._convert(obj)
        key = id(obj)
        entries = self._entries

        def forget(ref, key=key) -> None:
            # runs before the object's memory (and so its id) can be reused
            current = entries.get(key)
            if current is not None and current[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(obj, forget), value)
        return value

    def __len__(self) -> int:
        return len(self._entries)


def json_array(items) -> bytes:
    """A JSON array of already serialized items."""
    return b"[" + b",".join(items) + b"]"


def json_fields(fields: dict) -> bytes:
    """``fields`` serialized as the tail of a JSON object: ``,"a":1,"b":2}``, or ``}`` when empty."""
    return b"," + json_bytes(fields)[1:] if fields else b"}"
