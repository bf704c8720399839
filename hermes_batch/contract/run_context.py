"""The per-run context handed to backends and observers."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Optional

import attrs

LOG_PREFIX_CHARS = 100  # the default of --log_prefix_chars


@attrs.define
class RunContext:
    """Where a run lives and what it shares: names, folders, the blocking-call thread pool."""

    run_name: str
    run_dir: Path
    seed: int
    verbose: bool = False
    log_prefix_chars: int = LOG_PREFIX_CHARS
    thread_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    @property
    def scratch_dir(self) -> Path:
        """Working folders of local sandboxes."""
        return self.run_dir / "scratch"
