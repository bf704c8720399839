"""forecast.json: what the whole run will cost and yield, estimated from a --pilot's records.

The unit is a row (all its samples), so --samples_per_prompt and --allocation adaptive are covered as
they ran.  A stratum's total is its rows times the mean of its pilot rows; the run's, the sum over the
strata.  The 90% intervals:

- cost, tokens per sample, kept and verified trajectories per dollar, wall time: a stratified bootstrap
  (pilot rows drawn with replacement within each stratum, ``BOOTSTRAP`` times, seeded), the 5th and 95th
  percentiles of the figure over the replicates;
- rates (pass rate, keep rate, keep rate per filter): Wilson score intervals on the pilot's samples
  (the pilot is proportionally allocated, so its pooled samples weigh the strata as the dataset does).

Wall time at ``--num_workers``: the run's session-seconds (each sample's ``duration_s``) divided by the
sessions the pilot had at once (its session-seconds over the span from its first sample's start to its
last sample's end, at most --num_workers: what held sessions up, the machine, sandboxes, verifiers, is
in it), plus the pilot's time outside that span (start-up, merge), assumed the same for the whole run.
Model rate limits the pilot did not meet are not foreseen.

``--max_cost auto`` is the upper end of the cost interval (``max_cost_auto``): the whole run's cost,
the pilot's included, as --max_cost counts across resumes.
"""

from __future__ import annotations

import collections
import datetime
import json
import math
import random
from typing import Optional

from ..errors import UsageError
from ..folder.readback import read_small
from ..folder.runfolder import RunFolder, read_records
from ..folder.statistics import iter_finished
from ..formats.jsonguard import finite_dumps
from ..formats.records import Discarded, Failure
from .pilot import Pilot

FORECAST_NAME = "forecast.json"
SCHEMA_VERSION = 1
BOOTSTRAP = 1000
Z90 = 1.6448536269514722  # the normal quantile of 95%: a two-sided 90% interval
MAX_FORECAST_BYTES = 1 << 20

_SUMS = ("samples", "finished", "kept", "verified", "passed", "scored", "cost", "tokens", "session_s")


def _span(spans: list, timestamp: str, duration: float) -> None:
    """Widen ``spans`` ([first start, last end], epoch seconds) by a sample that ended at ``timestamp``."""
    try:
        end = datetime.datetime.fromisoformat(timestamp).timestamp()
    except (TypeError, ValueError):
        return
    start = end - max(0.0, duration)
    spans[:] = [min(spans[0], start), max(spans[1], end)] if spans else [start, end]


def _row_sums(folder: RunFolder, pilot: Pilot, filters: tuple, spans: list) -> dict:
    """Per pilot row: its samples' sums (cost, tokens, kept, passed, ... and ``discarded:FILTER``); ``spans``
    gets the first start and last end of the pilot's samples."""
    rows = {index: collections.Counter() for index in pilot.rows}
    for record in iter_finished(folder):
        discarded = isinstance(record, Discarded)
        traj = record.trajectory if discarded else record
        sums = rows.get(traj.prompt_index)
        if sums is None:
            continue
        meta = traj.metadata
        sums["samples"] += 1
        sums["finished"] += 1
        sums["kept"] += not discarded
        sums["scored"] += bool(meta.verifiers)
        sums["passed"] += bool(meta.passed)
        sums["verified"] += bool(meta.passed) and not discarded
        sums["cost"] += meta.usage.cost or 0.0
        sums["tokens"] += meta.usage.prompt_tokens + meta.usage.completion_tokens
        sums["session_s"] += meta.duration_s
        _span(spans, meta.timestamp, meta.duration_s)
        for name in record.filters if discarded else ():
            sums[f"discarded:{name}"] += 1
    for _line, failure in read_records(folder.failed, Failure):
        sums = rows.get(failure.prompt_index)
        if sums is not None:
            sums["samples"] += 1
            sums["cost"] += failure.usage.cost or 0.0
            sums["tokens"] += failure.usage.prompt_tokens + failure.usage.completion_tokens
    return rows


