"""The gate every model call goes through: retries, an adaptive limit of calls in flight, per-minute budgets.

One ``CallLimiter`` per run (``ModelClient.limiter``).  Each attempt of a call
takes a slot (at most ``limit`` attempts in flight), then a start time under
``--max_requests_per_minute`` and a token reservation under
``--max_tokens_per_minute``.  The limit follows AIMD: a 429 halves it, once
per round (only a call started since the last decrease can decrease it
again, so a burst of 429s from one overload counts once), and the call waits
for Retry-After before its next attempt; each ``limit`` successes of calls
started under the current limit add one back, up to the starting limit.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Awaitable, Callable, Optional

import attrs

from ..formats.endpoint_numbers import checked_usage
from ..errors import FatalModelError, ModelCallError, ModelEndpointError, ModelOutcome, RetryableModelError
from ..formats.records import CANCELLED_STATUS, CallRecord, ModelResponse
from .provider_guard import provider_name
from .retry import MAX_RETRIES, backoff_delay

log = logging.getLogger("hermes_batch.model.ratelimit")

DECREASE_FACTOR = 0.5
UNLIMITED = 1_000_000
TOKEN_BURST_S = 10.0  # a tokens-per-minute budget lets this many seconds' worth start at once

Send = Callable[[tuple, tuple], Awaitable[ModelResponse]]


class CallLimiter:
    """Retries with backoff, an AIMD limit of model calls in flight, and optional per-minute budgets."""

    def __init__(
        self,
        *,
        limit: Optional[int] = None,
        max_retries: int = MAX_RETRIES,
        requests_per_minute: Optional[float] = None,
        tokens_per_minute: Optional[float] = None,
        backoff_base: float = 1.0,
    ):
        self.start_limit = max(1, limit or UNLIMITED)
        self.limit = self.min_limit = self.start_limit
        self.max_retries = max_retries
        self.backoff_base = backoff_base
        self.in_flight = 0
        self.requests = 0  # attempts sent, failed ones included
        self.errors = 0
        self.rate_limited = 0
        self.cost: Optional[float] = None  # summed over the answers that reported one
        self._waiters: collections.deque = collections.deque()
        self._round = 0  # bumped by each decrease
        self._successes = 0  # of calls started in the current round
        self._interval = 60.0 / requests_per_minute if requests_per_minute else 0.0
        self._next_start = 0.0
        self._tokens_per_s = tokens_per_minute / 60.0 if tokens_per_minute else 0.0
        self._token_capacity = self._tokens_per_s * TOKEN_BURST_S
        self._tokens = self._token_capacity
        self._tokens_at = time.monotonic()
        self._completion_estimate = 256.0
        self._unpaused: Optional[asyncio.Event] = None  # made by pause(): set while calls may go out

    @classmethod
    def from_settings(cls, settings) -> "CallLimiter":
        """The limiter of a client's ModelSettings."""
        return cls(
            limit=settings.max_concurrent_requests,
            max_retries=settings.max_retries,
            requests_per_minute=settings.max_requests_per_minute,
            tokens_per_minute=settings.max_tokens_per_minute,
        )

    async def call(self, send: Send, messages: tuple, tools: tuple, *, calls: Optional[list] = None) -> ModelResponse:
        """``send(messages, tools)`` until it answers, retrying RetryableModelError up to ``max_retries`` times.

        Every attempt is appended to ``calls`` as a CallRecord.  Raises
        ModelEndpointError when the retries are used up; other errors pass through.
        """
        estimate = self._estimate(messages, tools) if self._tokens_per_s else 0
        attempt = 0
        while True:
            if self._unpaused is not None:
                await self._unpaused.wait()
            await self._acquire()
            round_, sent, started = self._round, False, 0.0
            try:
                await self._wait_for_budgets(estimate)
                sent, started = True, time.monotonic()
                response = await send(messages, tools)
            except RetryableModelError as exc:
                self._release()
                self._attempted(calls, exc.provider, started, exc.status, estimate)
                if exc.rate_limited:
                    self._decrease(round_)
                if attempt >= self.max_retries:
                    raise ModelEndpointError(f"{exc} (gave up after {attempt + 1} attempts)") from exc
                delay = backoff_delay(attempt, exc.retry_after, base=self.backoff_base)
            except BaseException as exc:
                self._release()
                if sent:
                    # a refusal, or a call cut short by a deadline or Ctrl-C: an attempt without an answer, which
                    # the run cut off itself when cancelled (no error of the endpoint)
                    status = CANCELLED_STATUS if isinstance(exc, asyncio.CancelledError) else getattr(exc, "status", None)
                    self._attempted(calls, getattr(exc, "provider", None), started, status, estimate)
                raise
            else:
                self._release()
                usage = checked_usage(response.usage)  # any client's, any tool's: a few comparisons when fine
                if usage is not response.usage:
                    response = attrs.evolve(response, usage=usage)
                self._attempted(calls, response.provider, started, 200, estimate, response)
                self._increase(round_)
                return response
            attempt += 1
            await asyncio.sleep(delay)

    def pause(self) -> None:
        """No call (nor retry) goes out until ``resume``; calls in flight go on (``hermes-batch ctl pause``)."""
        if self._unpaused is None:
            self._unpaused = asyncio.Event()
        self._unpaused.clear()

    def resume(self) -> None:
        if self._unpaused is not None:
            self._unpaused.set()

    # --- the limit of calls in flight --------------------------------------------------------------

    async def _acquire(self) -> None:
        if self.in_flight < self.limit and not self._waiters:
            self.in_flight += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release()  # the slot was handed over just as this call was cancelled
            else:
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass
            raise

    def _release(self) -> None:
        self.in_flight -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.in_flight < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1  # handed over, so no newcomer takes it first
                waiter.set_result(None)

    def _decrease(self, round_: int) -> None:
        self.rate_limited += 1
        if round_ != self._round:
            return  # this call started before the last decrease, which already answered its overload
        self._round += 1
        self._successes = 0
        in_flight_then = self.in_flight + 1
        new = max(1, int(min(self.limit, in_flight_then) * DECREASE_FACTOR))
        if new < self.limit:
            self.limit = new
            self.min_limit = min(self.min_limit, new)
            log.info("Rate limited (429): at most %d model calls in flight now.", new)

    def _increase(self, round_: int) -> None:
        if round_ != self._round or self.limit >= self.start_limit:
            return
        self._successes += 1
        if self._successes >= self.limit:
            self._successes = 0
            self.limit += 1
            self._wake()

    # --- budgets and accounting ----------------------------------------------------------------------

    async def _wait_for_budgets(self, estimate: int) -> None:
        if self._interval:
            now = time.monotonic()
            start = max(now, self._next_start)
            self._next_start = start + self._interval
            if start > now:
                await asyncio.sleep(start - now)
        if self._tokens_per_s:
            while True:
                self._refill()
                if self._tokens > 0:
                    self._tokens -= estimate  # may go below zero: later calls wait until it is paid back
                    return
                await asyncio.sleep(-self._tokens / self._tokens_per_s + 0.01)

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self._token_capacity, self._tokens + (now - self._tokens_at) * self._tokens_per_s)
        self._tokens_at = now

    def _estimate(self, messages: tuple, tools: tuple) -> int:
        chars = 0
        for m in messages:
            chars += len(m.content) + len(m.reasoning or "") + sum(len(c.raw_arguments) for c in m.tool_calls)
        chars += sum(len(t.description) + len(str(t.parameters)) for t in tools)
        return chars // 4 + int(self._completion_estimate)

    def _attempted(self, calls, provider, started, status, estimate, response: Optional[ModelResponse] = None) -> None:
        self.requests += 1
        if status not in (200, CANCELLED_STATUS):
            self.errors += 1
        if calls is not None:
            latency = round(time.monotonic() - started, 3) if started else 0.0
            # the provider is the endpoint's text: only a short line of it reaches records and the journal
            calls.append(CallRecord(provider_name(provider), latency, status))
        if response is None:
            if estimate:
                self._tokens += estimate  # refused or unanswered: assume nothing was used
            return
        usage = response.usage
        if usage.cost is not None:
            self.cost = (self.cost or 0.0) + usage.cost
        if estimate:
            used = usage.prompt_tokens + usage.completion_tokens
            if used:
                self._tokens = min(self._token_capacity, self._tokens + estimate - used)
                self._completion_estimate += 0.2 * (usage.completion_tokens - self._completion_estimate)

    # --- what the run shows and records --------------------------------------------------------------

    def summary(self) -> dict:
        """Lines for the progress display."""
        limit = "none" if self.limit >= UNLIMITED else str(self.limit)
        return {"model calls": f"{self.in_flight} in flight, limit {limit}", "rate-limited": str(self.rate_limited)}


async def check_endpoint(send: Send, messages: tuple, max_retries: int) -> None:
    """The preflight request: FatalModelError when the endpoint refuses the run or cannot be reached."""
    limiter = CallLimiter(limit=1, max_retries=max_retries, backoff_base=0.25)
    try:
        await limiter.call(send, messages, ())
    except ModelEndpointError as exc:
        cause = exc.__cause__ or exc
        raise FatalModelError(
            f"The preflight request failed {limiter.requests} times ({cause}); check --base_url and that the "
            "endpoint is up, or pass --no_preflight to skip this check."
        ) from exc
    except ModelOutcome:
        pass  # the endpoint answered: the key and the model are good
    except ModelCallError as exc:
        # e.g. a parameter the probe sends that this endpoint dislikes; the prompts will tell
        log.warning("The preflight request was refused (%s); starting the run anyway.", exc)
