"""calls.jsonl: every model request of the run, written as it is made.

The records of a prompt are written when it ends, so the calls of prompts cut
off by a crash (SIGKILL, power loss of the machine that runs the model client)
were paid for but are in no record.  The journal has one ``sent`` line before
each request goes out and one ``done`` line when it ends (status, provider,
latency, usage), so the totals of statistics.json and the ``--max_cost``
budget count every request the run made, finished or not.

Each line is one ``write`` system call (no fsync): a killed process loses
nothing it wrote, and the hot path pays a few microseconds per call.  A write
that fails (disk full) stops the run like any write of the run folder.  The
first line names the session that started the journal; only a journal started
with the run's first session covers the whole run (folders of versions before
the journal fall back to the records).
"""

from __future__ import annotations

import contextvars
import logging
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional

import attrs

from ..formats.endpoint_numbers import checked_usage, finite_seconds, stored_cost, stored_usage
from ..formats.jsonguard import finite_dumps
from ..formats.records import CANCELLED_STATUS, CallRecord, ModelResponse, Usage
from ..errors import RunFolderWriteError
from ..formats.lines import TOO_LONG, loads, read_lines
from .durable import repair_torn_tail, write_all, write_error
from .readback import open_file, open_reader

log = logging.getLogger(__name__)

JOURNAL_NAME = "calls.jsonl"
MAX_LINE_BYTES = 64 * 1024
"""Longest line of calls.jsonl that is read (its lines are about 60 to 300 bytes); a longer one is skipped unheld."""
MAX_NAME_CHARS = 256  # a provider's name
_SENT = b'{"event":"sent",'  # how CallJournal.sent lines begin

# The prompt a model call belongs to: set by the prompt processor, read when the call is journaled.
current_prompt: contextvars.ContextVar[int] = contextvars.ContextVar("hermes_batch_prompt", default=-1)


