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

Read back as untrusted (it may be edited between a kill and the resume): a plain
file only, bounded lines, and lines of other shapes skipped and counted.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import attrs

from ..errors import RunFolderWriteError
from ..formats.lines import TOO_LONG, loads, read_lines
from .durable import AppendLog, write_error
from .offloop import check_stop
from .readback import open_reader

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


MAX_LINE_BYTES = 64 * 1024 * 1024
"""Longest line of batches.jsonl that is read (a pending line of 50,000 requests is about 4 MB)."""
MAX_ID_CHARS = 256  # a custom id or a batch id: ours are 47 characters, providers' a few dozen


def _ids(value) -> tuple:
    """The custom ids of a submitted line; ValueError when it is not a list of short strings."""
    if type(value) is not list or any(type(c) is not str or len(c) > MAX_ID_CHARS for c in value):
        raise ValueError("custom_ids is not a list of ids")
    return tuple(value)


def _pending(value) -> list:
    """``[(custom_id, prompt_index)]`` of a pending line; ValueError when it is not what ``pending`` writes."""
    if type(value) is not list:
        raise ValueError("requests is not a list")
    out = []
    for request in value:
        if type(request) is not list or len(request) != 3:
            raise ValueError("a request is not [custom_id, prompt_index, turn]")
        custom_id, prompt, _turn = request
        if type(custom_id) is not str or len(custom_id) > MAX_ID_CHARS or type(prompt) is not int or prompt < -1:
            raise ValueError("a request has fields of the wrong types")
        out.append((custom_id, prompt))
    return out


def read_batches(path) -> list:
    """The batches submitted in an earlier session of the run (``Submitted``), in order; [] without a journal.

    The file is read back as untrusted: a plain file only (readback.open_reader), lines at most MAX_LINE_BYTES,
    and a line whose fields are not of the types this module writes is skipped (counted in a warning).
    """
    path = Path(path)
    pending: dict = {}  # custom_id -> prompt_index
    batches: dict = {}
    skipped = 0
    try:
        handle = open_reader(path)
        if handle is None:
            return []
        with handle:
            for n, (_offset, line) in enumerate(read_lines(handle, MAX_LINE_BYTES)):
                if not n & 0xFF:
                    check_stop()
                if line is TOO_LONG:
                    skipped += 1
                    continue
                if not line.strip():
                    continue
                try:
                    entry = loads(line)
                    event = entry["event"]
                    if event == "pending":
                        pending.update(_pending(entry["requests"]))
                    elif event == "submitted":
                        batch = entry["batch"]
                        if type(batch) is not str or len(batch) > MAX_ID_CHARS:
                            raise ValueError("batch is not an id")
                        batches[batch] = _ids(entry["custom_ids"])
                except (ValueError, KeyError, TypeError):
                    skipped += 1  # a torn or foreign line: it names no batch
    except OSError as exc:
        raise RunFolderWriteError(f"{path} could not be read ({exc}); check its permissions.") from exc
    if skipped:
        log.warning("%s: skipped %d line(s) that are not what a run writes there.", path, skipped)
    named = {c for ids in batches.values() for c in ids}
    unsent = sum(1 for c in pending if c not in named)
    if unsent:
        log.warning("%s: %d request(s) were being submitted when the run stopped, without a batch id on record; "
                    "if the provider got them they are paid for and are sent again.", path, unsent)
    return [
        Submitted(batch, ids, frozenset(pending[c] for c in ids if c in pending))
        for batch, ids in batches.items()
    ]
