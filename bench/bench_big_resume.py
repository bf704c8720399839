"""Bookkeeping of a big run: --resume of a finished run, and of one with a share left to run.

Issue 15's targets, at 1,000,000 prompts: a --resume of a finished run returns
in at most 10 s; with 1% left to run against the scripted server at 0 ms
latency, the time outside model and tool calls stays under 20 s; the driver's
peak memory stays under 300 MB for both; the disk of a finished run is at most
1.1 times its records plus the merged output.

The big run folder is built synthetically: a real run of a few hundred prompts
against the scripted model server gives the template records, which are copied
with new prompts, indexes and content keys (their journal lines too).  The
bookkeeping files a run of this version keeps beside the records (the per-batch
index, the dataset's key index) are built by the library from those copies, as
the run that wrote them would have.  "Outside model and tool calls" is the
resume's wall time minus that of a fresh run of just the prompts left.

    python bench/bench_big_resume.py [--prompts 1000000] [--batch_size 1000] [--left 0.01] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from common import measure_run, model_server, write_prompts

TEMPLATE_PROMPTS = 200


def prompt_text(i: int) -> str:
    return f"Synthetic task number {i}: run a command and report what it printed."


def run_args(dataset: Path, out: Path, name: str, url: str, batch_size: int, *extra: str) -> list[str]:
    return [
        "run", "--dataset_file", str(dataset), "--batch_size", str(batch_size), "--run_name", name,
        "--output_dir", str(out), "--base_url", url, "--model", "bench-model", "--api_key", "bench",
        "--num_workers", "64", "--distribution", "terminal_only", "--no-progress", "--seed", "1", *extra,
    ]


def make_template(workdir: Path, url: str) -> Path:
    folder = workdir / "template" / "tmpl"
    if (folder / "statistics.json").exists():
        return folder
    dataset = write_prompts(workdir / "template.jsonl", TEMPLATE_PROMPTS)
    measure_run(run_args(dataset, workdir / "template", "tmpl", url, 100))
    return folder


def _template_records(folder: Path) -> tuple[list[dict], dict]:
    records = []
    for path in sorted(folder.glob("batch_*.jsonl")):
        records += [json.loads(line) for line in path.open("rb")]
    calls: dict[int, list[dict]] = {}
    for line in (folder / "calls.jsonl").open("rb"):
        entry = json.loads(line)
        if "prompt_index" in entry:
            calls.setdefault(entry["prompt_index"], []).append(entry)
    records.sort(key=lambda r: r["prompt_index"])
    return records, calls


def build_folder(template: Path, out: Path, name: str, prompts: int, batch_size: int, left: float) -> Path:
    """A finished run of ``prompts`` prompts (every 1/left-th one not finished) in ``out/name``."""
    from hermes_batch import reindex
    from hermes_batch.records import content_key

    records, calls = _template_records(template)
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    dataset = write_dataset(out / f"{name}.jsonl", prompts)
    skip_every = round(1 / left) if left else 0
    sep = (",", ":")
    finished = 0
    with open(folder / "trajectories.jsonl", "w") as merged, open(folder / "calls.jsonl", "w") as journal:
        journal.write('{"event":"journal","first_session":0}\n')
        batch_file = None
        for i in range(prompts):
            if i % batch_size == 0:
                if batch_file:
                    batch_file.close()
                batch_file = open(folder / f"batch_{i // batch_size}.jsonl", "w")
            template_index = i % len(records)
            for entry in calls.get(template_index, ()):
                journal.write(json.dumps(dict(entry, prompt_index=i), separators=sep) + "\n")
            if skip_every and i % skip_every == skip_every - 1:
                continue
            record = dict(records[template_index])
            text = prompt_text(i)
            record["prompt_index"] = i
            record["conversations"] = [dict(t, value=text) if t["from"] == "human" else t
                                       for t in record["conversations"]]
            record["metadata"] = dict(record["metadata"], batch_num=i // batch_size,
                                      content_key=content_key(text, None, None))
            line = json.dumps(record, ensure_ascii=False, separators=sep) + "\n"
            batch_file.write(line)
            merged.write(line)
            finished += 1
        batch_file.close()
    run = json.loads((template / "run.json").read_text())
    run["config"]["batch_size"] = batch_size
    run["config"]["dataset_file"] = str(dataset)
    run["dataset"] = {"path": str(dataset), "fingerprint": reindex.fingerprint(dataset), "lines": prompts,
                      "valid": prompts}
    (folder / "run.json").write_text(json.dumps(run, indent=2))
    checkpoint = json.loads((template / "checkpoint.json").read_text())
    checkpoint.update(run_name=name, batch_size=batch_size, prompts_finished=finished, completed_prompts=finished,
                      completed_batches=list(range((prompts + batch_size - 1) // batch_size)))
    (folder / "checkpoint.json").write_text(json.dumps(checkpoint))
    shutil.copy(template / "statistics.json", folder / "statistics.json")
    build_bookkeeping(folder, dataset, batch_size)
    return folder


def write_dataset(path: Path, prompts: int) -> Path:
    with open(path, "w") as fh:
        for i in range(prompts):
            fh.write(json.dumps({"prompt": prompt_text(i)}) + "\n")
    return path


def build_bookkeeping(folder: Path, dataset: Path, batch_size: int) -> None:
    """The index files the run that wrote ``folder`` would have left (versions that keep them)."""
    try:
        from hermes_batch import bookkeeping
    except ImportError:
        return  # a version that scans the records instead
    bookkeeping.build_for_bench(folder, dataset, batch_size)


def disk_use(folder: Path) -> tuple[int, int]:
    """(bytes of every file of the folder, bytes of the batch files plus trajectories.jsonl)."""
    total = data = 0
    for entry in folder.rglob("*"):
        if entry.is_file():
            size = entry.stat().st_blocks * 512
            total += size
            if entry.name.startswith("batch_") and entry.suffix == ".jsonl" or entry.name == "trajectories.jsonl":
                data += size
    return total, data


def report(label: str, result: dict) -> None:
    print(f"{label:44s} wall {result['wall_s']:7.1f} s  cpu {result['cpu_s']:7.1f} s  "
          f"peak {result['peak_rss_mb']:5.0f} MB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1_000_000)
    parser.add_argument("--batch_size", type=int, default=1000)
    parser.add_argument("--left", type=float, default=0.01, help="share left to run in the second folder (0: skip)")
    parser.add_argument("--workdir", type=Path, help="kept between invocations (the template is reused)")
    parser.add_argument("--resumes", type=int, default=2, help="resumes of the finished folder to time")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-big-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "runs"
    with model_server(0.0, tool_calls=2) as url:
        template = make_template(workdir, url)
        started = time.perf_counter()
        folder = build_folder(template, out, "finished", args.prompts, args.batch_size, 0.0)
        print(f"built {args.prompts} finished prompts in {time.perf_counter() - started:.0f} s", flush=True)
        dataset = out / "finished.jsonl"
        for n in range(args.resumes):
            report(f"--resume of the finished run ({n + 1})",
                   measure_run(run_args(dataset, out, "finished", url, args.batch_size, "--resume")))
        total, data = disk_use(folder)
        print(f"disk of the finished run: {total / 1e9:.2f} GB, records + merged output {data / 1e9:.2f} GB, "
              f"ratio {total / data:.3f}", flush=True)
        shutil.rmtree(folder)
        if args.left:
            left = round(args.prompts * args.left)
            folder = build_folder(template, out, "partial", args.prompts, args.batch_size, args.left)
            partial = measure_run(run_args(out / "partial.jsonl", out, "partial", url, args.batch_size, "--resume"))
            report(f"--resume with {left} of {args.prompts} left", partial)
            shutil.rmtree(folder)
            fresh_dataset = workdir / "fresh.jsonl"
            with open(fresh_dataset, "w") as fh:
                for i in range(left):
                    fh.write(json.dumps({"prompt": prompt_text(i)}) + "\n")
            fresh = measure_run(run_args(fresh_dataset, out, "fresh", url, args.batch_size))
            report(f"fresh run of {left} prompts", fresh)
            print(f"time outside model and tool calls: {partial['wall_s'] - fresh['wall_s']:.1f} s "
                  f"(cpu {partial['cpu_s'] - fresh['cpu_s']:.1f} s)", flush=True)
            shutil.rmtree(out / "fresh")
    if not args.workdir:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
