"""statistics.json: the totals of every record of the run and its call journal, across resumes."""

from __future__ import annotations

import bisect
import datetime
import math
from collections import Counter, defaultdict
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import attrs
from rich import box
from rich.console import Console
from rich.table import Table

from .allocation_statistics import allocation_section
from .aggregate import REWARD_BUCKETS, TOKEN_CHECKS, Aggregate, Audit, Requests, Rewards, Scope, epoch
from .journal import JournalTotals, journal_path, read_journal
from .reindex import count_unmatched
from ..formats.records import AUDIT_KINDS, Discarded, Failure, SessionInfo, Trajectory, Usage, key_digest
from .runfolder import RunFolder, read_records
from ..formats.serialization import record_converter

STATISTICS_SCHEMA_VERSION = 1


def iter_finished(folder: RunFolder) -> Iterator[Union[Trajectory, Discarded]]:
    """Every finished record of the run: kept trajectories of all batch files, then discarded ones."""
    for _num, path in folder.iter_batch_files():
        for _line, traj in read_records(path, Trajectory):
            yield traj
    for _line, discarded in read_records(folder.discarded, Discarded):
        yield discarded


@attrs.frozen
class RunInfo:
    """What the run was: the run-level statistics fields of Hermes Agent's batch_runner.py."""

    model: Optional[str] = None
    distribution: Optional[str] = None
    batch_size: Optional[int] = None
    total_prompts: Optional[int] = None  # valid rows of the dataset (up to --max_samples)
    total_lines: Optional[int] = None  # rows considered, invalid ones included: prompt_index runs over these
    models: tuple[str, ...] = ()  # every model of the run's sessions (several only with --allow_changed_settings)
    distributions: tuple[str, ...] = ()


def _one(value: Optional[str], values: Sequence[str]) -> Optional[str]:
    """The run's one model (or distribution); None when its sessions used several, which ``models`` lists."""
    return None if len(values) > 1 else value


def _ratio(part: int, whole: int) -> Optional[float]:
    return round(part / whole, 4) if whole else None


def _percent(part: int, whole: int) -> float:
    return round(part / whole * 100, 2) if whole else 0.0


def _tool_usage(scope: Scope, tool_names: Iterable[str], seed_style: bool) -> dict:
    """Per tool: counts, and success and failure rates (ratios; in percent of ended calls as batch_runner.py wrote them)."""
    out = {}
    for name in sorted(tool_names):
        count, success, failure = scope.tools.get(name, (0, 0, 0))
        if seed_style:
            ended = success + failure
            rates = {"success_rate": _percent(success, ended), "failure_rate": _percent(failure, ended)}
        else:
            rates = {"success_rate": _ratio(success, count), "failure_rate": _ratio(failure, count)}
        out[name] = {"count": count, "success": success, "failure": failure, **rates}
    return out


