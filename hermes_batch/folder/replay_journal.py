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
that ran every prompt removes the file.  A prompt that failed keeps its
answers (its record is no end of its session: ``--resume`` runs it again).

Untrusted.  The file may have been edited between a kill and the resume: it
must be a plain file (a link, a FIFO or a device is refused in one sentence,
before the preflight); it is read streaming, a line at most ``MAX_LINE_BYTES``
long, and what is no answer (not JSON, nested too deep, fields of the wrong
types, not ASCII) is skipped and counted; the answers themselves are read and
checked (:func:`decode_response`) only when their prompt asks for them, so
memory holds where each line is, never the file.

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

import collections
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

from ..errors import RunFolderError, RunFolderWriteError
from ..formats.endpoint_numbers import stored_usage
from ..formats.jsonguard import safe_message
from ..formats.lines import TOO_LONG, loads, read_lines
from ..formats import token_ids
from ..formats.records import Message, ModelResponse, ToolCall
from .durable import atomic_write_lines, cut_torn_tail, write_all, write_error
from .offloop import check_stop
from .readback import open_file

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
    data = {
        "m": message_form(m),
        "f": response.finish_reason,
        "u": [u.prompt_tokens, u.completion_tokens, u.reasoning_tokens, u.cached_tokens, u.cost],
        "p": response.provider,
        "model": response.model,
    }
    if m.tokens is not None:  # --logprobs: a replayed turn keeps the token ids it was sampled with
        data["t"] = token_ids.to_json(m.tokens)
    return data


def _tuples(value: Any) -> Any:
    # JSON made the message's tuples lists; the records are frozen and compared by value
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _text(value: Any, what: str, optional: bool = True) -> Optional[str]:
    if value is None and optional:
        return None
    if type(value) is not str:
        raise ValueError(f"{what} is not a string")
    return value


