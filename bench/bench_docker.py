"""The docker sandbox: sandbox start latency, and a whole run compared with the local sandbox.

0. The engine's work for one prompt-like sandbox (``--commands`` commands, a
   file written and read, ``stop_processes``, close), one after the other: its
   CPU and the engine requests, by kind.
1. Time from asking for a sandbox (``DockerBackend.open``) to the first command's
   output (``echo ready``), median and 95th percentile, with 1 and with 32 prompts
   asking at once (the image is already on the engine, as after the first prompt),
   for each ``-S pool=`` of ``--pools``: with a pool, each round starts once the
   pool is full again, as in a run, where it fills while the first model calls are
   in flight.  Also the engine's CPU per sandbox and, with a pool, the memory of an
   idle started container (its shim's RSS plus its cgroup's memory).
2. End-to-end wall time of ``hermes-batch run`` over 200 prompts at --num_workers 32
   against the scripted model server at 500 ms per call (3 calls, 2 terminal
   commands per prompt), with --sandbox local and --sandbox docker (per pool), with
   the engine's CPU per prompt: dockerd, containerd and the shims (with the runc
   processes they reap), read from /proc while the run goes on.

Needs a Docker engine on this machine and the test image (``scripts/docker.sh`` provides both).
To compare with other code side by side, run it once more with that code first on
PYTHONPATH (``--pools 0`` for code without pools), e.g. a ``git worktree`` of main:

    python bench/bench_docker.py [--prompts 200] [--workers 32] [--latency 0.5] [--rounds 3] [--pools 0,auto] [--runner exec]
        [--reuse namespace]

``--reuse namespace`` measures ``-S reuse=namespace`` (with ``-S pool=auto``) beside the pools, each
part once more; for code without it, leave it out.  Part 1 also gives the memory of an open sandbox
(after its first command: its container's shim RSS plus its cgroup's memory).
    PYTHONPATH=/tmp/base/hermes_batch_docker/src python bench/bench_docker.py --pools 0
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from common import ideal_seconds, measure_run, model_server, write_prompts

from hermes_batch.formats.records import SandboxSpec
from hermes_batch.contract.run_context import RunContext
from hermes_batch_docker import DockerBackend, DockerConfig

IMAGE = "hermes-batch-test/busybox-a:1"


# By comm (at most 15 characters).  Not runc: each runc is a child of a shim, whose cutime counts it
# once reaped; read while alive as well, it would be counted twice.
ENGINE = ("dockerd", "containerd", "containerd-shim")
TICKS = os.sysconf("SC_CLK_TCK")


def percentile(values: list, share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))]


def _cpu_ticks(pid: str) -> int:
    """utime + stime + cutime + cstime of a process (its reaped children included), in ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(value) for value in fields[11:15])


class EngineCPU:
    """CPU seconds of the engine's processes (``names``, by comm) while it runs, shims that come and go included.

    Processes are read every 50 ms: a shim's last 50 ms before it exits are missed,
    and a shim's reaped children (runc, and the container's own commands) count.
    The engine may be shared: other users' work in the same window counts too.
    """

    def __init__(self, names=ENGINE):
        self.names = names
        self._start: dict = {}
        self._last: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _sample(self) -> dict:
        seen = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/comm") as f:
                    comm = f.read().strip()
                if comm.startswith(self.names):
                    seen[pid] = _cpu_ticks(pid)
            except OSError:
                continue
        return seen

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            self._last.update(self._sample())

    def __enter__(self) -> "EngineCPU":
        self._start = self._sample()
        self._last = dict(self._start)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._last.update(self._sample())

    @property
    def seconds(self) -> float:
        return sum(ticks - self._start.get(pid, 0) for pid, ticks in self._last.items()) / TICKS


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _cgroup_mb(container_id: str) -> float:
    for path in (f"/sys/fs/cgroup/memory/docker/{container_id}/memory.usage_in_bytes",
                 f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/memory.current",
                 f"/sys/fs/cgroup/docker/{container_id}/memory.current"):
        try:
            with open(path) as f:
                return int(f.read()) / 1024**2
        except OSError:
            continue
    return float("nan")


def idle_container_mb(api, container_ids: list) -> tuple:
    """(shim RSS, cgroup memory) per container, in MB, averaged over ``container_ids``."""
    shims, groups = [], []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and any(
                arg.decode() in container_ids for arg in argv
            ):
                shims.append(_rss_mb(int(pid)))
        except OSError:
            continue
    groups = [_cgroup_mb(cid) for cid in container_ids]
    count = max(1, len(container_ids))
    return sum(shims) / count, sum(groups) / count


def label_of(pool_size, reuse: str) -> str:
    return f"pool={pool_size}" + (f" reuse={reuse}" if reuse != "none" else "")


def pool_option(value: str):
    return value if value == "auto" else int(value)


