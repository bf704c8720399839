"""The replay journal (responses.jsonl): what a kill costs on resume, and what the journal costs per call.

1. Requests paid again on --resume: 200 prompts of 10 turns (nine tool calls,
   each a real command in a local sandbox) at 64 sessions, killed (SIGKILL) at a
   random moment (once a random share, 20% to 80%, of its answers came); the run folder is copied, and one copy resumes with its
   responses.jsonl (this version), the other without it (what versions before
   the journal did: a cut-off prompt starts again from its first turn).
2. The journal alone, in this process: its size with N sessions in flight, the
   time a lookup takes, and the CPU per call of hashing the request, encoding the
   answer and writing it (plus the end of each session and the compactions).

    python bench/bench_replay_journal.py [--prompts 200] [--workers 64] [--latency 0.2] [--seed 1]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import model_server, write_prompts

TURNS = 10


def run_args(dataset, out, url, workers, *extra):
    return [sys.executable, "-m", "hermes_batch", "run", "--dataset_file", str(dataset), "--batch_size", "50",
            "--run_name", "bench", "--output_dir", str(out), "--base_url", url, "--model", "bench-model",
            "--api_key", "bench", "--num_workers", str(workers), "--distribution", "terminal_only",
            "--no-progress", "--seed", "1", "--max_turns", str(TURNS), *extra]


def answered(folder: Path) -> int:
    from hermes_batch.folder.journal import JournalTotals, scan_journal

    totals = JournalTotals()
    scan_journal(folder / "calls.jsonl", totals)  # raw: the requests a kill cut off are not counted as errors
    return totals.done - totals.errors


def resume_cost(args) -> None:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp, model_server(args.latency, tool_calls=TURNS - 1) as url:
        tmp = Path(tmp)
        dataset = write_prompts(tmp / "prompts.jsonl", args.prompts)
        # a random moment of the run, as a share of its answers (its start-up takes a machine-dependent time)
        kill_at = rng.uniform(0.2, 0.8)
        proc = subprocess.Popen(run_args(dataset, tmp / "a", url, args.workers), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        calls = tmp / "a" / "bench" / "calls.jsonl"
        while proc.poll() is None:
            done = calls.read_bytes().count(b'"event":"done"') if calls.exists() else 0
            if done >= kill_at * args.prompts * TURNS:
                break
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.copytree(tmp / "a", tmp / "b", symlinks=True)
        journal = tmp / "b" / "bench" / "responses.jsonl"
        size = journal.stat().st_size if journal.exists() else 0
        if journal.exists():
            journal.unlink()  # b resumes as a version without the journal would
        paid_before_kill = answered(tmp / "a" / "bench")
        for name in ("a", "b"):
            subprocess.run(run_args(dataset, tmp / name, url, args.workers, "--resume"), check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        need = args.prompts * TURNS
        after, before = answered(tmp / "a" / "bench") - need, answered(tmp / "b" / "bench") - need
    print(f"{args.prompts} prompts x {TURNS} turns, {args.workers} sessions, latency {args.latency}s, "
          f"killed at {kill_at:.0%} of its answers (seed {args.seed}): {paid_before_kill} answers paid before the kill, "
          f"responses.jsonl {size / 1024:.0f} kB")
    print(f"requests paid again on --resume: without the journal {before}, with it {after}")


def journal_cost(args) -> None:
    from hermes_batch.folder.replay_journal import ResponseJournal
    from hermes_batch.contract.interfaces import ModelSettings
    from hermes_batch.formats.records import Message, ModelResponse, ToolCall, ToolSpec, Usage
    from hermes_batch.session.replay import Replayer

    class Client:
        name = "openai"
        settings = ModelSettings("bench-model", "http://127.0.0.1/v1")

    tools = (ToolSpec("terminal", "Run a command. " * 40, {"type": "object", "properties": {"command": {"type": "string"}}}),)
    system = Message("system", "You are a helpful agent. " * 100)
    sessions, per = args.sessions, TURNS

    class NoReplay:  # the same loop without the journal, to subtract what building the messages costs
        def lookup(self, messages, tools):
            return None

        def record(self, response):
            pass

    def loop(session, end) -> tuple:
        live, peak, calls = [], 0, 0
        started = time.process_time()
        for n in range(args.calls // per):
            replay = session(f"key{n:08d}")
            messages = [system, Message("user", f"Benchmark task number {n}: run a command.")]
            for turn in range(per):
                assert replay.lookup(tuple(messages), tools) is None
                call = ToolCall(f"call_{turn}", "terminal", {"command": f"echo {turn}"}, f'{{"command": "echo {turn}"}}')
                reply = Message("assistant", "Let me look at this. " * 20, reasoning="Thinking. " * 30,
                                tool_calls=(call,))
                replay.record(ModelResponse(reply, "tool_calls", Usage(1500, 300, 100, 0, 0.002), "p", "bench-model"))
                messages += [reply, Message("tool", '{"output": "' + "x" * 200 + '", "exit_code": 0}',
                                            tool_call_id=call.id, name="terminal")]
                calls += 1
            live.append(f"key{n:08d}")
            if len(live) > sessions:
                end(live.pop(0))
            peak = max(peak, journal.size)
        return time.process_time() - started, calls, peak, live

    with tempfile.TemporaryDirectory() as tmp:
        journal = ResponseJournal(Path(tmp) / "responses.jsonl")
        replayer = Replayer(journal, Client())
        bare, _, _, _ = loop(lambda key: NoReplay(), lambda key: None)
        cpu, calls, peak, live = loop(replayer.session, journal.end)
        cpu -= bare
        journal.close()
        reread = ResponseJournal(Path(tmp) / "responses.jsonl")
        recorded = reread.recorded(live[-1])
        replay = replayer.session(live[-1], dict(recorded))
        messages = [system, Message("user", f"Benchmark task number {int(live[-1][3:])}: run a command.")]
        started = time.perf_counter()
        hit = replay.lookup(tuple(messages), tools)
        lookup = time.perf_counter() - started
        assert hit is not None
        reread.close()
    print(f"journal alone: {calls} calls, {sessions} sessions in flight: {1e6 * cpu / calls:.0f} us CPU per call "
          f"(hash, encode, write, end, compaction); file at most {peak / 1024 / 1024:.1f} MB "
          f"({peak / (sessions * per) / 1024:.1f} kB per answer in flight); a first lookup {1e6 * lookup:.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sessions", type=int, default=256, help="sessions in flight for the journal alone")
    parser.add_argument("--calls", type=int, default=50000, help="calls for the journal alone")
    parser.add_argument("--skip_resume", action="store_true")
    args = parser.parse_args()
    journal_cost(args)
    if not args.skip_resume:
        resume_cost(args)


if __name__ == "__main__":
    main()
