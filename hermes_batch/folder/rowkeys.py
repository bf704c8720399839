"""The dataset's content keys, worked out once per dataset file, so a resume need not read the rows again.

Validating the dataset decodes every row; the same pass computes each valid
row's content key and keeps its 8-byte digest (16 bytes a row with its index).
``index/dataset.json`` keeps those and the validation report, under the
dataset's fingerprint (a hash of its bytes): a resume over the same file reads
it only to hash it, takes the report and keys from there, and matches them
against the finished prompts' digests (record_index.py).  Only when prompts are
left does the run read the rows again, to run them.
"""

from __future__ import annotations

import array
import json
import logging
from typing import Optional

import attrs

from ..formats import dataset
from . import offloop, reindex
from .record_index import INDEX_DIR, pack_array, unpack_array
from ..formats.records import content_key, key_digest
from .runfolder import RunFolder
from .durable import atomic_write_text

log = logging.getLogger(__name__)

VERSION = 1
NAME = "dataset.json"


@attrs.define
class RowKeys:
    """The digest of the content key and the prompt_index of every valid row, in file order."""

    digests: array.array = attrs.Factory(lambda: array.array("Q"))
    indexes: array.array = attrs.Factory(lambda: array.array("Q"))

    def add(self, index: int, row: dict) -> None:
        """``dataset.validate_dataset``'s ``on_valid``: the key as PromptRow.content_key makes it."""
        key = content_key(row["prompt"], row.get("image") or row.get("docker_image"), row.get("cwd"))
        self.digests.append(key_digest(key))
        self.indexes.append(index)


@attrs.frozen
class Validated:
    """A validated dataset: its report, its rows' keys, its fingerprint, and whether they came from the index."""

    report: dataset.DatasetReport
    keys: RowKeys
    fingerprint: str
    cached: bool = False


def validate(dataset_file, max_samples: Optional[int], folder: Optional[RunFolder]) -> Validated:
    """Validate the dataset (or take what ``folder``'s index says of the same bytes) and key its rows."""
    dataset.check_arguments(str(dataset_file), max_samples)  # before the fingerprint reads it: a FIFO would block
    fingerprint = reindex.fingerprint(dataset_file)
    if folder is not None:
        cached = _load(folder, str(dataset_file), fingerprint, max_samples)
        if cached is not None:
            return cached
    keys = RowKeys()
    report = dataset.validate_dataset(dataset_file, max_samples=max_samples, on_valid=keys.add)
    return Validated(report, keys, fingerprint)


def save(folder: RunFolder, validated: Validated, max_samples: Optional[int]) -> None:
    """Keep the report and keys in the run's index for the next resume (nothing to do if they came from it)."""
    if validated.cached:
        return
    report = validated.report
    data = {
        "version": VERSION, "path": report.path, "fingerprint": validated.fingerprint, "max_samples": max_samples,
        "report": {"valid": report.valid, "invalid": report.invalid, "problems": list(report.problems),
                   "total": report.total, "images": list(report.images)},
        "digests": pack_array(validated.keys.digests), "indexes": pack_array(validated.keys.indexes),
    }
    (folder.dir / INDEX_DIR).mkdir(exist_ok=True)
    atomic_write_text(folder.dir / INDEX_DIR / NAME, json.dumps(data, separators=(",", ":")) + "\n")


def build(folder: RunFolder, dataset_file, max_samples: Optional[int]) -> None:
    """Validate and key ``dataset_file`` and keep the result in ``folder``'s index."""
    save(folder, validate(dataset_file, max_samples, None), max_samples)


def _load(folder: RunFolder, path: str, fingerprint: str, max_samples: Optional[int]) -> Optional[Validated]:
    try:
        data = json.loads((folder.dir / INDEX_DIR / NAME).read_text(encoding="utf-8"))
        if (data["version"], data["path"], data["fingerprint"], data["max_samples"]) != (
            VERSION, path, fingerprint, max_samples
        ):
            return None
        saved = data["report"]
        report = dataset.DatasetReport(path, int(saved["valid"]), int(saved["invalid"]), tuple(saved["problems"]),
                                       int(saved["total"]), tuple(saved["images"]))
        keys = RowKeys(unpack_array("Q", data["digests"]), unpack_array("Q", data["indexes"]))
        if len(keys.digests) != len(keys.indexes) or len(keys.digests) != report.valid:
            return None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return Validated(report, keys, fingerprint, cached=True)


@attrs.frozen
class ResumeMatch:
    """What a session runs: the prompt indexes left (None: every valid row), and the finished prompts matched."""

    left: Optional[array.array]
    finished: int  # finished records in the run folder
    skipped: int  # rows skipped as finished

    @property
    def unmatched(self) -> int:
        """Finished records no row of the dataset claims (the dataset no longer holds those prompts)."""
        return self.finished - self.skipped


def match_finished(keys: RowKeys, finished: Optional[array.array]) -> ResumeMatch:
    """Match the rows against the digests of finished prompts, each finished prompt claiming one row.

    Duplicated rows count: a prompt three times in the dataset and finished twice runs once more.  The
    digests go into a set for the match (64 bytes each while it runs, so 64 MB at a million finished
    prompts); the few that are finished more than once are counted apart.
    """
    if not finished:
        return ResumeMatch(None, 0, 0)
    unclaimed = set(finished)
    more: dict = {}  # digest -> finished records beyond the first
    if len(unclaimed) != len(finished):
        for digest in offloop.stoppable(finished, 1 << 16):
            more[digest] = more.get(digest, -1) + 1
        more = {digest: extra for digest, extra in more.items() if extra}
    left = array.array("Q")
    for digest, index in offloop.stoppable(zip(keys.digests, keys.indexes), 1 << 16):
        if digest not in unclaimed:
            left.append(index)
        elif more.get(digest):
            more[digest] -= 1
        else:
            unclaimed.discard(digest)
    return ResumeMatch(left, len(finished), len(keys.digests) - len(left))


def batches_finished(keys: RowKeys, left: Optional[array.array], batch_size: int) -> set[int]:
    """The batches none of whose valid rows is left to run (empty before anything finished).

    A session that ended between a batch's last record and the checkpoint that
    calls it complete leaves nothing of that batch to run, so no later session
    would complete it: the resume counts it from the records instead.
    """
    if left is None:
        return set()
    finished = {index // batch_size for index in keys.indexes}
    finished.difference_update(index // batch_size for index in left)
    return finished


def rows_left(dataset_file, max_samples: Optional[int], left: Optional[array.array]):
    """The PromptRows of ``left`` (all valid rows if None), read from the file in one pass; none if nothing is left."""
    # the rows not left are counted, not decoded: with 1% of a million rows left at the end, decoding
    # the rest held back the first prompt by ten seconds
    yield from dataset.iter_rows(dataset_file, max_samples=max_samples, only=left)
