"""CPU and wall time of model calls: hermes-batch before and after a change, and a minimal asyncio loop.

Issue 12's targets: 1000 prompts, 3 model calls each at 500 ms, 256 sessions in
one process within 2.3x the latency-bound ideal; at most 4.5 ms CPU per model
call at 64 sessions; the same records before and after.

Every variant runs against the same scripted model server (its own process,
its CPU not counted), one after another, so their ratios hold on a busy machine:

- ``minimal``: a hand-written asyncio loop over the same conversations through
  the ``openai`` SDK (``--minimal_mode``: create() on httpx, create() on aiohttp,
  or post() of a body we build, on aiohttp), no sandbox: the floor.
- ``before``: ``hermes-batch run`` from ``--before`` (a git ref, checked out into
  a temporary worktree and put first on PYTHONPATH).
- ``after``: ``hermes-batch run`` from this checkout; ``after-httpx`` adds
  ``--http_backend httpx``.

The records of every hermes-batch variant are compared with those of the first
one, with what legitimately differs masked (timestamps, durations, latencies,
and the tool call ids the server numbers in arrival order).

    python bench/bench_model_calls.py [--sessions 256] [--prompts 1000] [--latency 0.5]
        [--before main] [--variants minimal,before,after,after-httpx] [--repeat 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ideal_seconds, measure_run, model_server, write_prompts

ROOT = Path(__file__).resolve().parent.parent
CALLS_PER_PROMPT = 3
VARIANTS = ("minimal", "before", "after", "after-httpx")
MINIMAL_MODES = ("create-httpx", "create-aiohttp", "post-aiohttp")
_MASKED = re.compile(r'"(timestamp|duration_s|latency_s)":("[^"]*"|[0-9.e+-]+)')
_CALL_IDS = re.compile(r"call_hb\d+")


# --- the minimal loop (run as a child process, so its CPU is measured like a run's) -----------------


async def _minimal(url: str, prompts: int, sessions: int, mode: str) -> None:
    import httpx2
    import openai
    from openai.types.chat import ChatCompletion

    from hermes_batch.formats.conversation import DEFAULT_SYSTEM_PROMPT
    from hermes_batch.default_plugins.terminal_tools import TerminalTool

    limits = httpx2.Limits(max_connections=sessions, max_keepalive_connections=sessions)
    transport = openai.DefaultAsyncHttpxClient if mode == "create-httpx" else openai.DefaultAioHttpClient
    client = openai.AsyncOpenAI(api_key="bench", base_url=url, max_retries=0, timeout=600.0,
                                http_client=transport(limits=limits, timeout=600.0))
    tools = [{"type": "function", "function": {"name": TerminalTool.name, "description": TerminalTool.description,
                                               "parameters": TerminalTool.parameters}}]
    slots = asyncio.Semaphore(sessions)

    async def session(i: int) -> None:
        messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
                    {"role": "user", "content": f"Benchmark task number {i}: run a command."}]
        async with slots:
            for _turn in range(CALLS_PER_PROMPT):
                if mode == "post-aiohttp":
                    body = {"model": "bench-model", "messages": messages, "tools": tools}
                    response = await client.post("/chat/completions", cast_to=ChatCompletion, body=body)
                else:
                    response = await client.chat.completions.create(model="bench-model", messages=messages, tools=tools)
                message = response.choices[0].message
                calls = message.tool_calls or []
                messages.append({"role": "assistant", "content": message.content, "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                    for c in calls
                ]} if calls else {"role": "assistant", "content": message.content})
                if not calls:
                    break
                for c in calls:
                    messages.append({"role": "tool", "tool_call_id": c.id, "content": json.dumps({"output": "ok\n"})})

    await asyncio.gather(*(session(i) for i in range(prompts)))
    await client.close()


# --- hermes-batch runs -----------------------------------------------------------------------------


_NO_PLUGINS = """\
import importlib.metadata

_entry_points = importlib.metadata.entry_points


def entry_points(**params):
    if params.get("group") == "hermes_batch":
        return importlib.metadata.EntryPoints(())
    return _entry_points(**params)


importlib.metadata.entry_points = entry_points
"""


@contextlib.contextmanager
def checkout(ref: str):
    """``ref`` of this repository in a temporary worktree."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                            capture_output=True, text=True, check=True).stdout.strip()
    folder = Path(tempfile.mkdtemp(prefix="hermes-batch-before-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), commit],
                   capture_output=True, check=True)
    # The plugins installed here are this checkout's, written for its core, and an older core fails to
    # load them: the 'before' run loads none (the bench needs only the core's sandbox and model client).
    (folder / "sitecustomize.py").write_text(_NO_PLUGINS)
    try:
        yield folder, commit
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder)], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def masked_records(run_dir: Path) -> list[str]:
    lines = []
    for name in ("trajectories.jsonl", "failed.jsonl", "discarded.jsonl"):
        path = run_dir / name
        if path.exists():
            for line in path.read_text().splitlines():
                lines.append(name + ": " + _CALL_IDS.sub("call_hb#", _MASKED.sub(r'"\1":0', line)))
    return sorted(lines)