class CallJournal:
    """Appends a line per model request of one session to the run's calls.jsonl."""

    stopped: Optional[RunFolderWriteError] = None  # a write of the run folder failed: no request goes out

    def __init__(self, path, session: int):
        self.path = Path(path)
        self.session = session
        self._fd: Optional[int] = None
        dropped = repair_torn_tail(self.path)
        if dropped:
            log.warning("%s: dropped %d bytes of a torn last line left by an interrupted write.", self.path, dropped)
        try:
            # 0o666: the user's umask decides, as for every file of the run folder; never through a link
            self._fd = open_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            self._size = os.fstat(self._fd).st_size  # where the next line starts
        except OSError as exc:
            raise write_error(self.path, exc) from exc
        self.cost: Optional[float] = None  # reported cost of what this session journaled, for --max_cost
        if self._size == 0:
            self._write({"event": "journal", "first_session": session})

    def _write(self, entry: dict) -> None:
        data = (finite_dumps(entry, separators=(",", ":")) + "\n").encode()  # ensure_ascii: always encodable
        try:
            write_all(self._fd, data)
        except OSError as exc:
            # Disk full or file too large: cut off the part of the line that landed, and stop the run (exit 74)
            # rather than fail the prompt that was about to pay for a request.
            try:
                os.ftruncate(self._fd, self._size)
            except OSError:
                pass  # the next start cuts a torn tail
            error = write_error(self.path, exc)
            self.stop(error)
            raise error from exc
        self._size += len(data)

    def stop(self, error: RunFolderWriteError) -> None:
        """A write of the run folder failed: every later request is refused (``sent`` raises); thread-safe."""
        if self.stopped is None:
            self.stopped = error

    def check(self) -> None:
        """RunFolderWriteError once the run folder could not be written: no request may go out."""
        if self.stopped is not None:  # paying for an answer the run cannot save
            raise RunFolderWriteError(str(self.stopped))

    def sent(self, prompt_index: Optional[int] = None) -> None:
        """A request (of ``prompt_index``, by default the current prompt's) is about to go out; raises
        RunFolderWriteError once the run folder could not be written."""
        self.check()
        prompt = current_prompt.get() if prompt_index is None else prompt_index
        self._write({"event": "sent", "session": self.session, "prompt_index": prompt})

    def tool_usage(self, usage: Usage) -> None:
        """A tool made a model call of its own (vision, mixture of agents): its tokens and cost count too."""
        entry = {"event": "usage", "session": self.session, "prompt_index": current_prompt.get()}
        usage = checked_usage(usage)  # checked where it came in; again here, a few comparisons, as it is written
        self._count(usage)
        entry.update(_usage_fields(usage))
        self._write(entry)

    def _count(self, usage: Usage) -> None:
        if usage.cost is not None:
            self.cost = (self.cost or 0.0) + usage.cost

    def done(self, call: CallRecord, usage: Optional[Usage]) -> None:
        """A request ended: answered (``usage`` given), refused, or cut off without an answer."""
        entry = {
            "event": "done",
            "session": self.session,
            "prompt_index": current_prompt.get(),
            "status": call.status or 0,
            "provider": call.provider or "",
            "latency_s": call.latency_s,
        }
        if usage is not None:
            usage = checked_usage(usage)
            self._count(usage)
            entry.update(_usage_fields(usage))
        self._write(entry)

    async def complete(self, client, messages: tuple, tools: tuple, calls: Optional[list]) -> ModelResponse:
        """``client.complete`` with every attempt journaled: ``sent`` before it goes out, ``done`` when it ends."""
        attempts: list = [] if calls is None else calls
        first = len(attempts)
        # --batch_api: the client's batcher writes the ``sent`` line when the request's batch goes out
        later = getattr(client, "sends_later", False)

        async def send(messages, tools):
            if later:
                self.check()
            else:
                self.sent()
            return await client.send(messages, tools)

        response, left = None, False
        try:
            response = await client.limiter.call(send, messages, tools, calls=attempts)
            return response
        except BaseException as exc:
            # --batch_api: cut off (Ctrl-C) while a batch at the provider holds it, the request's end is that
            # batch's, written when a --resume collects it (as after a SIGKILL), else it stays unanswered; cut
            # off while it waited for its batch to go out, it was never sent and has no end
            left = getattr(exc, "left_in_batch", False) or getattr(exc, "never_sent", False)
            raise
        finally:
            # the limiter appends a CallRecord per attempt, the last one answered when a response came
            ended = attempts[first:]
            for i, call in enumerate(ended):
                last = i == len(ended) - 1
                if left and last:
                    continue
                self.done(call, response.usage if response is not None and last else None)

    def relay(self, entry: dict) -> None:
        """Write a line another process journaled (a worker of the processes or Ray executor); its cost counts."""
        cost = stored_cost(entry.get("cost"))
        if entry.get("event") in ("done", "usage") and cost is not None:
            self.cost = (self.cost or 0.0) + cost
        self._write(entry)

    def close(self) -> None:
        """Close the file; safe to call more than once."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _usage_fields(usage: Usage) -> dict:
    """The journal's fields for ``usage``; the cost only when the endpoint reported one."""
    fields = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "reasoning_tokens": usage.reasoning_tokens,
        "cached_tokens": usage.cached_tokens,
    }
    if usage.cost is not None:
        fields["cost"] = usage.cost
    return fields


