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
import json
from typing import Optional

import attrs

from ..folder import offloop
from ..folder.rowkeys import ResumeMatch, RowKeys, match_finished
from ..folder.runfolder import RunFolder
from ..formats.records import key_digest, sample_digest
from ..formats.reward_numbers import stored_reward


def count(prompt_index: int, per_row: int, max_samples: Optional[int]) -> int:
    """How many samples the row ``prompt_index`` has."""
    if max_samples is None:
        return per_row
    return max(0, min(per_row, max_samples - prompt_index * per_row))


@attrs.frozen
class SampleMatch:
    """What a session runs: the rows with samples left (None: every row, every sample), each row's samples left."""

    left: Optional[array.array]  # prompt indexes, in file order
    finished: int  # finished records in the run folder
    skipped: int  # samples not to run: finished, or of rows that passed (--stop_on_success)
    samples: dict = attrs.field(factory=dict)  # prompt_index -> sample indexes left, for the rows in ``left``
    total: int = 0  # samples of the dataset (up to --max_samples)

    @property
    def to_run(self) -> int:
        return self.total - self.skipped

    def of(self, prompt_index: int, per_row: int, max_samples: Optional[int]) -> tuple:
        """The sample indexes left of the row ``prompt_index``."""
        if self.left is None:
            return tuple(range(count(prompt_index, per_row, max_samples)))
        return self.samples.get(prompt_index, ())


def match(keys: RowKeys, finished: Optional[array.array], per_row: int, max_samples: Optional[int],
          passed: Optional[set] = None) -> SampleMatch:
    """Match the samples of every row against the digests of finished records (see rowkeys.match_finished).

    ``passed``: digests of finished records that passed; their rows run no more samples (--stop_on_success).
    """
    expanded = RowKeys()
    for digest, index in offloop.stoppable(zip(keys.digests, keys.indexes), 1 << 14):
        for i in range(count(index, per_row, max_samples)):
            expanded.digests.append(sample_digest(digest, i))
            expanded.indexes.append(index * per_row + i)
    total = len(expanded.digests)
    found: ResumeMatch = match_finished(expanded, finished)
    if found.left is None and not passed:
        return SampleMatch(None, found.finished, 0, total=total)
    left_codes = found.left if found.left is not None else expanded.indexes
    passed_rows = set()
    if passed:
        for digest, code in zip(expanded.digests, expanded.indexes):
            if digest in passed:
                passed_rows.add(code // per_row)
    rows = array.array("Q")
    samples: dict = {}
    dropped = 0
    for code in left_codes:
        row, sample = divmod(code, per_row)
        if row in passed_rows:
            dropped += 1
            continue
        if row not in samples:
            rows.append(row)
            samples[row] = []
        samples[row].append(sample)
    samples = {row: tuple(found_) for row, found_ in samples.items()}
    skipped = total - len(left_codes) + dropped
    return SampleMatch(rows, found.finished, skipped, samples, total)


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
