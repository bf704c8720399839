"""End-to-end throughput of the local engine against the scripted model server.

Issue 2's target: 1000 prompts, 3 model calls each (2 tool calls, each a real
`echo` in a local sandbox), 500 ms per call, --num_workers 64: wall time at
most 1.5x the latency-bound ideal, at most 15 ms CPU per model call for the
whole process tree, peak memory under 200 MB.

    python bench/bench_local_run.py [--prompts 1000] [--workers 64] [--latency 0.5] [--tool-calls 2]

With ``--tool-calls`` at two values, the difference of the process tree's CPU
per prompt, divided by the difference of the calls, is what a command (and the
model call after it) costs; what remains of a prompt's CPU at 2 is its start
and end.  Run from another checkout's folder (``cd ../main && python
../this/bench/bench_local_run.py``), the run is of that checkout's code.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import ideal_seconds, measure_run, model_server, write_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.5)
    parser.add_argument("--tool-calls", type=int, default=2, help="commands each prompt runs, each a model call")
    parser.add_argument("--sandbox", default="local")
    parser.add_argument("-S", dest="sandbox_options", action="append", default=[],
                        help="a sandbox option passed to the run, e.g. -S isolation=process")
    args = parser.parse_args()
    calls_per_prompt = args.tool_calls + 1

    with tempfile.TemporaryDirectory() as tmp, model_server(args.latency, tool_calls=calls_per_prompt - 1) as url:
        dataset = write_prompts(Path(tmp) / "prompts.jsonl", args.prompts)
        result = measure_run([
            "run", "--dataset_file", str(dataset), "--batch_size", "100", "--run_name", "bench",
            "--output_dir", tmp, "--base_url", url, "--model", "bench-model", "--api_key", "bench",
            "--num_workers", str(args.workers), "--distribution", "terminal_only",
            "--sandbox", args.sandbox, "--no-progress", "--seed", "1",
            *(arg for option in args.sandbox_options for arg in ("-S", option)),
        ])
        stats = json.loads((Path(tmp) / "bench" / "statistics.json").read_text())

    calls = args.prompts * calls_per_prompt
    ideal = ideal_seconds(args.prompts, args.workers, calls_per_prompt, args.latency)
    print(f"prompts {args.prompts}, workers {args.workers}, latency {args.latency}s, sandbox {args.sandbox}")
    print(f"model calls recorded  {stats['finished']['model_calls']} (expected {calls})")
    print(f"wall time             {result['wall_s']:.1f} s  (ideal {ideal:.1f} s, ratio {result['wall_s'] / ideal:.2f}, target <= 1.5)")
    print(f"CPU per model call    {1000 * result['cpu_s'] / calls:.1f} ms  (process tree {result['cpu_s']:.1f} s, target <= 15 ms)")
    own = result["own_cpu_s"]
    print(f"  of which            {1000 * own / calls:.1f} ms in the hermes-batch process, "
          f"{1000 * (result['cpu_s'] - own) / calls:.1f} ms in the commands it ran (sandbox, tools)")
    print(f"peak memory           {result['peak_rss_mb']:.0f} MB  (target < 200 MB)")
    print(f"CPU per prompt        {1000 * result['cpu_s'] / args.prompts:.1f} ms  ({args.tool_calls} commands)")


if __name__ == "__main__":
    main()
