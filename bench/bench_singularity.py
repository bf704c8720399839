"""The singularity sandbox: sandbox start latency, and converting an image against finding it in the cache.

1. Time from asking for a sandbox (``SingularityBackend.open``) to the first
   command's output (``echo ready``), median and 95th percentile, with 1 and with
   16 prompts asking at once (the image is a SIF already, as after the first prompt),
   for each ``-S pool=`` of ``--pools``: with a pool, each round starts once the pool
   is full again, as in a run, where it fills while the first model calls are in
   flight.  With the CPU of the runtime per sandbox in the round: with the test rig,
   its processes run in a Docker container, so they are counted through the shims
   (and dockerd and containerd, which carry each call into the rig).  And the
   memory each open sandbox takes (the fall of the machine's MemAvailable with the
   round's sandboxes all open, so other work on the machine blurs it).
2. ``prepare_image`` of a ``docker-archive://`` image: the first time (a conversion
   to SIF) and then by a new backend (a cache hit), median of a few rounds each.
3. End-to-end wall time of ``hermes-batch run`` over ``--prompts`` prompts at
   ``--workers`` against the scripted model server at 500 ms per call (3 calls, 2
   terminal commands per prompt), with --sandbox local and --sandbox singularity
   (per pool), with the runtime's CPU per prompt (0 prompts: skipped).

``--reuse namespace`` measures ``-S reuse=namespace`` beside the pools (instances
that serve prompts one after another, each in a view of its own): in 1., each
round after the first finds the instances of the round before.

Needs Apptainer: a real one on PATH, or the one of ``scripts/apptainer.sh`` (which
this script sets up and uses when there is none), and the busybox test image of
``scripts/docker.sh`` for the archive.

    python bench/bench_singularity.py [--rounds 5] [--at-once 1,16] [--conversions 3] [--pools 0,auto] [--reuse namespace]
    PYTHONPATH=/tmp/base/hermes_batch_singularity/src python bench/bench_singularity.py --pools 0   # other code
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench_docker import EngineCPU, pool_option
from common import ideal_seconds, measure_run, model_server, write_prompts

from hermes_batch.formats.records import SandboxSpec
from hermes_batch.contract.run_context import RunContext
from hermes_batch_singularity import SingularityBackend, SingularityConfig

IMAGE = "hermes-batch-test/busybox-a:1"
REUSE = "reuse"  # in the list of pools: -S reuse=namespace instead of a pool
REPO = Path(__file__).resolve().parents[1]


def percentile(values: list, share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))]


def ensure_runtime() -> str:
    """Put an Apptainer on PATH (the test rig's when there is no real one); return what runs."""
    if not (shutil.which("apptainer") or shutil.which("singularity")):
        done = subprocess.run(["bash", str(REPO / "scripts" / "apptainer.sh")], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"no Apptainer: {done.stderr.strip()[-500:]}")
        os.environ["PATH"] = done.stdout.strip().splitlines()[-1] + os.pathsep + os.environ["PATH"]
    return shutil.which("apptainer") or shutil.which("singularity")


def make_archive(folder: Path) -> Path:
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True).returncode != 0:
        subprocess.run(["bash", str(REPO / "scripts" / "docker.sh"), "images"], check=True)
    archive = folder / "busybox-a.tar"
    subprocess.run(["docker", "save", "-o", str(archive), IMAGE], check=True)
    return archive


def backend_for(folder: Path, name: str, image: str, cache: Path, pool, pool_size=0) -> SingularityBackend:
    options = {"reuse": "namespace"} if pool_size == REUSE else {"pool": pool_size} if pool_size else {}
    config = SingularityConfig(image=image, cache_dir=str(cache), **options)
    return SingularityBackend(config, RunContext(name, folder / name, 0, thread_pool=pool))


async def first_output_latencies(folder: Path, sif: str, at_once: int, rounds: int, pool_size) -> tuple:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=at_once + 4)
    backend = backend_for(folder, f"bench-singularity-{at_once}", sif, folder / "cache", pool, pool_size)
    await backend.start()
    await backend.prepare_image(None)
    latencies = []
    used = []  # bytes of memory per open sandbox, per round
    runtime_s = 0.0

    async def one(index: int):
        started = time.perf_counter()
        sandbox = await backend.open(SandboxSpec(backend.run.run_name, index, f"{index:016x}"))
        try:
            result = await sandbox.exec("echo ready", 30)
            assert result.output == "ready\n", result
            latencies.append(time.perf_counter() - started)
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    try:
        for round_ in range(rounds):
            if pool_size and pool_size != REUSE:
                while backend.pooled() < backend.config.pool_size(backend.concurrency()):
                    await asyncio.sleep(0.05)
            available = memory_available()
            with EngineCPU() as cpu:
                sandboxes = await asyncio.gather(*(one(round_ * at_once + i) for i in range(at_once)))
                used.append((available - memory_available()) / at_once)  # all of the round's open at once
                await asyncio.gather(*(sandbox.close() for sandbox in sandboxes))
            runtime_s += cpu.seconds
    finally:
        await backend.shutdown()
        pool.shutdown()
    return latencies, runtime_s / len(latencies), statistics.median(used)


