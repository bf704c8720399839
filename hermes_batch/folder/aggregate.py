"""What statistics.json counts over a set of records, as totals that add up across files and sessions.

The statistics of a million-prompt run cannot come from reading every record
at each session's end.  Each record file keeps an :class:`Aggregate` of its
records in its index (record_index.py); statistics.json is built from the sum
of those, which equals one :class:`Aggregate` built by reading every record
(statistics.py builds it that way when asked, and the tests compare the two).
Every total here is a count, a set, a minimum or maximum, or an exact sum, so
the order in which records and files are added never changes the result.
"""

from __future__ import annotations

import array
import base64
import datetime
import sys
from collections import Counter, defaultdict
from fractions import Fraction
from typing import Iterable, Optional, Union

from ..formats.conversation import reasoning_counts
from ..formats.endpoint_numbers import TOKEN_FIELDS, stored_usage
from ..formats.records import AUDIT_KINDS, CANCELLED_STATUS, CallRecord, Discarded, Failure, Trajectory, Usage
from ..formats.reward_numbers import stored_reward
from ..formats.token_ids import DRIFT, MATCH, REDACTED, UNCHECKED

TOKEN_CHECKS = (MATCH, DRIFT, UNCHECKED, REDACTED)

_SCALE = 1074  # every finite double is an integer multiple of 2**-1074
_MAX_REASONS = 2000  # distinct discard reasons counted one by one; the rest are summed as "(other reasons)"
_REASON_CHARS = 300
_USAGE_FIELDS = (*TOKEN_FIELDS, "cost")


def epoch(timestamp: str) -> float:
    """A record's timestamp in seconds since the epoch, NaN when it is not an ISO timestamp."""
    try:
        return datetime.datetime.fromisoformat(timestamp).timestamp()
    except (TypeError, ValueError):
        return float("nan")


class ExactSum:
    """A sum of floats without rounding, so partial sums added in any order give the same float."""

    def __init__(self, scaled: int = 0, reported: bool = False):
        self.scaled = scaled  # the sum times 2**1074
        self.reported = reported  # some value was added: the endpoint reports costs

    def add(self, value: Optional[float]) -> None:
        if value is None:
            return
        self.reported = True
        numerator, denominator = float(value).as_integer_ratio()
        self.scaled += numerator << (_SCALE - denominator.bit_length() + 1)

    def merge(self, other: "ExactSum") -> None:
        self.scaled += other.scaled
        self.reported = self.reported or other.reported

    @property
    def value(self) -> Optional[float]:
        return float(Fraction(self.scaled, 1 << _SCALE)) if self.reported else None


class Scope:
    """Running totals over one set of samples (all finished, or kept only)."""

    _COUNTS = ("samples", "completed", "partial", "model_calls", "invalid_tool_calls", "turns_with", "turns_without",
               "samples_without_reasoning")

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

    def merge(self, other: "Scope") -> None:
        for name in self._COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name, (count, success, failure) in other.tools.items():
            totals = self.tools[name]
            totals[0] += count
            totals[1] += success
            totals[2] += failure
        self.partial_by_reason.update(other.partial_by_reason)

    def to_state(self) -> dict:
        state = {name: getattr(self, name) for name in self._COUNTS}
        state["tools"] = dict(self.tools)
        state["partial_by_reason"] = dict(self.partial_by_reason)
        return state

    @classmethod
    def from_state(cls, state: dict) -> "Scope":
        scope = cls()
        for name in cls._COUNTS:
            setattr(scope, name, int(state[name]))
        for name, totals in state["tools"].items():
            scope.tools[name] = [int(v) for v in totals]
        scope.partial_by_reason = Counter(state["partial_by_reason"])
        return scope


REWARD_BUCKETS = 10  # of the reward histogram over [0, 1]; rewards below 0 and above 1 have a bucket each


_BUCKETS = frozenset(f"{i / REWARD_BUCKETS:.1f}" for i in range(REWARD_BUCKETS))


