"""Several samples per row (--samples_per_prompt): which samples a session runs, and rejection sampling.

Sample ``i`` of a row is a record of its own whose content key is
``records.sample_key(row key, i)``: the row's own key for sample 0, so a run
folder written before samples existed (one sample a row) resumes as it did, and
a key of its own for every other sample, so the resume machinery (the indexes'
digests of finished records) sees each sample as one finished prompt.

``--max_samples N`` counts samples: the rows with prompt_index ``p`` run
samples ``i`` with ``p * K + i < N``.  Under ``--stop_on_success`` a row's
samples run one after another and a row stops at its first passing sample; a
resume skips the rows that already have one.
"""

from __future__ import annotations

import array
import collections
import collections.abc
import json
from typing import Optional

import attrs

from ..folder import offloop
from ..folder.rowkeys import RowKeys
from ..folder.runfolder import RunFolder
from ..formats.records import key_digest, sample_digest
from ..formats.reward_numbers import stored_reward


def count(prompt_index: int, per_row: int, max_samples: Optional[int]) -> int:
    """How many samples the row ``prompt_index`` has."""
    if max_samples is None:
        return per_row
    return max(0, min(per_row, max_samples - prompt_index * per_row))


class SamplesLeft(collections.abc.Sequence):
    """The sample indexes ``start``..``count - 1`` of a row but those in ``finished``, in order, made as they are
    asked for: a row may have a billion samples (--samples_per_prompt), of which a few finished."""

    __slots__ = ("start", "count", "finished", "_skipped")

    def __init__(self, count: int, finished: tuple, start: int = 0):
        self.start, self.count = start, count
        self.finished = tuple(sorted(i for i in set(finished) if start <= i < count))

    def __len__(self) -> int:
        return self.count - self.start - len(self.finished)

    def __iter__(self):
        skip = iter(self.finished)
        next_skip = next(skip, None)
        for i in range(self.start, self.count):
            if i == next_skip:
                next_skip = next(skip, None)
                continue
            yield i

    def __getitem__(self, at):
        if isinstance(at, slice):
            first, stop, step = at.indices(len(self))
            if step != 1:
                raise ValueError("SamplesLeft takes slices of step 1")
            if stop >= len(self):  # the rest of the row from ``first`` on: a view, made of nothing
                return SamplesLeft(self.count, self.finished, self[first] if first < len(self) else self.count)
            return tuple(self[k] for k in range(first, stop))
        if at < 0:
            at += len(self)
        if not 0 <= at < len(self):
            raise IndexError("sample index out of range")
        # the at-th index not finished: start + at, pushed on by each finished index at or before it
        candidate = self.start + at
        for done in self.finished:
            if done <= candidate:
                candidate += 1
            else:
                break
        return candidate

    def __repr__(self) -> str:
        return f"SamplesLeft({self.count}, {self.finished!r}, start={self.start})"


@attrs.frozen
class SampleMatch:
    """What a session runs: the rows with samples left (None: every row, every sample), each row's samples left."""

    left: Optional[array.array]  # prompt indexes, in file order
    finished: int  # finished records in the run folder
    skipped: int  # samples not to run: finished, or of rows that passed (--stop_on_success)
    samples: dict = attrs.field(factory=dict)  # prompt_index -> SamplesLeft, for the rows with a sample finished
    total: int = 0  # samples of the dataset (up to --max_samples)
    # --allocation adaptive: prompt_index -> ((sample, passed), ...) of the open rows' finished samples
    outcomes: dict = attrs.field(factory=dict)

    @property
    def to_run(self) -> int:
        return self.total - self.skipped

    def of(self, prompt_index: int, per_row: int, max_samples: Optional[int]):
        """The sample indexes left of the row ``prompt_index`` (a sequence made as it is read: a range, or a
        SamplesLeft; never a list of a billion numbers)."""
        found = self.samples.get(prompt_index)
        return found if found is not None else range(count(prompt_index, per_row, max_samples))


