"""A Harbor task suite on the real Docker engine: images built once each, the oracle check, a model run.

Makes a base image offline (FROM the busybox test image of scripts/docker.sh), then a suite of
``--tasks`` tasks over ``--environments`` distinct Dockerfiles FROM it (each environment's image new to the
engine: the Dockerfiles carry this run's nonce), and measures:

1. a model run over the suite (``run --tasks``, ``--workers`` sessions, ``--verifier command``) against the
   scripted test model server, which writes the answer the tests want: its wall time, the images it built
   (each exactly once: the builder's log lines), failed starts (failed.jsonl), peak disk of the engine's
   root and the run;
2. the same run over the same tasks on one shared prebuilt image (each task's ``docker_image``);
3. ``hermes-batch tasks check`` over the suite (all green: the solution passes, the untouched image fails).

    python bench/bench_tasks.py [--tasks 60] [--environments 12] [--workers 16] [--latency 0.5] [-S pool=0]
        [--sandbox singularity]

With ``--sandbox singularity`` (an ``apptainer`` on PATH, e.g. scripts/apptainer.sh's forwarders into a
container that shares /tmp) each image is built by the Docker engine and converted once to a SIF in a
cache folder under the suite's temporary folder, and the shared image is the base saved to a
docker-archive:// (converted once too); the oracle check is the docker sandbox's in both cases.
The images it built are removed at the end (``--keep`` keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from common import model_server

BASE_FROM = "hermes-batch-test/busybox-a:1"


def docker(*args: str, check: bool = True) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check).stdout


def make_base(nonce: str, folder: Path) -> str:
    """The suite's base image, built offline from the busybox test image (a few MB of its own)."""
    base = f"hermes-batch-bench/base:{nonce}"
    (folder / "base").mkdir(parents=True)
    (folder / "base" / "Dockerfile").write_text(
        f"FROM {BASE_FROM}\nRUN mkdir -p /opt /app && dd if=/dev/urandom of=/opt/blob bs=1M count=8 2>/dev/null\nWORKDIR /app\n")
    docker("build", "-q", "-t", base, str(folder / "base"))
    return base