def reward_bucket(reward: float) -> str:
    """The histogram bucket of a reward: ``"<0"``, ``"0.0"`` (0 <= r < 0.1) ... ``"0.9"`` (0.9 <= r <= 1), ``">1"``."""
    if reward < 0:
        return "<0"
    if reward > 1:
        return ">1"
    return f"{min(REWARD_BUCKETS - 1, int(reward * REWARD_BUCKETS)) / REWARD_BUCKETS:.1f}"


class Rewards:
    """What the verifiers said of the samples: reward totals, and per toolsets and row how many samples were
    scored and how many passed, which pass@k needs (a row's samples may lie in several files); the whole run's
    per-row counts are their sum (``rows``), not kept twice.

    Only samples a verifier ran on are counted, so a run without verifiers keeps nothing here.
    """

    def __init__(self) -> None:
        self.scored = self.verified = self.passed = 0  # samples a verifier ran on; of them, with a reward; passing
        self.reward_sum = ExactSum()  # of the verified samples' rewards
        self.buckets: Counter = Counter()  # reward_bucket -> verified samples
        # per row: samples scored << 32 | samples passed (one int, not a list: a million rows are a million entries)
        self.toolset_rows: dict[str, dict[int, int]] = {}  # toolsets ("terminal+file") -> prompt_index -> counts

    def add(self, traj: Trajectory) -> None:
        meta = traj.metadata
        if not meta.verifiers:
            return
        self.scored += 1
        # records read back are checked so already (serialization.py); a record made in the process may not be
        reward = stored_reward(meta.reward) if meta.verified else None
        passed = reward is not None and meta.passed
        self.passed += passed
        if reward is not None:
            self.verified += 1
            self.reward_sum.add(reward)
            self.buckets[reward_bucket(reward)] += 1
        counts = (1 << 32) | int(passed)
        index = traj.prompt_index
        rows = self.toolset_rows.setdefault("+".join(traj.toolsets_used), {})
        rows[index] = rows.get(index, 0) + counts

    def merge(self, other: "Rewards") -> None:
        self.scored += other.scored
        self.verified += other.verified
        self.passed += other.passed
        self.reward_sum.merge(other.reward_sum)
        self.buckets.update(other.buckets)
        for toolsets, rows in other.toolset_rows.items():
            _add_rows(self.toolset_rows.setdefault(toolsets, {}), rows)

    def mean(self) -> Optional[float]:
        """The verified samples' mean reward; None without any, or when the totals are none that rewards in
        [0, 1] could sum to (an index saved by an older version, or edited)."""
        if not self.verified or not self.reward_sum.reported:
            return None
        mean = Fraction(self.reward_sum.scaled, self.verified << _SCALE)  # exact: never overflows a float
        return float(mean) if 0 <= mean <= 1 else None

    def plausible(self) -> bool:
        """True when the totals are ones that records read with today's checks could give: every reward in
        [0, 1] (formats/reward_numbers.py), so their sum is at most the count of verified samples."""
        if not 0 <= self.passed <= self.verified <= self.scored:
            return False
        if not 0 <= self.reward_sum.scaled <= self.verified << _SCALE:
            return False
        return all(bucket in _BUCKETS and count >= 0 for bucket, count in self.buckets.items())

    def forget_reward_sum(self) -> None:
        """Drop the totals ``plausible`` refused where the records that gave them are gone: no mean is reported."""
        self.reward_sum = ExactSum()
        self.buckets = Counter({b: n for b, n in self.buckets.items() if b in _BUCKETS and n >= 0})

    @property
    def rows(self) -> dict[int, int]:
        """Per row, over all its samples: samples scored << 32 | samples passed (``toolset_rows`` summed)."""
        rows: dict[int, int] = {}
        for by_row in self.toolset_rows.values():
            _add_rows(rows, by_row)
        return rows

    @staticmethod
    def shapes(rows: dict) -> Counter:
        """How many rows of ``rows`` (``self.rows`` or one of ``toolset_rows``) had each ``(samples, passed)``."""
        return Counter({(value >> 32, value & 0xFFFFFFFF): count for value, count in Counter(rows.values()).items()})

    def to_state(self) -> Optional[dict]:
        if not self.scored:  # no verifier ran: nothing to write at each save of the index
            return None
        return {
            "scored": self.scored, "verified": self.verified, "passed": self.passed,
            "reward_sum": [str(self.reward_sum.scaled), self.reward_sum.reported], "buckets": dict(self.buckets),
            "toolset_rows": {toolsets: _pack_rows(rows) for toolsets, rows in self.toolset_rows.items()},
        }

    @classmethod
    def from_state(cls, state: Optional[dict]) -> "Rewards":
        rewards = cls()
        if not state:  # an index saved before rewards were counted: its records had none
            return rewards
        rewards.scored, rewards.verified, rewards.passed = (int(state[k]) for k in ("scored", "verified", "passed"))
        scaled, reported = state["reward_sum"]
        rewards.reward_sum = ExactSum(int(scaled), bool(reported))
        rewards.buckets = Counter({str(k): int(v) for k, v in state["buckets"].items()})
        rewards.toolset_rows = {str(t): _unpack_rows(rows) for t, rows in state["toolset_rows"].items()}
        return rewards


