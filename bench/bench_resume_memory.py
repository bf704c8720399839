"""The driver's peak memory on a resume of a large run that is nearly done, local and processes executors side by side.

Issue 13 asks for the driver's peak memory with 100,000 prompts of which
99,000 are already done.  A first session runs 10 real prompts of the
100,000-prompt dataset (--max_samples 10), which writes run.json for the whole
file; then 98,990 more finished records, copies of a real one with the prompt,
content key and index of their row, are appended to the batch files; then
`--resume` runs the last 1,000 prompts (3 model calls each at 10 ms) with each
executor.  The driver's peak resident memory (VmHWM) is read while it runs.

    python bench/bench_resume_memory.py [--prompts 100000] [--done 99000]
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import model_server, write_prompts

from hermes_batch.formats.dataset import iter_rows

BATCH = 100


def hermes(args: list[str]) -> dict:
    """Run ``hermes-batch`` as a child; its wall time and the driver's peak resident memory."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "hermes_batch", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]))
        except OSError:
            pass
        time.sleep(0.05)
    _out, err = proc.communicate()
    if proc.returncode != 0:
        sys.stderr.write(err[-4000:])
        raise SystemExit(f"hermes-batch exited with {proc.returncode}")
    return {"wall_s": time.perf_counter() - started, "peak_mb": peak / 1024}


def fabricate(folder: Path, dataset: Path, done: int) -> None:
    """Append finished records for rows 10..done-1, copies of the real record of row 0."""
    template = json.loads((folder / "batch_0.jsonl").read_text().splitlines()[0])
    files: dict[int, object] = {}
    try:
        for row in iter_rows(dataset, max_samples=done):
            if row.prompt_index < 10:
                continue
            record = copy.deepcopy(template)
            record["prompt_index"] = row.prompt_index
            record["metadata"]["batch_num"] = row.prompt_index // BATCH
            record["metadata"]["content_key"] = row.content_key
            for turn in record["conversations"]:
                if turn["from"] == "human":
                    turn["value"] = row.prompt
            batch = row.prompt_index // BATCH
            if batch not in files:
                files[batch] = open(folder / f"batch_{batch}.jsonl", "a")
            files[batch].write(json.dumps(record) + "\n")
    finally:
        for handle in files.values():
            handle.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=100_000)
    parser.add_argument("--done", type=int, default=99_000)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp, model_server(0.01) as url:
        dataset = write_prompts(Path(tmp) / "prompts.jsonl", args.prompts)
        base = ["run", "--dataset_file", str(dataset), "--batch_size", str(BATCH), "--base_url", url,
                "--model", "bench-model", "--api_key", "bench", "--num_workers", "64",
                "--distribution", "terminal_only", "--no-progress", "--seed", "1"]
        seed = Path(tmp) / "seed"
        hermes([*base, "--output_dir", str(seed), "--run_name", "r", "--max_samples", "10"])
        fabricate(seed / "r", dataset, args.done)
        print(f"{args.prompts} prompts, {args.done} finished, {args.prompts - args.done} to run on --resume")
        for label, executor in (("local", []), ("processes", ["--executor", "processes"])):
            out = Path(tmp) / label
            shutil.copytree(seed, out)
            result = hermes([*base, "--output_dir", str(out), "--run_name", "r", "--resume", *executor])
            kept = sum(1 for _ in open(out / "r" / "trajectories.jsonl"))
            print(f"  {label:<10} driver peak {result['peak_mb']:5.0f} MB  wall {result['wall_s']:5.1f} s  kept {kept}")


if __name__ == "__main__":
    main()
