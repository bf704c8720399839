"""batches.jsonl: the provider batches of a ``--batch_api`` run, so that a resume collects them instead of paying again.

Three kinds of line, each written with one ``write`` and fsync'd before the
run goes on:

- ``{"event": "pending", "session", "requests": [[custom_id, prompt_index, turn], ...]}``
  before a batch is submitted: these requests may be at the provider from now on;
- ``{"event": "submitted", "session", "batch": id, "custom_ids": [...]}`` once the provider
  named the batch (the ``custom_ids`` of the pending line before it);
- ``{"event": "collected", "session", "batch": id}`` once its results went to their sessions.

A custom id is ``<40 hex digits of the SHA-256 of the request body>-<serial>``:
the digest is what a later session matches its own requests against.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import attrs

from ..errors import RunFolderWriteError
from .durable import AppendLog, write_error

log = logging.getLogger(__name__)

BATCH_JOURNAL_NAME = "batches.jsonl"


def batch_journal_path(run_dir) -> Path:
    return Path(run_dir) / BATCH_JOURNAL_NAME


@attrs.frozen
class Submitted:
    """A batch an earlier session submitted: its id, its requests' custom ids."""

    batch: str
    custom_ids: tuple
    prompts: frozenset  # the prompt indexes its requests belong to


class BatchJournal:
    """Appends the lines of one session to the run's batches.jsonl (a durable ``AppendLog``)."""

    def __init__(self, path, session: int):
        self.path = Path(path)
        self.session = session
        self._log = AppendLog(self.path)
        try:
            self._log.open()  # a torn tail is cut off (and said) before this session's first line
        except OSError as exc:
            raise write_error(self.path, exc) from exc

    def _write(self, entry: dict) -> None:
        # one write and fsync, from the event loop: a batch is money, its line must outlive a power cut too
        self._log.append_sync(json.dumps(entry, separators=(",", ":")))

    def pending(self, requests: list) -> None:
        """``[(custom_id, prompt_index, turn), ...]`` are about to be submitted as one batch."""
        self._write({"event": "pending", "session": self.session, "requests": [list(r) for r in requests]})

    def submitted(self, batch_id: str, custom_ids: list) -> None:
        self._write({"event": "submitted", "session": self.session, "batch": batch_id, "custom_ids": custom_ids})

    def collected(self, batch_id: str) -> None:
        self._write({"event": "collected", "session": self.session, "batch": batch_id})

    def close(self) -> None:
        self._log.close()


def read_batches(path) -> list:
    """The batches submitted in an earlier session of the run (``Submitted``), in order; [] without a journal."""
    path = Path(path)
    if not path.exists():
        return []
    pending: dict = {}  # custom_id -> prompt_index
    batches: dict = {}
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise RunFolderWriteError(f"{path} could not be read ({exc}); check its permissions.") from exc
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            event = entry["event"]
            if event == "pending":
                for custom_id, prompt, _turn in entry["requests"]:
                    pending[str(custom_id)] = int(prompt)
            elif event == "submitted":
                ids = tuple(str(c) for c in entry["custom_ids"])
                batches[str(entry["batch"])] = ids
        except (ValueError, KeyError, TypeError):
            continue  # a torn or foreign line: it names no batch
    named = {c for ids in batches.values() for c in ids}
    unsent = sum(1 for c in pending if c not in named)
    if unsent:
        log.warning("%s: %d request(s) were being submitted when the run stopped, without a batch id on record; "
                    "if the provider got them they are paid for and are sent again.", path, unsent)
    return [
        Submitted(batch, ids, frozenset(pending[c] for c in ids if c in pending))
        for batch, ids in batches.items()
    ]