def _totals(pilot: Pilot, by_stratum: dict, keys: tuple) -> dict:
    """The whole run's sums: each stratum's rows times its pilot rows' mean."""
    out = dict.fromkeys(keys, 0.0)
    for name, size in pilot.strata.items():
        rows = by_stratum.get(name) or by_stratum[None]  # a stratum whose pilot row left nothing: the pooled mean
        for key in keys:
            out[key] += size * sum(r[key] for r in rows) / len(rows)
    return out


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def _figures(totals: dict, concurrency: int, overhead: float) -> dict:
    return {
        "cost": totals["cost"],
        "wall_s": totals["session_s"] / concurrency + overhead,
        "tokens_per_sample": _ratio(totals["tokens"], totals["samples"]),
        "kept_per_dollar": _ratio(totals["kept"], totals["cost"]),
        "verified_per_dollar": _ratio(totals["verified"], totals["cost"]),
        "samples": totals["samples"],
        "kept": totals["kept"],
        "verified": totals["verified"],
    }


def wilson(successes: float, n: float) -> Optional[dict]:
    """The rate and its 90% Wilson score interval; None without trials."""
    if not n:
        return None
    p = successes / n
    z2 = Z90 * Z90
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z90 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return {"estimate": _round(p), "low": _round(max(0.0, centre - half)), "high": _round(min(1.0, centre + half))}


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 6)


