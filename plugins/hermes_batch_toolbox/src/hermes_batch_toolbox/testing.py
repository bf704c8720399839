"""Local servers for testing the toolbox without the internet, on 127.0.0.1.

* :class:`LocalWebsite`: a small website with links, a form, images, a
  redirect, a slow page and a huge page, for ``web_extract`` and the browser,
  and hostile pages (redirects, scripts and frames that go where they are
  told, popup storms, a memory hog).
* :class:`SecretService`: a service on this machine's loopback that the tools
  must never reach; it counts the requests that did.
* :class:`SearxngStandIn`: a stand-in for a SearXNG instance's JSON search API.
* :class:`BraveStandIn`: a stand-in for the Brave Search API.
* :class:`FalStandIn`: a stand-in for FAL's synchronous image generation.

The stand-ins speak the documented request and response shapes of the real
services; they are not those services.  Each server runs in a background
thread (``with LocalWebsite() as site:``) or in your event loop (``async with``).
"""

from __future__ import annotations

import asyncio
import collections
import html
import json
import threading
from typing import Callable, Optional

from aiohttp import web

from hermes_batch.testing import png_for, solid_png

IMAGES = {"red.png": solid_png(8, 8, (255, 0, 0)), "blue.png": solid_png(16, 16, (0, 0, 255))}


async def _cancel_the_rest() -> None:
    """End handlers still running (a slow page nobody waits for) before the loop stops."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class AppServer:
    """An aiohttp application on 127.0.0.1, in a background thread or in the running loop."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host, self.port = host, port
        self.hits: collections.Counter = collections.Counter()  # path -> requests
        self._runner: Optional[web.AppRunner] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def astart(self):
        @web.middleware
        async def count(request, handler):
            self.hits[request.path] += 1
            return await handler(request)

        app = web.Application(middlewares=[count])
        self.routes(app)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start(self):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=type(self).__name__, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.astart(), self._loop).result(timeout=30)
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self.aclose(), self._loop).result(timeout=30)
        asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._loop = self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    async def __aenter__(self):
        return await self.astart()

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


def _redirect_to(location: str):
    async def handler(_request):
        raise web.HTTPFound(location)

    return handler


def _fixed(make, **kwargs):
    async def handler(_request):
        return make(**kwargs)

    return handler


def _page(title: str, body: str) -> web.Response:
    doc = f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head><body>{body}</body></html>"
    return web.Response(text=doc, content_type="text/html")


ARTICLE = (
    "The lighthouse on Gull Point was built in 1871 from granite quarried on the island itself. "
    "For ninety years a keeper climbed its hundred and twelve steps every evening to light the lamp. ",
    "In 1962 the light was automated, and the keeper's cottage became a small museum of charts, "
    "brass instruments and the logbooks that recorded every storm. ",
    "Visitors today can climb the tower on summer weekends. On a clear day the view reaches the three "
    "islands of the outer bay, and the museum keeps the original Fresnel lens in its front room. ",
)


