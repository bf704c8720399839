"""statistics.json: built by scanning the run folder, so it always covers the whole run across resumes."""

from __future__ import annotations

import bisect
import datetime
import math
from collections import Counter, defaultdict
from typing import Any, Iterable, Optional, Sequence

import attrs
from rich.console import Console
from rich.table import Table

from .conversation import reasoning_counts
from .journal import JournalTotals, journal_path, read_journal
from .reindex import count_unmatched
from .records import CallRecord, Discarded, Failure, SessionInfo, Trajectory, Usage
from .resume import iter_finished
from .runfolder import RunFolder, read_records
from .serialization import record_converter

STATISTICS_SCHEMA_VERSION = 1


@attrs.frozen
class RunInfo:
    """What the run was: the seed tool's run-level statistics fields."""

    model: Optional[str] = None
    distribution: Optional[str] = None
    batch_size: Optional[int] = None
    total_prompts: Optional[int] = None  # valid rows of the dataset (up to --max_samples)
    total_lines: Optional[int] = None  # rows considered, invalid ones included: prompt_index runs over these


def _ratio(part: int, whole: int) -> Optional[float]:
    return round(part / whole, 4) if whole else None


def _percent(part: int, whole: int) -> float:
    return round(part / whole * 100, 2) if whole else 0.0


class _Scope:
    """Running totals over one set of samples (all finished, or kept only)."""

    def __init__(self) -> None:
        self.samples = self.completed = self.partial = self.model_calls = self.invalid_tool_calls = 0
        self.turns_with = self.turns_without = self.samples_without_reasoning = 0
        self.tools: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        self.partial_by_reason: Counter = Counter()

    def add(self, traj: Trajectory) -> None:
        self.samples += 1
        self.completed += traj.completed
        self.partial += traj.partial
        if traj.partial:
            self.partial_by_reason[traj.metadata.end_reason or "unknown"] += 1
        self.model_calls += traj.api_calls
        self.invalid_tool_calls += len(traj.metadata.invalid_tool_calls)
        with_reasoning, without = reasoning_counts(traj.conversations)
        self.turns_with += with_reasoning
        self.turns_without += without
        self.samples_without_reasoning += with_reasoning == 0
        for name, stat in traj.tool_stats.items():
            totals = self.tools[name]
            totals[0] += stat.count
            totals[1] += stat.success
            totals[2] += stat.failure

    def seed_tool_statistics(self, tool_names: Iterable[str]) -> dict:
        """Per tool as the seed's ``tool_statistics``: counts, and success and failure rates in percent."""
        out = {}
        for name in sorted(tool_names):
            count, success, failure = self.tools.get(name, (0, 0, 0))
            ended = success + failure
            out[name] = {
                "count": count, "success": success, "failure": failure,
                "success_rate": _percent(success, ended), "failure_rate": _percent(failure, ended),
            }
        return out

    def seed_reasoning_statistics(self) -> dict:
        return {
            "total_assistant_turns": self.turns_with + self.turns_without,
            "turns_with_reasoning": self.turns_with,
            "turns_without_reasoning": self.turns_without,
        }

    def to_dict(self, tool_names: Iterable[str]) -> dict:
        turns = self.turns_with + self.turns_without
        usage = {}
        for name in sorted(tool_names):
            count, success, failure = self.tools.get(name, (0, 0, 0))
            usage[name] = {
                "count": count, "success": success, "failure": failure,
                "success_rate": _ratio(success, count), "failure_rate": _ratio(failure, count),
            }
        return {
            "samples": self.samples,
            "completed": self.completed,
            "partial": self.partial,
            "partial_by_reason": dict(sorted(self.partial_by_reason.items())),
            "model_calls": self.model_calls,
            "invalid_tool_calls": self.invalid_tool_calls,
            "tool_usage": usage,
            "reasoning": {
                "assistant_turns": turns,
                "with_reasoning": self.turns_with,
                "without_reasoning": self.turns_without,
                "share_with_reasoning": _ratio(self.turns_with, turns),
                "samples_without_reasoning": self.samples_without_reasoning,
            },
        }


