"""Branches from a shared prefix vs independent samples: model calls, tokens and verified DPO pairs.

The same rows run twice against the scripted model server: as ``--samples_per_prompt K`` (K independent
sessions a row) and as ``--branch_at T --branches K`` (the first T turns once a row, K branches from there).
Every session makes T tool calls (the prefix: the same whatever the sample), then a decisive tool call whose
result decides the answer, then the answer, which ``--verifier answer`` scores: a session passes with
probability ``--pass-rate``, drawn from its branch's seed (branches) or its session number (samples).  Both
runs are exported as DPO pairs (``pairs_per_row=0``; ``shared_prefix=true`` for the branches, whose pairs are
checked to share their prompt up to turn T).

    python bench/bench_branches.py [--rows 100] [--branches 4] [--turn 3] [--pass-rate 0.4] [--latency 0.05]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import measure_run

from hermes_batch.contract.interfaces import PREFLIGHT_PROMPT
from hermes_batch.testing import Reply, ScriptedModelServer


def make_script(turn: int, pass_rate: float):
    def passes(request) -> bool:
        who = request.body.get("seed", f"sample {request.sample}")
        draw = int(hashlib.sha256(f"{request.prompt}\0{who}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        return draw < pass_rate

    def script(request):
        if request.turn < turn:  # the prefix: the same in every session of the row
            return Reply(content=f"Step {request.turn}.", reasoning="Setting up.",
                         tool_calls=[("terminal", {"command": f"echo step {request.turn} >> log.txt"})])
        if request.turn == turn:  # the decisive step
            verdict = "right" if passes(request) else "wrong"
            return Reply(content="Deciding.", reasoning="Now the answer.",
                         tool_calls=[("terminal", {"command": f"echo {verdict} > answer.txt; cat answer.txt"})])
        right = "right" in (request.tool_results[-1] if request.tool_results else "")
        return Reply(content="The answer is 4" if right else "The answer is 5", reasoning="Done.")

    return script


def run(tmp: Path, name: str, url: str, dataset: Path, workers: int, extra: list) -> dict:
    result = measure_run([
        "run", "--dataset_file", str(dataset), "--batch_size", "100", "--run_name", name, "--output_dir", str(tmp),
        "--base_url", url, "--model", "bench-model", "--api_key", "bench", "--num_workers", str(workers),
        "--distribution", "terminal_only", "--no-progress", "--seed", "1", "--verifier", "answer",
        "--max_turns", "10", *extra,
    ])
    return result


def export_pairs(folder: Path, spec: str) -> list:
    out = folder.parent / f"{folder.name}.pairs.jsonl"
    subprocess.run([sys.executable, "-m", "hermes_batch", "export", str(folder), "--format", spec, "--output",
                    str(out)], check=True, capture_output=True)
    return [json.loads(line) for line in out.read_text().splitlines()]


def records(folder: Path) -> list:
    found = [json.loads(line) for line in (folder / "trajectories.jsonl").read_text().splitlines()]
    discarded = folder / "discarded.jsonl"
    if discarded.exists():
        found += [json.loads(line)["trajectory"] for line in discarded.read_text().splitlines()]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--turn", type=int, default=3, help="--branch_at: the prefix's model calls")
    parser.add_argument("--pass-rate", type=float, default=0.4)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=32)
    args = parser.parse_args()
    k = args.branches

    figures = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        dataset = tmp / "rows.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": f"Bench task {i}: what is 2 + 2?", "answer": 4}) + "\n"
                                   for i in range(args.rows)))
        modes = {
            "independent": ["--samples_per_prompt", str(k)],
            "branches": ["--branch_at", str(args.turn), "--branches", str(k)],
        }
        for mode, extra in modes.items():
            with ScriptedModelServer(make_script(args.turn, args.pass_rate), latency=args.latency) as server:
                measured = run(tmp, mode, server.base_url, dataset, args.workers, extra)
                calls = server.request_count - server.calls_for(PREFLIGHT_PROMPT)
            folder = tmp / mode
            stats = json.loads((folder / "statistics.json").read_text())
            saved = records(folder)
            spec = "dpo:pairs_per_row=0" + (",shared_prefix=true" if mode == "branches" else "")
            pairs = export_pairs(folder, spec)
            if mode == "branches":
                # each pair's prompt holds the shared prefix: T assistant turns after the user message
                assert all(sum(m["role"] == "assistant" for m in p["prompt"]) == args.turn for p in pairs)
                assert all(p["chosen"] != p["rejected"] for p in pairs)
            by_row: dict = {}
            for record in saved:
                by_row.setdefault(record["prompt_index"], []).append(record["metadata"]["passed"])
            figures[mode] = {
                "samples": len(saved),
                "model_calls": calls,
                "prompt_tokens": stats["tokens"]["prompt"],
                "passed": sum(r["metadata"]["passed"] for r in saved),
                "pairable_rows": sum(any(v) and not all(v) for v in by_row.values()),
                "pairs": len(pairs),
                "wall_s": measured["wall_s"],
                "cpu_s": measured["cpu_s"],
            }

    print(f"rows {args.rows}, K {k}, branch at turn {args.turn}, pass rate {args.pass_rate}, "
          f"latency {args.latency}s, workers {args.workers}")
    print(f"{'':22}{'independent':>14}{'branches':>14}")
    for name in ("samples", "model_calls", "prompt_tokens", "passed", "pairable_rows", "pairs", "wall_s", "cpu_s"):
        a, b = figures["independent"][name], figures["branches"][name]
        fmt = "{:>14.1f}" if isinstance(a, float) else "{:>14,}"
        print(f"{name:22}" + fmt.format(a) + fmt.format(b))
    for mode in ("independent", "branches"):
        f = figures[mode]
        print(f"{mode:12} pairs per 100 model calls {100 * f['pairs'] / f['model_calls']:.2f}, "
              f"model calls per sample {f['model_calls'] / f['samples']:.2f}")
    expected = args.rows * (args.turn + k * 2)
    print(f"branches: expected model calls rows x (T + K x 2) = {expected:,}; "
          f"independent: rows x K x (T + 2) = {args.rows * k * (args.turn + 2):,}")


if __name__ == "__main__":
    main()
