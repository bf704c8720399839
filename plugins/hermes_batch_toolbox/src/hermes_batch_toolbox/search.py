"""Search providers of ``web_search``: small classes, one per search API.

Built in: ``searxng`` (the JSON API of a SearXNG instance, which anyone can
self-host) and ``brave`` (the Brave Search API).  A third-party provider is a
:class:`SearchProvider` subclass published under the entry-point group
``hermes_batch_toolbox.search_providers``; ``-T web.provider=NAME`` selects it.
"""

from __future__ import annotations

import html
import importlib.metadata
import json
import re
from typing import TYPE_CHECKING, ClassVar, Optional
from urllib.parse import urlsplit

import attrs

if TYPE_CHECKING:
    import aiohttp

ENTRY_POINT_GROUP = "hermes_batch_toolbox.search_providers"
_TAGS = re.compile(r"<[^>]+>")


class SearchError(Exception):
    """The search API refused or failed; the message is one sentence for the model."""


@attrs.frozen
class SearchResult:
    title: str
    url: str
    description: str = ""


def clean(text) -> str:
    """Plain text from a snippet that may hold HTML tags and entities (Brave marks matches with <strong>)."""
    return html.unescape(_TAGS.sub("", text)).strip() if isinstance(text, str) else ""


class SearchProvider:
    """One search API.  ``search`` returns at most ``count`` results with URLs and titles."""

    name: ClassVar[str]
    default_url: ClassVar[Optional[str]] = None  # None: the user must give -T web.url
    key_variable: ClassVar[Optional[str]] = None  # environment variable of its key by default; None: no key

    def __init__(self, url: str, api_key: Optional[str], session: "aiohttp.ClientSession", timeout: float):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.session = session
        self.timeout = timeout

    async def search(self, query: str, count: int) -> list[SearchResult]:
        raise NotImplementedError

    async def _get_json(self, url: str, params: dict, headers: Optional[dict] = None):
        import aiohttp

        try:
            async with self.session.get(
                url, params=params, headers=headers or {}, timeout=aiohttp.ClientTimeout(total=self.timeout)
            ) as response:
                body = await response.content.read(8 * 1024 * 1024)
                if response.status != 200:
                    raise SearchError(self._status_error(response.status, body))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise SearchError(f"The {self.name} search API at {urlsplit(url).netloc} could not be reached ({type(exc).__name__}).") from None
        try:
            return json.loads(body)
        except ValueError:
            raise SearchError(f"The {self.name} search API answered with something that is not JSON.") from None

    def _status_error(self, status: int, body: bytes) -> str:
        return f"The {self.name} search API answered HTTP {status}."


class SearxngProvider(SearchProvider):
    """A SearXNG instance's ``/search?format=json`` (JSON must be enabled in its settings.yml)."""

    name = "searxng"

    async def search(self, query: str, count: int) -> list[SearchResult]:
        params = {"q": query, "format": "json", "pageno": 1, "safesearch": 1, "categories": "general"}
        data = await self._get_json(f"{self.url}/search", params, {"Accept": "application/json"})
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, list):
            raise SearchError("The searxng search API answered without a results list.")
        return _take(((r.get("title"), r.get("url"), r.get("content")) for r in results if isinstance(r, dict)), count)

    def _status_error(self, status: int, body: bytes) -> str:
        if status == 403:
            return "The SearXNG instance refused JSON (HTTP 403); enable it with search.formats: [html, json] in its settings.yml."
        return super()._status_error(status, body)


class BraveProvider(SearchProvider):
    """The Brave Search API: ``GET /res/v1/web/search`` with the ``X-Subscription-Token`` header."""

    name = "brave"
    default_url = "https://api.search.brave.com"
    key_variable = "BRAVE_API_KEY"

    async def search(self, query: str, count: int) -> list[SearchResult]:
        headers = {"Accept": "application/json", "X-Subscription-Token": self.api_key or ""}
        params = {"q": query, "count": min(max(count, 1), 20)}
        data = await self._get_json(f"{self.url}/res/v1/web/search", params, headers)
        web = data.get("web") if isinstance(data, dict) else None
        results = web.get("results", []) if isinstance(web, dict) else []
        if not isinstance(results, list):
            raise SearchError("The brave search API answered without a results list.")
        return _take(((r.get("title"), r.get("url"), r.get("description")) for r in results if isinstance(r, dict)), count)

    def _status_error(self, status: int, body: bytes) -> str:
        if status in (401, 403):
            return f"The Brave Search API refused the key (HTTP {status})."
        if status == 429:
            return "The Brave Search API rate limit was reached (HTTP 429); try again later."
        return super()._status_error(status, body)


def _take(triples, count: int) -> list[SearchResult]:
    out = []
    for title, url, description in triples:
        if isinstance(url, str) and url.startswith(("http://", "https://")):
            out.append(SearchResult(clean(title) or url, url, clean(description)))
        if len(out) >= count:
            break
    return out


BUILTIN = {cls.name: cls for cls in (SearxngProvider, BraveProvider)}


def providers() -> dict[str, type]:
    """Every search provider: the built-in ones and those installed under the entry-point group."""
    found = dict(BUILTIN)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in found:
            try:
                found[ep.name] = ep.load()
            except Exception:  # a broken third-party provider must not break the built-in ones
                continue
    return found