@attrs.define
class JournalTotals:
    """What calls.jsonl says the run requested and paid for."""

    first_session: Optional[int] = None  # None: no journal
    sent: int = 0
    done: int = 0
    errors: int = 0  # answered with a status other than 200, or ended without an answer (not cut off by the run)
    rate_limited: int = 0
    usage: Usage = Usage()
    cost_by_session: dict = attrs.Factory(dict)
    requests_by_provider: Counter = attrs.Factory(Counter)
    errors_by_provider: Counter = attrs.Factory(Counter)
    latency_ms: dict = attrs.Factory(lambda: defaultdict(Counter))  # provider -> whole milliseconds -> count

    @property
    def covers_run(self) -> bool:
        """True when the journal was started by the run's first session, so it holds every request."""
        return self.first_session == 0

    @property
    def requests(self) -> int:
        return max(self.sent, self.done)

    @property
    def unanswered(self) -> int:
        """Requests sent whose end was never written: cut off by a crash."""
        return max(0, self.sent - self.done)

    @property
    def cost(self) -> Optional[float]:
        return self.usage.cost


def read_journal(path) -> JournalTotals:
    """Sum up a calls.jsonl; a missing file gives empty totals, a bad line is skipped."""
    totals = JournalTotals()
    scan_journal(path, totals)
    return finish_totals(totals)


def scan_journal(path, totals: JournalTotals, start: int = 0) -> int:
    """Add the whole lines of a calls.jsonl from byte ``start`` on to ``totals``; return where they end.

    The totals stay raw (requests without an answer not yet counted), so a later
    call can go on from where this one ended: :func:`finish_totals` completes them.
    """
    handle = open_reader(path)  # a plain file: a FIFO or a link to /dev/zero is refused, not read for ever
    if handle is None:
        return start
    end = start
    with handle:
        for offset, raw in read_lines(handle, MAX_LINE_BYTES, start):
            if raw is TOO_LONG:
                end = handle.tell()  # read past it: no line of ours is that long
                continue
            end = offset + len(raw)
            if raw.startswith(_SENT):  # half the lines: counted without decoding (millions on a big run)
                totals.sent += 1
                continue
            try:
                entry = loads(raw)
                event = entry["event"]
            except (ValueError, KeyError, TypeError):
                continue
            if type(entry) is not dict or type(event) is not str:
                continue
            if event == "sent":
                totals.sent += 1
            elif event == "done":
                totals.done += 1
                status = entry.get("status") or 0
                provider = entry.get("provider") or "unknown"
                if type(status) is not int or type(provider) is not str or len(provider) > MAX_NAME_CHARS:
                    status, provider = 0, "unknown"  # an edited line: counted as an unknown failure
                totals.requests_by_provider[provider] += 1
                totals.latency_ms[provider][int(round(finite_seconds(entry.get("latency_s")) * 1000))] += 1
                if status not in (200, CANCELLED_STATUS):  # cut off by the run itself: not the endpoint's error
                    totals.errors += 1
                    totals.errors_by_provider[provider] += 1
                if status == 429:
                    totals.rate_limited += 1
            if event in ("done", "usage"):  # "usage": a model call a tool made, counted in tokens and cost only
                # one call's usage: what no call can report (NaN, Infinity, 10**30, negative) is not reported
                usage = stored_usage(entry, calls=1)
                totals.usage = totals.usage + usage
                if usage.cost is not None:
                    session = entry.get("session", 0)
                    session = session if type(session) is int else 0
                    totals.cost_by_session[session] = totals.cost_by_session.get(session, 0.0) + usage.cost
            if event == "journal" and totals.first_session is None:
                first = entry.get("first_session")
                totals.first_session = first if type(first) is int else -1  # -1: not the run's first session
    return end


def finish_totals(raw: JournalTotals) -> JournalTotals:
    """The totals of :func:`scan_journal` with the requests sent but never answered counted as errors."""
    totals = attrs.evolve(
        raw, requests_by_provider=Counter(raw.requests_by_provider), errors_by_provider=Counter(raw.errors_by_provider),
    )
    unanswered = totals.unanswered
    if unanswered:
        totals.requests_by_provider["unknown"] += unanswered
        totals.errors_by_provider["unknown"] += unanswered
        totals.errors += unanswered
    return totals


def journal_path(run_dir) -> Path:
    return Path(run_dir) / JOURNAL_NAME
