"""Shared by bench_pilot.py and bench_adaptive.py: a dataset of rows with their own pass rates, the scripted
model server answering right with each row's rate (PassRateScript, in this process's thread), and runs of
``hermes-batch run`` as child processes."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

from hermes_batch.testing import PassRateScript, ScriptedModelServer


def rate_of(prompt: str) -> float:
    return float(re.search(r"rate=([0-9]+(?:\.[0-9]+)?)", prompt).group(1))


def write_rows(path: Path, count: int, seed: int) -> Path:
    """Three kinds of task: easy (short, rate 0.7 to 1), medium, hard (long prompts, rate 0 to 0.3), a field
    ``kind`` for --pilot_by; a fifth of all rows can never be solved, a fifth always are."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(count):
            kind = rng.choice(("easy", "easy", "medium", "hard"))
            low, high = {"easy": (0.7, 1.0), "medium": (0.2, 0.8), "hard": (0.0, 0.3)}[kind]
            rate = round(rng.uniform(low, high), 3)
            if rng.random() < 0.2:
                rate = 0.0 if kind == "hard" else 1.0
            padding = " Details follow." * {"easy": 5, "medium": 40, "hard": 120}[kind]
            f.write(json.dumps({"prompt": f"Task {i} ({kind}), rate={rate}.{padding}", "answer": "42",
                                "kind": kind}) + "\n")
    return path


def server(seed: int, delay: float) -> ScriptedModelServer:
    return ScriptedModelServer(PassRateScript(rate_of, seed=seed, delay=delay)).start()


def run(url: str, dataset: Path, out: Path, name: str, *extra: str) -> float:
    """``hermes-batch run`` as a child process; its wall time."""
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "hermes_batch", "run", "--dataset_file", str(dataset), "--batch_size", "50",
         "--run_name", name, "--output_dir", str(out), "--base_url", url, "--model", "bench-model",
         "--api_key", "bench", "--no-progress", "--verifier", "answer", *extra],
        capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"hermes-batch run exited with {proc.returncode}")
    return time.perf_counter() - started


def statistics(out: Path, name: str) -> dict:
    return json.loads((out / name / "statistics.json").read_text())


def verified_kept(out: Path, name: str) -> int:
    """Kept trajectories a verifier passed."""
    path = out / name / "trajectories.jsonl"
    return sum(json.loads(line)["metadata"]["passed"] for line in path.read_text().splitlines() if line.strip())
