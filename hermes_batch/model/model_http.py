"""The HTTP side of the model clients: how requests are sent (``--http_backend``) and bodies built once per message.

By default (``aiohttp``) the SDK's client builds a request once, the way its
``post()`` builds every request (options, auth headers, base URL), and each
model call is one POST of that request with our body on an aiohttp session
of our own: at 64 sessions the SDK's ``post()`` cost 0.8 ms of CPU a call on
top of aiohttp, rebuilding the same URL and headers each time and passing
them through httpx.  An error status still becomes the SDK's own exception,
made by the SDK's client from the answer.  ``--http_backend httpx`` sends every
call through the SDK's ``post()`` on its default httpx transport instead.

On both, ``--request_timeout`` bounds a call from sending it to the last byte
of its answer, and an answer is read up to ``MAX_ANSWER_BYTES`` once
decompressed, never whole whatever its size.

Request bodies are JSON we assemble ourselves: each message of a conversation
is serialized once, when first sent, and kept while the message lives, so a
call serializes only what the previous turn added.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import logging
import os
import sys
import urllib.parse
import urllib.request
import weakref
from typing import Any, Callable, Generic, Optional, TypeVar

from ..errors import ConfigError, RetryableModelError

HTTP_BACKENDS = ("aiohttp", "httpx")

# The SDKs' own default: a server that closes idle connections sooner (uvicorn, vLLM: 5 s) must win the race.
KEEPALIVE_EXPIRY_S = 5.0
# The SDKs' default pool, for clients built without a concurrency (tests, plugins).
DEFAULT_MAX_CONNECTIONS = 1000
MAX_ANSWER_BYTES = 64 * 1024 * 1024
"""Most bytes of one model answer, counted once decompressed: a gzip answer of half a megabyte can expand to 500."""

T = TypeVar("T")
log = logging.getLogger(__name__)

_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def json_bytes(value: Any) -> bytes:
    """``value`` as the SDKs serialize a request body: compact UTF-8 JSON, no NaN."""
    return _encoder.encode(value).encode()


def connection_limits(sdk, settings):
    """One kept-alive connection per model call the run may have in flight, as the SDK's own ``Limits`` type."""
    size = settings.max_concurrent_requests or DEFAULT_MAX_CONNECTIONS
    return _sdk_httpx(sdk).Limits(
        max_connections=size, max_keepalive_connections=size, keepalive_expiry=KEEPALIVE_EXPIRY_S
    )


def http_client(sdk, settings):
    """The HTTP client an ``openai`` or ``anthropic`` SDK client is made with.

    With ``httpx`` it sends every call (see ``SdkPost``).  With ``aiohttp`` the SDK's client only builds
    requests (see ``DirectPost``): it gets an httpx client with a transport that never sends, so making it
    neither imports httpcore nor loads a certificate store (the SDK's default client did both, 20 to 90 ms of
    CPU per client).  An SDK that cannot build requests for DirectPost gets its default client, for post().
    """
    if settings.http_backend not in HTTP_BACKENDS:
        raise ConfigError(f"Unknown --http_backend {settings.http_backend!r}; pass one of {', '.join(HTTP_BACKENDS)}.")
    if settings.http_backend == "httpx":
        return sdk.DefaultAsyncHttpxClient(limits=connection_limits(sdk, settings), timeout=settings.request_timeout,
                                           event_hooks={"response": [_read_capped_httpx]})
    if _request_options_type(sdk) is None:
        return None
    httpx = _sdk_httpx(sdk)
    return httpx.AsyncClient(transport=_builder_transport(httpx)(), trust_env=False, timeout=settings.request_timeout)


def _sdk_httpx(sdk):
    """httpx or httpx2, whichever this SDK is built on."""
    return sys.modules[type(sdk.DEFAULT_CONNECTION_LIMITS).__module__.partition(".")[0]]


@functools.cache
def _builder_transport(httpx) -> type:
    class NeverSends(httpx.AsyncBaseTransport):
        """The transport of an SDK client that only builds requests; DirectPost sends them."""

        async def handle_async_request(self, request):
            raise RuntimeError("hermes-batch sends this SDK client's requests itself (model_http.DirectPost).")

    return NeverSends


# What DirectPost asks of an SDK's client: the steps of its own post(), and its errors.
SDK_INTERNALS = ("_prepare_options", "_build_request", "_prepare_request", "_make_status_error_from_response")


def poster(sdk, client, path: str, options: dict, settings) -> "SdkPost | DirectPost":
    """What sends a model call's body to ``path`` for ``settings.http_backend``: ``await poster.post(body)``."""
    if settings.http_backend == "httpx":
        return SdkPost(sdk, client, path, options, settings.request_timeout)
    options_type = _request_options_type(sdk)  # as http_client() found it: the SDK's client was made for it
    if options_type is None:  # an SDK of another shape: its own post() still works, at its cost
        _warn_post_only(sdk.__name__, getattr(sdk, "__version__", "unknown version"))
        return SdkPost(sdk, client, path, options, settings.request_timeout)
    return DirectPost(sdk, client, options_type, path, options, settings)


