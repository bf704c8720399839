"""Export time and output size per format for a large run folder (issue 17: 100,000 trajectories).

A short real run against the scripted model server (its ShapeScript: tool calls,
reasoning, failed calls, loops, long answers) provides the trajectories; they
are copied, each as a new prompt with its own random words in the prompt,
the reasoning, the tool output and the final answer, into a run folder of
``--trajectories`` records (the system turn with the tool definitions repeats,
as in a real run).  Startup
of the command (imports, plugins) is part of each figure: ``hermes-batch --help``
alone is measured for reference.  Then ``hermes-batch export`` runs once per format as a child process
(wall time, CPU, peak memory of the process), and near-duplicate removal once
at export time.

    python bench/bench_export.py [--trajectories 100000] [--formats sharegpt,openai,parquet] [--near-duplicates]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from common import measure_run

from hermes_batch.testing import ScriptedModelServer
from hermes_batch.testing.fixtures import TEST_API_KEY
from hermes_batch.testing.run_folders import ShapeScript, run_shapes

TEMPLATE_SHAPES = ("ok", "ok", "ok", "fail", "loop", "long", "notool", "dup", "cut", "empty")
BATCH_SIZE = 1000


def template_run(tmp: Path) -> Path:
    prompts = [f"[{shape}] template {n}" for n in range(20) for shape in TEMPLATE_SHAPES]
    with ScriptedModelServer(ShapeScript(), api_key=TEST_API_KEY) as server:
        return run_shapes(tmp, server, prompts, run_name="template", extra=["--no_filters"])


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_VOCABULARY) for _ in range(count))


_VOCABULARY = [f"{a}{b}{c}" for a in "bcdfgklmnprst" for b in "aeiou" for c in ("", "n", "r", "st", "ng")]


def _vary(turn: dict, rng: random.Random) -> None:
    value = turn["value"]
    if turn["from"] == "gpt":
        rest = value
        thought = ""
        if value.startswith("<think>\n") and "\n</think>" in value:
            rest = value.split("\n</think>", 1)[1]
            thought = f"<think>\n{_words(rng, 40)}\n</think>"
        if "tool_calls" in turn:
            turn["value"] = thought + rest  # the calls must stay as they are: the openai format checks them
        else:
            turn["value"] = (thought + "\n" if thought else "") + _words(rng, 60)
    elif turn["from"] == "tool":
        blocks = []
        for block in value.split("</tool_response>")[:-1]:
            payload = json.loads(block.split("<tool_response>\n", 1)[1])
            if isinstance(payload.get("content"), dict):
                payload["content"]["output"] = _words(rng, 80)
            blocks.append(f"<tool_response>\n{json.dumps(payload, ensure_ascii=False)}\n</tool_response>")
        turn["value"] = "\n".join(blocks)


def grow(template: Path, target: Path, count: int) -> int:
    """A run folder of ``count`` kept trajectories copied from ``template``'s; returns its bytes of records."""
    records = [json.loads(line) for p in sorted(template.glob("batch_*.jsonl")) for line in p.read_text().splitlines()]
    target.mkdir(parents=True)
    for name in ("run.json", "checkpoint.json"):
        shutil.copy(template / name, target / name)
    size = 0
    handle = None
    rng = random.Random(17)
    for i in range(count):
        if i % BATCH_SIZE == 0:
            if handle:
                handle.close()
            handle = open(target / f"batch_{i // BATCH_SIZE}.jsonl", "w", encoding="utf-8")
        record = copy.deepcopy(records[i % len(records)])
        record["prompt_index"] = i
        # distinct prompts, reasoning, tool output and answers, so that compression and near-duplicate removal
        # do not see copies (the scripted model's own texts are short and alike)
        record["conversations"][1]["value"] += " " + _words(rng, 12)
        for turn in record["conversations"][2:]:
            _vary(turn, rng)
        record["metadata"]["batch_num"] = i // BATCH_SIZE
        record["metadata"]["content_key"] = hashlib.sha256(f"bench {i}".encode()).hexdigest()[:32]
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        size += len(line.encode("utf-8"))
        handle.write(line)
    handle.close()
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=100_000)
    parser.add_argument("--formats", default="sharegpt,openai,parquet")
    parser.add_argument("--near-duplicates", action="store_true", help="also time export --filter near-duplicates (sharegpt)")
    parser.add_argument("--dir", default=None, help="work folder [default: a temporary one]")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        template = template_run(tmp)
        run_dir = tmp / "out" / "bench"
        records_bytes = grow(template, run_dir, args.trajectories)
        print(f"{args.trajectories} trajectories, {records_bytes / 1e6:.0f} MB of batch files "
              f"({records_bytes / args.trajectories / 1e3:.1f} kB each)")
        print(f"{'format':<26} {'wall s':>8} {'CPU s':>8} {'peak MB':>8} {'output MB':>10} {'traj/s':>8}")
        startup = measure_run(["--help"])
        print(f"{'(startup: --help)':<26} {startup['wall_s']:>8.1f} {startup['cpu_s']:>8.1f} {startup['peak_rss_mb']:>8.0f}")
        runs = [(name, [f"--format={name}"]) for name in args.formats.split(",")]
        if args.near_duplicates:
            runs.append(("sharegpt + near-duplicates", ["--format=sharegpt", "--filter=near-duplicates"]))
        for label, extra in runs:
            out = tmp / "exports" / label.replace(" ", "_")
            result = measure_run(["export", str(run_dir), *extra, f"--output={out}"])
            size = sum(p.stat().st_size for p in out.iterdir())
            print(f"{label:<26} {result['wall_s']:>8.1f} {result['cpu_s']:>8.1f} {result['peak_rss_mb']:>8.0f} "
                  f"{size / 1e6:>10.1f} {args.trajectories / result['wall_s']:>8.0f}")
            shutil.rmtree(out)
        print(f"(machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
