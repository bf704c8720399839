"""The ``browser`` toolset's machinery: one Chromium per run, one isolated context per prompt.

Chromium is Debian's (``executable``), driven by Playwright; Playwright's own
browser download is never used.  The browser starts at the first browser call
of the run; a prompt's context opens at its first ``browser_navigate`` and is
closed when the prompt ends (also on errors, deadlines and Ctrl-C) or at
``browser_close``.  At most ``max_contexts`` contexts are open at once; other
prompts wait for a slot.  A crashed browser is started again at the next call.

Every request of a context goes through its own :class:`~.proxy.GuardedProxy`,
which decides on the address it connects to.  A context holds at most
``max_pages`` pages (Chromium's popup blocker is on, so a page needs a click to
open one), and its pages' memory is measured every second: a context past
``max_memory_mb`` is closed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from typing import Any, Optional

import attrs

from hermes_batch import ToolsetRuntime, ToolsetSession

from . import proxy
from .options import positive
from .urls import AddressPolicy, FetchError, allowed_addresses, check_url

log = logging.getLogger("hermes_batch_toolbox.browser")

CHROMIUM_FLAGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    # WebRTC may not send UDP around the proxy (the proxy is the only way out)
    "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
    # one renderer per site of a page, not per cross-site frame: a page's frames are measured with it
    "--disable-site-isolation-trials",
)
# Playwright turns Chromium's popup blocker off; with it on, a page needs a click for each window it opens
IGNORED_PLAYWRIGHT_FLAGS = ("--disable-popup-blocking",)
CLOSE_TIMEOUT_S = 10.0
MEMORY_CHECK_S = 1.0  # how often the memory of the open contexts is measured
PLAYWRIGHT_FILES = 8  # descriptors of the run's Playwright driver: its pipes
OPEN_TIMEOUT_S = 60.0  # starting the browser or a context; slow on a loaded machine, so not the per-action timeout


class BrowserError(Exception):
    """A browser action failed; the message is one sentence for the model."""


@attrs.frozen
class BrowserConfig:
    """Options of the browser toolset (``-T browser.KEY=VALUE``)."""

    executable: str = "/usr/bin/chromium"  # Chromium or Chrome binary
    headless: bool = True
    max_contexts: int = attrs.field(default=8, validator=positive)  # prompts with an open browser context at once
    timeout: float = attrs.field(default=30.0, validator=positive)  # seconds per browser action
    slot_timeout: float = attrs.field(default=300.0, validator=positive)  # longest wait for a free context
    max_snapshot_chars: int = attrs.field(default=8000, validator=positive)
    max_pages: int = attrs.field(default=8, validator=positive)  # pages (tabs, popups) open in a context at once
    max_memory_mb: int = attrs.field(default=1024, validator=positive)  # memory of a context's pages
    allow_private: bool = False  # let pages reach loopback and private addresses
    allow_addresses: Any = attrs.field(default=(), converter=allowed_addresses)  # private addresses they may


class BrowserSession(ToolsetSession):
    """One prompt's browser context and its current page, opened by the first navigation."""

    runtime: BrowserRuntime

    def __init__(self, runtime: BrowserRuntime):
        super().__init__(runtime)
        self._context = None
        self._page = None
        self._slot = False
        self._proxy: Optional[proxy.GuardedProxy] = None
        self._cdp: dict = {}  # page -> CDP session measuring its memory
        self.closed_because: Optional[str] = None  # why the toolbox closed the context (memory), for the next call
        self.pages_refused = 0  # pages closed at once because max_pages were open
        self.navigations = 0  # navigation requests of the current page's main frame
        self.loads = 0  # documents it finished parsing (domcontentloaded)

    @property
    def is_open(self) -> bool:
        return self._context is not None

    async def page(self, *, open_context: bool = False):
        """The current page; opens the context first when ``open_context`` (browser_navigate does)."""
        if self._page is not None and self._page.is_closed():
            self._page = None
        if self._context is not None and not self.runtime.alive():
            await self.close()
            raise BrowserError("The browser crashed; call browser_navigate to start again.")
        if self._context is None:
            if not open_context:
                if self.closed_because:
                    raise BrowserError(f"{self.closed_because} Call browser_navigate to start again.")
                raise BrowserError("No page is open; call browser_navigate first.")
            self.closed_because = None
            await self._open()
        if self._page is None:
            still_open = [p for p in self._context.pages if not p.is_closed()]
            # the current page closed itself: go on with the newest other tab, as a person would
            self._page = still_open[-1] if still_open else await self._new_page()
        return self._page

    async def _open(self) -> None:
        runtime, cfg = self.runtime, self.config
        try:
            async with asyncio.timeout(cfg.slot_timeout):
                await runtime._slots.acquire()
        except TimeoutError:
            raise BrowserError(
                f"All {cfg.max_contexts} browser contexts stayed busy for {cfg.slot_timeout:g} s; try again later."
            ) from None
        self._slot = True
        try:
            browser = await runtime.browser()
            self._proxy = await proxy.GuardedProxy(runtime.policy, connect_timeout=cfg.timeout).start()
            async with asyncio.timeout(OPEN_TIMEOUT_S):
                context = await browser.new_context(
                    viewport={"width": 1280, "height": 800}, accept_downloads=False, service_workers="block",
                    proxy={"server": self._proxy.server},
                )
            self._context = context
            runtime.contexts_opened += 1
            context.on("page", self._on_page)
            runtime.watch(self)
        except BaseException:
            await self.close()
            raise

    async def _new_page(self):
        async with asyncio.timeout(OPEN_TIMEOUT_S):
            page = await self._context.new_page()
        self._adopt(page)
        return page

    def _on_page(self, page) -> None:
        # a popup, a target=_blank link or our own new page: past max_pages it is closed at once
        if self._context is None:
            return
        if len([p for p in self._context.pages if not p.is_closed()]) > self.config.max_pages:
            self.pages_refused += 1
            asyncio.ensure_future(_close_quietly(page))
            return
        self._adopt(page)

    async def make_room(self) -> None:
        """Before an action that opens a tab on purpose: close the oldest other page when max_pages are open."""
        pages = [p for p in self._context.pages if not p.is_closed()] if self._context is not None else []
        for page in pages[: max(0, len(pages) - self.config.max_pages + 1)]:
            if page is not self._page:
                await _close_quietly(page)

    def forget_refusals(self) -> None:
        if self._proxy is not None:
            self._proxy.forget()

    @property
    def refusal(self) -> Optional[str]:
        """Why the latest request the proxy refused (or could not connect) since forget_refusals was not let through."""
        return self._proxy.latest() if self._proxy is not None else None

    async def memory_mb(self) -> float:
        """Memory of the context's pages: JS heap, DOM and array buffers of each renderer, counted once each."""
        if self._context is None:
            return 0.0
        pages = [p for p in self._context.pages if not p.is_closed()]
        for gone in [p for p in self._cdp if p not in pages]:
            self._cdp.pop(gone, None)
        total, seen = 0, set()
        for page in pages:
            cdp = self._cdp.get(page)
            if cdp is None:
                cdp = self._cdp[page] = await self._context.new_cdp_session(page)
            heap = await cdp.send("Runtime.getHeapUsage")
            if len(pages) > 1:  # same-site pages share a renderer: count it once
                isolate = (await cdp.send("Runtime.getIsolateId"))["id"]
                if isolate in seen:
                    continue
                seen.add(isolate)
            total += heap["totalSize"] + heap.get("embedderHeapUsedSize", 0) + heap.get("backingStorageSize", 0)
        return total / 2**20

    async def check_memory(self) -> None:
        """Close the context when its pages use more than max_memory_mb."""
        try:
            async with asyncio.timeout(self.config.timeout):
                used = await self.memory_mb()
        except Exception:  # a page closing or navigating meanwhile, or a wedged renderer: measured again next time
            return
        limit = self.config.max_memory_mb
        if used > limit and self._context is not None:
            self.closed_because = (
                f"The pages of this prompt used {used:.0f} MB of memory, more than the browser's limit of "
                f"{limit} MB, so its browser context was closed."
            )
            log.info("closing a browser context that used %.0f MB", used)
            await self.close()

    def _adopt(self, page) -> None:
        # the first page, or a popup or target=_blank link: follow it, as a person would
        self._page = page

        def on_request(request) -> None:
            if page is self._page and request.is_navigation_request() and request.frame == page.main_frame:
                self.navigations += 1

        def on_load(_page) -> None:
            if page is self._page:
                self.loads += 1

        page.on("request", on_request)
        page.on("domcontentloaded", on_load)

    async def settle(self, navigations_before: int, loads_before: int) -> None:
        """After a click or a key press: if it started a navigation, wait (bounded) for the new document."""
        await asyncio.sleep(0.1)  # a form submission or a link starts its request a moment later
        if self.navigations == navigations_before:
            return
        try:
            async with asyncio.timeout(self.config.timeout):
                while self.loads == loads_before:
                    await asyncio.sleep(0.02)
        except TimeoutError:
            pass  # still loading: the next call sees the page as it is

    async def close(self) -> None:
        """Close the context (bounded in time) and give its slot back; safe to call again."""
        context, self._context, self._page = self._context, None, None
        guard, self._proxy = self._proxy, None
        self._cdp = {}
        self.runtime.unwatch(self)
        try:
            if context is not None:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await context.close()
        except Exception:
            log.debug("closing a browser context failed", exc_info=True)
        finally:
            if guard is not None:
                await guard.aclose()
            if self._slot:
                self._slot = False
                self.runtime._slots.release()