def forecast(folder: RunFolder, pilot: Pilot, filters: tuple, concurrency: int, pilot_wall_s: float,
             seed: int) -> dict:
    """forecast.json's content, from the pilot's records in ``folder``; runs off the event loop."""
    spans: list = []
    rows = _row_sums(folder, pilot, filters, spans)
    keys = _SUMS + tuple(f"discarded:{name}" for name in filters)
    ran = {index: sums for index, sums in rows.items() if sums["samples"]}
    if not ran:
        raise UsageError("The pilot finished no sample, so there is nothing to forecast from; look at failed.jsonl, "
                         "then run the pilot again with --overwrite.")
    by_stratum: dict = collections.defaultdict(list)
    for index, sums in ran.items():
        by_stratum[pilot.of_row[index]].append(sums)
    by_stratum[None] = list(ran.values())
    pooled = {key: sum(r[key] for r in ran.values()) for key in keys}
    # the sessions at once the pilot achieved, from its samples' span: below --num_workers when the machine, the
    # sandboxes or the verifiers held the sessions up, or its last sessions ran alone
    active = spans[1] - spans[0] if spans else 0.0
    at_once = min(float(concurrency), pooled["session_s"] / active) if active > 0 else float(concurrency)
    at_once = max(at_once, 1e-9)
    overhead = max(0.0, pilot_wall_s - active) if active > 0 else \
        max(0.0, pilot_wall_s - pooled["session_s"] / concurrency)
    point = _figures(_totals(pilot, by_stratum, keys), at_once, overhead)
    # the bootstrap: each stratum's pilot rows drawn again with replacement
    rng = random.Random(seed)
    replicates = max(200, min(BOOTSTRAP, 2_000_000 // (len(ran) * len(keys))))
    spread = collections.defaultdict(list)
    strata = [name for name in by_stratum if name is not None]
    for _ in range(replicates):
        again = {name: rng.choices(by_stratum[name], k=len(by_stratum[name])) for name in strata}
        again[None] = by_stratum[None]
        for key, value in _figures(_totals(pilot, again, keys), at_once, overhead).items():
            if value is not None:
                spread[key].append(value)

    def interval(key: str) -> Optional[dict]:
        values = sorted(spread[key])
        if point[key] is None or not values:
            return None
        return {"estimate": _round(point[key]), "low": _round(values[int(0.05 * (len(values) - 1))]),
                "high": _round(values[math.ceil(0.95 * (len(values) - 1))])}

    figures = {key: interval(key) for key in point}
    finished = pooled["finished"]
    figures["pass_rate"] = wilson(pooled["passed"], pooled["scored"])
    figures["keep_rate"] = wilson(pooled["kept"], finished)
    figures["keep_rate_by_filter"] = {name: wilson(finished - pooled[f"discarded:{name}"], finished)
                                      for name in filters}
    pilot_cost = pooled["cost"]
    return {
        "schema_version": SCHEMA_VERSION,
        "pilot": {
            "fraction": pilot.fraction, "by": pilot.by, "rows": len(pilot.rows), "rows_with_samples": len(ran),
            "rows_of_dataset": sum(pilot.strata.values()), "strata": len(pilot.strata),
            "samples": int(pooled["samples"]), "cost": _round(pilot_cost), "wall_s": round(pilot_wall_s, 3),
        },
        "concurrency": concurrency,
        "sessions_at_once": round(at_once, 3),
        "interval": "90%",
        "method": {
            "totals": "per stratum, its rows times the mean of its pilot rows (a row: all its samples), summed",
            "cost, wall_s, tokens_per_sample, kept_per_dollar, verified_per_dollar, samples, kept, verified":
                f"stratified bootstrap over the pilot's rows, {replicates} replicates, 5th and 95th percentiles",
            "pass_rate, keep_rate, keep_rate_by_filter": "Wilson score interval on the pilot's samples",
            "wall_s": "the run's session-seconds (samples' duration_s) / the sessions at once the pilot achieved "
                      f"({at_once:.2f}: its session-seconds / the span from its first sample's start to its last's "
                      f"end, at most the concurrency), plus the pilot's time outside that span ({overhead:.3f} s: "
                      "start-up, merge)",
            "max_cost_auto": "the upper end of the cost interval",
        },
        "figures": figures,
        "remaining": {
            "cost": _round(point["cost"] - pilot_cost),
            "wall_s": _round(max(overhead, point["wall_s"] - pooled["session_s"] / at_once)),
        },
        "max_cost_auto": figures["cost"]["high"] if figures["cost"] else None,
    }


def write(folder: RunFolder, content: dict) -> None:
    from ..folder.durable import atomic_write_text

    atomic_write_text(folder.dir / FORECAST_NAME, finite_dumps(content, indent=2) + "\n")


def auto_budget(folder: RunFolder) -> float:
    """--max_cost auto: forecast.json's ``max_cost_auto``; UsageError when there is no usable forecast."""
    advice = "run a pilot first (--pilot FRACTION), or give --max_cost a number"
    try:
        data = read_small(folder.dir / FORECAST_NAME, MAX_FORECAST_BYTES, advice=advice)
        content = json.loads(data) if data is not None else None
    except ValueError:
        content = None
    value = content.get("max_cost_auto") if isinstance(content, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise UsageError(f"--max_cost auto takes its budget from the run folder's {FORECAST_NAME}, and there is no "
                         f"usable one; {advice}.")
    return float(value)


def render(content: dict, console) -> None:
    """The forecast as the pilot prints it."""
    from rich.table import Table

    pilot = content["pilot"]
    table = Table(title=f"Forecast of the whole run from a pilot of {pilot['rows']} of {pilot['rows_of_dataset']} "
                        f"rows ({pilot['strata']} strata), 90% intervals", show_header=True)
    for header in ("Figure", "Estimate", "Low", "High"):
        table.add_column(header, justify="left" if header == "Figure" else "right")
    figures = content["figures"]

    def add(name: str, value: Optional[dict]) -> None:
        if value is not None:
            table.add_row(name, *(f"{value[k]:,.6g}" for k in ("estimate", "low", "high")))

    for key in ("cost", "wall_s", "samples", "tokens_per_sample", "pass_rate", "keep_rate", "kept",
                "verified", "kept_per_dollar", "verified_per_dollar"):
        add(key, figures.get(key))
    for name, value in figures["keep_rate_by_filter"].items():
        add(f"keep_rate {name}", value)
    console.print(table)