class _Requests:
    """Model requests per provider: count, errors, and latencies in whole milliseconds (for exact medians)."""

    def __init__(self) -> None:
        self.requests: Counter = Counter()
        self.errors: Counter = Counter()
        self.latency_ms: dict[str, Counter] = defaultdict(Counter)
        self.rate_limited: Optional[int] = None  # None: the limiters' counts of the sessions
        self.unanswered = 0

    @classmethod
    def from_journal(cls, journal: JournalTotals) -> "_Requests":
        requests = cls()
        requests.requests, requests.errors = journal.requests_by_provider, journal.errors_by_provider
        requests.latency_ms = journal.latency_ms
        requests.rate_limited, requests.unanswered = journal.rate_limited, journal.unanswered
        return requests

    def add(self, calls: Iterable[CallRecord]) -> None:
        for call in calls:
            provider = call.provider or "unknown"
            self.requests[provider] += 1
            if call.status != 200:
                self.errors[provider] += 1
            self.latency_ms[provider][int(round(call.latency_s * 1000))] += 1

    def to_dict(self, sessions: Sequence[SessionInfo]) -> dict:
        limits = [s for s in sessions if s.concurrency_start is not None]
        return {
            "requests": sum(self.requests.values()),
            "errors": sum(self.errors.values()),
            "rate_limited": sum(s.rate_limited_calls for s in sessions) if self.rate_limited is None else self.rate_limited,
            "unanswered": self.unanswered,
            "concurrency_limit": {
                "start": limits[-1].concurrency_start if limits else None,
                "min": min(s.concurrency_min for s in limits) if limits else None,
                "final": limits[-1].concurrency_final if limits else None,
            },
            "by_provider": {
                name: {
                    "requests": self.requests[name],
                    "errors": self.errors[name],
                    "median_latency_s": _median_ms(self.latency_ms[name]) / 1000,
                }
                for name in sorted(self.requests)
            },
        }


def _median_ms(histogram: Counter) -> float:
    total = sum(histogram.values())
    seen = 0
    values = sorted(histogram)
    for i, value in enumerate(values):
        seen += histogram[value]
        if seen * 2 > total:
            return float(value)
        if seen * 2 == total:
            return (value + values[i + 1]) / 2
    return 0.0


def reported_cost(folder: RunFolder) -> float:
    """Cost reported for the run so far, as statistics.json counts it: every call in the journal (else the records)."""
    journal = read_journal(journal_path(folder.dir))
    if journal.covers_run:
        return journal.cost or 0.0
    cost = 0.0
    for record in iter_finished(folder):
        cost += (record.trajectory if isinstance(record, Discarded) else record).metadata.usage.cost or 0.0
    for _line, failure in read_records(folder.failed, Failure):
        cost += failure.usage.cost or 0.0
    return cost


def _epoch(timestamp: str) -> Optional[float]:
    try:
        return datetime.datetime.fromisoformat(timestamp).timestamp()
    except (TypeError, ValueError):
        return None


class _SessionClock:
    """Tells which session (first run = 0, then each resume) wrote a record, from its timestamp."""

    def __init__(self, sessions: Sequence[SessionInfo]):
        starts = [_epoch(s.started_at) for s in sessions]
        ok = starts and None not in starts and starts == sorted(starts)
        self._starts = starts if ok else []

    def session_of(self, timestamp: str) -> int:
        t = _epoch(timestamp)
        if t is None or not self._starts:
            return 0
        return max(0, bisect.bisect_right(self._starts, t) - 1)


def _still_failed(failed: Counter, finished: Counter) -> int:
    """Prompts of one content key that failed and were not finished later.

    Each session retries every unfinished row, so the rows of a key ever
    attempted are at least (finished before the session + finished and failed
    in it) for every session; whatever of those is not finished has failed.
    """
    attempted = finished_so_far = 0
    for session in sorted(set(failed) | set(finished)):
        attempted = max(attempted, finished_so_far + finished[session] + failed[session])
        finished_so_far += finished[session]
    return max(0, attempted - finished_so_far)


