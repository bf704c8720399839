"""What a run looks like in numbers: counts and chart data, from the index plus statistics.json and run.json."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Optional

from .index import DISCARDED, FAILED, KEPT, RunIndex


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


def summarize(index: RunIndex) -> dict:
    """Everything the summary and the charts show, computed from the index's tallies and aggregates."""
    run_dir = index.run_dir
    stats = _read_json(run_dir / "statistics.json")
    run = _read_json(run_dir / "run.json") or {}
    checkpoint = _read_json(run_dir / "checkpoint.json") or {}
    cols, vocab, agg, tallies = index.columns, index.vocab, index.aggregates, index.tallies_now()
    # the counts were kept as the rows were added: a summary never walks a million rows
    counts = dict(enumerate(tallies.status))
    still_failed = index.still_failed()
    finished = sum(tallies.status) - counts[FAILED]

    end_reasons = Counter()
    for end_id, c in tallies.end.items():
        end_reasons[vocab["end"].values[end_id] or "unknown"] += c
    turns = tallies.turns
    duration = tallies.duration

    toolset_counts = Counter()
    for ts_id, c in tallies.toolsets.items():
        for name in vocab["toolsets"].values[ts_id]:
            toolset_counts[name] += c
    probabilities = dict((run.get("distribution") or {}).get("probabilities") or {})
    available = run.get("toolsets")
    if isinstance(available, dict) and available:
        probabilities = {k: v for k, v in probabilities.items() if k in available}

    by_kind = Counter()
    for i in still_failed:
        by_kind[vocab["error"].values[cols.error[i]] or "unknown"] += 1
    by_filter = Counter()
    for f_id, c in tallies.filters.items():
        for name in vocab["filters"].values[f_id]:
            by_filter[name] += c

    tokens = dict(agg.usage)
    cost = agg.cost
    requests = {name: {"requests": r[0], "errors": r[1], "rate_limited": r[2]} for name, r in agg.providers.items()}
    rate_limited = sum(r[2] for r in agg.providers.values())
    if stats:  # the call journal counts requests no record holds (prompts cut off by a crash)
        t = stats.get("tokens") or {}
        tokens = {"prompt": t.get("prompt", 0), "completion": t.get("completion", 0),
                  "reasoning": t.get("reasoning", 0), "cached": t.get("cached", 0)}
        cost = stats.get("cost")
        model_requests = stats.get("model_requests") or {}
        rate_limited = model_requests.get("rate_limited", rate_limited)
        for name, row in (model_requests.get("by_provider") or {}).items():
            requests.setdefault(name, {"rate_limited": 0}).update(
                requests=row.get("requests", 0), errors=row.get("errors", 0), median_latency_s=row.get("median_latency_s"))
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
        "partial": agg.partial,
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
        "latency_ms": dict(agg.latency_ms),
        "tools": sorted(((k, v) for k, v in agg.tools.items() if v[0]), key=lambda kv: (-kv[1][0], kv[0])),
        "reasoning": agg.reasoning,
        "toolsets": sorted(toolset_counts.items(), key=lambda kv: (-kv[1], kv[0])),
        "expected": expected_shares(probabilities),
        "finished": finished,
        "failures_by_kind": by_kind.most_common(),
        "discards_by_filter": by_filter.most_common(),
        "discard_reasons": agg.reasons.most_common(12),
        "statistics_at": ((stats or {}).get("timestamps") or {}).get("generated_at"),
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
    }
