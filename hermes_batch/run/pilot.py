"""--pilot FRACTION: which rows a pilot runs, a stratified share of the dataset.

A row's stratum is what is likely to change its cost and yield: the toolsets the distribution drew for
it, its image, its ``task`` field when it has one, and the field named by ``--pilot_by``.  Each stratum
gives ``ceil(FRACTION * rows)`` of its rows (at least one), those whose draw from (seed, content key) is
smallest: proportional allocation, so the pilot's pooled figures weigh the strata as the dataset does.
The pilot's rows are fixed by the seed and the rows' content, so a pilot run again picks the same rows,
and the ``--resume`` after it runs only the others (their records are found by content key).
"""

from __future__ import annotations

import collections
import hashlib
import heapq
import json
import math
from typing import Callable, Optional

import attrs

from ..folder import offloop, rowkeys

MAX_STRATUM_CHARS = 200  # a field's value in a stratum's name: enough to tell values apart, never a whole document


def draw(*parts) -> float:
    """A number in [0, 1) fixed by ``parts``."""
    digest = hashlib.sha256("\0".join(map(str, parts)).encode("utf-8")).digest()
    return int.from_bytes(digest[:7], "big") / (1 << 56)


@attrs.frozen
class Pilot:
    """The rows a pilot runs and the strata of the dataset."""

    fraction: float
    by: Optional[str]
    rows: frozenset  # prompt indexes of the pilot's rows
    of_row: dict  # prompt index of a pilot row -> its stratum
    strata: dict  # stratum -> rows of the dataset in it


def stratum(row, toolsets: tuple, by: Optional[str]) -> str:
    """The stratum of a dataset row (a PromptRow) given the toolsets drawn for it."""
    parts = ["+".join(toolsets) or "(no toolsets)", row.image or ""]
    for name in ("task", by) if by not in (None, "task") else ("task",):
        value = getattr(row, name, None) if name in ("image", "cwd", "id", "prompt") else row.extra.get(name)
        parts.append("" if value is None else json.dumps(value, sort_keys=True, ensure_ascii=False)[:MAX_STRATUM_CHARS])
    return " | ".join(parts)


def choose(dataset_file, max_rows: Optional[int], fraction: float, by: Optional[str],
           toolsets_of: Callable[[str], tuple], seed: int) -> Pilot:
    """The pilot's rows: two passes over the dataset (count the strata, then keep each one's smallest draws);
    memory is that of the strata and the rows chosen.  Runs off the event loop."""
    sizes: collections.Counter = collections.Counter()
    for row in offloop.stoppable(rowkeys.rows_left(dataset_file, max_rows, None)):
        sizes[stratum(row, toolsets_of(row.content_key), by)] += 1
    wanted = {name: max(1, math.ceil(fraction * size)) for name, size in sizes.items()}
    kept: dict = collections.defaultdict(list)  # stratum -> heap of (-draw, prompt index): its smallest draws
    for row in offloop.stoppable(rowkeys.rows_left(dataset_file, max_rows, None)):
        name = stratum(row, toolsets_of(row.content_key), by)
        item = (-draw(seed, "pilot", row.content_key), row.prompt_index)
        heap = kept[name]
        if len(heap) < wanted[name]:
            heapq.heappush(heap, item)
        elif item > heap[0]:
            heapq.heapreplace(heap, item)
    of_row = {index: name for name, heap in kept.items() for _d, index in heap}
    return Pilot(fraction, by, frozenset(of_row), of_row, dict(sizes))