def build_statistics(
    folder: RunFolder,
    *,
    filters_run: Sequence[str] = (),
    sessions: Sequence[SessionInfo] = (),
    invalid_skipped_total: int = 0,
    tool_names: Iterable[str] = (),
    now: Optional[str] = None,
    run: RunInfo = RunInfo(),
) -> dict:
    """Aggregate statistics of the whole run, from its batch, discarded and failed files and its call journal."""
    clock = _SessionClock(sessions)
    failed_by_key: dict[str, Counter] = defaultdict(Counter)
    kinds_by_key: dict[str, dict[int, Counter]] = defaultdict(lambda: defaultdict(Counter))
    failure_records = 0
    usage, usage_reported = Usage(), 0
    requests = _Requests()
    for _line, failure in read_records(folder.failed, Failure):
        failure_records += 1
        requests.add(failure.calls)
        usage += failure.usage
        session = clock.session_of(failure.timestamp)
        failed_by_key[failure.content_key][session] += 1
        kinds_by_key[failure.content_key][session][failure.error_kind] += 1

    finished, kept = _Scope(), _Scope()
    finished_by_key: dict[str, Counter] = defaultdict(Counter)  # only keys that ever failed, to bound memory
    by_filter = Counter({name: 0 for name in filters_run})
    first_ts: Optional[str] = None
    last_ts: Optional[str] = None
    all_tools = set(tool_names)
    discarded_total = 0
    for record in iter_finished(folder):
        if isinstance(record, Discarded):
            traj = record.trajectory
            discarded_total += 1
            by_filter.update(set(record.filters))
        else:
            traj = record
            kept.add(traj)
        finished.add(traj)
        all_tools.update(traj.tool_stats)
        meta = traj.metadata
        if meta.content_key in failed_by_key:
            finished_by_key[meta.content_key][clock.session_of(meta.timestamp)] += 1
        usage += meta.usage
        usage_reported += bool(meta.usage.prompt_tokens or meta.usage.completion_tokens)
        requests.add(meta.calls)
        if meta.timestamp:
            first_ts = meta.timestamp if first_ts is None else min(first_ts, meta.timestamp)
            last_ts = meta.timestamp if last_ts is None else max(last_ts, meta.timestamp)

    failed_prompts = 0
    failed_kinds: Counter = Counter()
    for key, failed in failed_by_key.items():
        still = _still_failed(failed, finished_by_key[key])
        if still:
            failed_prompts += still
            # why they fail now: the kinds seen in the last session that failed them
            failed_kinds.update(sorted(kinds_by_key[key][max(failed)].elements())[:still])

    journal = read_journal(journal_path(folder.dir))
    if journal.covers_run:
        # every request the run made, also those of prompts a crash cut off, which no record holds
        usage, requests = journal.usage, _Requests.from_journal(journal)
    total_tokens = usage.prompt_tokens + usage.completion_tokens
    generated_at = now or datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None).isoformat(timespec="seconds")
    duration = round(sum(s.duration_s for s in sessions), 3)
    total_batches = None
    if run.total_lines is not None and run.batch_size:
        total_batches = math.ceil(run.total_lines / run.batch_size)
    return {
        "schema_version": STATISTICS_SCHEMA_VERSION,
        "run_name": folder.run_name,
        # the seed tool's run-level fields, so scripts written for its statistics.json keep working
        "model": run.model,
        "distribution": run.distribution,
        "batch_size": run.batch_size,
        "total_prompts": run.total_prompts,
        "total_batches": total_batches,
        "completed_at": generated_at,
        "duration_seconds": round(duration, 2),
        "tool_statistics": finished.seed_tool_statistics(all_tools),
        "reasoning_statistics": finished.seed_reasoning_statistics(),
        "prompts": {
            "finished": finished.samples,
            "kept": kept.samples,
            "discarded": discarded_total,
            "failed": failed_prompts,
            "skipped_invalid": invalid_skipped_total,
        },
        "unmatched_records": count_unmatched(folder),
        "discarded_by_filter": dict(sorted(by_filter.items())),
        "failures": {"prompts": failed_prompts, "by_kind": dict(sorted(failed_kinds.items())), "records": failure_records},
        "finished": finished.to_dict(all_tools),
        "kept": kept.to_dict(all_tools),
        "tokens": {
            "prompt": usage.prompt_tokens,
            "completion": usage.completion_tokens,
            "reasoning": usage.reasoning_tokens,
            "cached": usage.cached_tokens,
            "total": total_tokens,
            "samples_reporting_usage": usage_reported,
        },
        "cost": None if usage.cost is None else round(usage.cost, 6),
        "model_requests": requests.to_dict(sessions),
        "duration": {
            "total_s": duration,
            "sessions": [record_converter.unstructure(s) for s in sessions],
        },
        "timestamps": {
            "generated_at": generated_at,
            "started_at": sessions[0].started_at if sessions else None,
            "first_sample_at": first_ts,
            "last_sample_at": last_ts,
        },
    }


