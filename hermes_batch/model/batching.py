"""``--batch_api``: the next request of every waiting session goes out in a provider batch, at half the price.

A session's model call (``send``) puts its request body into the current
batch and waits.  The batch is submitted when it holds ``max_requests``
requests or ``max_wait`` seconds after its first one came, whichever is first,
or at once when no more requests can come: every session that may still send
one (``senders``, the run's count) waits on a batch already; then a new one
starts, so several batches are in flight at once.  Each batch
is polled every ``poll_interval`` seconds until it ends, and its results go to
their sessions, which run their tools and queue their next request.

Faults: a request answered with an error inside a batch raises the error the
synchronous call would (RetryableModelError for 429 and 5xx), so the retry
loop of the run (``CallLimiter``) sends it again, in a later batch, with the
same limits.  A request an expired or cancelled batch did not process goes
back into the queue (not a retry: nothing was answered).

Nothing paid twice: before a batch is submitted its requests are written to
the run's batch journal (``journal.pending``), its id once the provider gave
it (``journal.submitted``).  A later session (``--resume``) loads them
(``expect``): a request whose body (SHA-256) is one an earlier batch holds
waits for that batch's result instead of being sent again.

The provider's side is a ``BatchAPI`` (``ModelClient.batch_api()``); this module
knows nothing of wire formats.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import logging
import time
from typing import Callable, Optional, Union

import attrs

from ..errors import FatalModelError, ModelCallError, RetryableModelError
from ..formats.lines import TOO_LONG, LineSplitter, loads
from ..formats.records import ModelResponse
from .model_http import MAX_ANSWER_BYTES
from .retry import backoff_delay

log = logging.getLogger("hermes_batch.model.batching")

MAX_REQUESTS = 1000
MAX_WAIT_S = 30.0
POLL_INTERVAL_S = 10.0
SUBMIT_RETRIES = 5  # attempts at uploading and creating one batch before its requests fail
MAX_RESULT_LINE_BYTES = MAX_ANSWER_BYTES + (1 << 20)
"""Longest line of a batch's results that is read: an answer as long as a synchronous one may be, and its
wrapping; a longer line is skipped without being held."""
RESULTS_BYTES = 1 << 30
RESULTS_BYTES_PER_REQUEST = 4 << 20
"""A batch's results are read (decompressed) up to RESULTS_BYTES and this much per request of the batch: a
stream without end (a gzip bomb) is cut there, its requests sent again."""

Outcome = Union[ModelResponse, BaseException]


@attrs.frozen
class BatchOptions:
    """``--batch_api_max_requests``, ``--batch_api_max_wait``, ``--batch_api_poll_interval``."""

    max_requests: int = MAX_REQUESTS
    max_wait: float = MAX_WAIT_S
    poll_interval: float = POLL_INTERVAL_S


class BatchAPI(abc.ABC):
    """One provider's batch endpoints, as a model client offers them (``ModelClient.batch_api``).

    ``max_requests`` and ``max_bytes`` are the provider's limits on one batch (OpenAI: 50,000 requests and a
    200 MB file; Anthropic: 100,000 requests and 256 MB): a batch is cut to fit both, whatever
    ``--batch_api_max_requests`` asks, and one the endpoint still refuses as too large (413) is split in two.
    """

    max_requests: int = 50_000
    max_bytes: int = 200 * 1000 * 1000

    def request_bytes(self, custom_id: str, body: bytes) -> int:
        """What one request adds to the size of its batch (its line of the uploaded file, or of the create call)."""
        return len(body) + len(custom_id) + 100

    @abc.abstractmethod
    async def check(self) -> None:
        """Raise FatalModelError when the endpoint has no batch API (or refuses the key)."""

    @abc.abstractmethod
    def body(self, messages: tuple, tools: tuple) -> bytes:
        """The request body of one call, as the synchronous call would send it."""

    @abc.abstractmethod
    async def submit(self, requests: list) -> str:
        """Submit ``[(custom_id, body), ...]`` as one batch; its id.

        Raises RetryableModelError when it may work later, FatalModelError or ModelCallError otherwise.
        """

    @abc.abstractmethod
    async def poll(self, batch_id: str) -> Optional[str]:
        """None while the batch is processed; once it ended, how ("completed", "expired", "cancelled", ...)."""

    @abc.abstractmethod
    async def results(self, batch_id: str, wanted: Optional[set] = None) -> dict:
        """``{custom_id: ModelResponse or the exception its error is}`` of the requests the ended batch processed.

        A request missing from it was not processed (the batch expired or was cancelled first).  ``wanted``: the
        custom ids to look for (the others are not kept).  The results come from the provider, so they are read
        streaming and bounded (:func:`result_lines`), and a request with two results keeps its answer over an
        error (:func:`keep_result`).
        """

    async def cancel(self, batch_id: str) -> None:
        """Ask the provider to stop processing the batch."""

    async def aclose(self) -> None:
        """Release connections."""


def digest(body: bytes) -> str:
    """What identifies a request across sessions: 40 hex digits of its body's SHA-256."""
    return hashlib.sha256(body).hexdigest()[:40]


