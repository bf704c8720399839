"""The singularity sandbox: sandbox start latency, and converting an image against finding it in the cache.

1. Time from asking for a sandbox (``SingularityBackend.open``) to the first
   command's output (``echo ready``), median and 95th percentile, with 1 and with
   16 prompts asking at once (the image is a SIF already, as after the first prompt).
2. ``prepare_image`` of a ``docker-archive://`` image: the first time (a conversion
   to SIF) and then by a new backend (a cache hit), median of a few rounds each.

Needs Apptainer: a real one on PATH, or the one of ``scripts/apptainer.sh`` (which
this script sets up and uses when there is none), and the busybox test image of
``scripts/docker.sh`` for the archive.

    python bench/bench_singularity.py [--rounds 5] [--at-once 1,16] [--conversions 3]
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

from hermes_batch.formats.records import SandboxSpec
from hermes_batch.contract.run_context import RunContext
from hermes_batch_singularity import SingularityBackend, SingularityConfig

IMAGE = "hermes-batch-test/busybox-a:1"
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


def backend_for(folder: Path, name: str, image: str, cache: Path, pool) -> SingularityBackend:
    config = SingularityConfig(image=image, cache_dir=str(cache))
    return SingularityBackend(config, RunContext(name, folder / name, 0, thread_pool=pool))


async def first_output_latencies(folder: Path, sif: str, at_once: int, rounds: int) -> list:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=at_once + 4)
    backend = backend_for(folder, f"bench-singularity-{at_once}", sif, folder / "cache", pool)
    await backend.start()
    await backend.prepare_image(None)
    latencies = []

    async def one(index: int) -> None:
        started = time.perf_counter()
        sandbox = await backend.open(SandboxSpec(backend.run.run_name, index, f"{index:016x}"))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of sandboxes per concurrency")
    parser.add_argument("--at-once", default="1,16", help="prompts asking for a sandbox at the same time")
    parser.add_argument("--conversions", type=int, default=3, help="rounds of first conversion and cache hit")
    options = parser.parse_args()
    binary = ensure_runtime()
    print(f"runtime: {binary}")
    # Under /tmp: the test rig's Apptainer sees /tmp at the same path.
    with tempfile.TemporaryDirectory(prefix="bench-singularity-", dir="/tmp") as tmp:
        folder = Path(tmp)
        archive = make_archive(folder)
        sif = folder / "busybox-a.sif"
        subprocess.run([binary, "build", str(sif), f"docker-archive://{archive}"], check=True, capture_output=True)
        print("time from asking for a sandbox to the first command's output:")
        for at_once in (int(n) for n in options.at_once.split(",")):
            latencies = asyncio.run(first_output_latencies(folder, str(sif), at_once, options.rounds))
            print(
                f"  {at_once:>3} at once: median {statistics.median(latencies):.2f} s, "
                f"p95 {percentile(latencies, 0.95):.2f} s  ({len(latencies)} sandboxes)"
            )
        first, hits = asyncio.run(conversion_times(folder, archive, options.conversions))
        print(
            f"image {IMAGE} as docker-archive://: first conversion median {statistics.median(first):.2f} s, "
            f"cache hit median {statistics.median(hits) * 1000:.1f} ms  ({len(first)} rounds)"
        )


if __name__ == "__main__":
    main()