def _fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _fmt_rate(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1%}"


def render_statistics(stats: dict, console: Console) -> None:
    """Print the statistics as rich tables."""
    prompts = stats["prompts"]
    kept, finished = stats["kept"], stats["finished"]

    if finished["tool_usage"]:
        tools = Table(title="Tool usage (kept samples; all finished in the last columns)")
        for header in ("Tool", "Calls", "Success", "Failure", "Success rate", "All calls", "All success rate"):
            tools.add_column(header, justify="left" if header == "Tool" else "right")
        for name, row in kept["tool_usage"].items():
            every = finished["tool_usage"][name]
            tools.add_row(name, str(row["count"]), str(row["success"]), str(row["failure"]),
                          _fmt_rate(row["success_rate"]), str(every["count"]), _fmt_rate(every["success_rate"]))
        console.print(tools)

    reasoning = Table(title="Reasoning coverage (assistant turns)")
    for header in ("Samples", "Turns", "With reasoning", "Without", "Share with", "Samples with none"):
        reasoning.add_column(header, justify="left" if header == "Samples" else "right")
    for label, scope in (("all finished", finished), ("kept", kept)):
        r = scope["reasoning"]
        reasoning.add_row(label, str(r["assistant_turns"]), str(r["with_reasoning"]), str(r["without_reasoning"]),
                          _fmt_rate(r["share_with_reasoning"]), str(r["samples_without_reasoning"]))
    console.print(reasoning)

    if stats["discarded_by_filter"]:
        discarded = Table(title="Discarded by filter")
        discarded.add_column("Filter")
        discarded.add_column("Samples", justify="right")
        for name, count in stats["discarded_by_filter"].items():
            discarded.add_row(name, str(count))
        console.print(discarded)

    if stats["failures"]["by_kind"]:
        failures = Table(title="Failed prompts by kind")
        failures.add_column("Kind")
        failures.add_column("Prompts", justify="right")
        for kind, count in stats["failures"]["by_kind"].items():
            failures.add_row(kind, str(count))
        console.print(failures)

    requests = stats.get("model_requests") or {}
    if requests.get("by_provider"):
        providers = Table(title="Model requests by provider")
        for header in ("Provider", "Requests", "Errors", "Median latency"):
            providers.add_column(header, justify="left" if header == "Provider" else "right")
        for name, row in requests["by_provider"].items():
            providers.add_row(name, str(row["requests"]), str(row["errors"]), f"{row['median_latency_s']:.3f} s")
        console.print(providers)

    tokens = stats["tokens"]
    duration = stats["duration"]
    totals = Table(title="Totals", show_header=False)
    totals.add_column("What")
    totals.add_column("Value", justify="right")
    rows: list[tuple[str, Any]] = [
        ("Prompts finished", prompts["finished"]),
        ("  kept", prompts["kept"]),
        ("  discarded", prompts["discarded"]),
        ("Prompts failed", prompts["failed"]),
        ("Prompts skipped as invalid", prompts["skipped_invalid"]),
        ("Completed / partial (all finished)", f"{finished['completed']} / {finished['partial']}"),
    ]
    rows += [(f"  partial: {reason}", count) for reason, count in finished.get("partial_by_reason", {}).items()]
    rows += [
        ("Model calls", finished["model_calls"]),
    ]
    if requests:
        limit = requests["concurrency_limit"]
        rows.append(("Requests / errors / rate-limited", f"{requests['requests']} / {requests['errors']} / {requests['rate_limited']}"))
        if limit["start"] is not None:
            rows.append(("Concurrency limit (start / min / final)", f"{limit['start']} / {limit['min']} / {limit['final']}"))
    rows += [
        ("Tokens (prompt / completion)", f"{tokens['prompt']:,} / {tokens['completion']:,}"),
        ("Tokens (reasoning / cached)", f"{tokens['reasoning']:,} / {tokens['cached']:,}"),
        ("Cost", "not reported" if stats["cost"] is None else f"${stats['cost']:.4f}"),
        ("Duration", f"{_fmt_duration(duration['total_s'])} over {len(duration['sessions'])} session(s)"),
    ]
    for label, value in rows:
        totals.add_row(label, str(value))
    console.print(totals)
