"""The ``browser`` toolset's machinery: one Chromium per run, one isolated context per prompt.

Chromium is Debian's (``executable``), driven by Playwright; Playwright's own
browser download is never used.  The browser starts at the first browser call
of the run; a prompt's context opens at its first ``browser_navigate`` and is
closed when the prompt ends (also on errors, deadlines and Ctrl-C) or at
``browser_close``.  At most ``max_contexts`` contexts are open at once; other
prompts wait for a slot.  A crashed browser is started again at the next call.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from typing import Optional
from urllib.parse import urlsplit

import attrs

from hermes_batch import ToolsetRuntime, ToolsetSession

from .urls import FetchError, address_blocked, check_url
from .options import positive

log = logging.getLogger("hermes_batch_toolbox.browser")

CHROMIUM_FLAGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
)
CLOSE_TIMEOUT_S = 10.0
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
    allow_private: bool = False  # let pages reach loopback and private addresses


class BrowserSession(ToolsetSession):
    """One prompt's browser context and its current page, opened by the first navigation."""

    runtime: BrowserRuntime

    def __init__(self, runtime: BrowserRuntime):
        super().__init__(runtime)
        self._context = None
        self._page = None
        self._slot = False
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
                raise BrowserError("No page is open; call browser_navigate first.")
            await self._open()
        if self._page is None:
            self._page = await self._new_page()
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
            async with asyncio.timeout(OPEN_TIMEOUT_S):
                context = await browser.new_context(
                    viewport={"width": 1280, "height": 800}, accept_downloads=False, service_workers="block"
                )
            self._context = context
            runtime.contexts_opened += 1
            if not cfg.allow_private:
                await context.route("**/*", _refuse_private)
            context.on("page", self._adopt)
        except BaseException:
            await self.close()
            raise

    async def _new_page(self):
        async with asyncio.timeout(OPEN_TIMEOUT_S):
            page = await self._context.new_page()
        self._adopt(page)
        return page

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
        try:
            if context is not None:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await context.close()
        except Exception:
            log.debug("closing a browser context failed", exc_info=True)
        finally:
            if self._slot:
                self._slot = False
                self.runtime._slots.release()


class BrowserRuntime(ToolsetRuntime):
    """Playwright and the browser of a run, started at the first browser call."""

    Session = BrowserSession

    def __init__(self, config: BrowserConfig, model):
        super().__init__(config, model)
        self._playwright = None
        self._browser = None
        self._launching = asyncio.Lock()
        self._slots: Optional[asyncio.Semaphore] = None
        self.contexts_opened = 0
        self.launches = 0

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
                    timeout=OPEN_TIMEOUT_S * 1000,
                )
            except Exception as exc:
                raise BrowserError(f"The browser could not be started ({_first_line(exc)}).") from None
            self.launches += 1
            return self._browser

    def alive(self) -> bool:
        return self._browser is not None and self._browser.is_connected()

    async def shutdown(self) -> None:
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


async def _refuse_private(route) -> None:
    """Abort requests to loopback or private hosts named literally (DNS names are resolved by Chromium)."""
    host = urlsplit(route.request.url).hostname or ""
    blocked = host == "localhost" or host.endswith(".localhost")
    if not blocked:
        try:
            blocked = address_blocked(host.strip("[]"))
        except ValueError:
            blocked = False  # a name, not an address
    if blocked:
        await route.abort("blockedbyclient")
    else:
        await route.fallback()


def checked_url(url: str, allow_private: bool) -> str:
    """``url`` with a scheme (https:// when it has none), or BrowserError when the browser may not go there."""
    url = url.strip()
    if url and "://" not in url and not url.startswith(("about:", "data:")):
        url = "https://" + url
    try:
        return check_url(url, allow_private)
    except FetchError as exc:
        raise BrowserError(str(exc)) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
