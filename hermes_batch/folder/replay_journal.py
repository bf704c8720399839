"""responses.jsonl: the model's answers to the sessions in flight, replayed when a cut-off prompt runs again.

Not to be confused with calls.jsonl (:mod:`.journal`, the *call* journal), which
counts every request the run paid for.  This *replay journal* keeps what those
requests answered, so that ``--resume`` does not pay for them again: a prompt
whose session was cut off (SIGKILL, Ctrl-C, a lost worker) runs again in a fresh
sandbox, and each request it would send is looked up here first.  While the
requests match, the recorded answer is used without a call and the tools run
for real (so the sandbox is rebuilt by the same commands); at the first request
that differs (a tool printed something else) the session goes live.

Key and entry.  An answer is kept under the prompt's key (its content key) and
the hash of the request it answered (:class:`RequestHasher`: the client, the
model settings that shape a body, the tools offered and every message).  A line
is ``{"p": key, "h": hash, "r": answer}`` (``r`` from :func:`encode_response`),
written (one ``write``, like calls.jsonl) before the session acts on the answer;
``{"end": key}`` says the prompt's record is written and its answers are dead.
A kill loses nothing written; a line torn by a kill is cut off at the next
start, so the journal is read up to its last whole entry.

Bounded.  The file holds only sessions in flight: once dead lines outweigh live
ones (and the file is past ``COMPACT_BYTES``) the live lines are copied to a new
file that atomically replaces it (a kill meanwhile leaves the old one); a run
that ran every prompt removes the file.

API, small so that answers got elsewhere (a batch API's) can be fed to a replay:

- ``ResponseJournal(path)`` opens the file, reading what a cut-off session left
  (``cut_off`` of them); ``recorded(key)`` hands out one session's answers,
  ``{request hash: answer}`` (the runner puts them on the prompt's job);
  ``write(key, request_hash, response)`` keeps a ModelResponse, ``relay(entry)``
  a line a worker made; ``end(key)`` once the record is written;
  ``close(finished=...)``.
- ``encode_response`` / ``decode_response``: the stored form of one answer.
- The request hash and the lookups of a session are in
  :mod:`hermes_batch.session.replay` (``RequestHasher(client).digest(messages,
  tools)``, ``Replayer(journal, client, cache).session(key, recorded)``), a layer
  up, since the run folder's modules never import the model layer.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import RunFolderWriteError
from ..formats.records import Message, ModelResponse, ToolCall
from ..formats.endpoint_numbers import stored_usage
from .durable import atomic_write_lines, repair_torn_tail, write_all, write_error

log = logging.getLogger(__name__)

REPLAY_JOURNAL_NAME = "responses.jsonl"
COMPACT_BYTES = 4 * 1024 * 1024
"""The file is compacted once past this size and more than twice the size of its live lines."""

# ASCII: the quickest encoder, and any text (a lone surrogate too) is written as escapes
_encoder = json.JSONEncoder(separators=(",", ":"), default=repr)


def canonical_json(value: Any) -> bytes:
    """``value`` as compact ASCII JSON, what the journal writes and the request hash reads."""
    return _encoder.encode(value).encode("ascii")



def message_form(message: Message) -> list:
    """A message as JSON types, every field in a fixed order."""
    calls = [[c.id, c.name, c.raw_arguments, c.arguments] for c in message.tool_calls]
    return [message.role, message.content, message.reasoning, calls, message.tool_call_id, message.name,
            message.provider_data]


def encode_response(response: ModelResponse) -> dict:
    """A ModelResponse as JSON types, every field kept (decode_response gives it back equal)."""
    m, u = response.message, response.usage
    return {
        "m": message_form(m),
        "f": response.finish_reason,
        "u": [u.prompt_tokens, u.completion_tokens, u.reasoning_tokens, u.cached_tokens, u.cost],
        "p": response.provider,
        "model": response.model,
    }


def _tuples(value: Any) -> Any:
    # JSON made the message's tuples lists; the records are frozen and compared by value
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def decode_response(data: dict) -> ModelResponse:
    """The ModelResponse :func:`encode_response` stored; ValueError when ``data`` is not one."""
    try:
        role, content, reasoning, calls, call_id, name, provider_data = data["m"]
        tool_calls = tuple(ToolCall(i, n, a if isinstance(a, dict) else None, raw) for i, n, raw, a in calls)
        prompt, completion, reasoning_tokens, cached, cost = data["u"]
        usage = stored_usage({"prompt_tokens": prompt, "completion_tokens": completion,
                              "reasoning_tokens": reasoning_tokens, "cached_tokens": cached, "cost": cost}, calls=1)
        message = Message(role, content, reasoning, tool_calls, call_id, name,
                          provider_data if isinstance(provider_data, (dict, str)) else _tuples(provider_data))
        return ModelResponse(message, data.get("f"), usage, data.get("p"), data.get("model"))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a recorded answer: {exc}") from exc


class ResponseJournal:
    """The run folder's responses.jsonl, written by the driver alone (workers' answers come as ``relay``)."""

    def __init__(self, path):
        self.path = Path(path)
        self.stopped: Optional[RunFolderWriteError] = None
        self._pending: dict = {}  # key -> {hash: answer} of sessions cut off before, not yet handed to a job
        self._spans: dict = {}  # key -> [(offset, length)] of its lines in the file
        self._live = 0  # bytes of those lines
        self._fd: Optional[int] = None
        self._load()

    # --- reading ----------------------------------------------------------------------------------

    def _load(self) -> None:
        try:
            dropped = repair_torn_tail(self.path)
            if dropped:
                log.warning("%s: dropped %d bytes of a torn last entry left by an interrupted write.",
                            self.path, dropped)
            data = self.path.read_bytes() if self.path.exists() else b""
        except OSError as exc:
            raise write_error(self.path, exc) from exc
        lines: dict = {}  # key -> [line], of keys not ended
        for raw in data.splitlines(keepends=True):
            try:
                entry = json.loads(raw)
                if "end" in entry:
                    lines.pop(entry["end"], None)
                    self._pending.pop(entry["end"], None)
                    continue
                key, request, answer = entry["p"], entry["h"], entry["r"]
            except (ValueError, KeyError, TypeError):
                continue  # a line of another version: skipped
            lines.setdefault(key, []).append(raw)
            self._pending.setdefault(key, {})[request] = answer
        kept = [line for key_lines in lines.values() for line in key_lines]
        if sum(map(len, kept)) != len(data):  # ended sessions' lines: dropped before anything is appended
            atomic_write_lines(self.path, (line.decode("utf-8", "replace") for line in kept))
        offset = 0
        for key, key_lines in lines.items():
            spans = self._spans.setdefault(key, [])
            for line in key_lines:
                spans.append((offset, len(line)))
                offset += len(line)
        self._live = offset
        self._open()

    def _open(self) -> None:
        try:
            # 0o666: the user's umask decides, as for every file of the run folder
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            self._size = os.fstat(self._fd).st_size
        except OSError as exc:
            raise write_error(self.path, exc) from exc

    @property
    def cut_off(self) -> int:
        """Sessions cut off before whose answers were not handed to a job yet."""
        return len(self._pending)

    def recorded(self, key: str) -> Optional[dict]:
        """The answers a cut-off session of ``key`` got, ``{request hash: answer}``, handed out once; else None."""
        return self._pending.pop(key, None)

    # --- writing ----------------------------------------------------------------------------------

    def write(self, key: str, request_hash: str, response: ModelResponse) -> None:
        """Keep ``response`` to the request ``request_hash`` of the session ``key``; one write, before it is used."""
        self._append(key, canonical_json({"p": key, "h": request_hash, "r": encode_response(response)}) + b"\n")

    def relay(self, entry: dict) -> None:
        """Write an answer a worker process journaled (``{"p", "h", "r"}``)."""
        key = entry.get("p")
        if isinstance(key, str):
            self._append(key, canonical_json(entry) + b"\n")

    def _append(self, key: str, data: bytes) -> None:
        if self._fd is None:
            return  # closed: the run is ending, and a resume pays for this answer again
        self._write(data)
        self._spans.setdefault(key, []).append((self._size - len(data), len(data)))
        self._live += len(data)

    def _write(self, data: bytes) -> None:
        try:
            write_all(self._fd, data)
        except OSError as exc:
            try:
                os.ftruncate(self._fd, self._size)  # whole lines only
            except OSError:
                pass  # the next start cuts a torn tail
            error = write_error(self.path, exc)
            self.stopped = self.stopped or error
            raise error from exc
        self._size += len(data)

    def end(self, key: str) -> None:
        """The record of ``key`` is written: its answers are dead (compacted away in time)."""
        self._pending.pop(key, None)
        spans = self._spans.pop(key, None)
        if not spans or self._fd is None:
            return
        self._live -= sum(length for _, length in spans)
        self._write(canonical_json({"end": key}) + b"\n")
        if self._size > COMPACT_BYTES and self._size > 2 * self._live:
            self.compact()

    def compact(self) -> None:
        """Replace the file by its live lines (atomically: a kill meanwhile leaves the old file whole)."""
        old = os.open(self.path, os.O_RDONLY)
        try:
            lines = [(key, os.pread(old, length, offset)) for key, spans in self._spans.items()
                     for offset, length in spans]
        finally:
            os.close(old)
        atomic_write_lines(self.path, (line.decode("utf-8", "replace") for _, line in lines))
        os.close(self._fd)
        self._spans, offset = {}, 0
        for key, line in lines:
            self._spans.setdefault(key, []).append((offset, len(line)))
            offset += len(line)
        self._live = offset
        self._open()

    @property
    def size(self) -> int:
        return self._size if self._fd is not None else 0

    def close(self, finished: bool = False) -> None:
        """Close the file; ``finished``: every prompt of the run has its record, so the file goes."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        if finished:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass


def replay_journal_path(run_dir) -> Path:
    return Path(run_dir) / REPLAY_JOURNAL_NAME


