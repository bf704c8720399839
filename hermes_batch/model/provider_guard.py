"""The provider guard: per-provider figures of the model's answers, and the exclusion of a provider that is
significantly worse than the rest.

OpenRouter serves one model through several upstream providers, whose quantization and tool-call handling
differ.  Each answered call is counted under the provider the answer names (``ModelResponse.provider``):
an invalid tool call (arguments that are not a JSON object, or a tool that was not offered), an empty
answer (no text, no tool call) and a cut answer (``finish_reason`` ``length``) are its failures; its
latency and, per sample, whether a verifier passed it are kept as figures.

The test (docs/options.md, "The provider guard"): each time a provider's answered calls reach a multiple
of ``LOOK_EVERY``, with at least ``MIN_CALLS`` of its own and ``MIN_CALLS`` of the other providers still
in use, its failure rate p1 is compared with the pooled rate p0 of those others by a one-sided
two-proportion z-test with a margin: H0 ``p1 - p0 <= MARGIN`` against H1 ``p1 - p0 > MARGIN``, with
Agresti and Caffo's adjusted proportions (one failure and one success added to each group) so that
rates of 0 or 1 still have a variance.  It is excluded when the p-value is below ``ALPHA / m * 6 /
(pi**2 * k**2)``: Bonferroni over the ``m`` providers seen, and over the looks at one provider an alpha
spent as ``6 / (pi**2 * k**2)`` for its k-th look (these sum to 1), so the chance of excluding a
provider no worse than the margin stays under ``ALPHA`` over the whole run, however long.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Callable, Iterable, Optional

import attrs

from ..formats.jsonguard import scrub_text
from ..formats.records import ModelResponse

log = logging.getLogger("hermes_batch.run")

ALPHA = 0.01
MARGIN = 0.05
MIN_CALLS = 50
LOOK_EVERY = 25
MAX_PROVIDER_CHARS = 100
MAX_PROVIDERS = 1000  # names counted; an endpoint that names a new provider per call cannot grow the guard without end
FAILURES = ("invalid_tool_calls", "empty_answers", "cut_answers")
_NORMAL = statistics.NormalDist()


def provider_name(value) -> Optional[str]:
    """The provider an endpoint names, as the run keeps it: a short line of text, else None (the endpoint is
    not trusted: a megabyte, a newline or a control character in a name would reach every record and log)."""
    if not isinstance(value, str):
        return None
    value = value.strip()
    if not value or len(value) > MAX_PROVIDER_CHARS or any(ord(c) < 32 or ord(c) == 127 for c in value):
        return None
    return scrub_text(value)


@attrs.define
class ProviderFigures:
    """One provider's counts in this session."""

    answered: int = 0
    invalid_tool_calls: int = 0
    empty_answers: int = 0
    cut_answers: int = 0
    failed: int = 0  # answers with any of the three
    latency_s: float = 0.0  # summed over the answered calls
    samples_verified: int = 0
    samples_passed: int = 0
    looks: int = 0

    def as_dict(self) -> dict:
        out = {name: getattr(self, name) for name in ("answered", *FAILURES, "failed")}
        out["failure_rate"] = round(self.failed / self.answered, 4) if self.answered else None
        out["mean_latency_s"] = round(self.latency_s / self.answered, 3) if self.answered else None
        out["samples_verified"] = self.samples_verified
        out["pass_rate"] = round(self.samples_passed / self.samples_verified, 4) if self.samples_verified else None
        return out


@attrs.frozen
class Exclusion:
    """A provider the guard excluded, with the figures of the test that did it."""

    provider: str
    answered: int
    failure_rate: float
    rest_failure_rate: float
    p_value: float
    threshold: float

    def as_dict(self) -> dict:
        return attrs.asdict(self)


def one_sided_p(failed: int, n: int, rest_failed: int, rest_n: int, margin: float = MARGIN) -> float:
    """The p-value of H0 ``p1 - p0 <= margin`` (Agresti-Caffo adjusted proportions, normal approximation)."""
    p1, p0 = (failed + 1) / (n + 2), (rest_failed + 1) / (rest_n + 2)
    se = math.sqrt(p1 * (1 - p1) / (n + 2) + p0 * (1 - p0) / (rest_n + 2))
    return 1.0 - _NORMAL.cdf((p1 - p0 - margin) / se)


