"""Adaptive against fixed samples on the same rows: verified trajectories per dollar.

Each seed: a dataset of rows with their own pass rates (pilot_rig.py), run with --samples_per_prompt K fixed,
and with --allocation adaptive --target_passes P --max_failures M; the same scripted answers for the same
samples.  Cost is what the run computed from the calls' reported usage (statistics.json ``cost``); a verified
trajectory is a kept one the answer verifier passed.

    python bench/bench_adaptive.py [--rows 300] [-K 8] [-P 2] [-M 3] [--workers 32] [--seeds 1 2 3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from pilot_rig import run, server, statistics, verified_kept, write_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("-K", type=int, default=8)
    parser.add_argument("-P", type=int, default=2)
    parser.add_argument("-M", type=int, default=3)
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    print(f"{'seed':<6}{'allocation':<11}{'samples':>8}{'cost $':>9}{'verified':>9}{'verified/$':>11}"
          f"{'rows passed':>12}{'rows passed/$':>14}{'wall s':>8}")
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            dataset = write_rows(out / "rows.jsonl", args.rows, seed)
            for allocation, extra in (("fixed", ()), ("adaptive", ("--allocation", "adaptive", "--target_passes",
                                                                  str(args.P), "--max_failures", str(args.M)))):
                model = server(seed, args.delay)
                try:
                    wall = run(model.base_url, dataset, out, allocation, "--samples_per_prompt", str(args.K),
                               "--num_workers", str(args.workers), "--seed", str(seed), *extra)
                finally:
                    model.stop()
                stats = statistics(out, allocation)
                cost, verified = stats["cost"], verified_kept(out, allocation)
                rows_passed = stats["rewards"]["rows_passed"]
                print(f"{seed:<6}{allocation:<11}{stats['prompts']['finished']:>8}{cost:>9.4f}{verified:>9}"
                      f"{verified / cost:>11.1f}{rows_passed:>12}{rows_passed / cost:>14.1f}{wall:>8.1f}")
                if allocation == "adaptive":
                    a = stats["allocation"]
                    print(f"      adaptive: rows capped {a['rows_capped']}, stopped early {a['rows_stopped_early']}, "
                          f"all samples {a['rows_all_samples']}, never passed {a['rows_never_passed']}, samples per "
                          f"row {a['samples_per_row']}, pass share {a['share_samples_passed']} "
                          f"(row mean {a['row_pass_share_mean']})")


if __name__ == "__main__":
    main()