def _request_options_type(sdk) -> Optional[type]:
    """The SDK's ``FinalRequestOptions`` where its client class has every step DirectPost takes, else None.

    ``http_client`` and ``poster`` both ask, of the class, so they cannot disagree: an SDK client made to
    only build requests is always sent through DirectPost.
    """
    try:
        options_type = importlib.import_module(f"{sdk.__name__}._models").FinalRequestOptions
        client_class = importlib.import_module(f"{sdk.__name__}._base_client").AsyncAPIClient
    except (ImportError, AttributeError):
        return None
    return options_type if all(callable(getattr(client_class, name, None)) for name in SDK_INTERNALS) else None


@functools.cache  # once per SDK and process, however many clients the run makes
def _warn_post_only(name: str, version: str) -> None:
    log.warning("This %s SDK (%s) builds its requests differently; model calls go through its post(), "
                "which costs more CPU.", name, version)


@functools.lru_cache(maxsize=4)
def _ssl_context(httpx, cert_file: Optional[str], cert_dir: Optional[str]):
    """The SDK's certificate store as httpx loads it (``SSL_CERT_FILE``, ``SSL_CERT_DIR``), once per process:
    it costs 60 ms of CPU (httpcore's import among it), and a run makes a client for the preflight and one
    for its prompts."""
    return httpx.create_ssl_context(trust_env=True)


class AnswerTooLarge(RetryableModelError):
    """A model answer went past MAX_ANSWER_BYTES once decompressed; it was not read further."""

    def __init__(self):
        super().__init__(f"The model endpoint's answer was larger than {MAX_ANSWER_BYTES // 2**20} MB once "
                         "decompressed; it was not read further.")


def _timed_out(timeout: float) -> TimeoutError:
    # the cause the clients' "could not be reached: ..." names
    return TimeoutError(f"no whole answer within --request_timeout ({timeout:g} s)")


async def _read_capped_httpx(response) -> None:
    """httpx's response hook: the body read here, decompressed, stopping past MAX_ANSWER_BYTES.

    httpx would read it whole; what is read is kept where ``response.aread()`` finds it.
    """
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise AnswerTooLarge()
        chunks.append(chunk)
    response._content = b"".join(chunks)


class SdkPost:
    """Every call through the SDK's ``post()``: its request building and its httpx transport.

    httpx's timeout bounds each read, and a body trickling a byte at a time
    never trips it: the whole call is bounded by ``timeout`` here.
    """

    def __init__(self, sdk, client, path: str, options: dict, timeout: float):
        self._sdk, self._client, self._path, self._options, self._timeout = sdk, client, path, options, timeout

    async def post(self, body: bytes) -> bytes:
        try:
            async with asyncio.timeout(self._timeout):
                return await self._client.post(self._path, cast_to=bytes, content=body, options=self._options)
        except TimeoutError:
            request = _sdk_httpx(self._sdk).Request("POST", str(self._client.base_url).rstrip("/") + self._path)
            raise self._sdk.APITimeoutError(request=request) from _timed_out(self._timeout)
        except self._sdk.APIConnectionError as exc:
            if isinstance(exc.__cause__, AnswerTooLarge):  # raised by the response hook, wrapped by the SDK
                raise exc.__cause__ from None
            raise

    async def aclose(self) -> None:
        pass


