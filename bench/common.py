"""Shared pieces of the benchmarks: the scripted model server as a process, and measuring a run."""

from __future__ import annotations

import contextlib
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path


@contextlib.contextmanager
def model_server(latency: float, tool_calls: int = 2):
    """The scripted model server in its own process (its CPU is not counted against the run)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hermes_batch.testing.server", "--port", "0",
         "--latency", str(latency), "--tool-calls", str(tool_calls)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        if not line.startswith("READY "):
            raise RuntimeError(f"the model server did not start: {line!r}")
        yield line.split()[1]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def write_prompts(path: Path, count: int, **extra) -> Path:
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"prompt": f"Benchmark task number {i}: run a command.", **extra}) + "\n")
    return path


def measure_run(args: list[str], *, module: str | None = "hermes_batch", env: dict | None = None) -> dict:
    """Run ``python -m module args`` (``python args`` without a module) as a child; wall time, CPU of its whole process tree, peak RSS."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    command = [sys.executable, *(["-m", module] if module else []), *args]
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{' '.join(command[:4])} exited with {proc.returncode}")
    return {
        "wall_s": wall,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        # ru_maxrss of reaped children is the largest single process (kB on Linux)
        "peak_rss_mb": after.ru_maxrss / 1024,
    }


def ideal_seconds(prompts: int, workers: int, calls_per_prompt: int, latency: float) -> float:
    return math.ceil(prompts / workers) * calls_per_prompt * latency
