"""report.html and `hermes-batch view` on large synthetic runs built from real records.

A demo run against the scripted model server (hermes_batch.testing.demo_run)
gives real kept, discarded and failed records; the synthetic run repeats them
with a new prompt text, prompt_index and content key each, in batch files of
1,000 (a 1,000,000-prompt run is about 6 GB, like a real one of this shape).

Measured:
- report: `hermes-batch report` (index built from scratch, as at the end of a
  run) for each size: wall time, size of report.html;
- view: `hermes-batch view` on the largest run: start-up (index built, then
  loaded from its cache), and in Chromium the time to the first page of the
  list and to a search that finds one prompt; the API's own time for a
  filter and a sort; the viewer's peak memory;
- long line: indexing a run whose one record is a line of N MB (its prompt),
  wall and CPU time (``--long-line-mb 400``).

    python bench/bench_view.py [--report-sizes 1000,100000] [--view-size 1000000] [--long-line-mb 0] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from hermes_batch.testing.demo_run import make_demo_run

BATCH = 1000


def _templates(run_dir: Path) -> list[tuple[str, bytes]]:
    """(file kind, raw line) of every record of the demo run."""
    out = []
    for path in sorted(run_dir.glob("batch_*.jsonl")):
        out += [("kept", line) for line in path.read_bytes().splitlines(keepends=True)]
    out += [("discarded", line) for line in (run_dir / "discarded.jsonl").read_bytes().splitlines(keepends=True)]
    out += [("failed", line) for line in (run_dir / "failed.jsonl").read_bytes().splitlines(keepends=True)]
    return out


def _retarget(kind: str, line: bytes):
    """A function i -> the line for synthetic prompt i (string surgery: json.dumps a million times is slow)."""
    data = json.loads(line)
    rec = data["trajectory"] if kind == "discarded" else data
    if kind == "failed":
        prompt, key, index = rec["prompt"], rec["content_key"], rec["prompt_index"]
    else:
        prompt = next(t["value"] for t in rec["conversations"] if t["from"] == "human")
        key, index = rec["metadata"]["content_key"], rec["prompt_index"]
    text = line.decode()
    p_json = json.dumps(prompt)[1:-1]
    parts = text.split(p_json)
    text_key = parts
    index_field = f'"prompt_index": {index},'
    if index_field not in text:
        index_field = f'"prompt_index":{index},'

    def make(i: int) -> bytes:
        new_prompt = f"Synthetic task {i}: {p_json}"
        out = new_prompt.join(text_key)
        out = out.replace(index_field, index_field.replace(str(index), str(i)), 1)
        out = out.replace(key, f"{i:032x}")
        return out.encode()

    return make


def build_run(demo: Path, target: Path, prompts: int) -> Path:
    """A run folder of ``prompts`` records, cycling through the demo's records."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("run.json", "checkpoint.json", "statistics.json"):
        shutil.copy(demo / name, target / name)
    makers = [(kind, _retarget(kind, line)) for kind, line in _templates(demo)]
    discarded = open(target / "discarded.jsonl", "wb")
    failed = open(target / "failed.jsonl", "wb")
    batch_file, batch_num = None, -1
    try:
        for i in range(prompts):
            kind, make = makers[i % len(makers)]
            if kind == "kept":
                if i // BATCH != batch_num:
                    if batch_file:
                        batch_file.close()
                    batch_num = i // BATCH
                    batch_file = open(target / f"batch_{batch_num}.jsonl", "ab")
                batch_file.write(make(i))
            else:
                (discarded if kind == "discarded" else failed).write(make(i))
    finally:
        for fh in (discarded, failed, batch_file):
            if fh:
                fh.close()
    return target


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.jsonl"))


