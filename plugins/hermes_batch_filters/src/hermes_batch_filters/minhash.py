"""The numpy half of ``near-duplicates``: MinHash signatures and the LSH band layout.

Its own module, imported when the filter runs: numpy took 0.2 s at the start of
every run and worker process with this plugin installed, filter used or not.
"""

from __future__ import annotations

import re
import zlib

import numpy as np

_PRIME = np.uint64((1 << 61) - 1)
_MAX_HASH = np.uint64((1 << 32) - 1)
_WORD = re.compile(r"\w+")
_SEED = 1
_CHUNK = 4096  # shingles hashed at once: bounds the temporary (num_perm x chunk) array
_integrate = getattr(np, "trapezoid", None) or np.trapz  # trapz was renamed in numpy 2


class MinHasher:
    """MinHash signatures of texts: ``num_perm`` universal hashes of each word ``shingle``-gram, minimised."""

    def __init__(self, num_perm: int = 128, shingle: int = 5, seed: int = _SEED):
        rng = np.random.RandomState(seed)
        self.num_perm, self.shingle = num_perm, shingle
        self.a = rng.randint(1, int(_PRIME), size=num_perm, dtype=np.uint64)[:, None]
        self.b = rng.randint(0, int(_PRIME), size=num_perm, dtype=np.uint64)[:, None]

    def shingles(self, text: str) -> set:
        words = _WORD.findall(text.lower())
        if not words:
            return set()
        n = min(self.shingle, len(words))
        return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}

    def signature(self, text: str):
        """The signature (uint32 array), or None for a text without words."""
        shingles = self.shingles(text)
        if not shingles:
            return None
        hashes = np.fromiter((zlib.crc32(s.encode("utf-8")) for s in shingles), dtype=np.uint64, count=len(shingles))
        signature = np.full(self.num_perm, _MAX_HASH, dtype=np.uint64)
        for start in range(0, len(hashes), _CHUNK):
            chunk = hashes[None, start : start + _CHUNK]
            # uint64 products wrap around, as in the usual MinHash implementations; the prime mixes them again
            permuted = ((self.a * chunk + self.b) % _PRIME) & _MAX_HASH
            np.minimum(signature, permuted.min(axis=1), out=signature)
        return signature.astype(np.uint32)


def band_layout(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) for LSH: the layout whose S-curve best separates pairs above and below ``threshold``.

    Missing a true pair weighs thirty times as much as a candidate that the
    signature comparison then rejects (which only costs time).
    """
    grid = np.linspace(0.0, 1.0, 201)
    best, best_cost = (1, num_perm), np.inf
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        hit = 1 - (1 - grid**rows) ** bands
        false_positive = _integrate(np.where(grid < threshold, hit, 0.0), grid)
        false_negative = _integrate(np.where(grid >= threshold, 1 - hit, 0.0), grid)
        cost = false_positive + 30 * false_negative
        if cost < best_cost:
            best, best_cost = (bands, rows), cost
    return best


def similarity(signature, other) -> float:
    """The estimated Jaccard similarity of two signatures: the share of their hashes that agree."""
    return float(np.mean(signature == other))