def decode_response(data: Any) -> ModelResponse:
    """The ModelResponse :func:`encode_response` stored; ValueError when ``data`` is not one.

    Read back from a file anyone may have edited (responses.jsonl, ``--response_cache``), so every field's type
    is checked here: a journaled answer replayed into a session must be one the model client could have made.
    """
    try:
        if type(data) is not dict:
            raise ValueError("not an object")
        role, content, reasoning, calls, call_id, name, provider_data = data["m"]
        if role != "assistant":  # a model's answer: anything else would make a malformed conversation
            raise ValueError(f"the role is {str(role)[:20]!r}, not 'assistant'")
        _text(content, "the content", optional=False)
        _text(reasoning, "the reasoning")
        if type(calls) is not list:
            raise ValueError("the tool calls are not a list")
        tool_calls = []
        for call in calls:
            i, n, raw, a = call
            tool_calls.append(ToolCall(_text(i, "a call id", False), _text(n, "a tool name", False),
                                       a if type(a) is dict else None, _text(raw, "a call's arguments", False)))
        _text(call_id, "the tool call id")
        _text(name, "the name")
        if provider_data is not None and type(provider_data) not in (dict, list, str):
            raise ValueError("the provider data is not an object, a list or a string")
        if provider_data is not None and nesting(provider_data) > MAX_PROVIDER_DEPTH:
            raise ValueError("the provider data is nested too deep")
        usage = data["u"]
        if type(usage) is not list:
            raise ValueError("the usage is not a list")
        prompt, completion, reasoning_tokens, cached, cost = usage
        # what no call can report (a string, NaN, 10**30 tokens) reads as not reported, as in calls.jsonl
        usage = stored_usage({"prompt_tokens": prompt, "completion_tokens": completion,
                              "reasoning_tokens": reasoning_tokens, "cached_tokens": cached, "cost": cost}, calls=1)
        message = Message(role, content, reasoning, tuple(tool_calls), call_id, name,
                          provider_data if type(provider_data) in (dict, str) else _tuples(provider_data),
                          tokens=token_ids.from_json(data.get("t")))
        finish, provider, model = data.get("f"), data.get("p"), data.get("model")
        response = ModelResponse(safe_message(message), _text(finish, "the finish reason"), usage,
                                 _text(provider, "the provider"), _text(model, "the model"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"not a recorded answer: {exc}") from exc
    return response


MAX_PROVIDER_DEPTH = 128
"""Most levels of a recorded answer's provider data (thinking blocks with a tool call's arguments, at most
MAX_DEPTH deep themselves); deeper data would overflow whatever serializes the next request or the record."""


def nesting(value: Any) -> int:
    """How many levels of lists and objects ``value`` has (iterative: any depth is safe to measure)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if type(item) is dict:
            item = item.values()
        elif type(item) is not list:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_PROVIDER_DEPTH:
            return deepest
        todo.extend((child, depth + 1) for child in item)
    return deepest


MAX_LINE_BYTES = 64 * 1024 * 1024
"""Longest line of responses.jsonl that is read: more than any answer the run reads (model_http.MAX_ANSWER_BYTES);
a longer one, which no session wrote, is skipped without being held."""

MAX_LIVE_LINES = 500_000
"""Most answers of cut-off sessions one resume takes from the file (a few hundred bytes of memory each while it
runs, the answers themselves are read when their prompt starts); beyond that, the rest is paid again."""

MAX_KEY_CHARS = 256

_SPAN_BITS = 32  # a line's offset and length, as one int: (offset << 32) | length


def _count(spans) -> int:
    return 1 if type(spans) is int else len(spans)


def _each(spans) -> tuple:
    """The spans of one key, kept as an int when it has one line (most keys), as a list else."""
    return (spans,) if type(spans) is int else spans


def _add(spans_of: dict, key: str, span: int) -> None:
    held = spans_of.get(key)
    if held is None:
        spans_of[key] = span
    elif type(held) is int:
        spans_of[key] = [held, span]
    else:
        held.append(span)


def _span(offset: int, length: int) -> int:
    return (offset << _SPAN_BITS) | length


def _unspan(span: int) -> tuple[int, int]:
    return span >> _SPAN_BITS, span & ((1 << _SPAN_BITS) - 1)


_ANSWER, _END = b'{"p":', b'{"end":'  # how the lines canonical_json writes begin


def _entry(line: bytes) -> tuple:
    """``("end", key)``, ``("answer", key, hash, answer)`` or ``("skip", why)`` for one line of the file."""
    if not line.isascii() or not line.startswith((_ANSWER, _END)):  # canonical_json's: ASCII, "p" or "end" first
        return "skip", "not written by hermes-batch"
    try:
        entry = loads(line)
    except ValueError as exc:
        return "skip", f"not JSON ({str(exc)[:60]})"
    if type(entry) is not dict:
        return "skip", "not an object"
    if "end" in entry:
        key = entry["end"]
        return ("end", key) if type(key) is str and len(key) <= MAX_KEY_CHARS else ("skip", "a malformed end line")
    key, request, answer = entry.get("p"), entry.get("h"), entry.get("r")
    if type(key) is not str or type(request) is not str or type(answer) is not dict:
        return "skip", "not an answer (p, h and r of the wrong types)"
    if len(key) > MAX_KEY_CHARS or len(request) > MAX_KEY_CHARS:
        return "skip", "a key longer than any the run makes"
    return "answer", key, request, answer


class ResponseJournal:
    """The run folder's responses.jsonl, written by the driver alone (workers' answers come as ``relay``).

    Made before the session's first prompt (on a resume, off the event loop while the run folder is scanned):
    the file is read once, streaming, rewritten with its live lines only, and opened for the session's
    answers.  The answers of cut-off sessions stay in the file until their prompt starts
    (``recorded``): memory holds where each line is, not the answers.
    """

    def __init__(self, path):
        self.path = Path(path)
        self.stopped: Optional[RunFolderWriteError] = None
        self.skipped: collections.Counter = collections.Counter()  # why -> lines of the file the load skipped
        self._pending: set = set()  # keys of sessions cut off before, not yet handed to a job
        self._spans: dict = {}  # key -> the span of its line in the file (an int), or a list of them
        self._live = 0  # bytes of those lines
        self._fd: Optional[int] = None
        self._size = 0
        self._load()
        self.open()

    # --- reading ----------------------------------------------------------------------------------

    def _load(self) -> None:
        try:
            fd = open_file(self.path, os.O_RDWR)  # never through a link, never waiting on a FIFO
        except OSError as exc:
            raise write_error(self.path, exc) from exc
        if fd is None:
            return
        try:
            dropped = cut_torn_tail(fd)
            if dropped:
                log.warning("%s: dropped %d bytes of a torn last entry left by an interrupted write.",
                            self.path, dropped)
            size = os.fstat(fd).st_size
            self._spans = self._scan(fd)
            self._live = sum(_unspan(span)[1] for spans in self._spans.values() for span in _each(spans))
            if self._live != size:  # ended sessions' lines and what is no answer: dropped before anything is appended
                try:
                    self._rewrite(fd)
                except RunFolderWriteError as exc:  # a full disk: the file stays as it is, read where it is
                    log.debug("%s was not compacted: %s", self.path, exc)
        except OSError as exc:
            raise write_error(self.path, exc) from exc
        finally:
            os.close(fd)
        self._pending = set(self._spans)
        if self.skipped:
            log.warning("%s: skipped %d line(s) that are no answer of this run (%s); their prompts pay for them "
                        "again if they were.", self.path, sum(self.skipped.values()),
                        "; ".join(f"{n} {why}" for why, n in self.skipped.most_common(4)))

    def _scan(self, fd: int) -> dict:
        lines: dict = {}  # key -> [span], of keys not ended
        count = 0
        with os.fdopen(os.dup(fd), "rb") as handle:
            for n, (offset, line) in enumerate(read_lines(handle, MAX_LINE_BYTES)):
                if not n & 0x3FF:
                    check_stop()
                if line is TOO_LONG:
                    self.skipped[f"longer than {MAX_LINE_BYTES >> 20} MiB"] += 1
                    continue
                if not line.strip():
                    continue
                if count >= MAX_LIVE_LINES and line.startswith(_ANSWER):
                    self.skipped[f"beyond the {MAX_LIVE_LINES:,} answers a resume takes"] += 1
                    continue  # not even decoded
                entry = _entry(line)
                if entry[0] == "skip":
                    self.skipped[entry[1]] += 1
                elif entry[0] == "end":
                    count -= _count(lines.pop(entry[1], ()))
                else:
                    _add(lines, entry[1], _span(offset, len(line)))
                    count += 1
        return lines

    def _rewrite(self, fd: int) -> None:
        """Replace the file by the live lines of ``self._spans`` (read from ``fd``), which then say where they are."""
        moved: dict = {}
        offset = 0
        for key, spans in self._spans.items():
            for span in _each(spans):
                length = _unspan(span)[1]
                _add(moved, key, _span(offset, length))
                offset += length

        def text():
            for n, span in enumerate(span for spans in self._spans.values() for span in _each(spans)):
                if not n & 0x3FF:
                    check_stop()
                offset, length = _unspan(span)
                yield os.pread(fd, length, offset).decode("ascii")

        atomic_write_lines(self.path, text())
        self._spans, self._live = moved, offset

    def open(self) -> None:
        """Open the file for the session's answers (made if missing); idempotent."""
        if self._fd is not None:
            return
        try:
            # 0o666: the user's umask decides, as for every file of the run folder
            self._fd = open_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            self._size = os.fstat(self._fd).st_size
        except OSError as exc:
            raise write_error(self.path, exc) from exc

    def holds(self, key: str) -> bool:
        """True when the file holds answers of ``key``."""
        return key in self._spans

    @property
    def cut_off(self) -> int:
        """Sessions cut off before whose answers were not handed to a job yet."""
        return len(self._pending)

    def recorded(self, key: str) -> Optional[dict]:
        """The answers a cut-off session of ``key`` got, ``{request hash: answer}``, handed out once; else None.

        Read from the file now (each is decoded, and checked, when the session asks for it)."""
        if key not in self._pending:
            return None
        self._pending.discard(key)
        return self.answers(key)

    def answers(self, key: str) -> Optional[dict]:
        """Every answer the file holds for ``key``, ``{request hash: answer}``, or None: also those of this session,
        as often as asked (a shared prefix, --branch_at, is replayed by each branch that rebuilds it)."""
        if key not in self._spans:
            return None
        answers: dict = {}
        try:
            fd = open_file(self.path)
        except (OSError, RunFolderError) as exc:
            log.warning("%s cannot be read again (%s); the answers of a cut-off prompt are paid again.", self.path, exc)
            return None
        if fd is None:
            return None
        try:
            for span in _each(self._spans.get(key, ())):
                offset, length = _unspan(span)
                entry = _entry(os.pread(fd, length, offset))
                if entry[0] == "answer" and entry[1] == key:
                    answers[entry[2]] = entry[3]
        finally:
            os.close(fd)
        return answers or None

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
        _add(self._spans, key, _span(self._size - len(data), len(data)))
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
        self._pending.discard(key)
        spans = self._spans.pop(key, None)
        if not spans or self._fd is None:
            return
        self._live -= sum(_unspan(span)[1] for span in _each(spans))
        self._write(canonical_json({"end": key}) + b"\n")
        if self._size > COMPACT_BYTES and self._size > 2 * self._live:
            self.compact()

    def compact(self) -> None:
        """Replace the file by its live lines (atomically: a kill meanwhile leaves the old file whole)."""
        old = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            self._rewrite(old)
        finally:
            os.close(old)
        os.close(self._fd)
        self._fd = None
        self.open()

    @property
    def size(self) -> int:
        return self._size if self._fd is not None else 0

    def close(self, finished: bool = False) -> None:
        """Close the file; ``finished``: every prompt of the run has its record, so the file goes.  Else it keeps
        only the live lines: the answers of prompts that have their record are not left behind."""
        if not finished and self._fd is not None and self._size > self._live and self.stopped is None:
            try:
                self.compact()
            except (OSError, RunFolderWriteError) as exc:  # a full disk: the next start compacts it
                log.debug("%s was not compacted: %s", self.path, exc)
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


