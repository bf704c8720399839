"""The browser toolset: a real Chromium (Debian's) through Playwright, against the local website."""

from __future__ import annotations

import asyncio
import os
import re
import signal

import pytest

from hermes_batch_toolbox.browser_tools import (
    BrowserBackTool,
    BrowserClickTool,
    BrowserCloseTool,
    BrowserGetImagesTool,
    BrowserNavigateTool,
    BrowserPressTool,
    BrowserScrollTool,
    BrowserSnapshotTool,
    BrowserTypeTool,
    compact,
    shorten,
)

pytestmark = pytest.mark.skipif(not os.access("/usr/bin/chromium", os.X_OK), reason="needs Debian's chromium")


async def call(tool, ctx, **arguments):
    return await tool().call(arguments, ctx)


def ref_of(snapshot: str, text: str) -> str:
    """The @ref of the first snapshot line that contains ``text``."""
    for line in snapshot.splitlines():
        if text in line and "[ref=" in line:
            return "@" + line.split("[ref=")[1].split("]")[0]
    raise AssertionError(f"{text!r} not in snapshot:\n{snapshot}")


@pytest.fixture
async def browser(toolsets, site):
    # the production address check, with the test site's one address allowed as a public site would be
    return await toolsets.start("browser", {"allow_addresses": [site.address], "timeout": 15})


async def test_a_session_navigates_reads_clicks_types_and_goes_back(browser, toolsets, sandbox, site):
    ctx = toolsets.context(sandbox, browser=browser)
    nav = await call(BrowserNavigateTool, ctx, url=site.url + "/")
    assert nav == {"success": True, "url": site.url + "/", "title": "Toolbox Test Site", "status": 200}

    snap = await call(BrowserSnapshotTool, ctx)
    assert snap["success"] and snap["element_count"] > 3
    assert 'heading "Welcome to the test site"' in snap["snapshot"]
    assert 'link "article about a lighthouse"' in snap["snapshot"]

    clicked = await call(BrowserClickTool, ctx, ref=ref_of(snap["snapshot"], "article about a lighthouse"))
    assert clicked["success"] and clicked["url"] == site.url + "/article" and clicked["title"] == "The Quiet Lighthouse"
    full = await call(BrowserSnapshotTool, ctx, full=True)
    assert "Fresnel lens" in full["snapshot"]

    back = await call(BrowserBackTool, ctx)
    assert back == {"success": True, "url": site.url + "/", "title": "Toolbox Test Site"}

    await call(BrowserNavigateTool, ctx, url=site.url + "/form")
    form = (await call(BrowserSnapshotTool, ctx))["snapshot"]
    typed = await call(BrowserTypeTool, ctx, ref=ref_of(form, 'textbox "Search query"'), text="brass lamps")
    assert typed == {"success": True, "typed": "brass lamps", "element": ref_of(form, 'textbox "Search query"')}
    pressed = await call(BrowserPressTool, ctx, key="Enter")
    assert pressed["success"] and pressed["title"] == "Results for brass lamps"
    assert "You searched for brass lamps." in (await call(BrowserSnapshotTool, ctx, full=True))["snapshot"]

    closed = await call(BrowserCloseTool, ctx)
    assert closed == {"success": True, "closed": True}
    assert (await call(BrowserSnapshotTool, ctx))["error"] == "No page is open; call browser_navigate first."


async def test_images_scrolling_and_new_tabs(browser, toolsets, sandbox, site):
    ctx = toolsets.context(sandbox, browser=browser)
    await call(BrowserNavigateTool, ctx, url=site.url + "/gallery")
    images = await call(BrowserGetImagesTool, ctx)
    assert images == {"success": True, "count": 2, "images": [
        {"url": site.url + "/images/red.png", "alt": "A red square", "width": 8, "height": 8},
        {"url": site.url + "/images/blue.png", "alt": "A blue square", "width": 16, "height": 16},
    ]}
    scrolled = await call(BrowserScrollTool, ctx, direction="down")
    assert scrolled["success"] and scrolled["scrolled"] == "down" and set(scrolled["position"]) == {"y", "height"}

    await call(BrowserNavigateTool, ctx, url=site.url + "/popup")
    link = ref_of((await call(BrowserSnapshotTool, ctx))["snapshot"], "Open the article")
    await call(BrowserClickTool, ctx, ref=link)
    snap = await call(BrowserSnapshotTool, ctx, full=True)
    assert snap["url"] == site.url + "/article"  # the new tab became the current page