class DirectPost:
    """POSTs of our bodies on aiohttp, with the URL and headers the SDK's client builds for them.

    At the first call the SDK's client builds the request as its ``post()``
    would (``_prepare_options``, ``_build_request``, ``_prepare_request``),
    and the credentials a base URL holds become a Basic ``Authorization`` as
    httpx makes them.  Each call then sends those headers with its body; the
    SDK's idempotency key, where it sets one, is new for each call.

    Errors come out as the SDK raises them, so the model clients classify them
    the same on both backends: a status of 400 or more becomes the exception
    the SDK's client makes from that answer (``_make_status_error_from_response``),
    a timeout ``APITimeoutError`` and any other transport failure
    ``APIConnectionError``, each with aiohttp's error as its cause.

    These are internals the ``openai`` and ``anthropic`` SDKs share (both are
    generated from one template); tests/test_model_transport.py sends every
    kind of answer and fault through them.  Proxies come from ``HTTP_PROXY``,
    ``HTTPS_PROXY``, ``ALL_PROXY`` and ``NO_PROXY``, certificates from
    ``SSL_CERT_FILE`` and ``SSL_CERT_DIR``, as on httpx.
    """

    def __init__(self, sdk, client, options_type: type, path: str, options: dict, settings):
        self._sdk, self._client, self._options_type = sdk, client, options_type
        self._path, self._options = path, options
        self._connections = settings.max_concurrent_requests or DEFAULT_MAX_CONNECTIONS
        self._timeout = settings.request_timeout
        self._lock = asyncio.Lock()
        self._session = None  # made with the request, at the first call
        self._idempotency: Optional[str] = None

    async def _prepare(self) -> None:
        import aiohttp
        import multidict

        client = self._client
        options = self._options_type.construct(method="post", url=self._path, content=b"", **self._options)
        request = client._build_request(await client._prepare_options(options))
        await client._prepare_request(request)
        httpx = _sdk_httpx(self._sdk)
        url = request.url
        if url.username or url.password:
            request = next(httpx.BasicAuth(url.username, url.password).sync_auth_flow(request))
            request.url = url.copy_with(userinfo=b"")
        self._request, self._httpx = request, httpx
        self._url = str(request.url)
        # aiohttp writes these itself: the length of each body, and the encodings it can decode
        self._headers = multidict.CIMultiDict(
            (name, value) for name, value in request.headers.multi_items()
            if name not in ("content-length", "host", "accept-encoding")
        )
        self._idempotency = getattr(client, "_idempotency_header", None)
        self._proxy = environment_proxy(self._url)
        t = self._timeout
        # TLS as the SDK makes it where a connection can need it; a plain http:// endpoint (a local vLLM) never
        # does but through a redirect, where aiohttp's default context (loaded at its import) serves.
        tls = self._url.startswith("https:") or self._proxy is not None
        context = _ssl_context(httpx, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")) if tls else True
        connector = aiohttp.TCPConnector(limit=self._connections, keepalive_timeout=KEEPALIVE_EXPIRY_S, ssl=context)
        # t for the whole call (an answer trickling a byte at a time never trips a timer between bytes), and
        # as httpx's Timeout(t): t to wait for a pooled connection, to connect, and between bytes of the answer.
        timeout = aiohttp.ClientTimeout(total=t, connect=t, sock_connect=t, sock_read=t)
        # trust_env would look up ~/.netrc at every request (on a thread), and refuse the SDK's Authorization beside it.
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False)
        self._errors = aiohttp.ClientError

    async def post(self, body: bytes) -> bytes:
        if self._session is None:
            async with self._lock:
                if self._session is None:
                    await self._prepare()
        headers = self._headers
        if self._idempotency:
            headers = headers.copy()
            headers[self._idempotency] = self._client._idempotency_key()
        try:
            async with self._session.post(self._url, data=body, headers=headers, proxy=self._proxy) as response:
                data = await _read_capped(response)
        except TimeoutError as exc:  # asyncio's and aiohttp's timeouts alike
            raise self._sdk.APITimeoutError(request=self._request) from _timed_out(self._timeout)
        except self._errors as exc:
            raise self._sdk.APIConnectionError(request=self._request) from exc
        if response.status >= 400:
            answer = self._httpx.Response(
                response.status, headers=response.raw_headers, content=data, request=self._request
            )
            raise self._client._make_status_error_from_response(answer)
        return data

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _read_capped(response) -> bytes:
    """An aiohttp response's body, decompressed, read up to MAX_ANSWER_BYTES (AnswerTooLarge past them)."""
    length = response.content_length
    if length is not None and length <= MAX_ANSWER_BYTES and "Content-Encoding" not in response.headers:
        return await response.read()  # the common answer: its length known and within the cap, read at once
    chunks, size = [], 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise AnswerTooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


ROUTINGS = ("auto", "openrouter", "none")


def speaks_openrouter(settings) -> bool:
    """OpenRouter's own request fields (usage accounting, its reasoning switch) go to the endpoint: OpenRouter's
    URLs, or any endpoint ``--routing openrouter`` says speaks them (a gateway, the scripted test server)."""
    return settings.routing == "openrouter" or is_openrouter(settings.base_url)


def sends_routing(settings) -> bool:
    """The ``provider`` routing object goes to the endpoint: ``--routing openrouter``, or ``auto`` (the default)
    for OpenRouter's own URLs; never with ``none``."""
    if settings.routing == "none":
        return False
    return speaks_openrouter(settings)


def is_openrouter(base_url: str) -> bool:
    """True for OpenRouter's API, the one endpoint that understands the ``provider`` routing object."""
    try:
        host = urllib.parse.urlsplit(base_url).hostname or ""
    except ValueError:
        return False
    return host == "openrouter.ai" or host.endswith(".openrouter.ai")


def environment_proxy(url: str) -> Optional[str]:
    """The proxy the environment names for ``url``: ``<SCHEME>_PROXY``, else ``ALL_PROXY``; None where
    ``NO_PROXY`` says."""
    proxies = urllib.request.getproxies_environment()
    scheme, _, rest = url.partition("://")
    host = rest.split("/", 1)[0].rpartition("@")[2]
    proxy = proxies.get(scheme.lower()) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass_environment(host, proxies):
        return None
    return proxy


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


def json_object(answer: bytes) -> dict:
    """A model's answer as the JSON object it must be; anything else is retried, like a 5xx."""
    try:
        data = json.loads(answer)
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict):
        raise RetryableModelError("The model endpoint answered with something that is not a JSON object.")
    return data


def json_array(items) -> bytes:
    """A JSON array of already serialized items."""
    return b"[" + b",".join(items) + b"]"


def json_fields(fields: dict) -> bytes:
    """``fields`` serialized as the tail of a JSON object: ``,"a":1,"b":2}``, or ``}`` when empty."""
    return b"," + json_bytes(fields)[1:] if fields else b"}"
