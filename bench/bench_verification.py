"""What verification costs, and what --stop_on_success saves (issue 31).

1. Extra wall time and CPU per sample of a ``command`` verifier, with the local
   and the Docker sandbox: the same run (one tool call per prompt) without and
   with ``--verifier command`` (a one-line test), the difference divided by the
   samples.  CPU is the run's process tree (Docker's engine and container
   processes are not children of the run, so for Docker it is the client side only).
2. The cost saved by ``--stop_on_success`` on rows that pass with probability
   ``--pass_rate`` per sample (the scripted server decides each sample with a
   seeded draw), ``--samples_per_prompt K``: sessions and cost with and without
   it, beside the expected values (a row passes with probability 1-(1-p)^K and
   takes (1-(1-p)^K)/p samples on average under --stop_on_success, K without).

    python bench/bench_verification.py [--prompts 40] [--rows 300] [--pass_rate 0.3] [--samples 8] [--skip_docker]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from common import measure_run, model_server, write_prompts

from hermes_batch.formats.records import Usage
from hermes_batch.testing import Reply, ScriptedModelServer

DOCKER_IMAGE = "hermes-batch-test/busybox-a:1"
COST_PER_CALL = 0.001


def overhead(sandbox: str, prompts: int, workers: int, options: list[str]) -> None:
    results = {}
    with model_server(0.02, tool_calls=1) as url:
        for verified in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                dataset = write_prompts(Path(tmp) / "prompts.jsonl", prompts, tests="test -n ok")
                extra = ["--verifier", "command"] if verified else []
                results[verified] = measure_run([
                    "run", "--dataset_file", str(dataset), "--batch_size", "100", "--run_name", "bench",
                    "--output_dir", tmp, "--base_url", url, "--model", "bench-model", "--api_key", "bench",
                    "--num_workers", str(workers), "--distribution", "terminal_only", "--sandbox", sandbox,
                    "--no-progress", "--seed", "1", *options, *extra,
                ])
                if verified:
                    records = [json.loads(line) for line in (Path(tmp) / "bench" / "trajectories.jsonl").open()]
                    assert all(r["metadata"]["passed"] for r in records), "a sample did not pass its test"
                    durations = [json.loads(r["metadata"]["verifiers"])[0]["duration_s"] for r in records]
    plain, checked = results[False], results[True]
    print(f"{sandbox}: {prompts} samples, {workers} workers")
    print(f"  wall  {plain['wall_s']:.2f} s -> {checked['wall_s']:.2f} s: "
          f"{1000 * (checked['wall_s'] - plain['wall_s']) / prompts:+.1f} ms per sample "
          f"(the verifier's own time: {1000 * sum(durations) / len(durations):.1f} ms per sample, in parallel)")
    print(f"  CPU   {plain['cpu_s']:.2f} s -> {checked['cpu_s']:.2f} s: "
          f"{1000 * (checked['cpu_s'] - plain['cpu_s']) / prompts:+.1f} ms per sample (process tree)")


def passes(prompt: str, sample: int, rate: float) -> bool:
    return random.Random(f"{prompt}#{sample}").random() < rate


def stop_on_success(rows: int, rate: float, samples: int) -> None:
    def script(request):
        answer = "PASS" if passes(request.prompt, request.sample, rate) else "FAIL"
        return Reply(content=f"The answer is {answer}", reasoning="Thinking.",
                     usage=Usage(prompt_tokens=100, completion_tokens=20, cost=COST_PER_CALL))

    print(f"stop_on_success: {rows} rows, pass rate {rate} per sample, --samples_per_prompt {samples}")
    expected_pass = 1 - (1 - rate) ** samples
    for stop in (False, True):
        with tempfile.TemporaryDirectory() as tmp, ScriptedModelServer(script) as server:
            dataset = write_prompts(Path(tmp) / "prompts.jsonl", rows, answer="PASS")
            measure_run([
                "run", "--dataset_file", str(dataset), "--batch_size", "100", "--run_name", "bench",
                "--output_dir", tmp, "--base_url", server.base_url, "--model", "bench-model", "--api_key", "bench",
                "--num_workers", "32", "--distribution", "terminal_only", "--no-progress", "--seed", "1",
                "--no_filters", "--verifier", "answer", "--samples_per_prompt", str(samples),
                *(["--stop_on_success"] if stop else []),
            ])
            records = [json.loads(line) for line in (Path(tmp) / "bench" / "trajectories.jsonl").open()]
            stats = json.loads((Path(tmp) / "bench" / "statistics.json").read_text())
        passed_rows = len({r["prompt_index"] for r in records if r["metadata"]["passed"]})
        cost = sum(r["metadata"]["usage"]["cost"] for r in records)
        expected = expected_pass / rate if stop else samples
        print(f"  {'with' if stop else 'without'} --stop_on_success: {len(records)} samples "
              f"({len(records) / rows:.2f} a row, expected {expected:.2f}), cost ${cost:.3f} "
              f"(statistics: ${stats.get('cost') or 0:.3f}), rows passed {passed_rows / rows:.1%} "
              f"(expected {expected_pass:.1%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=40, help="samples of the overhead runs")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=300, help="rows of the --stop_on_success runs")
    parser.add_argument("--pass_rate", type=float, default=0.3)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--skip_docker", action="store_true")
    args = parser.parse_args()
    overhead("local", args.prompts, args.workers, [])
    if not args.skip_docker:
        overhead("docker", args.prompts, args.workers, ["-S", f"image={DOCKER_IMAGE}"])
    stop_on_success(args.rows, args.pass_rate, args.samples)


if __name__ == "__main__":
    main()
