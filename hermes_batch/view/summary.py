"""What a run looks like in numbers: counts and chart data, from the index plus statistics.json and run.json."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Optional

from ..folder.aggregate import Aggregate
from ..folder.record_index import RecordIndex
from ..folder.statistics import audit_section, rewards_section
from ..errors import UsageError
from ..folder.runfolder import RunFolder
from .index import DISCARDED, FAILED, KEPT, VERDICTS, RunIndex


def _read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def expected_shares(probabilities: dict) -> dict:
    """Share of prompts each toolset should be sampled for: its coin, plus the fallback for the most likely one.

    The sampler flips one coin per toolset and, when none came up, includes the
    most likely toolset; so that one is included with p + prod(1 - p_i).
    """
    if not probabilities:
        return {}
    none_came_up = 1.0
    for p in probabilities.values():
        none_came_up *= 1.0 - float(p)
    top = max(probabilities, key=lambda name: float(probabilities[name]))
    return {name: float(p) + (none_came_up if name == top else 0.0) for name, p in probabilities.items()}


def record_index(run_dir: Path) -> Optional[RecordIndex]:
    """The run folder's own index (index/), read only: the run keeps it; what was appended since it last
    saved it is read from the records, and held in memory, so the next call reads only what is new."""
    try:
        return RecordIndex(RunFolder(run_dir.parent, run_dir.name), read_only=True)
    except UsageError:  # a folder renamed to a name no run could have: its records are still listed
        return None


def run_totals(run_dir: Path) -> Aggregate:
    """The run's totals as statistics.json counts them."""
    held = record_index(run_dir)
    return held.totals()[0] if held is not None else Aggregate()


def _sums(agg: Aggregate) -> dict:
    """The run-wide sums the summary shows, from the one aggregator behind statistics.json."""
    requests = agg.requests
    latency: Counter = Counter()
    for histogram in requests.latency_ms.values():
        latency.update(histogram)
    return {
        "tools": {name: list(totals) for name, totals in agg.finished.tools.items()},
        "reasoning": {name: [scope.turns_with, scope.turns_without, scope.samples_without_reasoning]
                      for name, scope in (("finished", agg.finished), ("kept", agg.kept))},
        "latency_ms": latency,
        "providers": {p: [requests.requests[p], requests.errors[p], requests.refused[p]] for p in requests.requests},
        "usage": {"prompt": agg.prompt_tokens, "completion": agg.completion_tokens,
                  "reasoning": agg.reasoning_tokens, "cached": agg.cached_tokens},
        "cost": agg.cost.value,
        "partial": agg.finished.partial,
        "reasons": agg.reasons,
        "rewards": agg.rewards,
        "audit": agg.audit,
    }


def _totals(index: RunIndex) -> Aggregate:
    with index.totals_lock:  # kept with the view's index, so a live viewer reads only what is new
        if index.record_index is None:
            index.record_index = record_index(index.run_dir)
        return index.record_index.totals()[0] if index.record_index is not None else Aggregate()


def _by_name(tally: Counter, values: list, names=lambda value: value) -> Counter:
    """Counts by interned id as counts by name (each value may hold several names, as a set of toolsets)."""
    out: Counter = Counter()
    for value_id, count in tally.items():
        for name in names(values[value_id]):
            out[name] += count
    return out


def _model_calls(agg: dict, stats: Optional[dict]) -> tuple:
    """(tokens, cost, requests by provider, rate-limited calls): the call journal's, by statistics.json, when
    there is one (it counts requests no record holds: prompts cut off by a crash), else the records'."""
    tokens, cost = agg["usage"], agg["cost"]
    requests = {name: {"requests": r[0], "errors": r[1], "rate_limited": r[2]} for name, r in agg["providers"].items()}
    rate_limited = sum(r[2] for r in agg["providers"].values())
    if stats:
        t = stats.get("tokens") or {}
        tokens = {"prompt": t.get("prompt", 0), "completion": t.get("completion", 0),
                  "reasoning": t.get("reasoning", 0), "cached": t.get("cached", 0)}
        cost = stats.get("cost")
        model_requests = stats.get("model_requests") or {}
        rate_limited = model_requests.get("rate_limited", rate_limited)
        for name, row in (model_requests.get("by_provider") or {}).items():
            requests.setdefault(name, {"rate_limited": 0}).update(
                requests=row.get("requests", 0), errors=row.get("errors", 0), median_latency_s=row.get("median_latency_s"))
    return tokens, cost, requests, rate_limited


