"""The pilot's forecast against the whole run's actual figures, for 3 seeds: does the 90% interval hold them?

For each seed: a dataset of rows with their own pass rates (pilot_rig.py), a --pilot of 10% stratified by
``kind``; then ``--resume`` runs the rest, and the folder's statistics give the actual cost, samples, kept and
verified trajectories, pass and keep rates, tokens per sample; a fresh run of the whole dataset at the same
--num_workers gives the actual wall time.

    python bench/bench_pilot.py [--rows 400] [--workers 16] [--fraction 0.1] [--delay 0.2] [--seeds 1 2 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from pilot_rig import run, server, statistics, verified_kept, write_rows


def actual_figures(out: Path, name: str, wall: float) -> dict:
    stats = statistics(out, name)
    finished, kept, cost = stats["prompts"]["finished"], stats["prompts"]["kept"], stats["cost"]
    verified = verified_kept(out, name)
    rewards = stats["rewards"]
    tokens = stats["tokens"]["prompt"] + stats["tokens"]["completion"]
    samples = finished + stats["prompts"]["failed"]
    return {
        "cost": cost, "wall_s": wall, "samples": samples, "kept": kept, "verified": verified,
        "tokens_per_sample": tokens / samples, "pass_rate": rewards["samples_passed"] / rewards["samples_scored"],
        "keep_rate": kept / finished, "kept_per_dollar": kept / cost, "verified_per_dollar": verified / cost,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds per model call (times 0.5 to 1.5)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    held, total = 0, 0
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            dataset = write_rows(out / "rows.jsonl", args.rows, seed)
            model = server(seed, args.delay)
            try:
                common = ("--num_workers", str(args.workers), "--seed", str(seed))
                run(model.base_url, dataset, out, "piloted", *common, "--pilot", str(args.fraction),
                    "--pilot_by", "kind")
                forecast = json.loads((out / "piloted" / "forecast.json").read_text())
                run(model.base_url, dataset, out, "piloted", "--resume")
                wall = run(model.base_url, dataset, out, "whole", *common)
                actual = actual_figures(out, "piloted", 0.0)
                actual["wall_s"] = statistics(out, "whole")["duration_seconds"]
                actual["wall_s_process"] = wall
            finally:
                model.stop()
        print(f"seed {seed}: pilot {forecast['pilot']['rows']} of {forecast['pilot']['rows_of_dataset']} rows, "
              f"{forecast['pilot']['strata']} strata, pilot cost ${forecast['pilot']['cost']:.4f}, "
              f"--max_cost auto ${forecast['max_cost_auto']:.4f}")
        print(f"  {'figure':<22}{'estimate':>12}{'low':>12}{'high':>12}{'actual':>12}  held")
        for name, value in forecast["figures"].items():
            if name == "keep_rate_by_filter" or value is None or name not in actual:
                continue
            inside = value["low"] <= actual[name] <= value["high"]
            held, total = held + inside, total + 1
            print(f"  {name:<22}{value['estimate']:>12.5g}{value['low']:>12.5g}{value['high']:>12.5g}"
                  f"{actual[name]:>12.5g}  {'yes' if inside else 'NO'}")
        print(f"  (wall_s actual: the whole run's session time; its process took {actual['wall_s_process']:.2f} s "
              "with start-up and exit)")
    print(f"intervals holding the actual figure: {held} of {total}")


if __name__ == "__main__":
    main()
