"""The ``browser`` toolset's tools, named and shaped like the Hermes agent's browser tools.

Every result is ``{"success": true, ...}`` or ``{"success": false, "error": "..."}``;
a timeout or a crash of the browser fails the call, never the prompt.
"""

from __future__ import annotations

import asyncio
import re
from typing import Awaitable, Callable

from hermes_batch import Tool, ToolContext

from .browser import BrowserError, BrowserSession, _first_line, checked_url
from .proxy import REFUSED_HEADER

_REF = re.compile(r"^\s*(?:\[?\s*ref\s*=\s*|@)?((?:f\d+)?e\d+)\s*\]?\s*$")
# roles kept by the compact snapshot: what can be acted on, and the headings that say where it is
_COMPACT_ROLES = re.compile(
    r"^\s*- (link|button|textbox|searchbox|checkbox|radio|combobox|listbox|option|menuitem|tab|switch|slider|"
    r"spinbutton|heading|img)\b"
)
_IMAGES_JS = """() => Array.from(document.images).slice(0, 200).map(img => ({
    url: img.currentSrc || img.src, alt: img.alt || "", width: img.naturalWidth, height: img.naturalHeight
})).filter(img => img.url)"""

Action = Callable[[object, BrowserSession], Awaitable[dict]]


def _ms(session: BrowserSession) -> float:
    return session.config.timeout * 1000


def _ref(value: str) -> str:
    match = _REF.match(value or "")
    if not match:
        raise BrowserError(f"{value!r} is not an element reference; use one from browser_snapshot, such as @e5.")
    return match.group(1)


async def _element(page, value: str):
    """(ref, locator) of an element of the last snapshot; fails at once, not after the timeout, when it is gone."""
    ref = _ref(value)
    target = page.locator(f"aria-ref={ref}")
    if await target.count() == 0:
        raise BrowserError(f"There is no element @{ref} on the page now; take a new browser_snapshot.")
    return ref, target


async def _act(ctx: ToolContext, action: Action, *, open_context: bool = False) -> dict:
    """Run ``action(page, session)`` within the toolset's timeout; any browser failure becomes an error result."""
    from playwright.async_api import Error as PlaywrightError

    session: BrowserSession = ctx.session("browser")
    timeout = session.config.timeout
    try:
        page = await session.page(open_context=open_context)
        # Playwright's own timeouts fire first; this one catches a wedged browser
        async with asyncio.timeout(2 * timeout + 5):
            return await action(page, session)
    except BrowserError as exc:
        return {"success": False, "error": str(exc)}
    except TimeoutError:
        return {"success": False, "error": f"The browser did not finish within {timeout:g} s."}
    except PlaywrightError as exc:
        if not session.runtime.alive():
            await session.close()
            return {"success": False, "error": "The browser crashed; call browser_navigate to start again."}
        if session.closed_because:  # the memory watchdog closed the context under this call
            return {"success": False, "error": f"{session.closed_because} Call browser_navigate to start again."}
        if "ERR_TUNNEL_CONNECTION_FAILED" in str(exc) and session.refusal:
            return {"success": False, "error": session.refusal}  # what the proxy said of that https:// address
        return {"success": False, "error": _first_line(exc)}


async def _where(page) -> dict:
    return {"url": page.url, "title": await page.title()}


NAVIGATION_ATTEMPTS = 3  # gotos a browser_navigate makes when each is interrupted by another navigation