def bench_report(run_dir: Path) -> dict:
    shutil.rmtree(run_dir / ".hermes-batch-view", ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hermes_batch", "report", str(run_dir)], capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    # the same in-process, without the CLI's start-up, split into indexing and rendering
    from hermes_batch.view.index import RunIndex
    from hermes_batch.view.report import render_report

    shutil.rmtree(run_dir / ".hermes-batch-view", ignore_errors=True)
    t0, c0 = time.perf_counter(), time.process_time()
    index = RunIndex(run_dir)
    index.refresh()
    index.save()
    t1, c1 = time.perf_counter(), time.process_time()
    html = render_report(index)
    t2, c2 = time.perf_counter(), time.process_time()
    index.close()
    # on a shared machine the CPU seconds say more than the wall time
    return {"command_s": round(wall, 2), "command_cpu_s": round(cpu, 2),
            "index_s": round(t1 - t0, 2), "index_cpu_s": round(c1 - c0, 2),
            "render_s": round(t2 - t1, 2), "render_cpu_s": round(c2 - c1, 2),
            "report_bytes": len(html.encode()), "records_bytes": _size(run_dir)}


def _get(url: str) -> tuple[float, bytes]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as response:
        body = response.read()
    return time.perf_counter() - started, body


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _start_viewer(run_dir: Path):
    """The viewer process, the URL it printed (with its token) and its start-up time."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "hermes_batch", "view", str(run_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    match = re.search(r"at (http://\S+/\?token=\S+) ", line)
    if not match:
        proc.kill()
        raise SystemExit(f"the viewer did not start: {line!r}")
    return proc, match.group(1), time.perf_counter() - started


def _api(url: str, path: str) -> str:
    """``path`` of the viewer whose printed URL is ``url``, with its token."""
    base, token = url.split("?token=")
    return f"{base}{path}{'&' if '?' in path else '?'}token={token}"


def bench_view(run_dir: Path, prompts: int) -> dict:
    shutil.rmtree(run_dir / ".hermes-batch-view", ignore_errors=True)
    out = {"records_bytes": _size(run_dir)}
    proc, url, out["start_cold_s"] = _start_viewer(run_dir)
    out["start_cold_cpu_s"] = round(_cpu_s(proc.pid), 1)
    out["peak_rss_cold_mb"] = round(_peak_rss_mb(proc.pid))
    proc.terminate()
    proc.wait()
    cache = run_dir / ".hermes-batch-view"
    out["cache_bytes"] = sum(p.stat().st_size for p in cache.iterdir())
    proc, url, out["start_cached_s"] = _start_viewer(run_dir)
    out["start_cached_cpu_s"] = round(_cpu_s(proc.pid), 1)
    try:
        target = prompts * 2 // 3
        # first the API alone (what the page asks for), then in the browser
        # the viewer's CPU per request tells the cost apart from the machine's load
        for name, path in (("first_page", "api/records?offset=0&limit=50"),
                           ("search_one", f"api/records?q=synthetic+task+{target}%3A&limit=50"),
                           ("filter_discarded", "api/records?status=discarded&limit=50"),
                           ("sort_turns", "api/records?sort=turns&desc=1&limit=50"),
                           ("sort_turns_again", "api/records?sort=turns&desc=1&offset=50&limit=50"),
                           ("summary", "api/summary")):
            cpu = _cpu_s(proc.pid)
            seconds, body = _get(_api(url, path))
            out[f"api_{name}_s"] = round(seconds, 3)
            out[f"api_{name}_cpu_s"] = round(_cpu_s(proc.pid) - cpu, 2)
            if name == "search_one":
                assert json.loads(body)["total"] == 1, body[:300]
        out.update(_browser(url, target))
        out["peak_rss_mb"] = round(_peak_rss_mb(proc.pid))
    finally:
        proc.terminate()
        proc.wait()
    return out


def _browser(url: str, target: int) -> dict:
    chromium = os.environ.get("HERMES_CHROMIUM", "/usr/bin/chromium")
    if not os.access(chromium, os.X_OK):
        return {}
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        started = time.perf_counter()
        page.goto(url)
        page.locator("#list .row").first.wait_for(timeout=600_000)
        first = time.perf_counter() - started
        started = time.perf_counter()
        page.fill("#q", f"Synthetic task {target}:")
        expect(page.locator("#list .row")).to_have_count(1, timeout=600_000)
        search = time.perf_counter() - started - 0.25  # the page waits 250 ms after the last keystroke
        browser.close()
    return {"browser_first_page_s": round(first, 3), "browser_search_s": round(search, 3)}


def bench_long_line(demo: Path, target: Path, megabytes: int) -> dict:
    """Index a run whose one record is a line of ``megabytes`` MB: the time must grow with the size, not its square.

    A line longer than the viewer's MAX_LINE_BYTES (64 MiB) is read past and skipped, never joined whole."""
    from hermes_batch.view.index import MAX_LINE_BYTES, RunIndex

    target.mkdir(parents=True, exist_ok=True)
    record = json.loads((demo / "batch_0.jsonl").read_bytes().splitlines()[0])
    for turn in record["conversations"]:
        if turn["from"] == "human":
            turn["value"] = "A very long prompt. " * (megabytes * 1_000_000 // 20)
    (target / "batch_0.jsonl").write_text(json.dumps(record) + "\n")
    del record
    t0, c0 = time.perf_counter(), time.process_time()
    index = RunIndex(target, persist=False)
    added = index.refresh()
    t1, c1 = time.perf_counter(), time.process_time()
    index.close()
    size = (target / "batch_0.jsonl").stat().st_size
    assert added == (1 if size <= MAX_LINE_BYTES else 0), added
    return {"line_bytes": size, "indexed": added, "index_s": round(t1 - t0, 2),
            "index_cpu_s": round(c1 - c0, 2), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-sizes", default="1000,100000")
    parser.add_argument("--view-size", type=int, default=1_000_000)
    parser.add_argument("--long-line-mb", type=int, default=0, help="also index one record this long (0: not)")
    parser.add_argument("--keep", type=Path, help="build the runs here and keep them (default: a temporary folder)")
    args = parser.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="bench-view-"))
    try:
        demo = base / "demo-out" / "demo"
        if not (demo / "statistics.json").exists():  # kept from an earlier --keep run
            demo = make_demo_run(base / "demo-out")
        results = {}
        if args.long_line_mb:
            results["long_line"] = bench_long_line(demo, base / "long-line", args.long_line_mb)
            print(json.dumps({f"long_line_{args.long_line_mb}mb": results["long_line"]}), flush=True)
        for size in (int(s) for s in args.report_sizes.split(",") if s):
            run_dir = build_run(demo, base / f"run{size}", size)
            results[f"report_{size}"] = bench_report(run_dir)
            print(json.dumps({f"report_{size}": results[f"report_{size}"]}), flush=True)
            if size != args.view_size:
                shutil.rmtree(run_dir)
        if args.view_size:
            run_dir = base / f"run{args.view_size}"
            if not run_dir.exists():
                started = time.perf_counter()
                build_run(demo, run_dir, args.view_size)
                print(json.dumps({"built": args.view_size, "s": round(time.perf_counter() - started, 1)}), flush=True)
            results[f"view_{args.view_size}"] = bench_view(run_dir, args.view_size)
            print(json.dumps({f"view_{args.view_size}": results[f"view_{args.view_size}"]}), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
