"""--batch_api against a synchronous run: batches, requests per batch and wall time (issue 34).

The scripted model server runs in its own process and takes --batch_delay seconds to process each
batch (and --latency seconds per synchronous call).  Every prompt takes 3 model calls (2 tool calls,
each a real `echo` in a local sandbox).  The batch run collects every waiting session's request into
the current batch (--batch_api_max_wait --max_wait, 1 s by default; polling every 0.5 s).  With
several --executor names each runs both ways, one after the other against the same server: under
`processes` the driver submits and collects while worker processes run the sessions.

    python bench/bench_batch_api.py [--prompts 1000] [--workers 1000] [--batch_delay 5] [--latency 0]
                                    [--executor local processes]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import measure_run, model_server, write_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--batch_delay", type=float, default=5.0, help="seconds the server takes per batch")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds the server takes per synchronous call")
    parser.add_argument("--max_requests", type=int, default=1000, help="--batch_api_max_requests")
    parser.add_argument("--max_wait", type=float, default=1.0, help="--batch_api_max_wait")
    parser.add_argument("--executor", nargs="+", default=["local"],
                        help="the executors to compare (local, processes), each run both ways")
    args = parser.parse_args()
    calls_per_prompt = 3

    results = {}
    with tempfile.TemporaryDirectory() as tmp, \
            model_server(args.latency, tool_calls=calls_per_prompt - 1, batch_delay=args.batch_delay) as url:
        dataset = write_prompts(Path(tmp) / "prompts.jsonl", args.prompts)
        for executor in args.executor:
            for way, extra in (
                ("synchronous", []),
                ("batch_api", ["--batch_api", "--batch_api_max_requests", str(args.max_requests),
                               "--batch_api_max_wait", str(args.max_wait), "--batch_api_poll_interval", "0.5"]),
            ):
                name = f"{executor}-{way}"
                result = results[(executor, way)] = measure_run([
                    "run", "--dataset_file", str(dataset), "--batch_size", "100", "--run_name", name,
                    "--output_dir", tmp, "--base_url", url, "--model", "bench-model", "--api_key", "bench",
                    "--num_workers", str(args.workers), "--distribution", "terminal_only",
                    "--sandbox", "local", "--no-progress", "--seed", "1", "--executor", executor, *extra,
                ])
                result["stats"] = json.loads((Path(tmp) / name / "statistics.json").read_text())

    print(f"prompts {args.prompts}, workers {args.workers}, {calls_per_prompt} model calls each; "
          f"server: {args.batch_delay:g} s per batch, {args.latency:g} s per synchronous call")
    for (executor, way), result in results.items():
        stats = result["stats"]
        print(f"{executor:10} {way:12} wall {result['wall_s']:7.1f} s   cpu {result['cpu_s']:6.1f} s   "
              f"kept {stats['kept']['samples']}   model calls {stats['finished']['model_calls']}")
        if way == "batch_api":
            batches = stats["batch_api"]
            print(f"{'':23} batches {batches['batches']}, requests {batches['requests']}, requests per batch "
                  f"{batches['requests_per_batch']} (largest {batches['largest']}), mean wait per request "
                  f"{batches['mean_wait_s']} s")
    for executor in args.executor:
        ratio = results[(executor, "batch_api")]["wall_s"] / results[(executor, "synchronous")]["wall_s"]
        print(f"{executor:10} wall time batch_api / synchronous: {ratio:.2f}")


if __name__ == "__main__":
    main()
