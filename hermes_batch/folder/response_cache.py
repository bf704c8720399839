"""``--response_cache DIR``: model answers kept across runs and run folders, found by the exact request.

Opt-in.  Where the replay journal (:mod:`.replay_journal`) keeps the answers of
the sessions in flight of one run folder, the cache keeps every answer of every
run that names the same folder, under the hash of the request it answered
(the client, the model settings that shape a body, the tools offered and every
message; see ``session.replay.RequestHasher``).  A request found there is not
sent: re-running a dataset with another filter or verifier, or a second run of
an unchanged prefix, pays nothing for the requests it shares with earlier runs.
Identical requests get identical answers, whatever the endpoint's temperature.

One SQLite database, ``DIR/responses.sqlite`` (write-ahead log: a kill loses at
most the last answers, never the database; several runs may share it at once).
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Optional

from ..errors import UsageError
from ..formats.records import ModelResponse
from .replay_journal import canonical_json, decode_response, encode_response

log = logging.getLogger(__name__)

CACHE_FILE = "responses.sqlite"


class ResponseCache:
    """The answers under ``folder``, by request hash: ``get(hash)`` and ``put(hash, response)``."""

    def __init__(self, folder):
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            # autocommit: each put is its own transaction, committed to the write-ahead log without an fsync
            self._db = sqlite3.connect(self.folder / CACHE_FILE, isolation_level=None, check_same_thread=False,
                                       timeout=30.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS answers (request TEXT PRIMARY KEY, answer TEXT NOT NULL)")
        except (OSError, sqlite3.Error) as exc:
            raise UsageError(
                f"--response_cache {folder}: cannot open {self.folder / CACHE_FILE} ({exc}); "
                "pass a folder you can write, or leave the option out."
            ) from exc
        self.hits = 0

    def get(self, request: str) -> Optional[ModelResponse]:
        row = self._db.execute("SELECT answer FROM answers WHERE request = ?", (request,)).fetchone()
        if row is None:
            return None
        try:
            import json

            response = decode_response(json.loads(row[0]))
        except ValueError:
            return None
        self.hits += 1
        return response

    def put(self, request: str, response: ModelResponse) -> None:
        answer = canonical_json(encode_response(response)).decode("ascii")
        try:
            self._db.execute("INSERT OR IGNORE INTO answers VALUES (?, ?)", (request, answer))
        except sqlite3.Error as exc:  # a full disk: the run goes on, paying for what it cannot keep
            log.warning("--response_cache: could not keep an answer (%s).", exc)

    def __len__(self) -> int:
        return self._db.execute("SELECT count(*) FROM answers").fetchone()[0]

    def close(self) -> None:
        self._db.close()


def open_cache(folder) -> Optional[ResponseCache]:
    """The cache of ``--response_cache``, None when it is not given."""
    return ResponseCache(folder) if folder else None
