"""``hermes-batch view``: a local web app over a run folder, live while the run writes to it.

aiohttp serves one page (styles and script inlined) and a small JSON API; the
index does the work in a thread so the event loop keeps answering.  The list
and the records are read from disk by offset on each request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from html import escape
from pathlib import Path
from typing import Optional

from aiohttp import web

from ..errors import HermesBatchError
from ..folder.control_socket import request_of, send
from .guard import Guard
from .index import RunIndex
from .query import Query, _Sorts, run_query
from .render import page, record_html, static_text, summary_html
from .summary import facets, summarize

log = logging.getLogger(__name__)

REFRESH_INTERVAL_S = 1.0
SUMMARY_MIN_INTERVAL_S = 5.0  # the summary is a pass over the columns: at most this often on a live run


class Viewer:
    """The viewer's state: the index, its sort orders and the last summary."""

    def __init__(self, run_dir: Path, index: Optional[RunIndex] = None, refresh_interval: float = REFRESH_INTERVAL_S,
                 progress=None):
        self.run_dir = Path(run_dir)
        self.progress = progress
        self.index = index or RunIndex(self.run_dir)
        self.refresh_interval = refresh_interval
        self.sorts = _Sorts()
        self._summary: tuple = (None, 0.0, "")  # (generation, when, html)
        self._summary_interval = SUMMARY_MIN_INTERVAL_S
        self._task: Optional[asyncio.Task] = None

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        await asyncio.to_thread(self.index.refresh, self.progress)
        await self._save()
        self._task = asyncio.create_task(self._follow())

    async def _save(self) -> None:
        try:
            await asyncio.to_thread(self.index.save)
        except OSError as exc:  # the cache only saves the next start a pass: serve without it
            log.warning("Could not save the view index of %s (%s); the next start indexes the run again.",
                        self.run_dir, exc.strerror or exc)

    async def stop(self, app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._save()
        self.index.close()

    async def _follow(self) -> None:
        """Index what the run appends, once per interval."""
        while True:
            await asyncio.sleep(self.refresh_interval)
            try:
                await asyncio.to_thread(self.index.refresh)
            except Exception:  # a half-replaced file must not stop the viewer; the next pass retries
                log.warning("could not index %s", self.run_dir, exc_info=True)

    def app(self, guard: Optional[Guard] = None) -> web.Application:
        app = web.Application(middlewares=[guard.middleware] if guard is not None else [])
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        app.router.add_get("/", self.home)
        app.router.add_get("/api/state", self.state)
        app.router.add_get("/api/records", self.records)
        app.router.add_get("/api/record", self.record)
        app.router.add_get("/api/summary", self.summary)
        app.router.add_get("/api/control", self.control)
        app.router.add_post("/api/control", self.control)
        return app

    # -- handlers ---------------------------------------------------------------------------

    async def home(self, request: web.Request) -> web.Response:
        name = escape(self.run_dir.name)
        body = (
            f'<header class="top"><h1>{name}</h1><span class="sub">hermes-batch view · {escape(str(self.run_dir))}</span>'
            '<span class="live" id="live"></span>'
            '<span class="control" id="control"><span id="control-state">no run listening</span> '
            '<button id="ctl-pause">pause</button><button id="ctl-resume">resume</button> '
            '<label>workers <input type="number" id="ctl-workers" min="1" step="1"></label>'
            '<button id="ctl-set-workers">set</button> '
            '<label>max cost $<input type="number" id="ctl-max-cost" min="0" step="any"></label>'
            '<button id="ctl-set-max-cost">set</button> <button id="ctl-stop">stop</button></span>'
            '</header><main>'
            '<div class="tabs"><button id="tab-records" class="on">Records</button>'
            '<button id="tab-summary">Summary</button></div>'
            '<section id="pane-records" class="viewer"><div><div class="controls">'
            '<input type="search" id="q" placeholder="Search prompts, answers and ids" autocomplete="off">'
            '<select id="status" data-facet="status"><option value="">any status</option></select>'
            '<select id="tool" data-facet="tool"><option value="">any tool called</option></select>'
            '<select id="toolset" data-facet="toolset"><option value="">any toolset</option></select>'
            '<select id="end" data-facet="end"><option value="">any end reason</option></select>'
            '<select id="filter" data-facet="filter"><option value="">any filter</option></select>'
            '<select id="error" data-facet="error"><option value="">any error kind</option></select>'
            '<select id="verdict" data-facet="verdict" hidden><option value="">any verdict</option></select>'
            '<input type="number" id="min_reward" hidden step="any" placeholder="min reward" title="Samples every verifier '
            'scored, at or above this reward">'
            '<select id="sort"><option value="arrival">order written</option><option value="prompt">prompt index</option>'
            '<option value="turns">model calls</option><option value="duration">duration</option>'
            '<option value="tokens">tokens</option><option value="reward">reward</option></select>'
            '<label><input type="checkbox" id="desc"> descending</label></div>'
            '<div class="pager"><span id="total"></span><span><button id="prev">‹ prev</button> '
            '<button id="next">next ›</button></span></div><div class="list" id="list"></div></div>'
            '<div class="detail" id="detail"><div class="placeholder">Pick a prompt on the left.</div></div></section>'
            '<section id="pane-summary" hidden></section></main>'
        )
        return web.Response(text=page(f"{self.run_dir.name}: hermes-batch view", body, static_text("viewer.js")),
                            content_type="text/html")

    async def state(self, request: web.Request) -> web.Response:
        index = self.index
        n = len(index)
        status = index.columns.status
        counts = {"kept": 0, "discarded": 0, "failed": 0}
        for value, count in zip(("kept", "discarded", "failed"), _count_statuses(status, n)):
            counts[value] = count
        return web.json_response({"generation": index.generation, "records": n, "counts": counts,
                                  "facets": facets(index)})

    async def records(self, request: web.Request) -> web.Response:
        query = Query.from_params(request.query)
        started = time.perf_counter()
        result = await asyncio.to_thread(run_query, self.index, query, self.sorts)
        result["generation"] = self.index.generation
        result["elapsed_ms"] = round((time.perf_counter() - started) * 1000, 1)
        return web.json_response(result)

    async def record(self, request: web.Request) -> web.Response:
        ref = request.query.get("ref", "")
        try:
            status, data = await asyncio.to_thread(self.index.read_ref, ref)
            html = record_html(status, data, link="#/" + ref)
        except (LookupError, OSError, ValueError, RecursionError) as exc:  # RecursionError: nested past rendering
            return web.Response(status=404, text=f'<p class="placeholder">{escape(str(exc))}</p>',
                                content_type="text/html")
        return web.Response(text=html, content_type="text/html")

    async def summary(self, request: web.Request) -> web.Response:
        generation, when, html = self._summary
        now = time.monotonic()
        if generation != self.index.generation and (not html or now - when >= self._summary_interval):
            generation = self.index.generation  # before: records that land meanwhile count as not covered
            summary = await asyncio.to_thread(summarize, self.index)
            html = summary_html(summary)
            self._summary = (generation, now, html)
            # on a large live run the summary is a pass over every column: spend at most a tenth of the time on it
            self._summary_interval = max(SUMMARY_MIN_INTERVAL_S, 10 * (time.monotonic() - now))
        return web.Response(text=html, content_type="text/html", headers={"X-Generation": str(generation)})


    async def control(self, request: web.Request) -> web.Response:
        """The run's controls (hermes-batch ctl): GET its status, POST ``{"command": ..., "value": ...}``."""
        ask = {"command": "status"}
        if request.method == "POST":
            # a header a page of another site cannot send without a CORS preflight, which is never answered
            if request.headers.get("X-Hermes-Batch-Control") != "1":
                return web.json_response({"ok": False, "error": "Send the X-Hermes-Batch-Control: 1 header."},
                                         status=403)
            try:
                body = await request.json()
                value = body.get("value")
                ask = request_of(str(body.get("command")), None if value is None else str(value))
            except (ValueError, AttributeError, HermesBatchError) as exc:
                return web.json_response({"ok": False, "error": str(exc) or "The request is not JSON."}, status=400)
        try:
            answer = await asyncio.to_thread(send, self.run_dir, ask)
        except HermesBatchError as exc:
            return web.json_response({"ok": False, "listening": False, "error": str(exc)})
        return web.json_response({**answer, "listening": True})


def _count_statuses(status, n: int) -> tuple:
    raw = status[:n].tobytes()
    return raw.count(0), raw.count(1), raw.count(2)


class IndexingError(Exception):
    """Building the index failed (a full disk, an unreadable file) before the viewer could listen."""

    def __init__(self, cause: OSError):
        super().__init__(str(cause))
        self.cause = cause


async def serve(run_dir: Path, host: str, port: int, announce, progress=None) -> None:
    """Serve the viewer until cancelled; ``announce(url, records)`` is called once it listens.

    The URL holds this start's token (see guard.py).  An OSError while
    indexing raises :class:`IndexingError`; one while binding, OSError.
    """
    guard = Guard(host)
    try:
        viewer = Viewer(run_dir, progress=progress)
        runner = web.AppRunner(viewer.app(guard), access_log=None)
        await runner.setup()  # the first pass over the run: on_startup
    except OSError as exc:
        raise IndexingError(exc) from exc
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        guard.listening(runner.addresses[0][1])
        announce(guard.url(), len(viewer.index))
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


__all__ = ["IndexingError", "Viewer", "serve"]