class Audit:
    """What the shortcut audit found (``metadata.audit``): samples audited, those with findings, per kind, and the
    same of the passing and of the kept samples.  Records without an audit (older versions) are not counted."""

    _COUNTS = ("audited", "passed", "with_findings", "passed_with_findings", "kept_with_findings")

    def __init__(self) -> None:
        self.audited = self.passed = 0  # samples audited; of them, passing
        self.with_findings = self.passed_with_findings = self.kept_with_findings = 0
        self.by_kind: Counter = Counter()  # kind -> samples with a finding of it
        self.passed_by_kind: Counter = Counter()

    def add(self, traj: Trajectory, kept: bool) -> None:
        meta = traj.metadata
        if meta.audit is None:
            return
        self.audited += 1
        self.passed += meta.passed
        if not meta.audit:
            return
        kinds = {f.kind for f in meta.audit if f.kind in AUDIT_KINDS}  # a newer version's kind is not counted
        self.with_findings += 1
        self.passed_with_findings += meta.passed
        self.kept_with_findings += kept
        self.by_kind.update(kinds)
        if meta.passed:
            self.passed_by_kind.update(kinds)

    def merge(self, other: "Audit") -> None:
        for name in self._COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.by_kind.update(other.by_kind)
        self.passed_by_kind.update(other.passed_by_kind)

    def to_state(self) -> Optional[dict]:
        if not self.audited:  # records of versions before the audit: nothing to save
            return None
        return {**{name: getattr(self, name) for name in self._COUNTS}, "by_kind": dict(self.by_kind),
                "passed_by_kind": dict(self.passed_by_kind)}

    @classmethod
    def from_state(cls, state: Optional[dict]) -> "Audit":
        audit = cls()
        if not state:  # an index saved before the audit, or of records without one
            return audit
        for name in cls._COUNTS:
            setattr(audit, name, int(state[name]))
        audit.by_kind = Counter({str(k): int(v) for k, v in state["by_kind"].items()})
        audit.passed_by_kind = Counter({str(k): int(v) for k, v in state["passed_by_kind"].items()})
        return audit


def pack_array(values: array.array) -> str:
    """An array as base64 of its little-endian bytes: how the indexes save digests, times and per-row counts."""
    if sys.byteorder != "little":
        values = array.array(values.typecode, values)
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


def unpack_array(typecode: str, text: str) -> array.array:
    values = array.array(typecode)
    values.frombytes(base64.b64decode(text.encode("ascii"), validate=True))
    if sys.byteorder != "little":
        values.byteswap()
    return values


def _pack_rows(rows: dict) -> list:
    """Per-row counts as two base64 arrays (prompt indices, counts): a million rows save and load in a blink."""
    return [pack_array(array.array("q", rows.keys())), pack_array(array.array("Q", rows.values()))]


def _unpack_rows(state: list) -> dict:
    indices, counts = unpack_array("q", state[0]), unpack_array("Q", state[1])
    if len(indices) != len(counts):
        raise ValueError("the rows' arrays differ in length")
    return dict(zip(indices, counts))


def _add_rows(mine: dict, theirs: dict) -> None:
    for index, counts in theirs.items():
        mine[index] = mine.get(index, 0) + counts