async def test_bad_refs_keys_and_urls_fail_the_call_only(browser, toolsets, sandbox, site):
    ctx = toolsets.context(sandbox, browser=browser)
    assert (await call(BrowserClickTool, ctx, ref="@e1"))["error"] == "No page is open; call browser_navigate first."
    assert browser.contexts_opened == 0 and browser.launches == 0  # only browser_navigate opens anything
    await call(BrowserNavigateTool, ctx, url=site.url + "/")
    assert (await call(BrowserClickTool, ctx, ref="the big button"))["error"].startswith("'the big button' is not an element reference")
    started = asyncio.get_running_loop().time()
    missing = await call(BrowserClickTool, ctx, ref="@e999")
    assert missing == {"success": False, "error": "There is no element @e999 on the page now; take a new browser_snapshot."}
    assert asyncio.get_running_loop().time() - started < 10  # at once, not after the action timeout
    assert (await call(BrowserTypeTool, ctx, ref="e998", text="x"))["error"].startswith("There is no element @e998")
    assert (await call(BrowserPressTool, ctx, key="NotAKey"))["success"] is False
    bad = await call(BrowserNavigateTool, ctx, url="file:///etc/passwd")
    assert bad == {"success": False, "error": "Only http and https URLs can be fetched, not 'file'."}
    assert (await call(BrowserNavigateTool, ctx, url=site.url + "/article"))["success"] is True


async def test_private_addresses_are_refused_unless_allowed(toolsets, sandbox, site):
    runtime = await toolsets.start("browser", {})
    ctx = toolsets.context(sandbox, browser=runtime)
    result = await call(BrowserNavigateTool, ctx, url=site.url + "/")
    assert result == {"success": False, "error": "127.0.0.1 is a private or local address; only public addresses can be fetched."}


# Hosts that all reach this machine's loopback, where the secret service listens on its own port.
LOOPBACK_HOSTS = ("localhost.", "foo.localhost.", "127.0.0.1", "[::127.0.0.1]", "[64:ff9b::7f00:1]")


async def settled_snapshot(ctx, secret, settled=lambda text: True, seconds: float = 10) -> str:
    """The full snapshot once the page's scripts and frames went where they go (``settled``), or the secret shows."""
    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        snap = await call(BrowserSnapshotTool, ctx, full=True)
        text = snap.get("snapshot", "") or snap.get("error", "")
        if secret.secret in text or settled(text) or asyncio.get_running_loop().time() > deadline:
            return text
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("how", ["navigate", "https", "redirect", "script", "frame", "fetch"])
async def test_no_way_leads_the_browser_to_loopback(browser, toolsets, sandbox, site, secret, how):
    # The site plays a public page (only its own address is allowed); every hop, frame and request a page
    # makes goes through the context's proxy, which decides on the address it would connect to.
    hits = sum(secret.hits.values())
    for host in LOOPBACK_HOSTS:
        target = f"{'https' if how == 'https' else 'http'}://{host}:{secret.port}/"
        ctx = toolsets.context(sandbox, browser=browser)
        url = {"redirect": f"{site.url}/redirect-to?url={target}", "script": f"{site.url}/go?url={target}",
               "frame": f"{site.url}/frame?url={target}", "fetch": f"{site.url}/fetch?url={target}"}.get(how, target)
        nav = await call(BrowserNavigateTool, ctx, url=url)
        if how in ("navigate", "https", "redirect"):
            assert nav["success"] is False, (host, nav)
            assert "is a private or local address; only public addresses can be fetched." in nav["error"], (host, nav)
        else:
            assert nav["success"] is True, (host, nav)
        refused = "is a private or local address; only public addresses can be fetched."
        went = {"script": lambda text: refused in text, "frame": lambda text: refused in text,
                "fetch": lambda text: "waiting" not in text}.get(how, lambda text: True)
        text = await settled_snapshot(ctx, secret, went)
        assert secret.secret not in text and went(text), (how, host, text)
        if how == "fetch":
            assert "fetch failed" in text
        await ctx.toolsets.aclose()
    assert sum(secret.hits.values()) == hits  # nothing ever connected to it


