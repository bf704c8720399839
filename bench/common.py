"""Shared pieces of the benchmarks: the scripted model server as a process, and measuring a run."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


@contextlib.contextmanager
def model_server(latency: float, tool_calls: int = 2, batch_delay: float = 0.0, command: str = None):
    """The scripted model server in its own process (its CPU is not counted against the run).

    ``batch_delay``: seconds its batch endpoints take per batch (``--batch_api``); ``command``: what each tool
    call runs (the server's default without).
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "hermes_batch.testing.server", "--port", "0",
         "--latency", str(latency), "--tool-calls", str(tool_calls),
         *(("--batch-delay", str(batch_delay)) if batch_delay else ()),
         *(("--command", command) if command is not None else ())],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        if not line.startswith("READY "):
            raise RuntimeError(f"the model server did not start: {line!r}")
        yield line.split()[1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def write_prompts(path: Path, count: int, **extra) -> Path:
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"prompt": f"Benchmark task number {i}: run a command.", **extra}) + "\n")
    return path


# Runs a module as __main__ and, at exit, writes the CPU seconds of that process alone (not of the
# processes it started, such as the local sandbox's commands) to the file $HERMES_BATCH_BENCH_OWN_CPU.
_OWN_CPU = (
    "import atexit, os, resource, runpy, sys\n"
    "def _own():\n"
    "    r = resource.getrusage(resource.RUSAGE_SELF)\n"
    "    open(os.environ['HERMES_BATCH_BENCH_OWN_CPU'], 'w').write(repr(r.ru_utime + r.ru_stime))\n"
    "atexit.register(_own)\n"
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)\n"
)


def measure_run(args: list[str], *, module: str | None = "hermes_batch", env: dict | None = None,
                cwd: str | None = None) -> dict:
    """Run ``python -m module args`` (``python args`` without a module) as a child, in ``cwd``.

    Python puts a ``-c`` program's working folder first on its path: run from
    this checkout, the child imports this checkout's hermes_batch whatever
    PYTHONPATH says, so a run of other code needs a ``cwd`` elsewhere.

    Returns its wall time, the CPU of its whole process tree (``cpu_s``), the CPU
    of the module's process alone (``own_cpu_s``, module runs only) and peak RSS.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with tempfile.NamedTemporaryFile("r", suffix=".cpu") as own:
        if module:
            command = [sys.executable, "-c", _OWN_CPU, module, *args]
            env = dict(env if env is not None else os.environ, HERMES_BATCH_BENCH_OWN_CPU=own.name)
        else:
            command = [sys.executable, *args]
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"{' '.join(command[:4])} exited with {proc.returncode}")
        own_cpu = float(own.read() or "nan") if module else None
    return {
        "wall_s": wall,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "own_cpu_s": own_cpu,
        # ru_maxrss of reaped children is the largest single process (kB on Linux)
        "peak_rss_mb": after.ru_maxrss / 1024,
    }


def ideal_seconds(prompts: int, workers: int, calls_per_prompt: int, latency: float) -> float:
    return math.ceil(prompts / workers) * calls_per_prompt * latency