class BrowserRuntime(ToolsetRuntime):
    """Playwright and the browser of a run, started at the first browser call."""

    Session = BrowserSession

    def __init__(self, config: BrowserConfig, model):
        super().__init__(config, model)
        self.policy = AddressPolicy.of(config)
        self._playwright = None
        self._browser = None
        self._launching = asyncio.Lock()
        self._slots: Optional[asyncio.Semaphore] = None
        self._open_sessions: set = set()
        self._watchdog: Optional[asyncio.Task] = None
        self.contexts_opened = 0
        self.launches = 0

    def files_needed(self) -> int:
        """Descriptors the browser may hold in this process at once: each open context's proxy, the driver's pipes."""
        return PLAYWRIGHT_FILES + self.config.max_contexts * proxy.descriptors()

    def unavailable_reason(self) -> Optional[str]:
        exe = self.config.executable
        path = exe if os.path.isabs(exe) else shutil.which(exe)
        if not path or not os.access(path, os.X_OK):
            return f"no Chromium at {exe}; install it (apt-get install chromium) or pass -T browser.executable=PATH."
        try:
            import playwright  # noqa: F401
        except ImportError:
            return "the playwright package is not installed; pip install playwright."
        return None

    async def start(self, run, client) -> None:
        await super().start(run, client)
        self._slots = asyncio.Semaphore(self.config.max_contexts)

    async def browser(self):
        """The run's browser, launched (or launched again after a crash) on demand."""
        async with self._launching:
            if self._browser is not None and self._browser.is_connected():
                return self._browser
            if self._playwright is None:
                from playwright.async_api import async_playwright

                self._playwright = await async_playwright().start()
            try:
                self._browser = await self._playwright.chromium.launch(
                    executable_path=self.config.executable,
                    headless=self.config.headless,
                    args=list(CHROMIUM_FLAGS),
                    ignore_default_args=list(IGNORED_PLAYWRIGHT_FLAGS),
                    timeout=OPEN_TIMEOUT_S * 1000,
                )
            except Exception as exc:
                raise BrowserError(f"The browser could not be started ({_first_line(exc)}).") from None
            self.launches += 1
            return self._browser

    def alive(self) -> bool:
        return self._browser is not None and self._browser.is_connected()

    def watch(self, session: BrowserSession) -> None:
        """Measure ``session``'s memory from now on (the watchdog runs while any context is open)."""
        self._open_sessions.add(session)
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.ensure_future(self._watch_memory())

    def unwatch(self, session: BrowserSession) -> None:
        self._open_sessions.discard(session)

    async def _watch_memory(self) -> None:
        while self._open_sessions:
            await asyncio.sleep(MEMORY_CHECK_S)
            for session in list(self._open_sessions):
                await session.check_memory()

    async def shutdown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
            self._watchdog = None
        try:
            if self._browser is not None:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await self._browser.close()
        except Exception:
            log.debug("closing the browser failed", exc_info=True)
        finally:
            self._browser = None
            if self._playwright is not None:
                try:
                    await self._playwright.stop()
                except Exception:
                    log.debug("stopping playwright failed", exc_info=True)
                self._playwright = None


async def _close_quietly(page) -> None:
    try:
        await page.close()
    except Exception:
        pass


def checked_url(url: str, policy: AddressPolicy) -> str:
    """``url`` with a scheme (https:// when it has none), or BrowserError when the browser may not go there.

    Only what the URL itself shows is judged here, for a quick answer; the proxy decides on every request.
    """
    url = url.strip()
    if url and "://" not in url and not url.startswith(("about:", "data:")):
        url = "https://" + url
    try:
        return check_url(url, policy)
    except FetchError as exc:
        raise BrowserError(str(exc)) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