TEST = """#!/bin/sh
if [ "$(cat /app/hello.txt 2>/dev/null)" = hello ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""


def make_suite(root: Path, tasks: int, environments: int, nonce: str, base: str, shared: bool) -> Path:
    """``tasks`` Harbor tasks over ``environments`` Dockerfiles (or all on ``base`` when ``shared``)."""
    for i in range(tasks):
        task = root / f"task-{i:03d}"
        for part in ("environment", "tests", "solution"):
            (task / part).mkdir(parents=True)
        image = f'docker_image = "{base}"\n' if shared else ""
        (task / "task.toml").write_text(f'[metadata]\nvariant = {i % environments}\n[agent]\ntimeout_sec = 300\n'
                                        f'[verifier]\ntimeout_sec = 120\n[environment]\n{image}')
        (task / "instruction.md").write_text(f"Task {i}: write hello.txt holding the line hello.\n")
        if not shared:
            (task / "environment" / "Dockerfile").write_text(
                f"FROM {base}\nLABEL bench={nonce}\nRUN echo variant-{i % environments} > /variant && "
                f"dd if=/dev/urandom of=/opt/own bs=1M count=2 2>/dev/null\n")
        (task / "tests" / "test.sh").write_text(TEST)
        (task / "solution" / "solve.sh").write_text("#!/bin/sh\necho hello > /app/hello.txt\n")
    return root


class DiskPeak:
    """The peak of the used bytes of the file systems of ``paths`` (sampled every 0.5 s), above the start."""

    def __init__(self, *paths: str):
        self.paths = [p for p in paths if os.path.exists(p)]
        self.start = self._used()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _used(self) -> int:
        devices = {}
        for path in self.paths:
            devices.setdefault(os.stat(path).st_dev, path)
        return sum(shutil.disk_usage(p).used for p in devices.values())

    def _watch(self):
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, self._used())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._used())


def run_suite(suite: Path, out: Path, name: str, url: str, workers: int, options: list, sandbox: str) -> dict:
    command = [sys.executable, "-m", "hermes_batch", "run", "--tasks", str(suite), "--batch_size", "20",
               "--run_name", name, "--output_dir", str(out), "--base_url", url, "--model", "bench-model",
               "--api_key", "bench", "--num_workers", str(workers), "--distribution", "terminal_only",
               "--sandbox", sandbox, "--verifier", "command", "--no-progress", "--seed", "1", "--verbose",
               *(arg for option in options for arg in ("-S", option))]
    started = time.perf_counter()
    with DiskPeak(docker_root(), str(out)) as disk:
        proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode not in (0, 3):
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"the run exited with {proc.returncode}")
    log = proc.stdout + proc.stderr
    built = re.findall(r"Built the image (\S+) in", log)
    converted = re.findall(r"Converting the image (\S+) to a SIF", log)
    records = [json.loads(line) for line in (out / name / "trajectories.jsonl").read_text().splitlines()]
    failed_path = out / name / "failed.jsonl"
    failed = [json.loads(line) for line in failed_path.read_text().splitlines()] if failed_path.exists() else []
    return {
        "wall_s": wall, "built": built, "converted": converted, "records": len(records),
        "passed": sum(r["metadata"]["passed"] for r in records), "failed": failed,
        "failed_starts": sum(f.get("error_kind") == "sandbox" for f in failed),
        "disk_peak_mb": (disk.peak - disk.start) / (1 << 20),
        "tasks_named": len({json.loads(r["metadata"]["row"])["task"] for r in records}),
        "not_passed": [(r["metadata"]["end_reason"], [(v.get("reason"), v.get("error")) for v in
                                                      json.loads(r["metadata"]["verifiers"])])
                       for r in records if not r["metadata"]["passed"]][:3],
    }


def docker_root() -> str:
    try:
        return json.loads(docker("info", "--format", "{{json .DockerRootDir}}")) or "/var/lib/docker"
    except (subprocess.CalledProcessError, json.JSONDecodeError):
        return "/var/lib/docker"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=60)
    parser.add_argument("--environments", type=int, default=12)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--latency", type=float, default=0.5, help="seconds per model call")
    parser.add_argument("--keep", action="store_true", help="keep the images it built")
    parser.add_argument("-S", dest="sandbox_options", action="append", default=[],
                        help="a sandbox option for both runs, e.g. -S pool=0")
    parser.add_argument("--sandbox", choices=("docker", "singularity"), default="docker")
    args = parser.parse_args()
    nonce = uuid.uuid4().hex[:10]
    options = list(args.sandbox_options)
    # under /tmp: the Apptainer of scripts/apptainer.sh runs in a container that shares /tmp alone
    with tempfile.TemporaryDirectory(prefix="bench-tasks-", dir="/tmp" if args.sandbox == "singularity" else None) as tmp:
        tmp = Path(tmp)
        base = make_base(nonce, tmp)
        try:
            shared_image = base
            if args.sandbox == "singularity":
                # the shared image is a converted archive, which keeps no WORKDIR: both runs start in the base's
                options += [f"cache_dir={tmp / 'sif-cache'}", "workdir=/app"]
                docker("save", "-o", str(tmp / "base.tar"), base)
                shared_image = f"docker-archive://{tmp / 'base.tar'}"
            suite = make_suite(tmp / "suite", args.tasks, args.environments, nonce, base, shared=False)
            shared = make_suite(tmp / "shared", args.tasks, args.environments, nonce, shared_image, shared=True)
            with model_server(args.latency, tool_calls=1, command="echo hello > hello.txt") as url:
                own = run_suite(suite, tmp / "out", "own-images", url, args.workers, options, args.sandbox)
                one = run_suite(shared, tmp / "out", "shared-image", url, args.workers, options, args.sandbox)
            started = time.perf_counter()
            check = subprocess.run([sys.executable, "-m", "hermes_batch", "tasks", "check", str(suite)],
                                   capture_output=True, text=True)
            check_s = time.perf_counter() - started
        finally:
            images = [line for line in docker("images", "--filter", f"label=bench={nonce}", "-q").split() if line]
            if not args.keep:
                for image in set(images):
                    docker("rmi", "-f", image, check=False)
                docker("rmi", "-f", base, check=False)
    distinct = len(set(own["built"]))
    print(f"suite: {args.tasks} tasks over {args.environments} Dockerfiles, {args.workers} sessions, "
          f"model latency {args.latency} s, 2 model calls per task, --sandbox {args.sandbox}, "
          f"-S {options or 'defaults'}")
    print(f"own images     wall {own['wall_s']:6.1f} s  built {len(own['built'])} images ({distinct} distinct, "
          f"each once: {len(own['built']) == distinct == args.environments})  passed {own['passed']}/"
          f"{own['records']}  failed starts {own['failed_starts']}  failed prompts {len(own['failed'])}  "
          f"disk peak +{own['disk_peak_mb']:.0f} MB  tasks named in records {own['tasks_named']}")
    if args.sandbox == "singularity":
        print(f"own images     converted to SIFs {len(own['converted'])} ({len(set(own['converted']))} distinct); "
              f"shared image converted {len(one['converted'])}")
    print(f"shared image   wall {one['wall_s']:6.1f} s  built {len(one['built'])} images  passed {one['passed']}/"
          f"{one['records']}  failed starts {one['failed_starts']}  failed prompts {len(one['failed'])}  "
          f"disk peak +{one['disk_peak_mb']:.0f} MB")
    print(f"ratio own/shared wall time: {own['wall_s'] / one['wall_s']:.2f}")
    last = check.stdout.strip().splitlines()[-1] if check.stdout.strip() else check.stderr[-500:]
    print(f"tasks check    {check_s:6.1f} s  exit {check.returncode}  {last}")
    for label, result in (("own images", own), ("shared image", one)):
        if result["not_passed"]:
            print(f"{label}: not passed (end reason, verifiers), the first ones:", result["not_passed"])
    if own["failed"] or one["failed"]:
        print("failures:", [f["message"][:200] for f in own["failed"] + one["failed"]][:3])


if __name__ == "__main__":
    main()