def mode_options(pool_size, reuse: str) -> dict:
    """The -S options of a measured mode: its pool (0 too: the default may be a pool), and reuse= only when asked."""
    return {"pool": pool_size} | ({"reuse": reuse} if reuse != "none" else {})


async def first_output_latencies(tmp: Path, at_once: int, rounds: int, max_starting, pool_size, runner=None,
                                 reuse: str = "none") -> tuple:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=at_once + 4)
    options = {"image": IMAGE} | ({"max_starting": max_starting} if max_starting else {})
    options |= mode_options(pool_size, reuse)
    if runner:
        options["runner"] = runner
    backend = DockerBackend(DockerConfig(**options), RunContext(f"bench-docker-{at_once}", tmp / f"run{at_once}", 0, thread_pool=pool))
    await backend.start()
    await backend.prepare_image(IMAGE)
    latencies = []
    memory = None
    open_memory = []
    engine_s = 0.0

    async def pool_full() -> None:
        if pool_size:
            target = backend.config.pool_size(backend.concurrency())
            while backend.pooled() < target:
                await asyncio.sleep(0.05)

    async def one(index: int) -> None:
        started = time.perf_counter()
        sandbox = await backend.open(SandboxSpec(backend.run.run_name, index, f"{index:016x}", image=IMAGE))
        try:
            result = await sandbox.exec("echo ready", 30)
            assert result.output == "ready\n", result
            latencies.append(time.perf_counter() - started)
            if at_once > 1 and len(open_memory) < 4:  # an open sandbox: its container with the prompt in it
                open_memory.append(idle_container_mb(backend.api, [sandbox.id]))
        finally:
            await sandbox.close()

    try:
        for round_ in range(rounds):
            await pool_full()
            if memory is None and pool_size and reuse == "none":
                ids = [c["Id"] for c in backend.api.containers(filters={"label": f"org.hermes-batch.session={backend.session}"})]
                memory = idle_container_mb(backend.api, ids)
            with EngineCPU() as cpu:  # the round's sandboxes: their exec and removal (their creation with no pool)
                await asyncio.gather(*(one(round_ * at_once + i) for i in range(at_once)))
            engine_s += cpu.seconds
    finally:
        await backend.shutdown()
        pool.shutdown()
    if open_memory:
        memory = tuple(statistics.mean(values) for values in zip(*open_memory))
    return latencies, engine_s / len(latencies), memory


class EngineRequests:
    """Counts the HTTP requests the SDK makes to the engine, by method and path (ids left out)."""

    def __init__(self):
        import docker.api.client as client

        self.counts: collections.Counter = collections.Counter()
        self._client = client.APIClient
        self._saved = {verb: getattr(client.APIClient, verb) for verb in ("_post", "_get", "_put", "_delete")}

    def __enter__(self) -> "EngineRequests":
        for verb, original in self._saved.items():
            def counted(client, url, *args, _original=original, _verb=verb, **kwargs):
                path = "/".join(part for part in url.split("/")[4:] if part and len(part) < 40)
                self.counts[f"{_verb[1:].upper()} {path}"] += 1
                return _original(client, url, *args, **kwargs)

            setattr(self._client, verb, counted)
        return self

    def __exit__(self, *exc) -> None:
        for verb, original in self._saved.items():
            setattr(self._client, verb, original)