class BrowserNavigateTool(Tool):
    name = "browser_navigate"
    description = (
        "Navigate to a URL in the browser. Starts the browser session and loads the page; call it before the "
        "other browser tools. For simple reading prefer web_search or web_extract (faster); use the browser to "
        "interact with a page (click, fill forms, dynamic content)."
    )
    parameters = {
        "type": "object",
        "properties": {"url": {"type": "string", "description": "The URL to navigate to (e.g., 'https://example.com')"}},
        "required": ["url"],
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        async def go(page, session):
            from playwright.async_api import Error as PlaywrightError

            url = checked_url(arguments["url"], session.runtime.policy)
            session.forget_refusals()
            response = None
            for attempt in range(NAVIGATION_ATTEMPTS):
                try:
                    response = await page.goto(url, wait_until="domcontentloaded", timeout=_ms(session))
                    break
                except PlaywrightError as exc:
                    # A navigation the previous action started late (a form sent by Enter) won the race, or
                    # Chromium restarted ours as a new document of the same URL: wait for whichever document
                    # is loading, and go again unless it is already the one asked for.
                    if "interrupted by another navigation" not in str(exc) or attempt == NAVIGATION_ATTEMPTS - 1:
                        raise
                    await page.wait_for_load_state("domcontentloaded", timeout=_ms(session))
                    if page.url == url:
                        break
            refused = response is not None and REFUSED_HEADER.lower() in response.headers
            if refused and session.refusal:  # the proxy refused this address or a redirect's (its page says why)
                return {"success": False, "error": session.refusal, "url": page.url}
            result = {"success": True, **await _where(page)}
            if response is not None:
                result["status"] = response.status
            return result

        return await _act(ctx, go, open_context=True)


class BrowserSnapshotTool(Tool):
    name = "browser_snapshot"
    description = (
        "Get a text snapshot of the current page's accessibility tree. Elements you can act on carry a ref "
        "(shown as [ref=e5]) to pass to browser_click and browser_type as '@e5'. full=false (default): a compact "
        "view of the interactive elements and headings; full=true: the whole page content. Long snapshots are "
        "shortened. Requires browser_navigate first."
    )
    parameters = {
        "type": "object",
        "properties": {
            "full": {
                "type": "boolean",
                "description": "If true, the complete page content; if false (default), the interactive elements only.",
                "default": False,
            }
        },
        "required": [],
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        async def snap(page, session):
            text = await page.aria_snapshot(mode="ai", timeout=_ms(session))
            elements = len(re.findall(r"\[ref=(?:f\d+)?e\d+\]", text))
            if not arguments.get("full", False):
                text = compact(text)
            return {"success": True, **await _where(page), "snapshot": shorten(text, session.config.max_snapshot_chars),
                    "element_count": elements}

        return await _act(ctx, snap)


def compact(snapshot: str) -> str:
    """The lines of an AI snapshot that can be acted on (and headings, and links' targets)."""
    lines, keep_url = [], False
    for line in snapshot.splitlines():
        if _COMPACT_ROLES.match(line):
            lines.append(line)
            keep_url = line.lstrip().startswith("- link")
        elif keep_url and line.lstrip().startswith("- /url:"):
            lines.append(line)
            keep_url = False
        else:
            keep_url = False
    return "\n".join(lines) if lines else snapshot


def shorten(text: str, limit: int) -> str:
    """``text`` cut at a line break before ``limit`` characters, with a note of what was left out."""
    if len(text) <= limit:
        return text
    lines, size = [], 0
    for line in text.splitlines():
        if size + len(line) + 1 > limit - 100:
            break
        lines.append(line)
        size += len(line) + 1
    left = len(text.splitlines()) - len(lines)
    return "\n".join(lines) + f"\n[... {left} more lines cut; scroll or use browser_snapshot(full=false) ...]"


class BrowserClickTool(Tool):
    name = "browser_click"
    description = (
        "Click an element by its ref from the snapshot (e.g., '@e5'). Requires browser_navigate and "
        "browser_snapshot first."
    )
    parameters = {
        "type": "object",
        "properties": {"ref": {"type": "string", "description": "The element reference from the snapshot (e.g., '@e5', '@e12')"}},
        "required": ["ref"],
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        async def click(page, session):
            ref, target = await _element(page, arguments["ref"])
            new_tab = await target.evaluate("el => !!el.closest('a[target]:not([target=_self])')", timeout=_ms(session))
            if new_tab:  # follow the tab it opens, closing the oldest other one when max_pages are open
                await session.make_room()
                async with page.context.expect_page(timeout=_ms(session)) as opened:
                    await target.click(timeout=_ms(session))
                page = await opened.value
                await page.wait_for_load_state("domcontentloaded", timeout=_ms(session))
            else:
                before = session.navigations, session.loads
                await target.click(timeout=_ms(session))
                await session.settle(*before)
            return {"success": True, "clicked": f"@{ref}", **await _where(page)}

        return await _act(ctx, click)


class BrowserTypeTool(Tool):
    name = "browser_type"
    description = (
        "Type text into an input field identified by its ref. Clears the field first, then types the new text. "
        "Requires browser_navigate and browser_snapshot first."
    )
    parameters = {
        "type": "object",
        "properties": {
            "ref": {"type": "string", "description": "The element reference from the snapshot (e.g., '@e3')"},
            "text": {"type": "string", "description": "The text to type into the field"},
        },
        "required": ["ref", "text"],
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        async def type_(page, session):
            ref, target = await _element(page, arguments["ref"])
            await target.fill(arguments["text"], timeout=_ms(session))
            return {"success": True, "typed": arguments["text"], "element": f"@{ref}"}

        return await _act(ctx, type_)


class BrowserScrollTool(Tool):
    name = "browser_scroll"
    description = "Scroll the page up or down to reveal more content. Requires browser_navigate first."
    parameters = {
        "type": "object",
        "properties": {"direction": {"type": "string", "enum": ["up", "down"], "description": "Direction to scroll"}},
        "required": ["direction"],
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        async def scroll(page, session):
            step = 640 if arguments["direction"] == "down" else -640
            position = await page.evaluate(
                "(dy) => { window.scrollBy(0, dy); return {y: Math.round(window.scrollY),"
                " height: document.documentElement.scrollHeight}; }",
                step,
            )
            return {"success": True, "scrolled": arguments["direction"], "position": position}

        return await _act(ctx, scroll)


class BrowserBackTool(Tool):
    name = "browser_back"
    description = "Navigate back to the previous page in the browser history. Requires browser_navigate first."
    parameters = {"type": "object", "properties": {}, "required": []}

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        async def back(page, session):
            before = page.url
            response = await page.go_back(wait_until="domcontentloaded", timeout=_ms(session))
            if response is None and page.url == before:
                return {"success": False, "error": "There is no previous page.", **await _where(page)}
            return {"success": True, **await _where(page)}

        return await _act(ctx, back)


class BrowserPressTool(Tool):
    name = "browser_press"
    description = (
        "Press a keyboard key, e.g. Enter to submit a form, Tab to move focus, Escape, ArrowDown. "
        "Requires browser_navigate first."
    )
    parameters = {
        "type": "object",
        "properties": {"key": {"type": "string", "description": "Key to press (e.g., 'Enter', 'Tab', 'Escape', 'ArrowDown')"}},
        "required": ["key"],
    }

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        async def press(page, session):
            before = session.navigations, session.loads
            await page.keyboard.press(arguments["key"])
            await session.settle(*before)
            return {"success": True, "pressed": arguments["key"], **await _where(page)}

        return await _act(ctx, press)


class BrowserGetImagesTool(Tool):
    name = "browser_get_images"
    description = (
        "List the images on the current page with their URLs and alt text, e.g. to analyze one with "
        "vision_analyze. Requires browser_navigate first."
    )
    parameters = {"type": "object", "properties": {}, "required": []}

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        async def images(page, session):
            found = await page.evaluate(_IMAGES_JS)
            return {"success": True, "images": found, "count": len(found)}

        return await _act(ctx, images)


class BrowserCloseTool(Tool):
    name = "browser_close"
    description = "Close the browser session and release its resources. Call it when done with browser tasks."
    parameters = {"type": "object", "properties": {}, "required": []}

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        session: BrowserSession = ctx.session("browser")
        was_open = session.is_open
        await session.close()
        return {"success": True, "closed": was_open}


BROWSER_TOOLS = (
    BrowserNavigateTool,
    BrowserSnapshotTool,
    BrowserClickTool,
    BrowserTypeTool,
    BrowserScrollTool,
    BrowserBackTool,
    BrowserPressTool,
    BrowserGetImagesTool,
    BrowserCloseTool,
)
