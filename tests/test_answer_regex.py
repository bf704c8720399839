"""Regex answers off the event loop with a time limit that stops them (issue 43, item 7): `answer:mode=regex`
matches in a reusable child process, killed when its verifier's time runs out, while the run keeps its pace."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

import hermes_batch
from hermes_batch.contract.interfaces import VerifierContext
from hermes_batch.default_plugins.regex_worker import RegexError, RegexWorkers
from hermes_batch.formats.records import PromptRow
from hermes_batch.run.selection import verifiers
from hermes_batch.testing import Reply, RoutedScript, write_dataset
from hermes_batch.testing.records import make_trajectory

CATASTROPHIC = r"(a+)+$"
STUCK = "a" * 26 + "!"  # re.search backtracks about 8 s on the test machine (the 27 took 22 s)


def answer_verifier(spec: str):
    (verifier,) = verifiers(hermes_batch.get_plugin_manager(load_entry_points=False).registry(), (spec,))
    return verifier


def context(pattern: str, answer: str) -> VerifierContext:
    row = PromptRow(0, "q", 1, extra={"answer": pattern})
    return VerifierContext(None, row, make_trajectory(answer=answer), None, lambda *a, **k: None)


class LoopClock:
    """Ticks every 10 ms on the event loop and keeps the longest gap: what a frozen loop makes every prompt wait."""

    def __init__(self):
        self.worst = 0.0
        self._task = asyncio.ensure_future(self._tick())

    async def _tick(self):
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.worst = max(self.worst, now - last - 0.01)
            last = now

    def stop(self) -> float:
        self._task.cancel()
        return self.worst


def test_a_catastrophic_pattern_is_stopped_at_its_timeout_and_the_event_loop_keeps_its_pace():
    verifier = answer_verifier("answer:mode=regex,timeout=0.5")

    async def main():
        clock = LoopClock()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(verifier.timeout):  # as session/verification.py bounds every verifier
                await verifier.verify(context(CATASTROPHIC, STUCK))
        took = time.monotonic() - started
        workers = verifier._regex
        ordinary = await verifier.verify(context(r"order AB-\d{4}", "Your order AB-1234 shipped."))
        worst = clock.stop()
        await verifier.shutdown()
        return took, worst, workers, ordinary

    took, worst, workers, ordinary = asyncio.run(main())
    assert 0.45 < took < 3  # the old verifier held the loop for the whole match, 8 s
    assert worst < 1, f"the event loop stood still for {worst:.2f} s"
    assert (workers.killed, workers.started) == (1, 2)  # the stuck process was killed, another one matched on
    assert ordinary.reward == 1.0 and ordinary.reason == "matches the pattern"


def test_ordinary_patterns_reuse_one_process_and_a_bad_pattern_is_the_row_s_error():
    verifier = answer_verifier("answer:mode=regex")

    async def main():
        rewards = [(await verifier.verify(context(rf"^x{i}\b", f"x{i} is it"))).reward for i in range(50)]
        rewards.append((await verifier.verify(context("^y", "x"))).reward)
        with pytest.raises(ValueError) as caught:
            await verifier.verify(context("(unclosed", "x"))
        pid = verifier._regex._idle[0].process.pid
        with open(f"/proc/{pid}/environ", "rb") as handle:
            environ = handle.read()
        started = verifier._regex.started
        await verifier.shutdown()
        return rewards, str(caught.value), environ, started

    rewards, error, environ, started = asyncio.run(main())
    assert rewards == [1.0] * 50 + [0.0]
    assert error.startswith("the row's `answer` pattern: not a valid regular expression (missing ), unterminated")
    assert started == 1
    assert environ == b""  # no key of the run's reaches the process


def test_a_stuck_match_does_not_hold_up_the_matches_of_other_prompts():
    workers = RegexWorkers()

    async def main():
        stuck = [asyncio.ensure_future(workers.search(CATASTROPHIC, STUCK)) for _ in range(2)]
        await asyncio.sleep(0.1)
        started = time.monotonic()
        found = await asyncio.gather(*(workers.search("b+", "a" * i + "b") for i in range(20)))
        took = time.monotonic() - started
        still = [not task.done() for task in stuck]
        for task in stuck:
            task.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)
        with pytest.raises(RegexError, match="not a valid regular expression"):
            await workers.search("a{2,1}", "aa")
        await workers.aclose()
        return found, took, still

    found, took, still = asyncio.run(main())
    assert found == [True] * 20 and still == [True, True]  # done while the stuck ones still ran, 8 s each
    assert took < 4
    assert workers.killed == 2


def test_the_matching_process_dies_with_the_run(tmp_path):
    """A run killed with SIGKILL mid-match leaves no process backtracking for hours."""
    script = tmp_path / "run.py"
    script.write_text(
        "import asyncio, sys\n"
        "from hermes_batch.default_plugins.regex_worker import RegexWorkers\n"
        "async def main():\n"
        "    workers = RegexWorkers()\n"
        "    task = asyncio.ensure_future(workers.search(sys.argv[1], sys.argv[2]))\n"
        "    while not workers.started:\n"
        "        await asyncio.sleep(0.01)\n"
        "    await asyncio.sleep(0.2)\n"
        "    print('matching', flush=True)\n"
        "    await task\n"
        "asyncio.run(main())\n")
    proc = subprocess.Popen([sys.executable, str(script), CATASTROPHIC, STUCK * 2], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "matching"
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 1
        child = int(children[0])
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def regex_children(parent: int) -> list:
    """The pids of ``parent``'s child processes that run regex_child.py."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat, open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == parent and b"regex_child.py" in cmdline.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_run_with_a_catastrophic_row_keeps_the_other_prompts_at_their_pace(runner, model_server, tmp_path):
    """Row 0's pattern backtracks for seconds; row 1's session, fifteen model calls 100 ms apart, runs meanwhile."""
    times = []

    async def steady(request):
        times.append(time.monotonic())
        await asyncio.sleep(0.1)
        if request.turn < 14:
            return Reply(reasoning="Next.", tool_calls=[("terminal", {"command": "true"})])
        return Reply(content="done", reasoning="Done.")

    def stuck(request):
        return Reply(content=STUCK, reasoning="Here.")

    runner.server = model_server(RoutedScript(lambda prompt: stuck if prompt == "stuck" else steady))
    rows = [{"prompt": "stuck", "answer": CATASTROPHIC}, {"prompt": "steady", "answer": "^done$"}]
    result = runner.invoke(write_dataset(tmp_path / "d.jsonl", rows), "--verifier", "answer:mode=regex,timeout=1",
                           "--max_turns", "20")
    assert result.exit_code == 0, result.output
    records = runner.records("trajectories.jsonl") + [d["trajectory"] for d in runner.records("discarded.jsonl")]
    by_prompt = {r["prompt_index"]: r["metadata"] for r in records}
    (entry,) = json.loads(by_prompt[0]["verifiers"])
    assert entry["error"] == "timed out after 1 s" and entry["duration_s"] < 3
    assert (by_prompt[0]["verified"], by_prompt[1]["passed"]) == (False, True)
    gaps = [b - a for a, b in zip(times, times[1:])]
    # 0.1 s apart, plus a turn's work (more on a loaded machine); the old verifier froze the loop for 8 s
    assert len(times) == 15 and max(gaps) < 2, gaps
    assert not regex_children(os.getpid())  # none left running