async def prompt_work(tmp: Path, count: int, commands: int, pool_size, runner=None, reuse: str = "none") -> tuple:
    """Engine CPU, wall time and engine requests of one prompt-like sandbox (``commands`` commands, a file
    written and read, stop_processes, close), sandboxes one after the other, with no pool refilling."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=12)
    options = {"image": IMAGE} | mode_options(pool_size, reuse) | ({"runner": runner} if runner else {})
    backend = DockerBackend(DockerConfig(**options), RunContext("bench-docker-work", tmp / "work", 0, thread_pool=pool))
    await backend.start()
    await backend.prepare_image(IMAGE)
    try:
        with EngineCPU() as cpu, EngineRequests() as requests:
            started = time.perf_counter()
            for index in range(count):
                sandbox = await backend.open(SandboxSpec(backend.run.run_name, index, f"{index:016x}", image=IMAGE))
                for number in range(commands):
                    await sandbox.exec(f"echo {number} > out; cat out; ls", 30)
                await sandbox.write_file("notes.txt", b"x" * 1000)
                await sandbox.read_file("notes.txt")
                await sandbox.stop_processes()
                await sandbox.close()
            wall = time.perf_counter() - started
    finally:
        await backend.shutdown()
        pool.shutdown()
    return cpu.seconds / count, wall / count, {key: value / count for key, value in sorted(requests.counts.items())}


def run_args(dataset: Path, out: str, url: str, workers: int, sandbox: str, pool=0, runner=None, reuse="none") -> list:
    args = [
        "run", "--dataset_file", str(dataset), "--batch_size", "50", "--run_name", f"bench-{sandbox}-{pool}-{reuse}",
        "--output_dir", out, "--base_url", url, "--model", "bench-model", "--api_key", "bench",
        "--num_workers", str(workers), "--distribution", "terminal_only", "--sandbox", sandbox,
        "--no-progress", "--seed", "1",
    ]
    if sandbox == "docker":
        args += ["-S", f"image={IMAGE}"]
    if sandbox == "docker":
        args += ["-S", f"pool={pool}"]  # 0 too: the default may be a pool
    if sandbox == "docker" and runner:
        args += ["-S", f"runner={runner}"]
    if sandbox == "docker" and reuse != "none":
        args += ["-S", f"reuse={reuse}"]
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--latency", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the start-latency measurement")
    parser.add_argument("--max_starting", type=int, default=None, help="-S max_starting (default: the backend's)")
    parser.add_argument("--pools", default="0,auto", help="-S pool= values to measure, comma-separated (0: no pool)")
    parser.add_argument("--reuse", default="", help="-S reuse= modes measured too, with pool=auto (e.g. namespace)")
    parser.add_argument("--runner", default=None, help="-S runner= (agent or exec; default: the backend's)")
    parser.add_argument("--commands", type=int, default=5, help="commands of the prompt-like sandbox of part 0")
    parser.add_argument("--parts", default="0,1,2", help="parts to run: 0 engine work per prompt, 1 start latency, 2 runs")
    args = parser.parse_args()
    pools = [pool_option(value) for value in args.pools.split(",")]
    modes = [(pool, "none") for pool in pools] + [("auto", reuse) for reuse in args.reuse.split(",") if reuse and reuse != "none"]
    calls_per_prompt = 3

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        runner = args.runner or getattr(DockerConfig(), "runner", "exec (one docker exec per command)")
        print(f"docker sandbox, image {IMAGE}, max_starting {args.max_starting or DockerConfig().max_starting}, runner {runner}")
        parts = args.parts.split(",")
        for pool_size, reuse in [(0, "none")] + [(0, m[1]) for m in modes if m[1] != "none"] if "0" in parts else []:
            cpu_s, wall_s, requests = asyncio.run(prompt_work(tmp_path, 10, args.commands, pool_size, args.runner, reuse))
            print(f"one prompt-like sandbox at a time, {label_of(pool_size, reuse)} ({args.commands} commands, a file "
                  f"written and read, stop_processes, close): engine CPU {1000 * cpu_s:.0f} ms, wall "
                  f"{1000 * wall_s:.0f} ms per sandbox;")
            print("  engine requests per sandbox: " + ", ".join(f"{key} {value:g}" for key, value in requests.items()))
        if "1" in parts:
            print("time from open() to the first command's output:")
        for pool_size, reuse in modes if "1" in parts else []:
            for at_once, rounds in ((1, max(10, 5 * args.rounds)), (32, args.rounds)):
                values, engine_s, memory = asyncio.run(
                    first_output_latencies(tmp_path, at_once, rounds, args.max_starting, pool_size, args.runner, reuse)
                )
                print(
                    f"  {label_of(pool_size, reuse):<22} {at_once:>2} at once: median {1000 * statistics.median(values):6.0f} ms, "
                    f"p95 {1000 * percentile(values, 0.95):6.0f} ms  ({len(values)} sandboxes), "
                    f"engine CPU {1000 * engine_s:4.0f} ms per sandbox in the round"
                    + (f"; {'open sandbox' if at_once > 1 else 'idle pooled container'}: shim {memory[0]:.1f} MB + "
                       f"cgroup {memory[1]:.1f} MB" if memory else "")
                )
        if "2" not in parts:
            return

        ideal = ideal_seconds(args.prompts, args.workers, calls_per_prompt, args.latency)
        print(f"\n{args.prompts} prompts, --num_workers {args.workers}, {args.latency * 1000:.0f} ms per model call, "
              f"{calls_per_prompt} calls per prompt (ideal {ideal:.1f} s):")
        with model_server(args.latency, tool_calls=calls_per_prompt - 1) as url:
            dataset = write_prompts(tmp_path / "prompts.jsonl", args.prompts)
            for sandbox, pool_size, reuse in [("local", 0, "none")] + [("docker", p, r) for p, r in modes]:
                with EngineCPU() as cpu:
                    result = measure_run(run_args(dataset, tmp, url, args.workers, sandbox, pool_size, args.runner, reuse))
                label = f"{sandbox} {label_of(pool_size, reuse)}" if sandbox == "docker" else sandbox
                print(
                    f"  --sandbox {label:<29}  wall {result['wall_s']:6.1f} s  (x{result['wall_s'] / ideal:.2f} of ideal), "
                    f"CPU of the hermes-batch process tree {result['cpu_s']:.1f} s, "
                    f"engine CPU {1000 * cpu.seconds / args.prompts:4.0f} ms per prompt"
                )


if __name__ == "__main__":
    main()
