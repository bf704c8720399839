"""The ``allocation`` section of statistics.json: how --allocation adaptive shaped the data.

Adaptive allocation stops a row at ``--target_passes`` passes or after ``--max_failures`` failures in a
row, so the samples are not a fixed K per row: easy rows are capped, hopeless rows given up on.  Two
consequences a user of the data should see: the share of passing samples is no estimate of the rows'
pass rates (capped rows stop on a pass, so their passing share is biased up), and rows are represented
unequally.  The section counts both, from each row's (samples, passed) as the records hold them.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional


def allocation_section(shapes: Counter, samples_per_prompt: int, target_passes: int,
                       max_failures: Optional[int]) -> dict:
    """From how many rows had each ``(samples, passed)`` (``Rewards.shapes``), under the adaptive rule."""
    rows = sum(shapes.values())
    samples = sum(n * count for (n, _c), count in shapes.items())
    passed = sum(c * count for (_n, c), count in shapes.items())
    capped = sum(count for (_n, c), count in shapes.items() if c >= target_passes)
    spent = sum(count for (n, c), count in shapes.items() if c < target_passes and n >= samples_per_prompt)
    gave_up = rows - capped - spent
    per_row = Counter()
    for (n, _c), count in shapes.items():
        per_row[n] += count
    rate_sum = sum(c / n * count for (n, c), count in shapes.items() if n)
    return {
        "allocation": "adaptive",
        "samples_per_prompt": samples_per_prompt,
        "target_passes": target_passes,
        "max_failures": max_failures,
        "rows": rows,
        "samples": samples,
        "rows_capped": capped,  # reached --target_passes: no more samples, however many were left
        # fewer than --target_passes passes and samples left: --max_failures failures in a row ended them (or
        # the budget, or an interruption, while the run is not finished)
        "rows_stopped_early": gave_up,
        "rows_all_samples": spent,  # ran every sample without reaching --target_passes
        "rows_never_passed": sum(count for (_n, c), count in shapes.items() if c == 0),
        "samples_saved": samples_per_prompt * rows - samples,  # against a fixed K on the same rows
        "samples_per_row": {str(n): per_row[n] for n in sorted(per_row)},
        "samples_per_row_mean": round(samples / rows, 6) if rows else None,
        # the pooled share of passing samples against the mean of the rows' own shares: they differ because
        # rows got unequal samples; neither is the pass rate a fixed K would have measured
        "share_samples_passed": round(passed / samples, 6) if samples else None,
        "row_pass_share_mean": round(rate_sum / rows, 6) if rows else None,
    }
