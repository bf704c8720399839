"""``near-duplicates``: MinHash over word shingles, with LSH banding to find candidate pairs.

Of trajectories whose estimated Jaccard similarity (of their word 5-grams) is at
least ``threshold``, the one with the lowest ``prompt_index`` is kept and the
others are discarded, naming it.  A trajectory is only compared with kept ones,
so no two kept trajectories are near-duplicates of each other, up to the
banding's chance of missing a pair: with the defaults about 4% of pairs right
at the threshold (where the estimate itself is as likely above as below), under
0.1% of pairs five points above it.

The similarity is estimated: with ``num_perm`` hashes its standard deviation
is sqrt(J(1-J)/num_perm), 0.02 for a pair 95% alike with the default 128, so
such a pair is judged below a 0.9 threshold about once in 200; raise
``num_perm`` or lower ``threshold`` for a wider margin.

Memory: ``num_perm`` 32-bit values per trajectory (512 bytes by default), so a
million trajectories need about half a gigabyte.  Deterministic: the hash
permutations come from a fixed seed.
"""

from __future__ import annotations

import json
from typing import Iterable

import attrs

from hermes_batch import RunFilter, Trajectory

from .rules import _at_least


def _over_choice(_instance, attribute, value):
    if value not in ("answer", "trajectory"):
        raise ValueError(f"{attribute.name} must be 'answer' or 'trajectory', got {value!r}")


def _threshold_range(_instance, attribute, value):
    if not 0 < value <= 1:
        raise ValueError(f"{attribute.name} must be above 0 and at most 1, got {value}")


def text_of(trajectory: Trajectory, over: str) -> str:
    """What is compared: the final answer, or what the agent did over every non-system turn.

    A tool turn counts by each result's tool name and content, without the ``tool_call_id`` the endpoint made up
    (new for every call, so the same session run twice would otherwise differ in every shingle holding one);
    the assistant turns' call blocks hold only the tool name and arguments already.
    """
    if over == "answer":
        return trajectory.final_answer or ""
    parts = []
    for turn in trajectory.conversations:
        if turn.from_ == "system":
            continue
        results = turn.tool_results
        if not results:
            parts.append(turn.value)
        for result in results:
            content = result.get("content")
            parts.append(f"{result.get('name', '')}\n{content if isinstance(content, str) else json.dumps(content)}")
    return "\n".join(parts)


class NearDuplicatesFilter(RunFilter):
    """Discard trajectories that nearly repeat an earlier kept one (MinHash + LSH over the whole run)."""

    @attrs.frozen
    class Config:
        threshold: float = attrs.field(default=0.9, validator=_threshold_range)  # estimated Jaccard similarity
        over: str = attrs.field(default="answer", validator=_over_choice)  # "answer" or "trajectory"
        num_perm: int = attrs.field(default=128, validator=_at_least(16))
        shingle: int = attrs.field(default=5, validator=_at_least(1))  # words per shingle

    name = "near-duplicates"
    description = ("Discard trajectories whose final answer (over=trajectory: whole conversation) nearly repeats an "
                   "earlier kept one: MinHash, estimated Jaccard >= threshold (default 0.9); export and refilter only.")

    def select(self, candidates: Iterable[tuple[object, Trajectory]]) -> dict:
        from .minhash import MinHasher, band_layout, similarity  # numpy, only when the filter runs

        c = self.config
        hasher = MinHasher(c.num_perm, c.shingle)
        docs = []  # (prompt_index, key, signature)
        for key, trajectory in candidates:
            signature = hasher.signature(text_of(trajectory, c.over))
            if signature is not None:
                docs.append((trajectory.prompt_index, key, signature))
        docs.sort(key=lambda doc: doc[0])
        bands, rows = band_layout(c.threshold, c.num_perm)
        buckets: list[dict] = [{} for _ in range(bands)]
        what = "final answer" if c.over == "answer" else "trajectory"
        rejected = {}
        for index, key, signature in docs:
            keys = [signature[band * rows : (band + 1) * rows].tobytes() for band in range(bands)]
            seen: set = set()
            match = None
            for band, band_key in enumerate(keys):
                for other_index, other in buckets[band].get(band_key, ()):
                    if other_index in seen:
                        continue
                    seen.add(other_index)
                    alike = similarity(signature, other)
                    if alike >= c.threshold:
                        match = (other_index, alike)
                        break
                if match:
                    break
            if match:
                rejected[key] = (f"near-duplicate of prompt {match[0]} "
                                 f"({match[1]:.0%} alike over the {what}, threshold {c.threshold:.0%})")
                continue
            for band, band_key in enumerate(keys):
                buckets[band].setdefault(band_key, []).append((index, signature))
        return rejected
