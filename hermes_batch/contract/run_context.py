"""The per-run context handed to backends and observers."""

from __future__ import annotations

import concurrent.futures
import os
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
    # Files of this machine that no sandbox may show its commands: the dataset (its rows' tests, answers, rubrics).
    private_paths: tuple = ()

    @property
    def scratch_dir(self) -> Path:
        """Working folders of local sandboxes."""
        return self.run_dir / "scratch"


def private_paths(config) -> tuple:
    """What no sandbox of a run with ``config`` (a RunConfig) may show: its dataset file."""
    dataset = getattr(config, "dataset_file", None)
    return (os.path.realpath(dataset),) if dataset else ()