def _own(result: dict, calls: int) -> str:
    """The hermes-batch process's own CPU per call, without the sandbox commands it ran."""
    own = result.get("own_cpu_s")
    return f"(own {1000 * own / calls:4.1f})" if own is not None else " " * 10


def run_variant(name: str, url: str, dataset: Path, out: Path, args, before_dir) -> tuple[dict, list]:
    run_args = [
        "run", "--dataset_file", str(dataset), "--batch_size", "100", "--run_name", "bench",
        "--output_dir", str(out), "--base_url", url, "--model", "bench-model", "--api_key", "bench",
        "--num_workers", str(args.sessions), "--distribution", "terminal_only", "--no-progress", "--seed", "1",
    ]
    env = None
    if name == "minimal":
        command = [str(Path(__file__).resolve()), "--_minimal", url, "--prompts", str(args.prompts),
                   "--sessions", str(args.sessions), "--minimal_mode", args.minimal_mode]
        return measure_run(command, module=None), []
    if name == "before":
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(before_dir), os.environ.get("PYTHONPATH")])))
        imported = subprocess.run([sys.executable, "-c", "import hermes_batch; print(hermes_batch.__file__)"],
                                  capture_output=True, text=True, env=env, cwd=str(out.parent), check=True).stdout
        if not Path(imported.strip()).is_relative_to(before_dir):
            raise SystemExit(f"the 'before' variant would import {imported.strip()}, not the code of --before")
    if name == "after-httpx":
        run_args += ["--http_backend", "httpx"]
    shutil.rmtree(out, ignore_errors=True)
    # Not from this checkout, whose folder would come first on the path of every variant: see measure_run.
    result = measure_run(run_args, env=env, cwd=str(out.parent))
    stats = json.loads((out / "bench" / "statistics.json").read_text())
    result["calls"] = stats["finished"]["model_calls"]
    return result, masked_records(out / "bench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--latency", type=float, default=0.5)
    parser.add_argument("--before", default="main", help="git ref of the 'before' variant")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--minimal_mode", choices=MINIMAL_MODES, default="post-aiohttp")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of all variants; the median is reported")
    parser.add_argument("--_minimal", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._minimal:
        asyncio.run(_minimal(args._minimal, args.prompts, args.sessions, args.minimal_mode))
        return
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")

    calls = args.prompts * CALLS_PER_PROMPT
    ideal = ideal_seconds(args.prompts, args.sessions, CALLS_PER_PROMPT, args.latency)
    results: dict = {v: [] for v in variants}
    records: dict = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        before_dir, commit = stack.enter_context(checkout(args.before)) if "before" in variants else (None, None)
        url = stack.enter_context(model_server(args.latency, tool_calls=CALLS_PER_PROMPT - 1))
        dataset = write_prompts(tmp / "prompts.jsonl", args.prompts)
        print(f"prompts {args.prompts}, sessions {args.sessions}, latency {args.latency}s, ideal {ideal:.1f} s"
              + (f", before = {args.before} ({commit[:10]})" if commit else ""))
        for round_ in range(args.repeat):
            for name in variants:
                load = os.getloadavg()[0]
                result, lines = run_variant(name, url, dataset, tmp / "out", args, before_dir)
                result["load"] = load
                results[name].append(result)
                if lines:
                    records.setdefault(name, lines)
                label = f"{name} ({args.minimal_mode})" if name == "minimal" else name
                print(f"  round {round_ + 1} {label:<24} wall {result['wall_s']:6.1f} s  ratio {result['wall_s'] / ideal:5.2f}  "
                      f"CPU {result['cpu_s']:6.1f} s  {1000 * result['cpu_s'] / calls:5.1f} ms/call  "
                      f"{_own(result, calls)}  load {load:4.1f}", flush=True)

    print(f"\nmedians over {args.repeat} round(s); ideal {ideal:.1f} s, {calls} calls")
    print(f"  {'variant':<14} {'wall/ideal':>10} {'CPU s':>8} {'ms/call':>8} {'own ms/call':>12}")
    for name, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        cpu = statistics.median(r["cpu_s"] for r in runs)
        own = [r["own_cpu_s"] for r in runs if r["own_cpu_s"] is not None]
        own_text = f"{1000 * statistics.median(own) / calls:12.1f}" if own else f"{'-':>12}"
        print(f"  {name:<14} {wall / ideal:10.2f} {cpu:8.1f} {1000 * cpu / calls:8.1f} {own_text}")
    if "before" in results and "after" in results:
        b = statistics.median(r["cpu_s"] for r in results["before"])
        a = statistics.median(r["cpu_s"] for r in results["after"])
        print(f"  after / before CPU: {a / b:.2f}")
    if len(records) > 1:
        first, *others = records
        for name in others:
            same = records[name] == records[first]
            detail = "" if same else f" ({sum(x != y for x, y in zip(records[name], records[first]))} lines differ)"
            print(f"records of {name} vs {first} (timestamps, durations, latencies, call ids masked): "
                  f"{'identical' if same else 'DIFFERENT'}{detail}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