class LocalWebsite(AppServer):
    """The test website; ``url`` is its root.  Pages:

    ``/`` (links, an image), ``/article`` (readable text), ``/form`` (a search
    form whose answer is ``/search?q=``), ``/gallery`` (images, a link),
    ``/popup`` (a link that opens a new tab), ``/images/red.png`` and
    ``/images/blue.png``, ``/redirect`` (302 to ``/article``), ``/redirect-loop``,
    ``/slow?delay=S`` (answers after S seconds, 30 by default),
    ``/huge?bytes=N`` (N bytes of HTML, 50 MB by default, streamed),
    ``/notes.txt`` (plain text), ``/binary`` (octet-stream), ``/missing`` (404).

    Hostile pages, each taking the address to go to as ``?url=``:
    ``/redirect-to`` (302), ``/go`` (a script sets ``location``), ``/frame``
    (an iframe), ``/fetch`` (a script fetches it and writes what it read into
    the page); ``/popups?n=N`` (opens N popups of itself when loaded, N more at
    each click of its button), ``/tabs`` (a link that opens ``/tabs`` in a new
    tab), ``/hog?mb=N`` (a script that keeps N MB of memory), ``/many?n=N&delay=S&from=URL,URL``
    (N images that each answer after S seconds, taken in turn from the sites of ``from``
    (this one by default): a page that holds many connections at once).

    When the site plays a public site in a test, allow its address only
    (``allow_addresses=[site.address]``), so that the check that refuses
    everything else is the production one.
    """

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``, for a toolset's ``allow_addresses``."""
        return f"{self.host}:{self.port}"

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/", self.index)
        r.add_get("/article", self.article)
        r.add_get("/form", self.form)
        r.add_get("/search", self.search)
        r.add_get("/gallery", self.gallery)
        r.add_get("/popup", self.popup)
        r.add_get("/images/{name}", self.image)
        r.add_get("/redirect", _redirect_to("/article"))
        r.add_get("/redirect-loop", _redirect_to("/redirect-loop"))
        r.add_get("/slow", self.slow)
        r.add_get("/huge", self.huge)
        r.add_get("/notes.txt", _fixed(web.Response, text="Plain notes: bring a lamp.\n", content_type="text/plain"))
        r.add_get("/binary", _fixed(web.Response, body=b"\x00\x01" * 512, content_type="application/octet-stream"))
        r.add_get("/missing", _fixed(web.Response, status=404, text="not here"))
        r.add_get("/redirect-to", self.redirect_to)
        r.add_get("/go", self.go)
        r.add_get("/frame", self.frame)
        r.add_get("/fetch", self.fetch)
        r.add_get("/popups", self.popups)
        r.add_get("/tabs", _fixed(_page, title="Tabs", body="<a href='/tabs' target='_blank'>Another tab</a>"))
        r.add_get("/hog", self.hog)
        r.add_get("/many", self.many)

    async def index(self, _request):
        return _page("Toolbox Test Site", (
            "<h1>Welcome to the test site</h1>"
            "<p>This site has an <a href='/article'>article about a lighthouse</a>, a "
            "<a href='/form'>search form</a> and a <a href='/gallery'>gallery</a>.</p>"
            "<img src='/images/red.png' alt='A red square'>"
        ))

    async def article(self, _request):
        paragraphs = "".join(f"<p>{p}</p>" for p in ARTICLE)
        return _page("The Quiet Lighthouse", (
            "<nav><a href='/'>Home</a> | <a href='/gallery'>Gallery</a></nav>"
            f"<article><h1>The Quiet Lighthouse</h1>{paragraphs}"
            "<p>Read more on the <a href='/'>front page</a>.</p></article>"
        ))

    async def form(self, _request):
        return _page("Search the site", (
            "<h1>Search the site</h1><form action='/search' method='get'>"
            "<label for='q'>Search query</label> <input id='q' name='q' type='text'>"
            "<button type='submit'>Search</button></form>"
        ))

    async def search(self, request):
        query = html.escape(request.query.get("q", ""))
        return _page(f"Results for {query}", f"<h1>Results for {query}</h1><p>You searched for {query}.</p>")

    async def gallery(self, _request):
        return _page("Gallery", (
            "<h1>Gallery</h1><img src='/images/red.png' alt='A red square'>"
            "<img src='/images/blue.png' alt='A blue square'><p><a href='/article'>Next page</a></p>"
        ))

    async def popup(self, _request):
        return _page("Popup", "<a href='/article' target='_blank'>Open the article in a new tab</a>")

    async def image(self, request):
        data = IMAGES.get(request.match_info["name"])
        if data is None:
            return web.Response(status=404, text="no such image")
        return web.Response(body=data, content_type="image/png")

    async def slow(self, request):
        await asyncio.sleep(float(request.query.get("delay", 30)))
        return _page("Slow", "<p>Finally.</p>")

    async def redirect_to(self, request):
        raise web.HTTPFound(request.query["url"])

    async def go(self, request):
        target = json.dumps(request.query["url"])
        return _page("Going", f"<p>Going elsewhere.</p><script>setTimeout(() => location.href = {target}, 50)</script>")

    async def frame(self, request):
        return _page("Framed", f"<h1>A frame</h1><iframe src='{html.escape(request.query['url'])}'></iframe>")

    async def fetch(self, request):
        target = json.dumps(request.query["url"])
        return _page("Fetching", (
            "<h1>Fetching</h1><p id=out>waiting</p><script>"
            f"fetch({target}).then(r => r.text()).then(t => out.textContent = 'fetched: ' + t)"
            ".catch(e => out.textContent = 'fetch failed')</script>"
        ))

    async def popups(self, request):
        n = int(request.query.get("n", 300))
        return _page("Popups", (
            f"<button onclick='storm()'>Open {n} windows</button><script>"
            f"function storm() {{ for (let i = 0; i < {n}; i++) window.open('/popups?n={n}', '_blank'); }}"
            "storm();</script>"
        ))

    async def many(self, request):
        n, delay = int(request.query.get("n", 40)), float(request.query.get("delay", 1))
        sites = [u for u in request.query.get("from", "").split(",") if u] or [""]
        images = "".join(f"<img src='{html.escape(sites[i % len(sites)])}/slow?delay={delay:g}&image={i}' alt=''>"
                         for i in range(n))
        return _page("Many", f"<h1>Many images</h1>{images}")

    async def hog(self, request):
        mb = int(request.query.get("mb", 512))
        return _page("Hog", (
            "<p id=out>allocating</p><script>window.kept = []; let n = 0;"
            "const t = setInterval(() => { if (n >= %d) { clearInterval(t); out.textContent = 'holding'; return; }"
            " const a = new Uint8Array(8 << 20); a.fill(1); kept.push(a); n += 8; }, 10);</script>" % mb
        ))

    async def huge(self, request):
        size = int(request.query.get("bytes", 50_000_000))
        response = web.StreamResponse(headers={"Content-Type": "text/html; charset=utf-8"})
        await response.prepare(request)
        chunk = ("<p>" + "All work and no play makes a huge page. " * 40 + "</p>\n").encode()
        await response.write(b"<!doctype html><html><head><title>Huge</title></head><body>")
        sent = 0
        try:
            while sent < size:
                await response.write(chunk)
                sent += len(chunk)
            await response.write(b"</body></html>")
        except (ConnectionResetError, RuntimeError):  # the reader stopped reading, as it should
            pass
        return response


