"""A run over many images with the docker sandbox: containers started, peak containers, failed starts, wall time.

``--images`` images (tags of the busybox test image, made here and removed at the end) with ``--per_image``
prompts each, the rows interleaved (image i % images), at ``--workers`` sessions against the scripted model
server (``--latency`` per call, 3 calls and 2 terminal commands per prompt), with ``-S pool=auto``.  From the
engine's event stream (the run's label): the containers created, the most that existed at once, and those
created but never started; from the run folder: prompts failed.  Each ``--max_starting`` value is one run.

With ``--storm N``, first the start storm alone: N sandboxes asked of one ``DockerBackend`` at the same moment
(``-S pool=0``), for each ``--max_starting``: the time until all are open, the slowest open, and the opens that
failed (what the engine handles at once on this machine).

To compare with other code in the same session, give its checkout with ``--base`` (a ``git archive`` of main
unpacked in /tmp, say): the same runs are made with it first on PYTHONPATH, from a folder outside this checkout.

    python bench/bench_docker_images.py [--images 12] [--per_image 5] [--workers 16] [--latency 0.5]
        [--max_starting 4,16,64] [--base /tmp/base] [--storm 64] [--parts storm,run]

Needs a Docker engine and the test image (``scripts/docker.sh`` provides both).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import docker
from docker.utils import kwargs_from_env

from common import ideal_seconds, measure_run, model_server

IMAGE = "hermes-batch-test/busybox-a:1"
LABEL_RUN = "org.hermes-batch.run"


class Containers:
    """The run's containers from the engine's event stream: created, started, and the most at once."""

    def __init__(self, api, run_name: str):
        self.created = self.started = self.now = self.peak = 0
        self.ids: dict[str, bool] = {}  # id -> started
        self._stream = api.events(decode=True, filters={"type": "container", "label": f"{LABEL_RUN}={run_name}"})
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self._stream:
                action, ident = event.get("Action"), event.get("id")
                if action == "create":
                    self.created += 1
                    self.ids[ident] = False
                    self.now += 1
                    self.peak = max(self.peak, self.now)
                elif action == "start":
                    self.started += 1
                    self.ids[ident] = True
                elif action == "destroy":
                    self.now -= 1
        except Exception:  # the stream was closed
            pass

    def stop(self) -> None:
        time.sleep(1)
        self._stream.close()
        self._thread.join(5)

    @property
    def never_started(self) -> int:
        return sum(1 for started in self.ids.values() if not started)


async def storm(count: int, max_starting: int, tmp: str) -> tuple:
    """(seconds until all are open, the slowest open, failed opens) for ``count`` sandboxes asked at once."""
    from hermes_batch import RunContext, SandboxSpec
    from hermes_batch_docker import DockerBackend, DockerConfig

    name = f"bench-storm-{max_starting}-{os.getpid()}"
    pool = concurrent.futures.ThreadPoolExecutor(count + 8)
    backend = DockerBackend(DockerConfig(image=IMAGE, pool=0, max_starting=max_starting),
                            RunContext(name, Path(tmp) / name, seed=0, thread_pool=pool))
    await backend.start()
    try:
        async def one(i: int):
            began = time.perf_counter()
            sandbox = await backend.open(SandboxSpec(name, i, f"{i:08d}", image=None, cwd=None))
            await sandbox.exec("true", 60)
            return sandbox, time.perf_counter() - began

        began = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)
        total = time.perf_counter() - began
        opened = [r for r in results if not isinstance(r, BaseException)]
        slowest = max((seconds for _, seconds in opened), default=float("nan"))
        await asyncio.gather(*(sandbox.close() for sandbox, _ in opened), return_exceptions=True)
        return total, slowest, count - len(opened)
    finally:
        await backend.shutdown()
        pool.shutdown()


def run_args(dataset: Path, out: str, url: str, workers: int, name: str, max_starting: int) -> list:
    return [
        "run", "--dataset_file", str(dataset), "--batch_size", "10", "--run_name", name,
        "--output_dir", out, "--base_url", url, "--model", "bench-model", "--api_key", "bench",
        "--num_workers", str(workers), "--distribution", "terminal_only", "--sandbox", "docker",
        "--no-progress", "--seed", "1", "-S", f"image={IMAGE}", "-S", "pool=auto", "-S", f"max_starting={max_starting}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=12)
    parser.add_argument("--per_image", type=int, default=5)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--latency", type=float, default=0.5)
    parser.add_argument("--max_starting", default="4", help="-S max_starting values, one run each")
    parser.add_argument("--base", default=None, help="a checkout of the code to compare with (run first)")
    parser.add_argument("--storm", type=int, default=0, help="sandboxes asked at once in the start storm (0: none)")
    parser.add_argument("--parts", default="storm,run", help="storm (with --storm), run")
    args = parser.parse_args()
    if args.storm and "storm" in args.parts:
        print(f"start storm: {args.storm} sandboxes asked at once, -S pool=0:")
        with tempfile.TemporaryDirectory() as tmp:
            for max_starting in [int(v) for v in args.max_starting.split(",")]:
                total, slowest, failed = asyncio.run(storm(args.storm, max_starting, tmp))
                print(f"  max_starting {max_starting:>3}: all open in {total:5.1f} s, slowest open {slowest:5.1f} s, "
                      f"failed {failed}")
    if "run" not in args.parts:
        return
    api = docker.APIClient(**kwargs_from_env(), version="auto", timeout=60)
    tag = f"{os.getpid()}"
    images = [f"hermes-batch-bench/img{k}-{tag}:1" for k in range(args.images)]
    for image in images:
        repository, _, version = image.rpartition(":")
        api.tag(IMAGE, repository, version)
    prompts = args.images * args.per_image
    calls = 3
    ideal = ideal_seconds(prompts, args.workers, calls, args.latency)
    codes = ([("base", args.base)] if args.base else []) + [("branch", None)]
    print(f"{args.images} images x {args.per_image} prompts (interleaved), --num_workers {args.workers}, -S pool=auto, "
          f"{1000 * args.latency:.0f} ms per model call, {calls} calls per prompt (ideal {ideal:.1f} s):")
    try:
        with tempfile.TemporaryDirectory() as tmp, model_server(args.latency, tool_calls=calls - 1) as url:
            dataset = Path(tmp) / "prompts.jsonl"
            with open(dataset, "w") as f:
                for i in range(prompts):
                    f.write(json.dumps({"prompt": f"Benchmark task {i}: run a command.",
                                        "image": images[i % args.images]}) + "\n")
            for max_starting in [int(v) for v in args.max_starting.split(",")]:
                for label, path in codes:
                    name = f"bench-images-{label}-{max_starting}-{tag}"
                    env, cwd = None, None
                    if path:
                        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                            [path, f"{path}/hermes_batch_docker/src"]))
                        cwd = tmp
                    watch = Containers(api, name)
                    try:
                        result = measure_run(run_args(dataset, tmp, url, args.workers, name, max_starting), env=env,
                                             cwd=cwd)
                    finally:
                        watch.stop()
                    failed_path = Path(tmp) / name / "failed.jsonl"
                    failed = sum(1 for line in failed_path.read_text().splitlines() if line.strip()) \
                        if failed_path.exists() else 0
                    print(f"  {label:<6} max_starting {max_starting:>2}: wall {result['wall_s']:6.1f} s "
                          f"(x{result['wall_s'] / ideal:.2f} of ideal), containers created {watch.created} "
                          f"(started {watch.started}, never started {watch.never_started}), "
                          f"peak at once {watch.peak}, prompts failed {failed}, "
                          f"CPU of the hermes-batch tree {result['cpu_s']:.1f} s")
    finally:
        for image in images:
            try:
                api.remove_image(image)
            except docker.errors.APIError:
                pass


if __name__ == "__main__":
    main()
