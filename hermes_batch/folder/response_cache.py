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

Shared, so untrusted, and never in the way of the run:

- it is opened, and checked, before the preflight (``open_cache``): a folder that
  cannot be written, a file that is no database, or a damaged one stops the run
  in one sentence before anything is paid or written;
- answers are added by a thread of their own, so another process holding the
  database's write lock (a long transaction, a backup) delays the cache, not the
  run's event loop; reads in write-ahead-log mode do not wait for writers, and
  one that would is a miss;
- damage found later (a page overwritten while the run goes) turns the cache off
  for the rest of the run with one warning, instead of failing prompts;
- an answer is read only up to ``MAX_ANSWER_CHARS`` and replayed only if it is
  one a model client could have made (``replay_journal.decode_response``).
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
from pathlib import Path
from typing import Optional

from ..errors import RunFolderError, UsageError
from ..formats.lines import loads
from ..formats.records import ModelResponse
from . import readback
from .replay_journal import MAX_LINE_BYTES, canonical_json, decode_response, encode_response

log = logging.getLogger(__name__)

CACHE_FILE = "responses.sqlite"
MAX_ANSWER_CHARS = MAX_LINE_BYTES
"""Longest stored answer that is read (as long as a line of responses.jsonl); a longer one is a miss."""
READ_WAIT_S = 0.05
"""How long a lookup waits for a lock (only a database out of write-ahead-log mode has readers wait) before
counting as a miss: it runs on the event loop."""
WRITE_WAIT_S = 30.0
"""How long the writing thread waits for another process's write lock, per answer."""
QUEUE_ANSWERS = 10_000
"""Answers waiting to be added; beyond this (the database locked for long) new ones are not kept."""
CLOSE_WAIT_S = 5.0
"""How long the end of a run waits for the answers still to be added."""

_STOP = object()


def _cache_error(folder, path: Path, exc: BaseException, what: str = "cannot open") -> UsageError:
    return UsageError(
        f"--response_cache {folder}: {what} {path} ({exc}); pass a folder you can write, move the file away "
        "(a new cache is made), or leave the option out."
    )


class ResponseCache:
    """The answers under ``folder``, by request hash: ``get(hash)`` and ``put(hash, response)``."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.path = self.folder / CACHE_FILE
        self.hits = 0
        self.dropped = 0  # answers not kept: the queue was full, or the database could not be written
        self._broken: Optional[str] = None  # why the cache is off for the rest of the run
        self._lock = threading.Lock()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for name in (CACHE_FILE, CACHE_FILE + "-wal", CACHE_FILE + "-shm"):
                readback.check_file(self.folder / name, written=False,
                                    advice="move it away, pass another folder, or leave the option out")
            # autocommit: each put is its own transaction, committed to the write-ahead log without an fsync
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                       timeout=READ_WAIT_S)
        except (OSError, sqlite3.Error) as exc:
            raise _cache_error(folder, self.path, exc) from exc
        except RunFolderError as exc:
            raise UsageError(f"--response_cache {folder}: {exc}") from None
        try:
            self._setup()
        except sqlite3.Error as exc:
            self._db.close()
            damaged = isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError)
            raise _cache_error(folder, self.path, exc, "damaged database" if damaged else "cannot open") from exc
        self._queue: queue.Queue = queue.Queue(QUEUE_ANSWERS)
        self._writer = threading.Thread(target=self._write_answers, name="hermes-batch-response-cache", daemon=True)
        self._writer.start()

    def _setup(self) -> None:
        db = self._db
        db.execute("PRAGMA busy_timeout = %d" % int(WRITE_WAIT_S * 1000))  # setting up may wait for others
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        if not db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'answers'").fetchall():
            db.execute("CREATE TABLE IF NOT EXISTS answers (request TEXT PRIMARY KEY, answer TEXT NOT NULL)")
        columns = [row[1] for row in db.execute("PRAGMA table_info(answers)")]
        if columns != ["request", "answer"]:
            raise sqlite3.DatabaseError(f"its table answers has the columns {columns}, not request and answer")
        # the pages a lookup starts from: a file overwritten past its first page fails here, not at every prompt
        db.execute("SELECT request, length(answer) FROM answers ORDER BY request LIMIT 1").fetchall()
        db.execute("SELECT max(rowid) FROM answers").fetchall()
        db.execute("PRAGMA busy_timeout = %d" % int(READ_WAIT_S * 1000))

    # --- reading, on the event loop ---------------------------------------------------------------------

    def get(self, request: str) -> Optional[ModelResponse]:
        """The answer kept for ``request``, or None (not there, unreadable, or the cache is off)."""
        if self._broken is not None:
            return None
        try:
            with self._lock:
                row = self._db.execute("SELECT answer FROM answers WHERE request = ? AND length(answer) <= ?",
                                       (request, MAX_ANSWER_CHARS)).fetchone()
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                return None  # not worth holding up the run: the request is sent
            self._off(exc)
            return None
        except sqlite3.Error as exc:
            self._off(exc)
            return None
        if row is None or type(row[0]) is not str:
            return None
        try:
            response = decode_response(loads(row[0]))
        except ValueError:
            return None  # a row of another shape: a miss
        self.hits += 1
        return response

    def _off(self, exc: BaseException) -> None:
        if self._broken is None:
            self._broken = str(exc)
            log.warning("--response_cache %s: %s failed (%s); the run goes on without it, paying for its requests. "
                        "Move the file away to start a new cache.", self.folder, self.path, exc)

    # --- writing, on a thread of its own ---------------------------------------------------------------

    def put(self, request: str, response: ModelResponse) -> None:
        """Add the answer to ``request``, in the background; never waits."""
        if self._broken is not None:
            return
        answer = canonical_json(encode_response(response)).decode("ascii")
        try:
            self._queue.put_nowait((request, answer))
        except queue.Full:
            self._drop(1, "it has been locked by another process for long")

    def _drop(self, count: int, why: str) -> None:
        with self._lock:
            first = not self.dropped
            self.dropped += count
        if first:
            log.warning("--response_cache %s: answers are not being kept (%s); the run goes on.", self.folder, why)

    def _write_answers(self) -> None:
        try:
            db = sqlite3.connect(self.path, isolation_level=None, timeout=WRITE_WAIT_S)
        except sqlite3.Error as exc:
            self._writes_failed(exc)
            return
        try:
            while (item := self._queue.get()) is not _STOP:
                try:
                    db.execute("INSERT OR IGNORE INTO answers VALUES (?, ?)", item)
                except sqlite3.Error as exc:  # locked past WRITE_WAIT_S, a full disk, damage: the run goes on
                    self._drop(1, str(exc))
        finally:
            db.close()

    def _writes_failed(self, exc: BaseException) -> None:
        self._drop(0, str(exc))
        while self._queue.get() is not _STOP:
            self._drop(1, str(exc))

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT count(*) FROM answers").fetchone()[0]

    def close(self) -> None:
        """Add the answers still waiting (for at most CLOSE_WAIT_S), then close."""
        if self._writer.is_alive():
            try:
                self._queue.put(_STOP, timeout=CLOSE_WAIT_S)
            except queue.Full:
                pass
            self._writer.join(CLOSE_WAIT_S)
            if self._writer.is_alive():
                log.warning("--response_cache %s: %d answer(s) were not kept, the database stayed locked by "
                            "another process.", self.folder, self._queue.qsize())
        with self._lock:
            self._db.close()


def open_cache(folder) -> Optional[ResponseCache]:
    """The cache of ``--response_cache``, None when it is not given; UsageError when it cannot be used."""
    return ResponseCache(folder) if folder else None
