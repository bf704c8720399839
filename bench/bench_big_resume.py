"""Bookkeeping of a big run: --resume of a finished run, and of one with a share left to run.

Issue 15's targets, at 1,000,000 prompts: a --resume of a finished run returns
in at most 10 s; with 1% left to run against the scripted server at 0 ms
latency, the time outside model and tool calls stays under 20 s; the driver's
peak memory stays under 300 MB for both; the disk of a finished run is at most
1.1 times its records plus the merged output.

The big run folder is built synthetically: a real run of a few hundred prompts
against the scripted model server gives the template records, which are copied
with new prompts, indexes and content keys (their journal lines too).  The
indexes a run of this version keeps beside the records (index/) are built with
the library's own classes as each copy is written, as the run that wrote them
would have, and so is report.html with the view cache behind it; the first
resume then checks the indexes against the files.  The folder
with a share left is the same run cut off before its last prompts (the merge
of the resume then only appends).  "Outside model and tool calls" is the
resume's wall time minus that of a fresh run of just the prompts left, and,
measured within the one run (so it holds on a busy machine), the time from
its start to its first model request plus that from its last answer to its
exit (read off the growth of its call journal).

    python bench/bench_big_resume.py [--prompts 1000000] [--batch_size 1000] [--left 0.01] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
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


def _line_template(record: dict) -> str:
    """The record as one JSON line with markers where each copy's prompt, index, batch and key go."""
    marked = dict(record, prompt_index="@@INDEX@@")
    marked["conversations"] = [dict(t, value="@@PROMPT@@") if t["from"] == "human" else t
                               for t in record["conversations"]]
    marked["metadata"] = dict(record["metadata"], batch_num="@@BATCH@@", content_key="@@KEY@@")
    return json.dumps(marked, ensure_ascii=False, separators=(",", ":")) + "\n"


def _fill(template: str, index: int, batch: int, prompt: str, key: str) -> str:
    return (template.replace('"@@INDEX@@"', str(index)).replace('"@@BATCH@@"', str(batch))
            .replace("@@PROMPT@@", prompt).replace("@@KEY@@", key))


