"""The local executor beside the processes executor, side by side in one go, against the scripted model server.

Issue 13's target: 1000 prompts, 3 model calls each (2 tool calls, each a real
`echo` in a local sandbox), 500 ms per call, local sandbox.  At --num_workers 256
the processes executor takes at most 1.7 times the latency-bound ideal on a
2-core machine; at --num_workers 64 it is never slower than the local executor.

    python bench/bench_executors.py [--prompts 1000] [--concurrency 256 64] [--workers N] [--latency 0.5]
                                    [--goes N] [--ray]

With --goes N each concurrency is measured N times, the executors taking turns
to go first (on a shared machine the second of a pair often meets a warmer, or
busier, machine).

With --ray (hermes-batch-ray installed) the Ray executor runs too, on a
one-node cluster the script starts in a temporary folder and stops again
(or on --ray_address HOST:PORT); its actors' CPU is outside this process
tree, so only its wall time is comparable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ideal_seconds, measure_run, model_server, write_prompts

CALLS_PER_PROMPT = 3


def run_once(url: str, dataset: Path, tmp: str, name: str, concurrency: int, executor: list[str]) -> dict:
    result = measure_run([
        "run", "--dataset_file", str(dataset), "--batch_size", "100", "--run_name", name,
        "--output_dir", tmp, "--base_url", url, "--model", "bench-model", "--api_key", "bench",
        "--num_workers", str(concurrency), "--distribution", "terminal_only",
        "--no-progress", "--seed", "1", *executor,
    ])
    stats = json.loads((Path(tmp) / name / "statistics.json").read_text())
    result["model_calls"] = stats["finished"]["model_calls"]
    return result


@contextlib.contextmanager
def ray_head(cpus: int):
    """A one-node Ray cluster in a temporary folder; its processes (found by that folder) are stopped at the end."""
    temp_dir = tempfile.mkdtemp(prefix="hb-bench-ray-", dir="/tmp")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray = str(Path(sys.executable).with_name("ray"))
    subprocess.run([ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--temp-dir", temp_dir,
                    "--num-cpus", str(cpus), "--include-dashboard", "false", "--disable-usage-stats"],
                   check=True, capture_output=True, env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))
    try:
        yield f"127.0.0.1:{port}"
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in _tree(temp_dir):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            time.sleep(3)


def _tree(marker: str) -> set:
    parents, roots = {}, set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                parents[int(entry.name)] = int(Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[1])
                if marker.encode() in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                    roots.add(int(entry.name))
    ours = roots - {os.getpid()}
    while more := {pid for pid, parent in parents.items() if parent in ours} - ours:
        ours |= more
    return ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--workers", type=int, default=None, help="-E workers=N (default: one per core)")
    parser.add_argument("--latency", type=float, default=0.5)
    parser.add_argument("--goes", type=int, default=1, help="measure each concurrency this many times")
    parser.add_argument("--ray", action="store_true", help="also the Ray executor, on a cluster started for the bench")
    parser.add_argument("--ray_address", help="also the Ray executor, on this cluster")
    args = parser.parse_args()
    processes = ["--executor", "processes"] + (["-E", f"workers={args.workers}"] if args.workers else [])

    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        url = stack.enter_context(model_server(args.latency, tool_calls=CALLS_PER_PROMPT - 1))
        cpus = max(os.cpu_count() or 1, args.workers or 1)
        address = args.ray_address or (stack.enter_context(ray_head(cpus)) if args.ray else None)
        dataset = write_prompts(Path(tmp) / "prompts.jsonl", args.prompts)
        print(f"prompts {args.prompts}, {CALLS_PER_PROMPT} calls each at {args.latency}s, local sandbox")
        for go, concurrency in ((go, c) for go in range(args.goes) for c in args.concurrency):
            ideal = ideal_seconds(args.prompts, concurrency, CALLS_PER_PROMPT, args.latency)
            executors = {"local": [], "processes": processes}
            if address:
                workers = args.workers or os.cpu_count() or 1  # as many actors as worker processes
                executors["ray"] = ["--executor", "ray", "-E", f"address={address}", "-E", f"workers={workers}"]
            order = list(executors)
            order = order[go % len(order):] + order[:go % len(order)]  # each goes first in turn
            results = {label: run_once(url, dataset, tmp, f"{label}-{concurrency}-{go}", concurrency, executors[label])
                       for label in order}
            print(f"--num_workers {concurrency} (ideal {ideal:.1f} s)" + (f", go {go + 1}, {order[0]} first" if args.goes > 1 else ""))
            for label, result in sorted(results.items(), key=lambda item: list(executors).index(item[0])):
                cpu = "" if label == "ray" else f"  CPU {1000 * result['cpu_s'] / (args.prompts * CALLS_PER_PROMPT):5.1f} ms/call"
                print(
                    f"  {label:<10} {result['wall_s']:6.1f} s  ratio {result['wall_s'] / ideal:4.2f}{cpu}  "
                    f"calls {result['model_calls']}"
                )
            local = results["local"]["wall_s"]
            print(f"  processes/local wall time {results['processes']['wall_s'] / local:.2f}")
            if "ray" in results:
                extra = (results["ray"]["wall_s"] - local) * concurrency / args.prompts
                print(f"  ray/local wall time {results['ray']['wall_s'] / local:.2f}, "
                      f"{1000 * extra:+.0f} ms per prompt (wall time difference x sessions / prompts)")


if __name__ == "__main__":
    main()