class Requests:
    """Model requests per provider: count, errors, and latencies in whole milliseconds (for exact medians)."""

    def __init__(self) -> None:
        self.requests: Counter = Counter()
        self.errors: Counter = Counter()
        self.refused: Counter = Counter()  # answered 429: the endpoint's rate limit
        self.latency_ms: dict[str, Counter] = defaultdict(Counter)
        self.rate_limited: Optional[int] = None  # None: the limiters' counts of the sessions
        self.unanswered = 0

    def add(self, calls: Iterable[CallRecord]) -> None:
        for call in calls:
            provider = call.provider or "unknown"
            self.requests[provider] += 1
            if call.status not in (200, CANCELLED_STATUS):  # cut off by the run itself: no error of the endpoint
                self.errors[provider] += 1
                self.refused[provider] += call.status == 429
            self.latency_ms[provider][int(round(call.latency_s * 1000))] += 1

    def merge(self, other: "Requests") -> None:
        self.requests.update(other.requests)
        self.errors.update(other.errors)
        self.refused.update(other.refused)
        for provider, histogram in other.latency_ms.items():
            self.latency_ms[provider].update(histogram)

    def to_state(self) -> dict:
        return {"requests": dict(self.requests), "errors": dict(self.errors), "refused": dict(self.refused),
                "latency_ms": {p: {str(ms): n for ms, n in h.items()} for p, h in self.latency_ms.items()}}

    @classmethod
    def from_state(cls, state: dict) -> "Requests":
        requests = cls()
        requests.requests = Counter(state["requests"])
        requests.errors = Counter(state["errors"])
        requests.refused = Counter(state.get("refused", {}))  # not in an index of an earlier version
        for provider, histogram in state["latency_ms"].items():
            requests.latency_ms[provider] = Counter({int(ms): n for ms, n in histogram.items()})
        return requests