class SecretService(AppServer):
    """A service on this machine's loopback holding ``secret``, readable by any page (CORS open) that reaches it.

    ``hits`` counts the requests that reached it: a test of the tools' address
    checks asserts it stays empty.
    """

    def __init__(self, secret: str = "the-loopback-secret-7d1f", **kwargs):
        super().__init__(**kwargs)
        self.secret = secret

    def routes(self, app: web.Application) -> None:
        async def answer(_request):
            return web.Response(
                text=f"<!doctype html><title>Secret</title><p>{self.secret}</p>", content_type="text/html",
                headers={"Access-Control-Allow-Origin": "*"},
            )

        app.router.add_route("*", "/{tail:.*}", answer)


class SearxngStandIn(AppServer):
    """A stand-in for SearXNG's ``GET /search?q=...&format=json``.

    ``results(query)`` gives the result dicts (``url``, ``title``, ``content``);
    by default every query finds the LocalWebsite at ``site_url``.  Without
    ``format=json`` it answers 403, as SearXNG does when JSON is not enabled.
    """

    def __init__(self, site_url: str = "http://127.0.0.1:9", results: Optional[Callable[[str], list]] = None, **kwargs):
        super().__init__(**kwargs)
        self.site_url = site_url
        self.results = results or self.site_results
        self.queries: list[str] = []

    def site_results(self, query: str) -> list:
        return [
            {"url": f"{self.site_url}/article", "title": "The Quiet Lighthouse", "content": f"A page about {query}.",
             "engine": "stand-in", "score": 1.0},
            {"url": f"{self.site_url}/gallery", "title": "Gallery", "content": "Two squares, red and blue.",
             "engine": "stand-in", "score": 0.5},
        ]

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/search", self.search)

    async def search(self, request):
        if request.query.get("format") != "json":
            return web.Response(status=403, text="Forbidden")
        query = request.query.get("q", "")
        self.queries.append(query)
        results = self.results(query)
        return web.json_response({"query": query, "number_of_results": len(results), "results": results,
                                  "answers": [], "suggestions": [], "unresponsive_engines": []})


class BraveStandIn(AppServer):
    """A stand-in for the Brave Search API's ``GET /res/v1/web/search`` (key in ``X-Subscription-Token``)."""

    def __init__(self, key: str, results: Optional[list] = None, **kwargs):
        super().__init__(**kwargs)
        self.key = key
        self.canned = results
        self.requests: list[dict] = []

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/res/v1/web/search", self.search)

    async def search(self, request):
        self.requests.append({"q": request.query.get("q"), "count": request.query.get("count")})
        if request.headers.get("X-Subscription-Token") != self.key:
            return web.json_response({"type": "ErrorResponse", "error": {"code": "SUBSCRIPTION_TOKEN_INVALID",
                                      "status": 422, "detail": "The provided subscription token is invalid."}}, status=401)
        query = request.query.get("q", "")
        results = self.canned if self.canned is not None else [
            {"title": f"About <strong>{html.escape(query)}</strong>", "url": f"https://example.org/{i}",
             "description": f"Result {i} for <strong>{html.escape(query)}</strong> &amp; more.", "type": "search_result"}
            for i in range(1, 4)
        ]
        return web.json_response({"type": "search", "query": {"original": query},
                                  "web": {"type": "search", "results": results}})


class FalStandIn(AppServer):
    """A stand-in for FAL's ``POST https://fal.run/<model>`` (key as ``Authorization: Key ...``)."""

    def __init__(self, key: str, **kwargs):
        super().__init__(**kwargs)
        self.key = key
        self.requests: list[dict] = []
        self._files: dict[str, bytes] = {}

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/files/{name}", self.file)
        app.router.add_post("/{model:.+}", self.generate)

    async def generate(self, request):
        body = await request.json()
        self.requests.append({"model": request.match_info["model"], **body})
        if request.headers.get("Authorization") != f"Key {self.key}":
            return web.json_response({"detail": "Invalid API key"}, status=401)
        image = png_for(body.get("prompt", ""))
        name = f"{len(self._files)}.png"
        self._files[name] = image
        return web.json_response({
            "images": [{"url": f"{self.url}/files/{name}", "width": 16, "height": 16, "content_type": "image/png"}],
            "seed": 42, "has_nsfw_concepts": [False], "prompt": body.get("prompt", ""),
        })

    async def file(self, request):
        data = self._files.get(request.match_info["name"])
        return web.Response(body=data, content_type="image/png") if data else web.Response(status=404)