async def test_the_refusal_is_made_by_the_proxy_on_the_address_connected_to(browser, toolsets, sandbox, site, secret):
    # the quick check of the URL does not see through a redirect: the proxy refuses the hop, names it, and
    # the page shows the refusal instead of the target; an allowed address goes through the same proxy
    ctx = toolsets.context(sandbox, browser=browser)
    hits = sum(secret.hits.values())
    nav = await call(BrowserNavigateTool, ctx, url=f"{site.url}/redirect-to?url=http://localhost.:{secret.port}/")
    assert nav == {"success": False, "url": f"http://localhost.:{secret.port}/",
                   "error": "localhost. is a private or local address; only public addresses can be fetched."}
    assert "only public addresses can be fetched" in (await call(BrowserSnapshotTool, ctx, full=True))["snapshot"]
    assert (await call(BrowserNavigateTool, ctx, url=f"{site.url}/redirect"))["title"] == "The Quiet Lighthouse"
    assert ctx.session("browser")._proxy.refusals >= 1 and sum(secret.hits.values()) == hits


async def test_a_slow_page_times_out_and_the_session_goes_on(toolsets, sandbox, site):
    runtime = await toolsets.start("browser", {"allow_private": True, "timeout": 3})
    ctx = toolsets.context(sandbox, browser=runtime)
    assert (await call(BrowserNavigateTool, ctx, url=site.url + "/"))["success"] is True
    slow = await call(BrowserNavigateTool, ctx, url=site.url + "/slow?delay=20")
    assert slow["success"] is False and "Timeout 3000ms exceeded" in slow["error"]
    assert (await call(BrowserNavigateTool, ctx, url=site.url + "/notes.txt"))["success"] is True


@pytest.mark.parametrize("race", ["ours restarted", "another won", "never settles"])
async def test_a_navigation_interrupted_by_another_one_goes_again_or_ends_where_it_was_going(
        browser, toolsets, sandbox, site, monkeypatch, race):
    # Chromium can restart a goto as a new document of the same URL (Playwright then reports it
    # interrupted by a navigation to that URL), or a late form submission can win the race.
    from playwright.async_api import Error as PlaywrightError
    from playwright.async_api import Page

    real_goto, gotos = Page.goto, []

    async def racing_goto(page, url, **kwargs):
        gotos.append(url)
        if race == "never settles" or len(gotos) == 1:
            await real_goto(page, url if race == "ours restarted" else site.url + "/article", **kwargs)
            raise PlaywrightError(f'Navigation to "{url}" is interrupted by another navigation to "{url}"')
        return await real_goto(page, url, **kwargs)

    monkeypatch.setattr(Page, "goto", racing_goto)
    ctx = toolsets.context(sandbox, browser=browser)
    result = await call(BrowserNavigateTool, ctx, url=site.url + "/gallery")
    if race == "ours restarted":  # already where it was going: no second goto
        assert result == {"success": True, "url": site.url + "/gallery", "title": "Gallery"} and len(gotos) == 1
    elif race == "another won":  # elsewhere: one more goto
        assert result == {"success": True, "url": site.url + "/gallery", "title": "Gallery", "status": 200}
        assert len(gotos) == 2
    else:  # bounded: the call fails after its attempts
        assert result["success"] is False and "interrupted by another navigation" in result["error"]
        assert len(gotos) == 3


async def test_contexts_are_isolated_and_closed_with_their_prompt(browser, toolsets, sandbox, site):
    first, second = toolsets.context(sandbox, browser=browser), toolsets.context(sandbox, browser=browser)
    await call(BrowserNavigateTool, first, url=site.url + "/")
    page = await first.session("browser").page()
    await page.evaluate("() => { localStorage.setItem('owner', 'first'); document.cookie = 'who=first'; }")
    await call(BrowserNavigateTool, second, url=site.url + "/")
    other = await second.session("browser").page()
    assert await other.evaluate("() => [localStorage.getItem('owner'), document.cookie]") == [None, ""]
    live = await browser.browser()
    assert len(live.contexts) == 2
    await first.toolsets.aclose()
    await second.toolsets.aclose()
    assert live.contexts == [] and browser._slots._value == browser.config.max_contexts