def total_samples(keys: RowKeys, per_row: int, max_samples: Optional[int]) -> int:
    """The samples of the dataset's valid rows (up to --max_samples)."""
    if max_samples is None:
        return per_row * len(keys.indexes)
    return sum(count(index, per_row, max_samples) for index in keys.indexes)


def match(keys: RowKeys, finished: Optional[array.array], per_row: int, max_samples: Optional[int],
          passed: Optional[set] = None, rule=None) -> SampleMatch:
    """Match the samples of every row against the digests of finished records (see rowkeys.match_finished).

    ``passed``: digests of finished records that passed; their rows run no more samples (--stop_on_success), or
    with ``rule`` (an ``adaptive.Rule``, --allocation adaptive) the rows it stops run no more, and the other rows'
    outcomes go to ``SampleMatch.outcomes``.
    Memory is that of the rows and the finished records, never of the samples: sample ``i`` of every row is
    looked up in one pass over the rows, ``i`` = 0, 1, 2... until every finished record is claimed (the rows'
    samples run in order, so that is soon), and the samples left are ranges with the finished ones left out.
    """
    total = total_samples(keys, per_row, max_samples)
    if not finished:
        return SampleMatch(None, 0, 0, total=total)
    unclaimed = collections.Counter(finished)  # a digest twice: two records, which claim two rows' samples
    remaining = len(finished)
    done: dict = collections.defaultdict(list)  # prompt_index -> its sample indexes finished
    passed_rows: set = set()
    passes: dict = collections.defaultdict(list)  # with ``rule``: prompt_index -> passed, as ``done`` lists them
    sample, longest = 0, max((count(index, per_row, max_samples) for index in keys.indexes), default=0)
    while remaining and sample < longest:
        for digest, index in offloop.stoppable(zip(keys.digests, keys.indexes), 1 << 14):
            if sample >= count(index, per_row, max_samples):
                continue
            key = sample_digest(digest, sample)
            if unclaimed.get(key):
                unclaimed[key] -= 1
                remaining -= 1
                done[index].append(sample)
                if rule is not None:
                    passes[index].append(key in passed)
                elif passed and key in passed:
                    passed_rows.add(index)
        sample += 1
    rows = array.array("Q")
    samples: dict = {}
    outcomes: dict = {}
    skipped = 0
    for index in offloop.stoppable(keys.indexes, 1 << 16):
        size = count(index, per_row, max_samples)
        finished_here = done.get(index, ())
        if rule is not None and finished_here:
            in_order = sorted(zip(finished_here, passes[index]))
            if rule.settled([ok for _i, ok in in_order], len(finished_here) < size) is not None:
                passed_rows.add(index)
            else:
                outcomes[index] = tuple(in_order)
        if index in passed_rows:
            skipped += size  # its finished samples, and the rest it does not run
            continue
        skipped += len(finished_here)
        if len(finished_here) == size:
            continue
        rows.append(index)
        if finished_here:
            samples[index] = SamplesLeft(size, tuple(finished_here))
    return SampleMatch(rows, len(finished), skipped, samples, total, outcomes)


def passed_digests(folder: RunFolder) -> set:
    """The digests of the content keys of finished records that passed (kept or discarded ones)."""
    out = set()
    paths = [path for _num, path in folder.iter_batch_files()]
    if folder.discarded.exists():
        paths.append(folder.discarded)
    for path in paths:
        with open(path, "rb") as handle:
            for line in handle:
                if b'"passed":true' not in line:  # most lines: not decoded
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a torn tail
                meta = (record.get("trajectory") or record).get("metadata") or {}
                # as the record classes read it: no pass without a reward in [0, 1] (serialization.py)
                if (meta.get("passed") is True and meta.get("verified") is True
                        and stored_reward(meta.get("reward")) is not None
                        and isinstance(meta.get("content_key"), str)):
                    out.add(key_digest(meta["content_key"]))
    return out