class ProviderGuard:
    """Counts each provider's answers and excludes one significantly worse than the rest (see the module).

    ``active``: exclusions are made (routing fields reach the endpoint); otherwise the guard only counts, and
    says once which provider it would have excluded.  ``on_exclude`` is called with each new exclusion (the
    run persists it).
    """

    def __init__(self, *, active: bool = True, excluded: Iterable[Exclusion] = (),
                 on_exclude: Optional[Callable[[Exclusion], None]] = None, alpha: float = ALPHA,
                 margin: float = MARGIN, min_calls: int = MIN_CALLS, look_every: int = LOOK_EVERY):
        self.active = active
        self.exclusions: list[Exclusion] = list(excluded)
        self.excluded: tuple[str, ...] = tuple(e.provider for e in self.exclusions)
        self.version = 0  # bumped by each exclusion: clients rebuild their routing fields when it changed
        self.on_exclude = on_exclude
        self.alpha, self.margin, self.min_calls, self.look_every = alpha, margin, min_calls, look_every
        self.figures: dict[str, ProviderFigures] = {}
        self.after_exclusion: dict[str, int] = {}  # answers that still came from a provider once excluded
        self._warned: set[str] = set()

    # --- counting -------------------------------------------------------------------------------

    def answered(self, response: ModelResponse, tools: tuple, latency_s: float = 0.0) -> None:
        """Count one answered call."""
        figures = self._figures(response.provider)
        if figures is None:
            return
        message = response.message
        offered = {tool.name for tool in tools}
        invalid = any(call.arguments is None or call.name not in offered for call in message.tool_calls)
        empty = not message.tool_calls and not (message.content or "").strip()
        cut = response.finish_reason == "length"
        figures.answered += 1
        figures.invalid_tool_calls += invalid
        figures.empty_answers += empty
        figures.cut_answers += cut
        figures.failed += invalid or empty or cut
        figures.latency_s += max(0.0, latency_s)
        name = provider_name(response.provider)
        if name in self.excluded:
            self.after_exclusion[name] = self.after_exclusion.get(name, 0) + 1
            return
        if figures.answered >= self.min_calls and figures.answered % self.look_every == 0:
            self._look(name, figures)

    def sample_ended(self, outcome) -> None:
        """A sample ended: when a verifier ran, its pass counts for each provider that answered in it."""
        meta = getattr(outcome, "metadata", None)
        if meta is None or not meta.verifiers:
            return
        passed = meta.passed
        for provider in {call.provider for call in meta.calls if call.status == 200}:
            figures = self._figures(provider)
            if figures is not None:
                figures.samples_verified += 1
                figures.samples_passed += bool(passed)

    def _figures(self, provider) -> Optional[ProviderFigures]:
        name = provider_name(provider)
        if name is None:
            return None  # not named: nothing to exclude it by
        figures = self.figures.get(name)
        if figures is None:
            if len(self.figures) >= MAX_PROVIDERS:
                return None
            figures = self.figures[name] = ProviderFigures()
        return figures

    # --- the test -------------------------------------------------------------------------------

    def _look(self, name: str, figures: ProviderFigures) -> None:
        rest = [f for other, f in self.figures.items() if other != name and other not in self.excluded]
        rest_n, rest_failed = sum(f.answered for f in rest), sum(f.failed for f in rest)
        if rest_n < self.min_calls:
            return  # nothing to compare with yet
        figures.looks += 1
        threshold = self.alpha / len(self.figures) * 6 / (math.pi ** 2 * figures.looks ** 2)
        p_value = one_sided_p(figures.failed, figures.answered, rest_failed, rest_n, self.margin)
        if p_value >= threshold:
            return
        exclusion = Exclusion(name, figures.answered, round(figures.failed / figures.answered, 4),
                              round(rest_failed / rest_n, 4), float(f"{p_value:.3g}"), float(f"{threshold:.3g}"))
        if not self.active:
            if name not in self._warned:
                self._warned.add(name)
                log.warning("Provider %s fails %.0f%% of its answers against %.0f%% for the others (p=%.2g), but "
                            "routing fields are not sent to this endpoint, so it is not excluded (see --routing).",
                            name, exclusion.failure_rate * 100, exclusion.rest_failure_rate * 100, p_value)
            return
        self.exclusions.append(exclusion)
        self.excluded += (name,)
        self.version += 1
        log.warning("Provider %s excluded for the rest of the run: %.0f%% of its %d answers failed (invalid tool "
                    "calls, empty or cut answers) against %.0f%% for the other providers (p=%.2g < %.2g).",
                    name, exclusion.failure_rate * 100, figures.answered, exclusion.rest_failure_rate * 100,
                    p_value, threshold)
        if self.on_exclude is not None:
            self.on_exclude(exclusion)

    # --- what the run shows and records -------------------------------------------------------------

    def statistics(self) -> dict:
        """statistics.json's ``provider_guard``: this session's figures per provider, and every exclusion."""
        return {
            "active": self.active,
            "test": {"alpha": self.alpha, "margin": self.margin, "min_calls": self.min_calls,
                     "look_every": self.look_every},
            "excluded": [e.as_dict() for e in self.exclusions],
            "answers_after_exclusion": dict(self.after_exclusion),
            "by_provider": {name: f.as_dict() for name, f in sorted(self.figures.items())},
        }

    def summary(self) -> dict:
        """Lines for the progress display."""
        return {"excluded providers": ", ".join(self.excluded)} if self.excluded else {}


MAX_EXCLUSIONS = 100


def exclusions_from_state(data) -> list[Exclusion]:
    """The exclusions a run folder's provider_guard.json holds; ValueError, saying what is wrong, when the file
    is not what a run writes (it is read back, so not trusted)."""
    if not isinstance(data, dict) or not isinstance(data.get("excluded"), list):
        raise ValueError("it is not an object with an 'excluded' list")
    entries = data["excluded"]
    if len(entries) > MAX_EXCLUSIONS:
        raise ValueError(f"it names more than {MAX_EXCLUSIONS} providers")
    found = []
    for entry in entries:
        if not isinstance(entry, dict) or provider_name(entry.get("provider")) != entry.get("provider"):
            raise ValueError("an entry does not name a provider")
        numbers = {}
        for field in ("answered", "failure_rate", "rest_failure_rate", "p_value", "threshold"):
            value = entry.get(field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"the {field} of provider {entry['provider']!r} is not a number")
            numbers[field] = value
        found.append(Exclusion(entry["provider"], int(numbers.pop("answered")), **numbers))
    return found
