"""The browser toolset's costs: context start, a navigate+snapshot round trip, memory per context.

With 1 and with 16 prompts at once (each its own browser context, opened by
its first browser_navigate, as in a run), against the toolbox's local website:

* context start: a prompt's first browser_navigate opening its context, up to
  the page object (slot, browser.new_context, new_page), median and p95;
* round trip: browser_navigate to the article page then browser_snapshot
  (the tools as a run calls them), median and p95 over the rounds;
* memory: the proportional set size (PSS, so shared pages count once) of all
  Chromium processes with N contexts open, each on a page, minus with none,
  divided by N.

    python bench/bench_browser.py [--rounds 5] [--concurrency 1,16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from hermes_batch.contract.interfaces import ModelSettings, ToolContext
from hermes_batch.contract.plugins import collect, get_plugin_manager
from hermes_batch.contract.run_context import RunContext
from hermes_batch.contract.toolsets import PromptToolsets, build_runtimes
from hermes_batch_toolbox.browser_tools import BrowserNavigateTool, BrowserSnapshotTool
from hermes_batch_toolbox.testing import LocalWebsite


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def pss_mb(pids) -> float:
    total_kb = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kb += int(line.split()[1])
        except OSError:
            pass  # a process that ended meanwhile
    return total_kb / 1024


async def chromium_pids(runtime) -> list[int]:
    browser = await runtime.browser()
    cdp = await browser.new_browser_cdp_session()
    info = await cdp.send("SystemInfo.getProcessInfo")
    await cdp.detach()
    return [p["id"] for p in info["processInfo"]]


async def prompt(runtime, site: str, rounds: int, starts: list, trips: list) -> PromptToolsets:
    sessions = PromptToolsets({"browser": runtime})
    ctx = ToolContext(sandbox=None, toolsets=sessions)
    started = time.perf_counter()
    await ctx.session("browser").page(open_context=True)
    starts.append(time.perf_counter() - started)
    for _ in range(rounds):
        started = time.perf_counter()
        nav = await BrowserNavigateTool().call({"url": site + "/article"}, ctx)
        snap = await BrowserSnapshotTool().call({}, ctx)
        trips.append(time.perf_counter() - started)
        assert nav["success"] and snap["success"], (nav, snap)
    return sessions


async def measure(site: str, concurrency: int, rounds: int, tmp: Path) -> dict:
    settings = ModelSettings(model="none", base_url="http://127.0.0.1:9/v1")
    # the production address check, with the local site's one address allowed (as the toolbox's tests do)
    options = {"browser": {"allow_addresses": [site.split("//", 1)[1]], "max_contexts": concurrency, "timeout": 60}}
    runtime = build_runtimes(collect(get_plugin_manager()), ["browser"], options, settings)["browser"]
    await runtime.start(RunContext("bench", tmp, seed=0), None)
    try:
        await runtime.browser()  # one browser per run, started once: not part of a context's start
        idle = pss_mb(await chromium_pids(runtime))
        starts, trips = [], []
        sessions = await asyncio.gather(*(prompt(runtime, site, rounds, starts, trips) for _ in range(concurrency)))
        busy = pss_mb(await chromium_pids(runtime))
        for s in sessions:
            await s.aclose()
        return {
            "start_median": statistics.median(starts), "start_p95": p95(starts),
            "trip_median": statistics.median(trips), "trip_p95": p95(trips),
            "mb_per_context": (busy - idle) / concurrency, "idle_mb": idle,
        }
    finally:
        await runtime.shutdown()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="navigate+snapshot rounds per prompt")
    parser.add_argument("--concurrency", default="1,16", help="prompts at once, comma-separated")
    args = parser.parse_args()
    with LocalWebsite() as site, tempfile.TemporaryDirectory() as tmp:
        print(f"{'prompts':>7}  {'context start median / p95':>27}  {'navigate+snapshot median / p95':>31}  {'MB per context':>14}")
        for n in (int(x) for x in args.concurrency.split(",")):
            r = await measure(site.url, n, args.rounds, Path(tmp))
            print(f"{n:>7}  {1000 * r['start_median']:>12.0f} ms / {1000 * r['start_p95']:>6.0f} ms"
                  f"  {1000 * r['trip_median']:>16.0f} ms / {1000 * r['trip_p95']:>6.0f} ms  {r['mb_per_context']:>14.1f}"
                  f"   (browser alone {r['idle_mb']:.0f} MB PSS)")


if __name__ == "__main__":
    asyncio.run(main())