def summarize(index: RunIndex) -> dict:
    """Everything the summary and the charts show: counts from the index's tallies, sums from the run's totals."""
    run_dir = index.run_dir
    stats = _read_json(run_dir / "statistics.json")
    run = _read_json(run_dir / "run.json") or {}
    checkpoint = _read_json(run_dir / "checkpoint.json") or {}
    cols, vocab, tallies = index.columns, index.vocab, index.tallies_now()
    agg = _sums(_totals(index))
    # the counts were kept as the rows were added: a summary never walks a million rows
    counts = dict(enumerate(tallies.status))
    still_failed = index.still_failed()
    finished = sum(tallies.status) - counts[FAILED]

    end_reasons = _by_name(tallies.end, vocab["end"].values, lambda value: (value or "unknown",))
    turns = tallies.turns
    duration = tallies.duration

    toolset_counts = _by_name(tallies.toolsets, vocab["toolsets"].values)
    probabilities = dict((run.get("distribution") or {}).get("probabilities") or {})
    available = run.get("toolsets")
    if isinstance(available, dict) and available:
        probabilities = {k: v for k, v in probabilities.items() if k in available}

    by_kind = Counter()
    for i in still_failed:
        by_kind[vocab["error"].values[cols.error[i]] or "unknown"] += 1
    by_filter = _by_name(tallies.filters, vocab["filters"].values)
    tokens, cost, requests, rate_limited = _model_calls(agg, stats)
    sessions = ((stats or {}).get("duration") or {}).get("sessions") or checkpoint.get("sessions") or []
    config = run.get("config") or {}
    return {
        "run_name": run_dir.name,
        # several with --allow_changed_settings: the report names them all, never one of them as the run's
        "model": ", ".join((stats or {}).get("models") or ()) or config.get("model") or (stats or {}).get("model"),
        "distribution": (run.get("distribution") or {}).get("name") or config.get("distribution"),
        "total_prompts": (run.get("dataset") or {}).get("valid"),
        "counts": {
            "kept": counts[KEPT], "discarded": counts[DISCARDED], "failed": len(still_failed),
            "failure_records": counts[FAILED],
            "skipped_invalid": ((stats or {}).get("prompts") or {}).get("skipped_invalid", 0),
        },
        "partial": agg["partial"],
        "unreadable": tallies.unreadable,
        "model_calls": tallies.model_calls,
        "tokens": tokens,
        "cost": cost,
        "rate_limited": rate_limited,
        "requests": dict(sorted(requests.items())),
        "sessions": sessions,
        "duration_total_s": sum(float(s.get("duration_s") or 0) for s in sessions),
        "end_reasons": end_reasons.most_common(),
        "turns": dict(turns),
        "duration": dict(duration),
        "latency_ms": dict(agg["latency_ms"]),
        "tools": sorted(((k, v) for k, v in agg["tools"].items() if v[0]), key=lambda kv: (-kv[1][0], kv[0])),
        "reasoning": agg["reasoning"],
        "toolsets": sorted(toolset_counts.items(), key=lambda kv: (-kv[1], kv[0])),
        "expected": expected_shares(probabilities),
        "finished": finished,
        "failures_by_kind": by_kind.most_common(),
        "discards_by_filter": by_filter.most_common(),
        "discard_reasons": agg["reasons"].most_common(12),
        "statistics_at": ((stats or {}).get("timestamps") or {}).get("generated_at"),
        "rewards": rewards_section(agg["rewards"]),  # None when no verifier ran
        "audit": audit_section(agg["audit"]),  # None when no record was audited (versions before the audit)
    }


def facets(index: RunIndex) -> dict:
    """The values each filter of the viewer can take."""
    vocab = index.vocab
    tools = sorted({t for combo in vocab["tools"].values for t in combo})
    toolsets = sorted({t for combo in vocab["toolsets"].values for t in combo})
    filters = sorted({t for combo in vocab["filters"].values for t in combo})
    return {
        "status": ["kept", "discarded", "failed"],
        "tool": tools,
        "toolset": toolsets,
        "end": sorted(v for v in vocab["end"].values if v),
        "filter": filters,
        "error": sorted(v for v in vocab["error"].values if v),
        "verdict": list(VERDICTS) if index.tallies.scored else [],
    }