def keep_result(found: dict, custom_id: str, outcome) -> None:
    """Put ``outcome`` in ``found`` unless the request already has an answer: a provider that lists a request
    twice (an answer, then an error) was paid for the answer, which must not be sent again."""
    if not isinstance(found.get(custom_id), ModelResponse):
        found[custom_id] = outcome


async def result_lines(chunks, wanted: Optional[set], what: str):
    """The JSON objects of the lines of a batch's results (an async iterator of byte chunks, decompressed), read
    streaming: a line longer than MAX_RESULT_LINE_BYTES, one that is not a JSON object, and everything past the
    byte bound (``wanted``'s size sets it) are skipped, and counted in one warning naming ``what``."""
    splitter = LineSplitter(MAX_RESULT_LINE_BYTES)
    limit = RESULTS_BYTES + RESULTS_BYTES_PER_REQUEST * (len(wanted) if wanted is not None else 50_000)
    size, skipped, cut = 0, 0, False
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            cut = True
            break
        for line in splitter.feed(chunk):
            entry = _result_entry(line)
            if entry is None:
                skipped += line is TOO_LONG or bool(line.strip())
            else:
                yield entry
    if not cut:
        last = splitter.end()
        entry = None if last is None else _result_entry(last)
        if entry is not None:
            yield entry
        elif last is not None and (last is TOO_LONG or last.strip()):
            skipped += 1
    if skipped or cut:
        log.warning("%s held %s%s; skipped%s.", what,
                    f"{skipped} line(s) that are no result (not JSON, or longer than "
                    f"{MAX_RESULT_LINE_BYTES >> 20} MiB)" if skipped else "",
                    f"{' and ' if skipped else ''}more than {limit >> 20} MiB" if cut else "",
                    ": the requests without a result go out again" if cut else "")


def _result_entry(line) -> Optional[dict]:
    if line is TOO_LONG:
        return None
    try:
        entry = loads(line)
    except ValueError:
        return None
    return entry if type(entry) is dict else None


class _Request:
    __slots__ = ("body", "digest", "future", "queued_at", "custom_id", "prompt", "turn", "sent", "on_sent", "size")

    def __init__(self, body: bytes, key: str, prompt: int, turn: int, on_sent: Optional[Callable] = None):
        self.body, self.digest, self.prompt, self.turn = body, key, prompt, turn
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.queued_at = time.monotonic()
        self.custom_id = ""
        self.sent = False  # its batch went out (its upload began): it may be at the provider, and is paid for
        self.on_sent = on_sent
        self.size = 0  # what it adds to its batch (BatchAPI.request_bytes)


@attrs.define
class BatchCounts:
    """What statistics.json and the progress display say of the batches of this session."""

    batches: int = 0  # submitted
    requests: int = 0  # sent in them
    largest: int = 0
    answered: int = 0  # requests whose batch gave them an answer (an error included)
    failed: int = 0  # answered with an error (retried by the run's retry loop when retryable)
    requeued: int = 0  # not processed by an expired or cancelled batch: sent again in a later one
    expired: int = 0  # batches
    cancelled: int = 0  # batches
    replayed: int = 0  # requests answered by a batch an earlier session (or a lost worker's session) submitted
    wait_s: float = 0.0  # summed over the requests: from queued to answered

    def as_dict(self) -> dict:
        data = attrs.asdict(self)
        data["wait_s"] = round(self.wait_s, 3)
        data["requests_per_batch"] = round(self.requests / self.batches, 2) if self.batches else 0.0
        data["mean_wait_s"] = round(self.wait_s / self.answered, 3) if self.answered else 0.0
        return data