async def test_contexts_are_bounded_and_a_prompt_waits_for_a_slot(toolsets, sandbox, site):
    runtime = await toolsets.start("browser", {"allow_private": True, "max_contexts": 2, "slot_timeout": 0.5})
    ctxs = [toolsets.context(sandbox, browser=runtime) for _ in range(3)]
    for ctx in ctxs[:2]:
        assert (await call(BrowserNavigateTool, ctx, url=site.url + "/"))["success"]
    waited = await call(BrowserNavigateTool, ctxs[2], url=site.url + "/")
    assert waited == {"success": False, "error": "All 2 browser contexts stayed busy for 0.5 s; try again later."}
    # the third prompt gets the slot of a closed one
    waiting = asyncio.create_task(call(BrowserNavigateTool, ctxs[2], url=site.url + "/"))
    await asyncio.sleep(0.1)
    await call(BrowserCloseTool, ctxs[0])
    assert (await waiting)["success"] is True
    for ctx in ctxs:
        await ctx.toolsets.aclose()


async def test_a_cancelled_prompt_closes_its_context(browser, toolsets, sandbox, site):
    ctx = toolsets.context(sandbox, browser=browser)

    async def prompt():
        try:
            await call(BrowserNavigateTool, ctx, url=site.url + "/")
            await call(BrowserNavigateTool, ctx, url=site.url + "/slow?delay=30")
        finally:
            await ctx.toolsets.aclose()  # what the processor does when a prompt ends, however it ends

    task = asyncio.create_task(prompt())
    await asyncio.sleep(1.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await browser.browser()).contexts == [] and browser._slots._value == browser.config.max_contexts


async def test_a_crashed_browser_fails_the_call_and_is_started_again(browser, toolsets, sandbox, site):
    ctx = toolsets.context(sandbox, browser=browser)
    await call(BrowserNavigateTool, ctx, url=site.url + "/")
    live = await browser.browser()
    cdp = await live.new_browser_cdp_session()
    info = await cdp.send("SystemInfo.getProcessInfo")
    [pid] = [p["id"] for p in info["processInfo"] if p["type"] == "browser"]
    os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        if not live.is_connected():
            break
        await asyncio.sleep(0.05)
    crashed = await call(BrowserSnapshotTool, ctx)
    assert crashed == {"success": False, "error": "The browser crashed; call browser_navigate to start again."}
    again = await call(BrowserNavigateTool, ctx, url=site.url + "/article")
    assert again["success"] is True and browser.launches == 2


def test_compact_keeps_what_can_be_acted_on_and_shorten_cuts_at_lines():
    snapshot = "\n".join([
        "- generic [ref=e1]:", "  - heading \"Title\" [level=1] [ref=e2]", "  - paragraph [ref=e3]: long text",
        "  - link \"Home\" [ref=e4]:", "    - /url: /", "  - textbox \"Name\" [ref=e5]",
    ])
    assert compact(snapshot).splitlines() == [
        "  - heading \"Title\" [level=1] [ref=e2]", "  - link \"Home\" [ref=e4]:", "    - /url: /", "  - textbox \"Name\" [ref=e5]",
    ]
    long = "\n".join(f"- line {i}" for i in range(1000))
    cut = shorten(long, 500)
    assert len(cut) <= 500 and cut.endswith("more lines cut; scroll or use browser_snapshot(full=false) ...]")


async def test_a_huge_page_gives_a_bounded_snapshot(toolsets, sandbox, site):
    runtime = await toolsets.start("browser", {"allow_private": True, "max_snapshot_chars": 3000})
    ctx = toolsets.context(sandbox, browser=runtime)
    assert (await call(BrowserNavigateTool, ctx, url=site.url + "/huge?bytes=2000000"))["success"] is True
    snap = await call(BrowserSnapshotTool, ctx, full=True)
    assert snap["success"] is True and len(snap["snapshot"]) <= 3000
    assert "All work and no play" in snap["snapshot"] and snap["snapshot"].endswith("more lines cut; scroll or use browser_snapshot(full=false) ...]")


