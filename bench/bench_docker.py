"""The docker sandbox: sandbox start latency, and a whole run compared with the local sandbox.

1. Time from asking for a sandbox (``DockerBackend.open``) to the first command's
   output (``echo ready``), median and 95th percentile, with 1 and with 32 prompts
   asking at once (the image is already on the engine, as after the first prompt).
2. End-to-end wall time of ``hermes-batch run`` over 200 prompts at --num_workers 32
   against the scripted model server at 500 ms per call (3 calls, 2 terminal
   commands per prompt), with --sandbox docker and with --sandbox local.

Needs a Docker engine and the test image (``scripts/docker.sh`` provides both).

    python bench/bench_docker.py [--prompts 200] [--workers 32] [--latency 0.5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import tempfile
import time
from pathlib import Path

from common import ideal_seconds, measure_run, model_server, write_prompts

from hermes_batch.formats.records import SandboxSpec
from hermes_batch.contract.run_context import RunContext
from hermes_batch_docker import DockerBackend, DockerConfig

IMAGE = "hermes-batch-test/busybox-a:1"


def percentile(values: list, share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))]


async def first_output_latencies(tmp: Path, at_once: int, rounds: int, max_starting) -> list:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=at_once + 4)
    options = {"image": IMAGE} | ({"max_starting": max_starting} if max_starting else {})
    backend = DockerBackend(DockerConfig(**options), RunContext(f"bench-docker-{at_once}", tmp / f"run{at_once}", 0, thread_pool=pool))
    await backend.start()
    await backend.prepare_image(IMAGE)
    latencies = []

    async def one(index: int) -> None:
        started = time.perf_counter()
        sandbox = await backend.open(SandboxSpec(backend.run.run_name, index, f"{index:016x}", image=IMAGE))
        try:
            result = await sandbox.exec("echo ready", 30)
            assert result.output == "ready\n", result
            latencies.append(time.perf_counter() - started)
        finally:
            await sandbox.close()

    try:
        for round_ in range(rounds):
            await asyncio.gather(*(one(round_ * at_once + i) for i in range(at_once)))
    finally:
        await backend.shutdown()
        pool.shutdown()
    return latencies


def run_args(dataset: Path, out: str, url: str, workers: int, sandbox: str) -> list:
    args = [
        "run", "--dataset_file", str(dataset), "--batch_size", "50", "--run_name", f"bench-{sandbox}",
        "--output_dir", out, "--base_url", url, "--model", "bench-model", "--api_key", "bench",
        "--num_workers", str(workers), "--distribution", "terminal_only", "--sandbox", sandbox,
        "--no-progress", "--seed", "1",
    ]
    if sandbox == "docker":
        args += ["-S", f"image={IMAGE}"]
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--latency", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the start-latency measurement")
    parser.add_argument("--max_starting", type=int, default=None, help="-S max_starting (default: the backend's)")
    args = parser.parse_args()
    calls_per_prompt = 3

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        print(f"docker sandbox, image {IMAGE}, max_starting {args.max_starting or DockerConfig().max_starting}")
        print("time from open() to the first command's output:")
        for at_once, rounds in ((1, max(10, 5 * args.rounds)), (32, args.rounds)):
            values = asyncio.run(first_output_latencies(tmp_path, at_once, rounds, args.max_starting))
            print(
                f"  {at_once:>2} at once: median {1000 * statistics.median(values):6.0f} ms, "
                f"p95 {1000 * percentile(values, 0.95):6.0f} ms  ({len(values)} sandboxes)"
            )

        ideal = ideal_seconds(args.prompts, args.workers, calls_per_prompt, args.latency)
        print(f"\n{args.prompts} prompts, --num_workers {args.workers}, {args.latency * 1000:.0f} ms per model call, "
              f"{calls_per_prompt} calls per prompt (ideal {ideal:.1f} s):")
        with model_server(args.latency, tool_calls=calls_per_prompt - 1) as url:
            dataset = write_prompts(tmp_path / "prompts.jsonl", args.prompts)
            for sandbox in ("local", "docker"):
                result = measure_run(run_args(dataset, tmp, url, args.workers, sandbox))
                print(
                    f"  --sandbox {sandbox:<6}  wall {result['wall_s']:6.1f} s  (x{result['wall_s'] / ideal:.2f} of ideal), "
                    f"CPU of the hermes-batch process tree {result['cpu_s']:.1f} s"
                )


if __name__ == "__main__":
    main()
