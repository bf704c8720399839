"""The modal sandbox backend against the local Modal STAND-IN (not Modal's cloud).

1. Overhead per prompt: one prompt after another, the backend creates a sandbox,
   runs 2 commands and terminates it, through the real ``modal`` SDK.  Reported:
   wall time of each step (median, p95), and the CPU the benchmark process spends
   per prompt (the backend and the SDK, with its synchronicity thread); the
   stand-in runs in a process of its own, so its CPU (and the Docker engine's)
   is not counted there and is reported apart.
2. Sandboxes in flight at --workers 200 with max_starting and create_rate at their
   defaults: 200 prompts at once, each opening a sandbox, running a command,
   holding it for --hold seconds (standing in for the model's turns), running a
   second command and closing it.  Sampled every 50 ms: sandboxes open, creations
   in flight; and how long the ramp to all of them took.

The stand-in runs each sandbox as a container of the local Docker engine (busybox
test image from ``scripts/docker.sh``), started before the measurement (as Modal
keeps capacity warm), so creation does not wait for the engine; each command is a
real ``docker exec``, whose cost is in the exec times.

    python bench/bench_modal.py [--prompts 20] [--workers 200] [--hold 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hermes_batch_modal" / "tests"))

from hermes_batch.formats.records import SandboxSpec  # noqa: E402
from hermes_batch.contract.run_context import RunContext  # noqa: E402
from hermes_batch_modal import ModalBackend, ModalConfig  # noqa: E402

IMAGE = "hermes-batch-test/busybox-a:1"


def percentile(values: list, share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))]


class StandInProcess:
    """The stand-in in a child process, so its CPU stays out of the benchmark's.

    ``prewarm`` containers are started before it serves, as Modal keeps capacity warm: the
    benchmark then measures the client, not how fast the local engine starts containers.
    """

    def __init__(self, prewarm: int):
        self.prewarm = prewarm

    def __enter__(self):
        env = dict(os.environ, PYTHONPATH=str(REPO / "hermes_batch_modal" / "tests"))
        command = [sys.executable, "-m", "standin", "--prewarm", IMAGE, str(self.prewarm)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "READY":
            raise SystemExit(f"the stand-in did not start: {line}")
        _, url, token_id, token_secret = line
        os.environ.update(MODAL_SERVER_URL=url, MODAL_TOKEN_ID=token_id, MODAL_TOKEN_SECRET=token_secret)
        return self

    def __exit__(self, *exc):
        self.proc.stdin.close()
        self.stats = json.loads(self.proc.stdout.readline() or "{}")
        self.proc.wait(60)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def overhead(tmp: Path, prompts: int) -> dict:
    backend = ModalBackend(ModalConfig(image=IMAGE), RunContext("bench-modal-overhead", tmp / "overhead", 0))
    await backend.start()
    await backend.prepare_image(IMAGE)
    steps = {"create+ready": [], "exec 1": [], "exec 2": [], "terminate": [], "prompt": []}
    try:
        await one_prompt(backend, 10_000, steps)  # warm: the router connection and the code paths
        steps = {name: [] for name in steps}
        cpu_before = cpu_seconds()
        for index in range(prompts):
            await one_prompt(backend, index, steps)
        cpu = cpu_seconds() - cpu_before
    finally:
        await backend.shutdown()
    return {"steps": steps, "cpu_per_prompt_ms": 1000 * cpu / prompts}


async def one_prompt(backend: ModalBackend, index: int, steps: dict) -> None:
    begin = time.perf_counter()
    sandbox = await backend.open(SandboxSpec(backend.run.run_name, index, f"{index:016x}", image=IMAGE))
    t1 = time.perf_counter()
    first = await sandbox.exec("echo one", 30)
    t2 = time.perf_counter()
    second = await sandbox.exec("ls / | wc -l", 30)
    t3 = time.perf_counter()
    await sandbox.close()
    t4 = time.perf_counter()
    assert first.output == "one\n" and second.exit_code == 0, (first, second)
    for name, value in (("create+ready", t1 - begin), ("exec 1", t2 - t1), ("exec 2", t3 - t2), ("terminate", t4 - t3), ("prompt", t4 - begin)):
        steps[name].append(value)


async def in_flight(tmp: Path, workers: int, hold: float) -> dict:
    config = ModalConfig(image=IMAGE)  # max_starting and create_rate at their defaults
    backend = ModalBackend(config, RunContext("bench-modal-in-flight", tmp / "in-flight", 0))
    await backend.start()
    await backend.prepare_image(IMAGE)
    samples = []
    opened_at = []
    holding = 0
    started = time.perf_counter()
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            creating = config.max_starting - backend._starting._value
            samples.append((time.perf_counter() - started, holding, creating))
            await asyncio.sleep(0.05)

    async def prompt(index: int) -> None:
        nonlocal holding
        sandbox = await backend.open(SandboxSpec(backend.run.run_name, index, f"{index:016x}", image=IMAGE))
        holding += 1
        opened_at.append(time.perf_counter() - started)
        try:
            await sandbox.exec("echo start", 60)
            await asyncio.sleep(hold)
            await sandbox.exec("echo end", 60)
        finally:
            holding -= 1
            await sandbox.close()

    sampler = asyncio.ensure_future(sample())
    cpu_before = cpu_seconds()
    try:
        results = await asyncio.gather(*(prompt(i) for i in range(workers)), return_exceptions=True)
    finally:
        stop.set()
        await sampler
        await backend.shutdown()
    failures = [r for r in results if isinstance(r, BaseException)]
    return {
        "workers": workers,
        "max_starting": config.max_starting,
        "create_rate": config.create_rate,
        "peak_open": max(s[1] for s in samples),
        "peak_creating": max(s[2] for s in samples),
        "all_open_after_s": max(opened_at) if opened_at else None,
        "wall_s": time.perf_counter() - started,
        "cpu_s": cpu_seconds() - cpu_before,
        "creation_retries": backend.creation_retries,
        "failures": [str(f)[:200] for f in failures[:3]] + ([f"... {len(failures)} in all"] if len(failures) > 3 else []),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20, help="prompts one after another for the overhead")
    parser.add_argument("--workers", type=int, default=200)
    parser.add_argument("--hold", type=float, default=30.0, help="seconds each prompt keeps its sandbox in part 2")
    parser.add_argument("--skip-in-flight", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with StandInProcess(prewarm=args.prompts + 1) as standin:
            result = asyncio.run(overhead(tmp, args.prompts))
        server_cpu = standin.stats.get("cpu_s", 0.0) / (args.prompts + 1)
        print(f"1. Overhead per prompt, {args.prompts} prompts one after another (create, 2 execs, terminate):")
        for name, values in result["steps"].items():
            print(f"   {name:<13} median {1000 * statistics.median(values):7.1f} ms   p95 {1000 * percentile(values, 0.95):7.1f} ms")
        print(f"   CPU of the backend and the modal SDK: {result['cpu_per_prompt_ms']:.1f} ms per prompt")
        print(f"   CPU of the stand-in server (another process; Docker's not counted): {1000 * server_cpu:.1f} ms per prompt")
        if not args.skip_in_flight:
            with StandInProcess(prewarm=args.workers) as standin:
                flight = asyncio.run(in_flight(tmp, args.workers, args.hold))
            print(f"2. In flight at --workers {flight['workers']} (max_starting={flight['max_starting']}, "
                  f"create_rate={flight['create_rate']:g}/s, each sandbox held {args.hold:g} s):")
            print(f"   peak sandboxes open {flight['peak_open']}, peak creations in flight {flight['peak_creating']}, "
                  f"all {flight['workers']} open after {flight['all_open_after_s']:.1f} s, wall {flight['wall_s']:.1f} s")
            print(f"   stand-in saw at most {standin.stats.get('peak_starting')} creations at once and "
                  f"{standin.stats.get('peak_running')} sandboxes running; creation retries {flight['creation_retries']}")
            print(f"   CPU of the backend and the SDK: {flight['cpu_s']:.1f} s for {flight['workers']} prompts")
            if flight["failures"]:
                print(f"   failures: {flight['failures']}")


if __name__ == "__main__":
    main()