def _scope_dict(scope: Scope, tool_names: Iterable[str]) -> dict:
    turns = scope.turns_with + scope.turns_without
    return {
        "samples": scope.samples,
        "completed": scope.completed,
        "partial": scope.partial,
        "partial_by_reason": dict(sorted(scope.partial_by_reason.items())),
        "model_calls": scope.model_calls,
        "invalid_tool_calls": scope.invalid_tool_calls,
        "tool_usage": _tool_usage(scope, tool_names, seed_style=False),
        "reasoning": {
            "assistant_turns": turns,
            "with_reasoning": scope.turns_with,
            "without_reasoning": scope.turns_without,
            "share_with_reasoning": _ratio(scope.turns_with, turns),
            "samples_without_reasoning": scope.samples_without_reasoning,
        },
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that ``k`` of a row's ``n`` samples, ``c`` of them passing, drawn without replacement, hold a
    pass: ``1 - C(n-c, k) / C(n, k)`` (the unbiased estimator of Chen et al., 2021); needs ``k <= n``."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _ks(most: int) -> list[int]:
    """The k of pass@k to report for rows of up to ``most`` samples: each up to 10, else powers of two and ``most``."""
    if most <= 10:
        return list(range(1, most + 1))
    return sorted({2**i for i in range(most.bit_length()) if 2**i <= most} | {most})


def _row_rewards(shapes: Counter) -> dict:
    """pass@k and the rows that never passed, from how many rows had each ``(samples, passed)``.

    pass@k averages each row's estimate over the rows with at least k samples, and counts as 1 a row with fewer
    samples that passed (under --stop_on_success a row stops at its first pass: it passed within k); a row with
    fewer than k samples and no pass says nothing of k, so it is left out (``pass_at_k_rows`` counts the rows used).
    """
    total = sum(shapes.values())
    never = sum(count for (_n, c), count in shapes.items() if c == 0)
    at_k, used = {}, {}
    for k in _ks(max((n for n, _c in shapes), default=0)):
        value, rows_used = 0.0, 0
        for (n, c), count in shapes.items():
            if n >= k:
                value += pass_at_k(n, c, k) * count
            elif c > 0:
                value += count
            else:
                continue
            rows_used += count
        at_k[str(k)], used[str(k)] = (round(value / rows_used, 6) if rows_used else None), rows_used
    return {
        "rows": total,
        "rows_passed": total - never,
        "rows_never_passed": never,
        "share_rows_never_passed": _ratio(never, total),
        "samples_per_row_max": max((n for n, _c in shapes), default=0),
        "pass_at_k": at_k,
        "pass_at_k_rows": used,
    }


def rewards_section(rewards: Rewards) -> Optional[dict]:
    """The ``rewards`` section of statistics.json; None when no verifier ran on any sample."""
    if not rewards.scored:
        return None
    buckets = {f"{i / REWARD_BUCKETS:.1f}": rewards.buckets.get(f"{i / REWARD_BUCKETS:.1f}", 0)
               for i in range(REWARD_BUCKETS)}
    mean = rewards.mean()
    by_toolsets = {name: rewards.shapes(rows) for name, rows in rewards.toolset_rows.items()}
    return {
        "samples_scored": rewards.scored,  # a verifier ran on them
        "samples_verified": rewards.verified,  # every verifier gave a reward
        "samples_unverified": rewards.scored - rewards.verified,  # a verifier failed: reward 0, never passed
        "samples_passed": rewards.passed,
        "share_samples_passed": _ratio(rewards.passed, rewards.scored),
        "reward_mean": None if mean is None else round(mean, 6),
        "reward_histogram": buckets,
        **_row_rewards(rewards.shapes(rewards.rows)),
        "by_toolsets": {
            name or "(none)": {
                "samples": sum(n * count for (n, _c), count in shapes.items()),
                "passed": sum(c * count for (_n, c), count in shapes.items()), **_row_rewards(shapes),
            }
            for name, shapes in sorted(by_toolsets.items())
        },
    }


def audit_section(audit: Audit) -> Optional[dict]:
    """The ``audit`` section of statistics.json (the shortcut audit); None when no record was audited."""
    if not audit.audited:
        return None
    return {
        "samples_audited": audit.audited,
        "samples_with_findings": audit.with_findings,
        "share_with_findings": _ratio(audit.with_findings, audit.audited),
        "samples_passed": audit.passed,  # of the audited samples
        "passed_with_findings": audit.passed_with_findings,
        "kept_with_findings": audit.kept_with_findings,
        # every kind, 0 included: one shape in every run
        "by_kind": {kind: {"samples": audit.by_kind.get(kind, 0), "passed": audit.passed_by_kind.get(kind, 0)}
                    for kind in AUDIT_KINDS},
    }


def _requests_from_journal(journal: JournalTotals) -> Requests:
    requests = Requests()
    requests.requests, requests.errors = journal.requests_by_provider, journal.errors_by_provider
    requests.latency_ms = journal.latency_ms
    requests.rate_limited, requests.unanswered = journal.rate_limited, journal.unanswered
    return requests


def _requests_dict(requests: Requests, sessions: Sequence[SessionInfo]) -> dict:
    limits = [s for s in sessions if s.concurrency_start is not None]
    rate_limited = requests.rate_limited
    return {
        "requests": sum(requests.requests.values()),
        "errors": sum(requests.errors.values()),
        "rate_limited": sum(s.rate_limited_calls for s in sessions) if rate_limited is None else rate_limited,
        "unanswered": requests.unanswered,
        "concurrency_limit": {
            "start": limits[-1].concurrency_start if limits else None,
            "min": min(s.concurrency_min for s in limits) if limits else None,
            "final": limits[-1].concurrency_final if limits else None,
        },
        "by_provider": {
            name: {
                "requests": requests.requests[name],
                "errors": requests.errors[name],
                "median_latency_s": _median_ms(requests.latency_ms[name]) / 1000,
            }
            for name in sorted(requests.requests)
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


def reported_cost(folder: RunFolder, journal: Optional[JournalTotals] = None) -> float:
    """Cost reported for the run so far, as statistics.json counts it: every call in the journal (else the records)."""
    journal = read_journal(journal_path(folder.dir)) if journal is None else journal
    if journal.covers_run:
        return journal.cost or 0.0
    cost = 0.0
    for record in iter_finished(folder):
        cost += (record.trajectory if isinstance(record, Discarded) else record).metadata.usage.cost or 0.0
    for _line, failure in read_records(folder.failed, Failure):
        cost += failure.usage.cost or 0.0
    return cost


class _SessionClock:
    """Tells which session (first run = 0, then each resume) wrote a record, from its timestamp."""

    def __init__(self, sessions: Sequence[SessionInfo]):
        starts = [epoch(s.started_at) for s in sessions]
        ok = starts and not any(math.isnan(t) for t in starts) and starts == sorted(starts)
        self._starts = starts if ok else []

    def session_at(self, seconds: float) -> int:
        """The session of a record written at ``seconds`` since the epoch (NaN: unknown, counted as the first)."""
        if math.isnan(seconds) or not self._starts:
            return 0
        return max(0, bisect.bisect_right(self._starts, seconds) - 1)


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


FinishTimes = Callable[[set], Iterable[tuple[int, float]]]
"""Given key digests, (digest, epoch seconds) of every finished record with one of them."""


def scan_records(folder: RunFolder) -> tuple[Aggregate, FinishTimes]:
    """The totals of every record of the run, by reading each one: the reference the indexes must equal."""
    aggregate = Aggregate()
    for _line, failure in read_records(folder.failed, Failure):
        aggregate.add(failure)
    failed = {key_digest(key) for key, _ts, _kind in aggregate.failures}
    finishes = []  # only of keys that ever failed, to bound memory
    for record in iter_finished(folder):
        aggregate.add(record)
        meta = (record.trajectory if isinstance(record, Discarded) else record).metadata
        if failed and (digest := key_digest(meta.content_key)) in failed:
            finishes.append((digest, epoch(meta.timestamp)))
    return aggregate, lambda _digests: finishes


def _failed_prompts(aggregate: Aggregate, finish_times: FinishTimes, clock: _SessionClock) -> tuple[int, Counter]:
    """Prompts that failed and never finished since, and the error kinds of their last failures."""
    failed_by_key: dict[int, Counter] = defaultdict(Counter)
    kinds_by_key: dict[int, dict[int, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for key, timestamp, kind in aggregate.failures:
        digest, session = key_digest(key), clock.session_at(epoch(timestamp))
        failed_by_key[digest][session] += 1
        kinds_by_key[digest][session][kind] += 1
    finished_by_key: dict[int, Counter] = defaultdict(Counter)
    if failed_by_key:
        for digest, seconds in finish_times(set(failed_by_key)):
            finished_by_key[digest][clock.session_at(seconds)] += 1
    failed_prompts = 0
    failed_kinds: Counter = Counter()
    for digest, failed in failed_by_key.items():
        still = _still_failed(failed, finished_by_key[digest])
        if still:
            failed_prompts += still
            # why they fail now: the kinds seen in the last session that failed them
            failed_kinds.update(sorted(kinds_by_key[digest][max(failed)].elements())[:still])
    return failed_prompts, failed_kinds


def build_statistics(
    folder: RunFolder,
    *,
    filters_run: Sequence[str] = (),
    sessions: Sequence[SessionInfo] = (),
    invalid_skipped_total: int = 0,
    tool_names: Iterable[str] = (),
    now: Optional[str] = None,
    run: RunInfo = RunInfo(),
    totals: Optional[tuple[Aggregate, FinishTimes]] = None,
    journal: Optional[JournalTotals] = None,
    allocation: Optional[tuple] = None,
) -> dict:
    """Aggregate statistics of the whole run, from its batch, discarded and failed files and its call journal.

    ``totals`` and ``journal`` are what the run's indexes hold (record_index.py); without them every record
    and the whole journal are read.  ``allocation``: (K, target passes, max failures) of --allocation adaptive.
    """
    aggregate, finish_times = scan_records(folder) if totals is None else totals
    failed_prompts, failed_kinds = _failed_prompts(aggregate, finish_times, _SessionClock(sessions))
    finished, kept = aggregate.finished, aggregate.kept
    by_filter = Counter({name: 0 for name in filters_run})
    by_filter.update(aggregate.by_filter)
    all_tools = aggregate.tools | set(tool_names)
    usage = Usage(aggregate.prompt_tokens, aggregate.completion_tokens, aggregate.reasoning_tokens,
                  aggregate.cached_tokens, aggregate.cost.value)
    requests = aggregate.requests
    journal = read_journal(journal_path(folder.dir)) if journal is None else journal
    if journal.covers_run:
        # every request the run made, also those of prompts a crash cut off, which no record holds
        usage, requests = journal.usage, _requests_from_journal(journal)
    total_tokens = usage.prompt_tokens + usage.completion_tokens
    generated_at = now or datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None).isoformat(timespec="seconds")
    duration = round(sum(s.duration_s for s in sessions), 3)
    total_batches = None
    if run.total_lines is not None and run.batch_size:
        total_batches = math.ceil(run.total_lines / run.batch_size)
    return {
        "schema_version": STATISTICS_SCHEMA_VERSION,
        "run_name": folder.run_name,
        # batch_runner.py's run-level fields, so scripts written for its statistics.json keep working
        "model": _one(run.model, run.models),
        "models": list(run.models) or ([run.model] if run.model else []),
        "distribution": _one(run.distribution, run.distributions),
        "distributions": list(run.distributions) or ([run.distribution] if run.distribution else []),
        "batch_size": run.batch_size,
        "total_prompts": run.total_prompts,
        "total_batches": total_batches,
        "completed_at": generated_at,
        "duration_seconds": round(duration, 2),
        "tool_statistics": _tool_usage(finished, all_tools, seed_style=True),
        "reasoning_statistics": {
            "total_assistant_turns": finished.turns_with + finished.turns_without,
            "turns_with_reasoning": finished.turns_with,
            "turns_without_reasoning": finished.turns_without,
        },
        "prompts": {
            "finished": finished.samples,
            "kept": kept.samples,
            "discarded": aggregate.discarded,
            "failed": failed_prompts,
            "skipped_invalid": invalid_skipped_total,
        },
        "unmatched_records": count_unmatched(folder),
        "discarded_by_filter": dict(sorted(by_filter.items())),
        "failures": {"prompts": failed_prompts, "by_kind": dict(sorted(failed_kinds.items())),
                     "records": aggregate.failure_records},
        "finished": _scope_dict(finished, all_tools),
        "kept": _scope_dict(kept, all_tools),
        "tokens": {
            "prompt": usage.prompt_tokens,
            "completion": usage.completion_tokens,
            "reasoning": usage.reasoning_tokens,
            "cached": usage.cached_tokens,
            "total": total_tokens,
            "samples_reporting_usage": aggregate.usage_reported,
        },
        "cost": None if usage.cost is None else round(usage.cost, 6),
        "rewards": rewards_section(aggregate.rewards),
        "audit": audit_section(aggregate.audit),
        # --logprobs: how many samples' token ids the endpoint's tokenizer agreed with (docs/training-data.md)
        "token_check": ({name: aggregate.token_checks[name] for name in TOKEN_CHECKS}
                        if aggregate.token_checks else None),
        **({} if allocation is None else
           {"allocation": allocation_section(aggregate.rewards.shapes(aggregate.rewards.rows), *allocation)}),
        "model_requests": _requests_dict(requests, sessions),
        "duration": {
            "total_s": duration,
            "sessions": [record_converter.unstructure(s) for s in sessions],
        },
        "timestamps": {
            "generated_at": generated_at,
            "started_at": sessions[0].started_at if sessions else None,
            "first_sample_at": aggregate.first_ts,
            "last_sample_at": aggregate.last_ts,
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
        # every installed tool is in the statistics (records list them all): the table shows those called
        called = [name for name, row in finished["tool_usage"].items() if row["count"]]
        unused = len(finished["tool_usage"]) - len(called)
        tools = _table("Tool usage (kept samples; all finished in the last two columns)",
                       ("Tool", "Calls", "Success", "Failure", "Rate", "All calls", "All rate"))
        for name in called:
            row, every = kept["tool_usage"][name], finished["tool_usage"][name]
            tools.add_row(name, str(row["count"]), str(row["success"]), str(row["failure"]),
                          _fmt_rate(row["success_rate"]), str(every["count"]), _fmt_rate(every["success_rate"]))
        tools.caption = "Rate: the share of calls that succeeded" + (
            f"; {unused} tool(s) of the installed toolsets not called" if unused else "")
        console.print(tools)

    reasoning = _table("Reasoning coverage (assistant turns)",
                       ("Samples", "Turns", "With reasoning", "Without", "Share with", "Samples with none"))
    for label, scope in (("all finished", finished), ("kept", kept)):
        r = scope["reasoning"]
        reasoning.add_row(label, str(r["assistant_turns"]), str(r["with_reasoning"]), str(r["without_reasoning"]),
                          _fmt_rate(r["share_with_reasoning"]), str(r["samples_without_reasoning"]))
    console.print(reasoning)

    if stats["discarded_by_filter"]:
        discarded = _table("Discarded by filter", ("Filter", "Samples"))
        for name, count in stats["discarded_by_filter"].items():
            discarded.add_row(name, str(count))
        console.print(discarded)

    if stats["failures"]["by_kind"]:
        failures = _table("Failed prompts by kind", ("Kind", "Prompts"))
        for kind, count in stats["failures"]["by_kind"].items():
            failures.add_row(kind, str(count))
        console.print(failures)

    if stats.get("rewards"):
        render_rewards(stats["rewards"], console)

    if stats.get("audit") and stats["audit"]["samples_with_findings"]:
        render_audit(stats["audit"], console)

    requests = stats.get("model_requests") or {}
    if requests.get("by_provider"):
        providers = _table("Model requests by provider", ("Provider", "Requests", "Errors", "Median latency"))
        for name, row in requests["by_provider"].items():
            providers.add_row(name, str(row["requests"]), str(row["errors"]), f"{row['median_latency_s']:.3f} s")
        console.print(providers)

    tokens = stats["tokens"]
    duration = stats["duration"]
    totals = _table("Totals", ("What", "Value"), show_header=False)
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


def _table(title: str, headers: Sequence[str], show_header: bool = True) -> Table:
    """A table that fits an 80-column terminal (a pipe's width): no outer rules, a name column that folds rather
    than being cut short with an ellipsis, numbers that never wrap."""
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, show_header=show_header)
    for i, header in enumerate(headers):
        if i == 0:
            table.add_column(header, overflow="fold")
        else:
            table.add_column(header, justify="right", no_wrap=True)
    return table


def _fmt_pass(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1%}"


def render_rewards(rewards: dict, console: Console) -> None:
    """The verifiers' tables: pass@k per run and per toolsets, and the reward distribution."""
    ks = list(rewards["pass_at_k"])
    # no column rules: up to pass@4 fits an 80-column terminal (a pipe's width) without cutting a number short
    passing = Table(title="Verified samples: pass@k (rows of the dataset, all finished samples)", box=box.SIMPLE_HEAD,
                    pad_edge=False, collapse_padding=True)
    passing.add_column("Toolsets", overflow="fold", min_width=8)  # a long combination folds, the numbers never
    for header in ("Samples", "Passed", "Rows", "Never\npassed", *(f"pass@{k}" for k in ks)):
        passing.add_column(header, justify="right", no_wrap=True)
    scopes = [("all", {"samples": rewards["samples_scored"], "passed": rewards["samples_passed"], **rewards})]
    if len(rewards["by_toolsets"]) > 1:
        scopes += list(rewards["by_toolsets"].items())
    for label, scope in scopes:
        passing.add_row(label, str(scope["samples"]), str(scope["passed"]), str(scope["rows"]),
                        f"{scope['rows_never_passed']} ({_fmt_pass(scope['share_rows_never_passed'])})",
                        *(_fmt_pass(scope["pass_at_k"].get(k)) for k in ks))
    console.print(passing)
    histogram = Table(title="Reward distribution (verified samples)")
    histogram.add_column("Reward")
    histogram.add_column("Samples", justify="right")
    histogram.add_column("", justify="left")
    most = max(rewards["reward_histogram"].values(), default=0) or 1
    for bucket, count in rewards["reward_histogram"].items():
        label = bucket if bucket in ("<0", ">1") else f"{bucket}-{float(bucket) + 0.1:.1f}"
        histogram.add_row(label, str(count), "#" * round(count / most * 30))
    mean = rewards["reward_mean"]
    histogram.caption = (f"mean {'-' if mean is None else f'{mean:.3f}'}; "
                         f"{rewards['samples_unverified']} sample(s) whose verifier failed (reward 0, not passed)")
    console.print(histogram)


def render_audit(audit: dict, console: Console) -> None:
    """The shortcut audit's table: samples with a finding of each kind, of all and of the passing ones."""
    table = Table(title="Shortcut audit (samples with findings; docs/verification.md)")
    for header in ("Kind", "Samples", "Passed"):
        table.add_column(header, justify="left" if header == "Kind" else "right")
    for kind, row in audit["by_kind"].items():
        if row["samples"]:
            table.add_row(kind, str(row["samples"]), str(row["passed"]))
    table.caption = (f"{audit['samples_with_findings']} of {audit['samples_audited']} audited samples have findings; "
                     f"{audit['passed_with_findings']} of {audit['samples_passed']} passing, "
                     f"{audit['kept_with_findings']} kept")
    console.print(table)