def build_folder(template: Path, out: Path, name: str, prompts: int, batch_size: int, left: float) -> Path:
    """A finished run of ``prompts`` prompts (the last ``left`` share not run yet) in ``out/name``."""
    from hermes_batch.folder import reindex
    from hermes_batch.formats.records import Trajectory, content_key
    from hermes_batch.formats.serialization import from_json

    records, calls = _template_records(template)
    lines = [_line_template(r) for r in records]
    call_lines = ["".join(json.dumps(dict(entry, prompt_index="@@INDEX@@"), separators=(",", ":")) + "\n"
                          for entry in calls.get(t, ())) for t in range(len(records))]
    structured = [from_json(r, Trajectory) for r in records]
    try:
        from hermes_batch.folder import record_index, rowkeys
        from hermes_batch.folder.aggregate import epoch
        from hermes_batch.formats.records import key_digest
        from hermes_batch.folder.runfolder import RunFolder
    except ImportError:  # a version that scans the records instead of keeping indexes
        record_index = None
    epochs = [epoch(r["metadata"]["timestamp"]) for r in records] if record_index else []
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    dataset = write_dataset(out / f"{name}.jsonl", prompts)
    done = prompts - round(prompts * left)
    run_index = record_index.RecordIndex(RunFolder(out, name)) if record_index else None
    index = None
    ends: list = []  # where each batch ends in trajectories.jsonl
    with open(folder / "trajectories.jsonl", "w") as merged, open(folder / "calls.jsonl", "w") as journal:
        journal.write('{"event":"journal","first_session":0}\n')
        batch_file = None
        for i in range(done):
            batch = i // batch_size
            if i % batch_size == 0:
                if batch_file:
                    batch_file.close()
                    _save(run_index, index)
                    ends.append(merged.tell())
                batch_file = open(folder / f"batch_{batch}.jsonl", "w")
                index = run_index and record_index.FileIndex(folder / f"batch_{batch}.jsonl", "kept")
            t = i % len(records)
            journal.write(call_lines[t].replace('"@@INDEX@@"', str(i)))
            text = prompt_text(i)
            key = content_key(text, None, None)
            line = _fill(lines[t], i, batch, text, key)
            batch_file.write(line)
            merged.write(line)
            if index is not None:  # what the run adds to the index as it writes each record
                index.aggregate.add(structured[t])
                index.digests.append(key_digest(key))
                index.epochs.append(epochs[t])
        batch_file.close()
        _save(run_index, index)
        ends.append(merged.tell())
    run = json.loads((template / "run.json").read_text())
    run["config"]["batch_size"] = batch_size
    run["config"]["dataset_file"] = str(dataset)
    run["dataset"] = {"path": str(dataset), "fingerprint": reindex.fingerprint(dataset), "lines": prompts,
                      "valid": prompts}
    (folder / "run.json").write_text(json.dumps(run, indent=2))
    checkpoint = json.loads((template / "checkpoint.json").read_text())
    checkpoint.update(run_name=name, batch_size=batch_size, prompts_finished=done, completed_prompts=done,
                      completed_batches=list(range(done // batch_size)))
    (folder / "checkpoint.json").write_text(json.dumps(checkpoint) + "\n")
    shutil.copy(template / "statistics.json", folder / "statistics.json")
    if run_index is not None:
        run_index.journal_totals()
        rowkeys.build(RunFolder(out, name), dataset, None)
        _save_merge_state(run_index, folder, ends)
    try:  # report.html and its view cache, as the run's end would have left them
        from hermes_batch.view import write_report
    except ImportError:
        pass
    else:
        write_report(folder)
    return folder


def _save_merge_state(run_index, folder: Path, ends: list) -> None:
    """index/merged.json as the merge that wrote trajectories.jsonl would have left it."""
    from hermes_batch.folder import merge

    _total, _times, batches = run_index.totals()
    names = frozenset().union(*(b.tools for b in batches))
    current = [[b.num, b.covered, b.edges] for b in batches if b.kept]
    state = merge._writer_state(folder / "trajectories.jsonl", "trajectories.jsonl", ends, names, current)
    (folder / "index" / merge.STATE).write_text(json.dumps({"version": merge.VERSION, "writers": {"jsonl": state}}))


def _save(run_index, index) -> None:
    if index is not None:
        index.seal()
        run_index.save(index)


def write_dataset(path: Path, prompts: int) -> Path:
    with open(path, "w") as fh:
        for i in range(prompts):
            fh.write(json.dumps({"prompt": prompt_text(i)}) + "\n")
    return path


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


def timed_run(args: list[str], journal: Path) -> dict:
    """measure_run, plus the run's serial ends read off its call journal: from the start to the first model
    request written to ``journal``, and from the last line written to the exit.

    Those two are the time a session spends outside model and tool calls
    before and after them, measured within one run, so unlike a difference of
    two runs' wall times they hold on a busy machine.
    """
    import threading

    start_size = journal.stat().st_size if journal.exists() else 0
    seen = {"first": None, "last": None}
    done = threading.Event()

    def watch() -> None:
        size = start_size
        while not done.is_set():
            try:
                now = journal.stat().st_size
            except FileNotFoundError:
                now = 0
            if now > size:
                stamp = time.perf_counter()
                seen["first"] = seen["first"] or stamp
                seen["last"], size = stamp, now
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    started = time.perf_counter()
    watcher.start()
    try:
        result = measure_run(args)
    finally:
        done.set()
        watcher.join()
    ended = started + result["wall_s"]
    if seen["first"] is not None:
        result["to_first_call_s"] = seen["first"] - started
        result["after_last_call_s"] = ended - seen["last"]
    return result


def report(label: str, result: dict) -> None:
    ends = ""
    if "to_first_call_s" in result:
        ends = (f"  start to first model request {result['to_first_call_s']:5.1f} s, "
                f"last answer to exit {result['after_last_call_s']:5.1f} s")
    print(f"{label:44s} wall {result['wall_s']:7.1f} s  cpu {result['cpu_s']:7.1f} s  "
          f"peak {result['peak_rss_mb']:5.0f} MB{ends}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1_000_000)
    parser.add_argument("--batch_size", type=int, default=1000)
    parser.add_argument("--left", type=float, default=0.01, help="share left to run in the second folder (0: skip)")
    parser.add_argument("--workdir", type=Path, help="kept between invocations (the template is reused)")
    parser.add_argument("--resumes", type=int, default=2, help="resumes of the finished folder to time (0: skip it)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-big-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "runs"
    with model_server(0.0, tool_calls=2) as url:
        template = make_template(workdir, url)
        if args.resumes:
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
            partial = timed_run(run_args(out / "partial.jsonl", out, "partial", url, args.batch_size, "--resume"),
                                folder / "calls.jsonl")
            report(f"--resume with {left} of {args.prompts} left", partial)
            shutil.rmtree(folder)
            fresh_dataset = workdir / "fresh.jsonl"
            with open(fresh_dataset, "w") as fh:
                for i in range(left):
                    fh.write(json.dumps({"prompt": prompt_text(i)}) + "\n")
            fresh = timed_run(run_args(fresh_dataset, out, "fresh", url, args.batch_size), out / "fresh" / "calls.jsonl")
            report(f"fresh run of {left} prompts", fresh)
            print(f"time outside model and tool calls: {partial['wall_s'] - fresh['wall_s']:.1f} s "
                  f"(cpu {partial['cpu_s'] - fresh['cpu_s']:.1f} s) as the difference of the two runs", flush=True)
            if "to_first_call_s" in partial:
                serial = partial["to_first_call_s"] + partial["after_last_call_s"]
                print(f"the resume's own serial ends (before its first model request, after its last answer): "
                      f"{serial:.1f} s, {serial - fresh['to_first_call_s'] - fresh['after_last_call_s']:.1f} s "
                      "more than the fresh run's", flush=True)
            shutil.rmtree(out / "fresh")
    if not args.workdir:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
