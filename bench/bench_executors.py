"""The local executor beside the processes executor, side by side in one go, against the scripted model server.

Issue 13's target: 1000 prompts, 3 model calls each (2 tool calls, each a real
`echo` in a local sandbox), 500 ms per call, local sandbox.  At --num_workers 256
the processes executor takes at most 1.7 times the latency-bound ideal on a
2-core machine; at --num_workers 64 it is never slower than the local executor.

    python bench/bench_executors.py [--prompts 1000] [--concurrency 256 64] [--workers N] [--latency 0.5]
"""

from __future__ import annotations

import argparse
import json
import tempfile
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--workers", type=int, default=None, help="-E workers=N (default: one per core)")
    parser.add_argument("--latency", type=float, default=0.5)
    args = parser.parse_args()
    processes = ["--executor", "processes"] + (["-E", f"workers={args.workers}"] if args.workers else [])

    with tempfile.TemporaryDirectory() as tmp, model_server(args.latency, tool_calls=CALLS_PER_PROMPT - 1) as url:
        dataset = write_prompts(Path(tmp) / "prompts.jsonl", args.prompts)
        print(f"prompts {args.prompts}, {CALLS_PER_PROMPT} calls each at {args.latency}s, local sandbox")
        for concurrency in args.concurrency:
            ideal = ideal_seconds(args.prompts, concurrency, CALLS_PER_PROMPT, args.latency)
            local = run_once(url, dataset, tmp, f"local-{concurrency}", concurrency, [])
            split = run_once(url, dataset, tmp, f"processes-{concurrency}", concurrency, processes)
            print(f"--num_workers {concurrency} (ideal {ideal:.1f} s)")
            for label, result in (("local", local), ("processes", split)):
                print(
                    f"  {label:<10} {result['wall_s']:6.1f} s  ratio {result['wall_s'] / ideal:4.2f}  "
                    f"CPU {1000 * result['cpu_s'] / (args.prompts * CALLS_PER_PROMPT):5.1f} ms/call  "
                    f"peak {result['peak_rss_mb']:4.0f} MB/process  calls {result['model_calls']}"
                )
            print(f"  processes/local wall time {split['wall_s'] / local['wall_s']:.2f}")


if __name__ == "__main__":
    main()
