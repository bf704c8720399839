"""The provider guard: what excluding a bad provider saves, against the same run without the guard.

Three scripted providers serve the model (hermes_batch.testing.ScriptedProvider): ``good`` spoils 2% of its
tool calls, ``slight`` 5%, ``bad`` 50%, equally likely to be routed to.  The same prompts run with the guard
(--routing openrouter, so the scripted server gets and honours provider.ignore) and without it (--routing none:
the guard counts but cannot exclude); the figures are the server's calls per provider, the answers the run
counted as spoilt (invalid tool calls), and when the guard excluded ``bad``.

    python bench/bench_provider_guard.py [--prompts 300] [--workers 16] [--seeds 1,2,3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import write_prompts

from hermes_batch.testing import ScriptedModelServer, ScriptedProvider, ToolLoopScript

PROVIDERS = (
    ScriptedProvider("good", invalid_tool_calls=0.02),
    ScriptedProvider("slight", invalid_tool_calls=0.05),
    ScriptedProvider("bad", invalid_tool_calls=0.5),
)
RATES = {p.name: p.invalid_tool_calls for p in PROVIDERS}  # of the answers with tool calls: 2 of a prompt's 3


def one_run(tmp: Path, prompts: int, workers: int, seed: int, guard: bool) -> dict:
    name = f"{'guard' if guard else 'noguard'}-{seed}"
    dataset = write_prompts(tmp / "prompts.jsonl", prompts)
    with ScriptedModelServer(ToolLoopScript(tool_calls=2), providers=PROVIDERS, seed=seed, record=False) as server:
        subprocess.run([
            sys.executable, "-m", "hermes_batch", "run", "--dataset_file", str(dataset), "--batch_size", "100",
            "--run_name", name, "--output_dir", str(tmp), "--base_url", server.base_url, "--model", "bench-model",
            "--api_key", "bench", "--num_workers", str(workers), "--distribution", "terminal_only", "--no-progress",
            "--seed", "1", "--no_filters", "--routing", "openrouter" if guard else "none",
        ], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        served = server.provider_calls
    stats = json.loads((tmp / name / "statistics.json").read_text())
    excluded = (stats.get("provider_guard") or {}).get("excluded", [])
    figures = stats["provider_guard"]["by_provider"]
    return {"served": dict(served), "excluded": excluded, "spoilt": sum(f["failed"] for f in figures.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--seeds", default="1")
    args = parser.parse_args()
    print(f"prompts {args.prompts} (3 model calls each), workers {args.workers}, providers "
          + ", ".join(f"{p.name} {p.invalid_tool_calls:.0%} invalid tool calls" for p in PROVIDERS))
    for seed in (int(s) for s in args.seeds.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            on = one_run(Path(tmp), args.prompts, args.workers, seed, guard=True)
            off = one_run(Path(tmp), args.prompts, args.workers, seed, guard=False)
        for label, result in (("no guard", off), ("guard", on)):
            served = result["served"]
            print(f"seed {seed} {label:9s} calls {sum(served.values()):5d}  served "
                  + ", ".join(f"{p} {served.get(p, 0)}" for p in RATES)
                  + f"  spoilt answers {result['spoilt']}")
        for e in on["excluded"]:
            print(f"seed {seed} excluded {e['provider']} after {e['answered']} answers "
                  f"({e['failure_rate']:.0%} failed vs {e['rest_failure_rate']:.0%}, p={e['p_value']:.2g})")
        saved = off["served"].get("bad", 0) - on["served"].get("bad", 0)
        print(f"seed {seed} calls kept from bad: {saved}; spoilt answers avoided: {off['spoilt'] - on['spoilt']}")


if __name__ == "__main__":
    main()