class Batcher:
    """Collects the requests of waiting sessions into batches; see the module docstring."""

    def __init__(self, api: BatchAPI, options: BatchOptions = BatchOptions(), journal=None):
        self.api = api
        self.options = options
        self.journal = journal  # pending/submitted/collected lines (hermes_batch.folder.batch_journal), or None
        self.counts = BatchCounts()
        self._queue: list = []
        self._timer: Optional[asyncio.TimerHandle] = None
        self._tasks: set = set()
        self._in_flight: dict = {}  # batch id (or "" while submitting) -> its requests
        self._earlier: dict = {}  # digest -> futures of its outcomes in earlier sessions' batches
        self._serial = 0
        self._queued_bytes = 0
        self.fatal: Optional[BaseException] = None
        # told the prompt index of each request as its batch goes out: the run's call journal writes its ``sent``
        # line then, not while it waits in the queue (a kill there sent nothing, and pays for nothing)
        self.on_sent: Optional[Callable[[int], None]] = None
        self._waiting: set = set()  # requests queued or in a batch, not answered yet: one per waiting session
        # How many sessions may still send a request, or None while more may start (set by the run): once all of
        # them wait on a batch, no request can come to fill the open one, and waiting for max_wait gains nothing.
        self.senders: Optional[Callable[[], Optional[int]]] = None

    # --- sessions' side ------------------------------------------------------------------------------

    async def send(self, messages: tuple, tools: tuple, prompt: int = -1,
                   on_sent: Optional[Callable[[], None]] = None) -> ModelResponse:
        """The answer to one call, through a batch (or an earlier session's batch that holds it).

        ``on_sent`` is called when the request's batch goes out.  Cut off (CancelledError) after that, the error
        says ``left_in_batch`` (a batch at the provider may hold it); before, ``never_sent`` (nothing was paid):
        CallJournal.complete writes no end for either.
        """
        if self.fatal is not None:
            raise self.fatal
        body = self.api.body(messages, tools)
        key = digest(body)
        outcome = await self._from_earlier(key)
        if outcome is not None:
            return outcome
        # not in any, not processed, or failed: it goes out like any request
        turn = sum(1 for m in messages if m.role == "assistant")
        request = _Request(body, key, prompt, turn, on_sent)
        request.size = self.api.request_bytes(f"{key}-{self._serial}", body)
        if request.size > self.api.max_bytes:
            error = ModelCallError(
                f"The request is {request.size / 1e6:.1f} MB, more than one batch of the endpoint may hold "
                f"({self.api.max_bytes / 1e6:g} MB); it cannot go out with --batch_api.", status=413)
            error.never_sent = True
            raise error
        self._enqueue(request)
        try:
            return await request.future
        except asyncio.CancelledError as exc:
            if request.sent:  # journaled as pending: a batch at the provider may hold it (CallJournal.complete)
                exc.left_in_batch = True
            else:
                exc.never_sent = True
            raise
        finally:
            if not request.future.done():  # the session was cancelled (--prompt_timeout, Ctrl-C)
                request.future.cancel()

    async def earlier(self, messages: tuple, tools: tuple) -> Optional[ModelResponse]:
        """The answer an earlier session's batch holds for this call (its result, once that batch ended), else None:
        then ``send`` it."""
        if self.fatal is not None or not self._earlier:
            return None
        return await self._from_earlier(digest(self.api.body(messages, tools)))

    def forget(self, messages: tuple, tools: tuple) -> None:
        """The replay journal answered this call: its answer in an earlier session's batch is used, so it goes
        to no other session that sends the same body (another sample of the prompt)."""
        if not self._earlier:
            return
        key = digest(self.api.body(messages, tools))
        held = self._earlier.get(key)
        if held:
            held.pop(0)
            if not held:
                del self._earlier[key]

    async def _from_earlier(self, key: str) -> Optional[ModelResponse]:
        held = self._earlier.get(key)  # its places in earlier sessions' batches (more than one: sent again there)
        while held:
            earlier = held.pop(0)
            if not held:
                del self._earlier[key]
            outcome = await earlier
            if isinstance(outcome, ModelResponse):
                self.counts.replayed += 1
                return outcome
            held = self._earlier.get(key)
        return None

    @property
    def _max_requests(self) -> int:
        return max(1, min(self.options.max_requests, self.api.max_requests))

    def _enqueue(self, request: _Request) -> None:
        self._queue.append(request)
        self._queued_bytes += request.size
        if request not in self._waiting:
            self._waiting.add(request)
            request.future.add_done_callback(lambda _f: self._waiting.discard(request))
        if (len(self._queue) >= self._max_requests or self._queued_bytes >= self.api.max_bytes
                or self._nothing_more_comes()):
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.options.max_wait, self._flush)

    def _nothing_more_comes(self) -> bool:
        """Every session that may still send a request waits on a batch (``senders``)."""
        if self.senders is None or not self._queue:
            return False
        senders = self.senders()
        return senders is not None and sum(not r.future.done() for r in self._waiting) >= senders

    def wake(self) -> None:
        """A session ended, or no more can start: submit the open batch now if every session left waits on one."""
        if self._nothing_more_comes():
            self._flush()

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        queue = [r for r in self._queue if not r.future.done()]  # sessions cut off meanwhile send nothing
        self._queue, self._queued_bytes = [], 0
        batch, size = [], 0
        for request in queue:  # cut to the provider's limits: requests and bytes
            if batch and (len(batch) >= self._max_requests or size + request.size > self.api.max_bytes):
                self._start(batch)
                batch, size = [], 0
            batch.append(request)
            size += request.size
        if batch:
            self._start(batch)

    def _start(self, batch: list) -> None:
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- one batch -------------------------------------------------------------------------------------

    async def _run(self, batch: list) -> None:
        for request in batch:
            if not request.custom_id:
                self._serial += 1
                request.custom_id = f"{request.digest}-{self._serial}"
        try:
            batch_id = await self._submit(batch)
        except ModelCallError as exc:
            if exc.status == 413 and len(batch) > 1:
                # too large for this endpoint, whatever it said its limits are: each half goes out on its own
                log.info("The endpoint refused a batch of %d requests as too large; it goes out in two.", len(batch))
                half = len(batch) // 2
                self._start(batch[:half])
                self._start(batch[half:])
                return
            self._fail(batch, exc)
            return
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._fail(batch, ModelCallError("The batch was not submitted."))
                raise
            self._fail(batch, exc)
            return
        self._in_flight[batch_id] = batch
        try:
            outcome = await self._until_ended(batch_id)
            results = await self._retry(self.api.results, batch_id, {r.custom_id for r in batch})
        except BaseException as exc:
            self._in_flight.pop(batch_id, None)
            if isinstance(exc, Exception):
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(exc)
                return
            raise
        self._in_flight.pop(batch_id, None)
        if outcome == "failed" and not results:  # the provider refused the batch as a whole (its validation)
            error = ModelCallError(f"The endpoint refused the batch {batch_id} as a whole (it failed validation).")
            results = {request.custom_id: error for request in batch}
        if outcome == "expired":
            self.counts.expired += 1
        elif outcome == "cancelled":
            self.counts.cancelled += 1
        now = time.monotonic()
        again = []
        for request in batch:
            result = results.get(request.custom_id)
            if result is None:
                again.append(request)
                continue
            self.counts.answered += 1
            self.counts.wait_s += now - request.queued_at
            if request.future.done():
                continue  # its session ended meanwhile: the answer was paid for, and is lost
            if isinstance(result, BaseException):
                self.counts.failed += 1
                request.future.set_exception(result)
            else:
                request.future.set_result(result)
        if self.journal is not None:
            self.journal.collected(batch_id)
        if again:
            log.info("Batch %s %s; %d request(s) go out again in the next batch.", batch_id, outcome, len(again))
            self.counts.requeued += len(again)
            for request in again:
                if not request.future.done():
                    self._enqueue(request)

    def _fail(self, batch: list, error: Exception) -> None:
        for request in batch:
            if not request.future.done():
                request.future.set_exception(error)
        if isinstance(error, FatalModelError):
            self.fatal = error

    async def _submit(self, batch: list) -> str:
        requests = [(r.custom_id, r.body) for r in batch]
        if self.journal is not None:
            # before the provider sees it: a kill from here on leaves a trace of what may have been sent
            self.journal.pending([(r.custom_id, r.prompt, r.turn) for r in batch])
        for request in batch:  # from here on each request may be paid for: calls.jsonl counts it as sent
            if not request.sent:
                request.sent = True
                if self.on_sent is not None:
                    self.on_sent(request.prompt)
                if request.on_sent is not None:
                    request.on_sent()
        batch_id = await self._retry(self.api.submit, requests, attempts=SUBMIT_RETRIES)
        if self.journal is not None:
            self.journal.submitted(batch_id, [r.custom_id for r in batch])
        self.counts.batches += 1
        self.counts.requests += len(batch)
        self.counts.largest = max(self.counts.largest, len(batch))
        log.debug("Batch %s submitted with %d request(s).", batch_id, len(batch))
        return batch_id

    async def _until_ended(self, batch_id: str, *, at_once: bool = False) -> str:
        """How the batch ended, checked every ``poll_interval`` (the first time at once with ``at_once``);
        a check that fails for now is tried again at the next."""
        while True:
            if not at_once:
                await asyncio.sleep(self.options.poll_interval)
            at_once = False
            try:
                outcome = await self.api.poll(batch_id)
            except RetryableModelError as exc:
                log.info("Checking batch %s failed (%s); trying again.", batch_id, exc)
                continue
            if outcome is not None:
                return outcome

    @staticmethod
    async def _retry(call, *args, attempts: int = SUBMIT_RETRIES):
        for attempt in range(attempts):
            try:
                return await call(*args)
            except RetryableModelError as exc:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(backoff_delay(attempt, exc.retry_after, base=0.5))

    # --- an earlier session's batches (--resume) --------------------------------------------------------

    def expect(self, batch_id: str, custom_ids: list) -> None:
        """Collect ``batch_id``, submitted by an earlier session, and answer its requests from it when sent again."""
        loop = asyncio.get_running_loop()
        futures = {}
        for custom_id in custom_ids:
            futures[custom_id] = future = loop.create_future()
            self._earlier.setdefault(custom_id.partition("-")[0], []).append(future)
        task = loop.create_task(self._collect_earlier(batch_id, futures))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def adopt(self, messages: tuple, tools: tuple, outcome: asyncio.Future) -> None:
        """The session that sent this call is gone (its worker was lost) but its request stays in its batch: the
        answer (``outcome``'s result, None if there is none) goes to the next session that sends the same request,
        as an earlier session's batch's would (a prompt run again from its first turn sends it again)."""
        self._earlier.setdefault(digest(self.api.body(messages, tools)), []).append(outcome)

    async def _collect_earlier(self, batch_id: str, futures: dict) -> None:
        results: dict = {}
        try:
            await self._until_ended(batch_id, at_once=True)
            results = await self._retry(self.api.results, batch_id, set(futures))
        except Exception as exc:
            log.warning("The batch %s of an earlier session could not be collected (%s); its requests are sent "
                        "again.", batch_id, exc)
        finally:
            for custom_id, future in futures.items():
                if not future.done():
                    future.set_result(results.get(custom_id))
        if self.journal is not None and results:
            self.journal.collected(batch_id)

    # --- the run's side ------------------------------------------------------------------------------------

    async def check(self) -> None:
        """FatalModelError (exit 2) when the endpoint has no batch API, refuses the key, or cannot be checked;
        before any prompt runs."""
        try:
            await self._retry(self.api.check)
        except FatalModelError:
            raise
        except ModelCallError as exc:
            raise FatalModelError(f"Checking the endpoint's batch API failed ({exc}); run without --batch_api, "
                                  "or again once the endpoint answers.") from exc

    def summary(self) -> dict:
        """Lines for the progress display."""
        c = self.counts
        return {
            "batches": f"{len(self._in_flight)} in flight, {c.batches} submitted, {len(self._queue)} request(s) queued",
        }

    async def aclose(self) -> None:
        """Stop waiting; batches in flight are left to the provider (a ``--resume`` collects them)."""
        if self._in_flight:
            requests = sum(len(batch) for batch in self._in_flight.values())
            log.warning("%d batch(es) of %d request(s) are left in flight at the provider; --resume collects them "
                        "instead of sending them again.", len(self._in_flight), requests)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.api.aclose()


