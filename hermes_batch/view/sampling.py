"""Picking records from the view index's columns: those of a status, an even spread of them, failures left."""

from __future__ import annotations

from collections import Counter
from typing import Iterator

from .fields import FAILED

_FEW = 4096  # of a status: fewer rows than this are listed one by one to pick samples from
_BLOCK = 4096


def rows_of(columns, status: int) -> Iterator[int]:
    """The record numbers of one status, in order (found in the column's bytes, not row by row)."""
    column = columns.status[:len(columns)].tobytes()
    code = bytes((status,))
    i = column.find(code)
    while i >= 0:
        yield i
        i = column.find(code, i + 1)


def spread(columns, status: int, k: int, max_length: int) -> list:
    """``k`` records of ``status`` no longer than ``max_length``, spread evenly (first and last included).

    The same choice every time.  A status with many records is not listed:
    the n-th record of it is found from counts of the status column's bytes
    by blocks (a record longer than ``max_length`` gives way to the next).
    """
    length = columns.length
    count = len(columns)
    column = columns.status[:count].tobytes()
    code = bytes((status,))
    total = column.count(code)
    if total <= max(k, _FEW):
        return _spread([i for i in rows_of(columns, status) if length[i] <= max_length], k)
    blocks = [column.count(code, start, start + _BLOCK) for start in range(0, count, _BLOCK)]
    step = (total - 1) / (k - 1) if k > 1 else 0
    chosen: list = []
    for j in range(k):
        i = _nth(column, code, blocks, round(j * step))
        while i >= 0 and (length[i] > max_length or (chosen and i <= chosen[-1])):
            i = column.find(code, i + 1)
        if i < 0:
            break
        chosen.append(i)
    return chosen


def _nth(column: bytes, code: bytes, blocks: list, nth: int) -> int:
    """The row of the ``nth`` byte ``code`` of ``column``, from the block counts ``blocks``."""
    start = 0
    for n in blocks:  # the block that holds the nth record of the status
        if nth < n:
            break
        nth, start = nth - n, start + _BLOCK
    i = column.find(code, start)
    for _ in range(nth):
        i = column.find(code, i + 1)
    return i


def _spread(items: list, k: int) -> list:
    """``k`` items spread evenly over ``items`` (first and last included): a sample that is the same every time."""
    if len(items) <= k:
        return items
    step = (len(items) - 1) / (k - 1) if k > 1 else 0
    return [items[round(j * step)] for j in range(k)]


def still_failed(columns) -> set:
    """Record numbers of failures whose prompt has no finished record (a later retry did not succeed)."""
    keys = columns.key
    failed = list(rows_of(columns, FAILED))
    if not failed:
        return set()
    failed_keys = {keys[i] for i in failed}
    # rows of any status with one of those keys, counted in C; less the failures, the finished ones remain
    finished = Counter(filter(failed_keys.__contains__, keys[:len(columns)]))
    finished.subtract(keys[i] for i in failed)
    latest = {}  # a prompt that failed in several sessions counts once, by its last failure
    for i in failed:
        if not finished[keys[i]]:
            latest[keys[i]] = i
    return set(latest.values())