class Aggregate:
    """The totals statistics.json and the merge need from a set of kept, discarded and failed records."""

    _COUNTS = ("discarded", "usage_reported", "failure_records", "prompt_tokens", "completion_tokens",
               "reasoning_tokens", "cached_tokens")

    def __init__(self) -> None:
        self.finished, self.kept = Scope(), Scope()
        self.discarded = self.usage_reported = self.failure_records = 0
        self.prompt_tokens = self.completion_tokens = self.reasoning_tokens = self.cached_tokens = 0
        self.cost = ExactSum()
        self.by_filter: Counter = Counter()
        self.reasons: Counter = Counter()  # (filter, reason) of the discarded samples
        self.tools: set[str] = set()  # tool names in the stats of any finished sample
        self.merge_tools: set[str] = set()  # in the stats or error counts of any kept sample: every merged line lists them
        self.requests = Requests()
        self.rewards = Rewards()  # of every finished sample, kept or discarded
        self.audit = Audit()  # of every finished sample, kept or discarded
        self.token_checks: Counter = Counter()  # metadata.token_check of the finished samples (--logprobs)
        self.first_ts: Optional[str] = None
        self.last_ts: Optional[str] = None
        # (content key, timestamp, error kind) of every failure record: few, and needed whole to tell which still fail
        self.failures: list[tuple[str, str, str]] = []

    def add(self, record: Union[Trajectory, Discarded, Failure]) -> None:
        """Count one record of the run."""
        if isinstance(record, Failure):
            self.failure_records += 1
            self.requests.add(record.calls)
            self._add_usage(record.usage)
            self.failures.append((record.content_key, record.timestamp, record.error_kind))
            return
        if isinstance(record, Discarded):
            traj = record.trajectory
            self.discarded += 1
            self.by_filter.update(set(record.filters))
            for name, reason in zip(record.filters, record.reasons):
                self._add_reason((name, reason[:_REASON_CHARS]), 1)
        else:
            traj = record
            self.kept.add(traj)
            self.merge_tools.update(traj.tool_stats)
            self.merge_tools.update(traj.tool_error_counts)
        self.finished.add(traj)
        self.rewards.add(traj)
        self.audit.add(traj, kept=traj is record)
        self.tools.update(traj.tool_stats)
        meta = traj.metadata
        if meta.token_check in TOKEN_CHECKS:  # what another version may write is not counted
            self.token_checks[meta.token_check] += 1
        usage = self._add_usage(meta.usage)
        self.usage_reported += bool(usage.prompt_tokens or usage.completion_tokens)
        self.requests.add(meta.calls)
        if meta.timestamp:
            self.first_ts = meta.timestamp if self.first_ts is None else min(self.first_ts, meta.timestamp)
            self.last_ts = meta.timestamp if self.last_ts is None else max(self.last_ts, meta.timestamp)

    def _add_usage(self, usage) -> Usage:
        # counted as the record is written and read back: a value no record can hold is not reported
        usage = stored_usage({name: getattr(usage, name) for name in _USAGE_FIELDS})
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.reasoning_tokens += usage.reasoning_tokens
        self.cached_tokens += usage.cached_tokens
        self.cost.add(usage.cost)
        return usage

    def _add_reason(self, key: tuple, count: int) -> None:
        if key in self.reasons or len(self.reasons) < _MAX_REASONS:
            self.reasons[key] += count
        else:
            self.reasons[(key[0], "(other reasons)")] += count

    def merge(self, other: "Aggregate") -> None:
        """Add the totals of another set of records."""
        self.finished.merge(other.finished)
        self.kept.merge(other.kept)
        for name in self._COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.cost.merge(other.cost)
        self.by_filter.update(other.by_filter)
        for key, count in other.reasons.items():
            self._add_reason(key, count)
        self.tools |= other.tools
        self.merge_tools |= other.merge_tools
        self.requests.merge(other.requests)
        self.rewards.merge(other.rewards)
        self.audit.merge(other.audit)
        self.token_checks.update(other.token_checks)
        for ts in (other.first_ts, other.last_ts):
            if ts is not None:
                self.first_ts = ts if self.first_ts is None else min(self.first_ts, ts)
                self.last_ts = ts if self.last_ts is None else max(self.last_ts, ts)
        self.failures += other.failures

    def to_state(self) -> dict:
        state = {name: getattr(self, name) for name in self._COUNTS}
        state.update(
            finished=self.finished.to_state(), kept=self.kept.to_state(),
            cost=[str(self.cost.scaled), self.cost.reported], by_filter=dict(self.by_filter),
            reasons=[[name, reason, count] for (name, reason), count in self.reasons.items()],
            tools=sorted(self.tools), merge_tools=sorted(self.merge_tools), requests=self.requests.to_state(),
            rewards=self.rewards.to_state(), audit=self.audit.to_state(), token_checks=dict(self.token_checks),
            first_ts=self.first_ts,
            last_ts=self.last_ts, failures=self.failures,
        )
        return state

    @classmethod
    def from_state(cls, state: dict) -> "Aggregate":
        """The aggregate ``to_state`` saved; raises KeyError, TypeError or ValueError on a damaged one."""
        agg = cls()
        for name in cls._COUNTS:
            setattr(agg, name, int(state[name]))
        agg.finished, agg.kept = Scope.from_state(state["finished"]), Scope.from_state(state["kept"])
        scaled, reported = state["cost"]
        agg.cost = ExactSum(int(scaled), bool(reported))
        agg.by_filter = Counter(state["by_filter"])
        agg.reasons = Counter({(str(n), str(r)): int(c) for n, r, c in state.get("reasons", ())})  # none in older ones
        agg.tools, agg.merge_tools = set(state["tools"]), set(state["merge_tools"])
        agg.requests = Requests.from_state(state["requests"])
        agg.rewards = Rewards.from_state(state.get("rewards"))
        agg.audit = Audit.from_state(state.get("audit"))  # none in indexes of versions before the audit
        checks = state.get("token_checks") or {}  # none in indexes of versions before --logprobs
        if not isinstance(checks, dict):
            raise TypeError("token_checks is not an object")
        agg.token_checks = Counter({k: int(v) for k, v in checks.items() if k in TOKEN_CHECKS})
        agg.first_ts, agg.last_ts = state["first_ts"], state["last_ts"]
        agg.failures = [(str(k), str(t), str(e)) for k, t, e in state["failures"]]
        return agg