def open_pages(ctx) -> int:
    context = ctx.session("browser")._context
    return len([p for p in context.pages if not p.is_closed()])


async def test_a_popup_storm_opens_no_windows_and_later_calls_go_on(browser, toolsets, sandbox, site):
    # a page that opens 300 windows, each of which opens 300 more: Chromium's popup blocker lets a page open
    # a window only on a click, one per click, and a context never holds more than max_pages
    ctx = toolsets.context(sandbox, browser=browser)
    started = asyncio.get_running_loop().time()
    nav = await call(BrowserNavigateTool, ctx, url=f"{site.url}/popups?n=300")
    assert nav["success"] is True and nav["title"] == "Popups"
    await asyncio.sleep(1)
    assert open_pages(ctx) == 1
    button = ref_of((await call(BrowserSnapshotTool, ctx))["snapshot"], "Open 300 windows")
    assert (await call(BrowserClickTool, ctx, ref=button))["success"] is True
    await asyncio.sleep(1)
    assert open_pages(ctx) <= 2 <= browser.config.max_pages
    assert (await call(BrowserSnapshotTool, ctx))["success"] is True
    assert (await call(BrowserNavigateTool, ctx, url=f"{site.url}/article"))["title"] == "The Quiet Lighthouse"
    assert asyncio.get_running_loop().time() - started < 30


async def test_a_context_holds_at_most_max_pages(toolsets, sandbox, site):
    runtime = await toolsets.start("browser", {"allow_addresses": [site.address], "max_pages": 3, "timeout": 15})
    ctx = toolsets.context(sandbox, browser=runtime)
    await call(BrowserNavigateTool, ctx, url=f"{site.url}/tabs")
    for _ in range(5):  # the agent follows new tabs: the oldest other tab is closed to make room
        clicked = await call(BrowserClickTool, ctx, ref=ref_of((await call(BrowserSnapshotTool, ctx))["snapshot"], "Another tab"))
        assert clicked["success"] is True and clicked["title"] == "Tabs"
        assert open_pages(ctx) <= 3
    session = ctx.session("browser")
    for _ in range(4):  # windows a page opened some other way are closed at once past max_pages
        await session._context.new_page()
    await asyncio.sleep(0.5)
    assert open_pages(ctx) == 3 and session.pages_refused >= 4
    assert (await call(BrowserSnapshotTool, ctx))["success"] is True
    await (await session.page()).evaluate("() => window.close()")  # the current tab closes itself: go on in another
    await asyncio.sleep(0.5)
    assert (await call(BrowserSnapshotTool, ctx))["url"] == f"{site.url}/tabs" and open_pages(ctx) == 2
    await ctx.toolsets.aclose()


async def test_a_context_past_max_memory_mb_is_closed_and_the_prompt_can_start_again(toolsets, sandbox, site):
    runtime = await toolsets.start("browser", {"allow_addresses": [site.address], "max_memory_mb": 200, "timeout": 15})
    ctx = toolsets.context(sandbox, browser=runtime)
    assert (await call(BrowserNavigateTool, ctx, url=f"{site.url}/article"))["success"] is True
    assert await ctx.session("browser").memory_mb() < 50  # an ordinary page is far below the limit
    assert (await call(BrowserNavigateTool, ctx, url=f"{site.url}/hog?mb=600"))["success"] is True
    for _ in range(100):
        snap = await call(BrowserSnapshotTool, ctx)
        if not snap["success"]:
            break
        await asyncio.sleep(0.2)
    assert re.fullmatch(
        r"The pages of this prompt used \d+ MB of memory, more than the browser's limit of 200 MB, so its browser "
        r"context was closed\. Call browser_navigate to start again\.", snap["error"]), snap
    live = await runtime.browser()
    for _ in range(100):  # the call may fail while the context is still closing
        if live.contexts == [] and runtime._slots._value == runtime.config.max_contexts:
            break
        await asyncio.sleep(0.1)
    assert live.contexts == [] and runtime._slots._value == runtime.config.max_contexts
    assert (await call(BrowserNavigateTool, ctx, url=f"{site.url}/article"))["success"] is True
    await ctx.toolsets.aclose()
