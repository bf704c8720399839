"""The live progress display, or periodic log lines when stderr is not a terminal."""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import time
from typing import Callable, Optional

log = logging.getLogger("hermes_batch.run.progress")

LOG_INTERVAL_S = 15.0


class Progress:
    """Counts prompts dispatched and ended; shows done/total, kept, discarded, failed, rate and ETA."""

    def __init__(self, total: int, enabled: Optional[bool] = None):
        self.total = total
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.counts: collections.Counter = collections.Counter()
        self.in_flight = 0
        self._started = time.monotonic()
        self._live = None
        self._task: Optional[asyncio.Task] = None
        self._sources: list[Callable[[], dict]] = []

    def start(self) -> None:
        self._started = time.monotonic()
        if self.enabled:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(get_renderable=self._render, console=Console(stderr=True), refresh_per_second=2, transient=False)
            self._live.start()
        else:
            self._task = asyncio.get_running_loop().create_task(self._log_periodically())

    def watch(self, source: Callable[[], dict]) -> None:
        """Show what ``source()`` returns ({label: value}) at each refresh."""
        self._sources.append(source)

    def dispatched(self) -> None:
        self.in_flight += 1

    def ended(self, kind: str) -> None:
        self.in_flight -= 1
        self.counts[kind] += 1

    @property
    def done(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        elapsed = max(time.monotonic() - self._started, 1e-6)
        rate = self.done / elapsed
        remaining = max(self.total - self.done, 0)
        eta = f"{remaining / rate:.0f}s" if rate > 0 else "?"
        parts = [
            f"{self.done}/{self.total} done",
            f"kept {self.counts['kept']}",
            f"discarded {self.counts['discarded']}",
            f"failed {self.counts['failed']}",
            f"in flight {self.in_flight}",
            f"{rate * 60:.1f} prompts/min",
            f"ETA {eta}",
        ]
        for source in self._sources:
            parts += [f"{k} {v}" for k, v in source().items()]
        return " | ".join(parts)

    def _render(self):
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        grid = Table.grid(padding=(0, 1))
        grid.add_row(ProgressBar(total=max(self.total, 1), completed=self.done, width=40), self.summary())
        return grid

    async def _log_periodically(self) -> None:
        while True:
            await asyncio.sleep(LOG_INTERVAL_S)
            log.info("progress: %s", self.summary())

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._task is not None:
            self._task.cancel()
            self._task = None