# --- for the BatchAPIs of the SDK clients ---------------------------------------------------------------


def management_error(sdk, exc: BaseException, base_url: str, what: str) -> Exception:
    """The error of a call that manages batches (upload, create, poll, results), from the ``openai`` or
    ``anthropic`` SDK's exception: 404 means the endpoint has no batch API."""
    from .retry import RETRYABLE_STATUS, api_error_text

    if isinstance(exc, sdk.APIStatusError):
        status, text = exc.status_code, api_error_text(exc)
        if status in (401, 403):
            return FatalModelError(f"The endpoint {base_url} refused the API key for {what} ({status}: {text}); "
                                   "pass a key allowed to use its batch API.")
        if status in (404, 405, 501) and what == "its batch API":
            return FatalModelError(f"The endpoint {base_url} has no batch API ({status}: {text}); "
                                   "run without --batch_api.")
        if status in RETRYABLE_STATUS:
            return RetryableModelError(f"The endpoint answered {status} for {what}: {text}", status=status)
        return ModelCallError(f"The endpoint refused {what} ({status}: {text}).", status=status)
    if isinstance(exc, (sdk.APITimeoutError, sdk.APIConnectionError)):
        return RetryableModelError(f"The endpoint at {base_url} could not be reached for {what}: {exc}")
    return ModelCallError(f"{what} failed: {exc}")


def status_error(sdk, status: int, body, url: str):
    """The SDK's own exception for an error answer that came inside a batch, for the client's classification."""
    from .model_http import _sdk_httpx

    httpx = _sdk_httpx(sdk)
    response = httpx.Response(status, request=httpx.Request("POST", url))
    message = body.get("error", {}).get("message") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
    return sdk.APIStatusError(str(message or f"Error code: {status}"), response=response, body=body)
