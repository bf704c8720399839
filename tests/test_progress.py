"""The progress display: a live view on a terminal, periodic log lines otherwise."""

import asyncio
import io
import logging

from rich.console import Console

from hermes_batch.run import progress as progress_module
from hermes_batch.run.progress import Progress


async def test_without_a_terminal_progress_is_logged_periodically(monkeypatch, caplog):
    monkeypatch.setattr(progress_module, "LOG_INTERVAL_S", 0.05)
    caplog.set_level(logging.INFO, logger="hermes_batch.run.progress")
    progress = Progress(total=4, enabled=False)
    progress.watch(lambda: {"limit": "8", "rate-limited": "2"})
    progress.start()
    for _ in range(3):
        progress.dispatched()
    progress.ended("kept")
    progress.ended("discarded")
    await asyncio.sleep(0.2)
    progress.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "hermes_batch.run.progress"]
    assert lines, "no progress line was logged"
    last = lines[-1]
    for part in ("2/4 done", "kept 1", "discarded 1", "failed 0", "in flight 1", "ETA", "limit 8", "rate-limited 2"):
        assert part in last, (part, last)


def test_the_live_view_renders_the_same_counts():
    progress = Progress(total=10, enabled=False)
    progress.dispatched()
    progress.ended("failed")
    console = Console(file=io.StringIO(), width=200)
    console.print(progress._render())
    shown = console.file.getvalue()
    assert "1/10 done" in shown and "failed 1" in shown