def memory_available() -> int:
    """The machine's MemAvailable in bytes: what the open sandboxes take of it is the runtime's, wherever it runs."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


async def conversion_times(folder: Path, archive: Path, rounds: int) -> tuple[list, list]:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)
    uri = f"docker-archive://{archive}"
    first, hits = [], []
    try:
        for round_ in range(rounds):
            cache = folder / f"conversion-cache-{round_}"  # empty: the first prepare converts
            for kind in ("first", "hit"):
                backend = backend_for(folder, f"bench-convert-{round_}-{kind}", uri, cache, pool)
                await backend.start()
                started = time.perf_counter()
                await backend.prepare_image(None)
                (first if kind == "first" else hits).append(time.perf_counter() - started)
                await backend.shutdown()
    finally:
        pool.shutdown()
    return first, hits


def run_args(dataset: Path, out: str, url: str, workers: int, sandbox: str, sif: str, pool=0) -> list:
    args = [
        "run", "--dataset_file", str(dataset), "--batch_size", "50", "--run_name", f"bench-{sandbox}-{pool}",
        "--output_dir", out, "--base_url", url, "--model", "bench-model", "--api_key", "bench",
        "--num_workers", str(workers), "--distribution", "terminal_only", "--sandbox", sandbox,
        "--no-progress", "--seed", "1",
    ]
    if sandbox == "singularity":
        args += ["-S", f"image={sif}", "-S", f"cache_dir={Path(out) / 'run-cache'}"]
    if pool == REUSE:
        args += ["-S", "reuse=namespace"]
    elif pool:
        args += ["-S", f"pool={pool}"]
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of sandboxes per concurrency")
    parser.add_argument("--at-once", default="1,16", help="prompts asking for a sandbox at the same time")
    parser.add_argument("--conversions", type=int, default=3, help="rounds of first conversion and cache hit")
    parser.add_argument("--pools", default="0,auto", help="-S pool= values to measure, comma-separated (0: no pool)")
    parser.add_argument("--reuse", default="", help="namespace: measure -S reuse=namespace too")
    parser.add_argument("--prompts", type=int, default=200, help="prompts of the whole-run comparison (0: skip it)")
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--latency", type=float, default=0.5)
    options = parser.parse_args()
    pools = [pool_option(value) for value in options.pools.split(",")] + ([REUSE] if options.reuse == "namespace" else [])
    binary = ensure_runtime()
    print(f"runtime: {binary}")
    # Under /tmp: the test rig's Apptainer sees /tmp at the same path.
    with tempfile.TemporaryDirectory(prefix="bench-singularity-", dir="/tmp") as tmp:
        folder = Path(tmp)
        archive = make_archive(folder)
        sif = folder / "busybox-a.sif"
        subprocess.run([binary, "build", str(sif), f"docker-archive://{archive}"], check=True, capture_output=True)
        print("time from asking for a sandbox to the first command's output:")
        for pool_size in pools:
            for at_once in (int(n) for n in options.at_once.split(",")):
                latencies, runtime_s, used = asyncio.run(
                    first_output_latencies(folder, str(sif), at_once, options.rounds, pool_size)
                )
                print(
                    f"  {'reuse=namespace' if pool_size == REUSE else f'pool={pool_size}':<15} {at_once:>3} at once: median {statistics.median(latencies):.2f} s, "
                    f"p95 {percentile(latencies, 0.95):.2f} s  ({len(latencies)} sandboxes), "
                    f"runtime CPU {1000 * runtime_s:4.0f} ms per sandbox in the round, "
                    f"memory {used / 2**20:.1f} MB per open sandbox"
                )
        first, hits = asyncio.run(conversion_times(folder, archive, options.conversions))
        print(
            f"image {IMAGE} as docker-archive://: first conversion median {statistics.median(first):.2f} s, "
            f"cache hit median {statistics.median(hits) * 1000:.1f} ms  ({len(first)} rounds)"
        )
        if options.prompts:
            calls = 3
            ideal = ideal_seconds(options.prompts, options.workers, calls, options.latency)
            print(f"\n{options.prompts} prompts, --num_workers {options.workers}, {options.latency * 1000:.0f} ms per model "
                  f"call, {calls} calls per prompt (ideal {ideal:.1f} s):")
            with model_server(options.latency, tool_calls=calls - 1) as url:
                dataset = write_prompts(folder / "prompts.jsonl", options.prompts)
                for sandbox, pool_size in [("local", 0)] + [("singularity", p) for p in pools]:
                    with EngineCPU() as cpu:
                        result = measure_run(run_args(dataset, tmp, url, options.workers, sandbox, str(sif), pool_size))
                    label = sandbox if sandbox == "local" else f"{sandbox} reuse=namespace" if pool_size == REUSE else f"{sandbox} pool={pool_size}"
                    print(
                        f"  --sandbox {label:<27} wall {result['wall_s']:6.1f} s  (x{result['wall_s'] / ideal:.2f} of ideal), "
                        f"CPU of the hermes-batch process tree {result['cpu_s']:.1f} s, "
                        f"runtime CPU {1000 * cpu.seconds / options.prompts:4.0f} ms per prompt"
                    )


if __name__ == "__main__":
    main()
