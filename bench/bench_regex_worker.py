"""What matching `answer:mode=regex` in a child process costs, and what a stuck match does to the event loop
(issue 43, item 7).

1. Ordinary patterns: N matches one after another through the regex worker (``RegexWorkers.search``) and
   with ``re.search`` on the loop, as the answer verifier did before: wall time and CPU (this process and its
   children) per match; and N matches started at once (a run's verifications overlapping).
2. The first match of a run: the time to start the worker process.
3. A stuck match (``(a+)+$`` against 26 ``a`` and ``!``) cut at 1 s while a task ticks every 10 ms on the
   loop: the loop's longest gap, and the same measure with ``re.search`` on the loop for 22 ``a``.

    python bench/bench_regex_worker.py [--matches 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import time

from hermes_batch.default_plugins.regex_worker import RegexWorkers

ANSWER = "After checking the logs, the order id is AB-1234 and it shipped on 2024-05-01.\n\\boxed{AB-1234}"
PATTERNS = [r"AB-\d{4}", r"\bshipped\b", r"^After", r"(?i)order id is [a-z]{2}-\d+", r"\\boxed\{AB-\d+\}"]


def cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


async def ticking(seconds_between: float = 0.01):
    worst = [0.0]

    async def tick():
        last = time.monotonic()
        while True:
            await asyncio.sleep(seconds_between)
            now = time.monotonic()
            worst[0] = max(worst[0], now - last - seconds_between)
            last = now

    return asyncio.ensure_future(tick()), worst


async def main(matches: int) -> None:
    workers = RegexWorkers()
    started = time.perf_counter()
    await workers.search("x", "x")
    print(f"first match (starts the worker process): {(time.perf_counter() - started) * 1000:.1f} ms")

    wall, used = time.perf_counter(), cpu()
    for i in range(matches):
        await workers.search(PATTERNS[i % len(PATTERNS)], ANSWER)
    wall, used = time.perf_counter() - wall, cpu() - used
    print(f"worker, one after another: {wall / matches * 1e6:.0f} us wall, {used / matches * 1e6:.0f} us CPU per match")

    wall, used = time.perf_counter(), cpu()
    for i in range(matches):
        re.search(PATTERNS[i % len(PATTERNS)], ANSWER)
    wall, used = time.perf_counter() - wall, cpu() - used
    print(f"re.search on the loop:     {wall / matches * 1e6:.1f} us wall, {used / matches * 1e6:.1f} us CPU per match")

    wall, used = time.perf_counter(), cpu()
    await asyncio.gather(*(workers.search(PATTERNS[i % len(PATTERNS)], ANSWER) for i in range(matches)))
    wall, used = time.perf_counter() - wall, cpu() - used
    print(f"worker, {matches} at once: {wall / matches * 1e6:.0f} us wall, {used / matches * 1e6:.0f} us CPU per match "
          f"({workers.started} processes started in all)")

    ticker, worst = await ticking()
    started = time.perf_counter()
    try:
        async with asyncio.timeout(1.0):
            await workers.search(r"(a+)+$", "a" * 26 + "!")
    except TimeoutError:
        pass
    stopped = time.perf_counter() - started
    await asyncio.sleep(0.05)
    ticker.cancel()
    print(f"stuck match in the worker, cut at 1 s: stopped after {stopped:.2f} s; the loop's longest gap "
          f"{worst[0] * 1000:.0f} ms; {workers.killed} process killed")

    ticker, worst = await ticking()
    await asyncio.sleep(0.03)
    started = time.perf_counter()
    re.search(r"(a+)+$", "a" * 22 + "!")  # what the verifier did before: 22 a, not 26, to keep the bench short
    blocked = time.perf_counter() - started
    await asyncio.sleep(0.05)
    ticker.cancel()
    print(f"stuck match on the loop (22 a): {blocked:.2f} s; the loop's longest gap {worst[0] * 1000:.0f} ms")
    await workers.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matches", type=int, default=2000)
    asyncio.run(main(parser.parse_args().matches))
