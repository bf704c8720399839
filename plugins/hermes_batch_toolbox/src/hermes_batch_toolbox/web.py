"""The ``web`` toolset: ``web_search`` through a search provider, ``web_extract`` of pages' readable text.

Tool names, arguments and result shapes follow the Hermes agent's web tools:
``web_search(query)`` -> ``{success, data: {web: [{title, url, description, position}]}}``,
``web_extract(urls)`` -> ``{results: [{url, title, content, error}]}``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import attrs

from hermes_batch import Tool, ToolContext, ToolsetRuntime

from . import search
from .endpoint import read_secret
from .extract import cut, readable
from .options import positive
from .urls import AddressPolicy, allowed_addresses

MAX_URLS = 5


def _provider_name(_instance, _attribute, value: Optional[str]) -> None:
    if value is not None and value not in search.providers():
        raise ValueError(f"provider must be one of {', '.join(sorted(search.providers()))}, got {value!r}")


@attrs.frozen
class WebConfig:
    """Options of the web toolset (``-T web.KEY=VALUE``)."""

    provider: Optional[str] = attrs.field(default=None, validator=_provider_name)  # searxng, brave, or a plugin's
    url: Optional[str] = None  # the provider's base URL: your SearXNG instance; for brave, its API by default
    api_key_env: Optional[str] = None  # environment variable holding the provider's key (brave: BRAVE_API_KEY)
    max_results: int = attrs.field(default=5, validator=positive)
    timeout: float = attrs.field(default=20.0, validator=positive)  # seconds per search or page
    max_page_bytes: int = attrs.field(default=2_000_000, validator=positive)  # bytes read of a page
    max_chars: int = attrs.field(default=15_000, validator=positive)  # characters of text kept per page
    allow_private: bool = False  # let web_extract reach loopback and private addresses
    allow_addresses: Any = attrs.field(default=(), converter=allowed_addresses)  # private addresses it may reach


class WebRuntime(ToolsetRuntime):
    """The search provider and the two HTTP sessions (provider API; pages the model names) of a run."""

    def __init__(self, config: WebConfig, model):
        super().__init__(config, model)
        self.provider_cls = search.providers().get(config.provider) if config.provider else None
        self.key_variable = config.api_key_env or (self.provider_cls.key_variable if self.provider_cls else None)
        self.provider: Optional[search.SearchProvider] = None
        self._api = None  # aiohttp sessions, made at start (aiohttp is imported only by runs that use the web)
        self.pages = None

    def unavailable_reason(self) -> Optional[str]:
        cls, cfg = self.provider_cls, self.config
        if cls is None:
            return (
                "no search provider is configured; pass -T web.provider=searxng -T web.url=http://your-searxng "
                "or -T web.provider=brave with the key in BRAVE_API_KEY."
            )
        if not (cfg.url or cls.default_url):
            return f"the {cls.name} provider needs its address; pass -T web.url=http://host:port."
        if self.key_variable and not read_secret(self.key_variable):
            return f"the {cls.name} provider needs a key, but the environment variable {self.key_variable} is not set."
        return None

    async def start(self, run, client) -> None:
        import aiohttp

        from .net import client_session

        await super().start(run, client)
        cfg = self.config
        self._api = aiohttp.ClientSession(headers={"User-Agent": "hermes-batch-toolbox"}, trust_env=False)
        self.policy = AddressPolicy.of(cfg)
        self.pages = client_session(self.policy)
        url = cfg.url or self.provider_cls.default_url
        self.provider = self.provider_cls(url, read_secret(self.key_variable), self._api, cfg.timeout)

    async def shutdown(self) -> None:
        for session in (self._api, self.pages):
            if session is not None:
                await session.close()


def _runtime(ctx: ToolContext) -> WebRuntime:
    return ctx.session("web").runtime


class WebSearchTool(Tool):
    name = "web_search"
    description = (
        "Search the web for information on any topic. Returns up to 5 relevant results with titles, URLs "
        "and descriptions. Use web_extract to read the full content of a result."
    )
    parameters = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "The search query to look up on the web"}},
        "required": ["query"],
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        query = arguments.get("query", "")
        if not query.strip():
            return {"success": False, "error": "The query is empty."}
        runtime = _runtime(ctx)
        try:
            results = await runtime.provider.search(query.strip(), runtime.config.max_results)
        except search.SearchError as exc:
            return {"success": False, "error": str(exc)}
        web = [
            {"title": r.title, "url": r.url, "description": r.description, "position": i}
            for i, r in enumerate(results, start=1)
        ]
        return {"success": True, "data": {"web": web}}


class WebExtractTool(Tool):
    name = "web_extract"
    description = (
        "Extract the readable content of web pages, as markdown text with links. Pass up to 5 URLs. "
        "Long pages are shortened. If a URL fails or needs interaction (forms, scripts), use the browser tools."
    )
    parameters = {
        "type": "object",
        "properties": {
            "urls": {
                "type": "array",
                "items": {"type": "string"},
                "description": f"List of URLs to extract content from (max {MAX_URLS} URLs per call)",
                "maxItems": MAX_URLS,
            }
        },
        "required": ["urls"],
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        urls = arguments.get("urls", [])
        if not urls:
            return {"success": False, "results": [], "error": "Pass at least one URL."}
        if len(urls) > MAX_URLS:
            return {"success": False, "results": [], "error": f"At most {MAX_URLS} URLs per call; got {len(urls)}."}
        runtime = _runtime(ctx)
        results = await asyncio.gather(*(self._one(runtime, url) for url in urls))
        if all(r["error"] for r in results):
            return {"success": False, "results": results, "error": "None of the URLs could be read."}
        return {"success": True, "results": results}

    async def _one(self, runtime: WebRuntime, url: str) -> dict[str, Any]:
        from .net import FetchError, fetch

        cfg = runtime.config
        try:
            page = await fetch(
                runtime.pages, url, max_bytes=cfg.max_page_bytes, timeout=cfg.timeout, policy=runtime.policy
            )
        except FetchError as exc:
            return {"url": url, "title": "", "content": "", "error": str(exc)}
        if page.status >= 400:
            return {"url": page.url, "title": "", "content": "", "error": f"The page answered HTTP {page.status}."}
        try:
            title, text = await asyncio.to_thread(readable, page)
        except ValueError as exc:
            return {"url": page.url, "title": "", "content": "", "error": f"{page.url} cannot be read as text: {exc}."}
        text, shortened = cut(text, cfg.max_chars)
        notes = []
        if page.truncated:
            notes.append(f"only the first {cfg.max_page_bytes} bytes of the page were read")
        if shortened:
            notes.append(f"the text was cut to {cfg.max_chars} characters")
        if notes:
            text += f"\n\n[... {'; '.join(notes)} ...]"
        return {"url": page.url, "title": title, "content": text, "error": None}


WEB_TOOLS = (WebSearchTool, WebExtractTool)
