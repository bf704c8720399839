"""Backoff for model calls: exponential with full jitter, honouring Retry-After and rate-limit reset headers.

The retry loop itself is :meth:`hermes_batch.model.ratelimit.CallLimiter.call`.
"""

from __future__ import annotations

import email.utils
import random
import re
import time
from typing import Mapping, Optional

from ..errors import ModelCallError, RetryableModelError

MAX_RETRIES = 6  # retries of one failing model call

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524, 529})


def retry_after_seconds(headers: Optional[Mapping[str, str]]) -> Optional[float]:
    """Seconds the server asked us to wait (``retry-after-ms`` or ``retry-after``), if any."""
    if not headers:
        return None
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        try:
            return max(0.0, float(raw_ms) / 1000.0)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        parsed = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, parsed.timestamp() - time.time()) if parsed else None


def backoff_delay(attempt: int, retry_after: Optional[float], *, base: float = 1.0, cap: float = 60.0) -> float:
    """Delay before retry number ``attempt`` (0-based): the server's wish, else jittered exponential."""
    if retry_after is not None:
        return min(retry_after, cap * 5) + random.uniform(0, 0.1 * base)
    return random.uniform(0, min(cap, base * (2**attempt)))


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _duration_seconds(raw: str) -> Optional[float]:
    """``"1s"``, ``"6m0s"``, ``"20ms"`` (OpenAI's reset headers) or a plain number of seconds."""
    raw = raw.strip()
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    parts = _DURATION_PART.findall(raw)
    if not parts or "".join(n + u for n, u in parts) != raw:
        return None
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)


def _reset_at_seconds(raw: str) -> Optional[float]:
    """``x-ratelimit-reset``: epoch milliseconds (OpenRouter), epoch seconds, or seconds to wait."""
    try:
        value = float(raw)
    except ValueError:
        return None
    now = time.time()
    if value > 1e11:
        return max(0.0, value / 1000.0 - now)
    if value > 1e9:
        return max(0.0, value - now)
    return max(0.0, value)


def choose_reset_wait(limits) -> Optional[float]:
    """Seconds to wait given ``(seconds until reset, exhausted)`` per limit.

    The latest reset among exhausted limits (the call cannot pass before it),
    else the soonest reset; None when no limit was reported.
    """
    limits = list(limits)
    exhausted = [seconds for seconds, spent in limits if spent]
    if exhausted:
        return max(exhausted)
    return min((seconds for seconds, _spent in limits), default=None)


def rate_limit_reset_seconds(headers: Optional[Mapping[str, str]]) -> Optional[float]:
    """Seconds until a 429's limit resets, from OpenAI-style ``x-ratelimit-*`` headers, if any.

    Of ``x-ratelimit-reset-requests`` and ``-tokens`` the exhausted one counts
    (``remaining`` 0), else the sooner; ``x-ratelimit-reset`` is OpenRouter's.
    """
    if not headers:
        return None
    limits = []
    for kind in ("requests", "tokens"):
        raw = headers.get(f"x-ratelimit-reset-{kind}")
        seconds = _duration_seconds(raw) if raw else None
        if seconds is not None:
            limits.append((seconds, str(headers.get(f"x-ratelimit-remaining-{kind}", "")).strip() == "0"))
    wait = choose_reset_wait(limits)
    if wait is not None:
        return wait
    raw = headers.get("x-ratelimit-reset")
    return _reset_at_seconds(raw) if raw else None


def api_error_text(exc) -> str:
    """The provider's own message from an ``openai`` or ``anthropic`` SDK status error."""
    body = exc.body
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    return str(exc.message)


def error_for_status(
    status: int, headers: Optional[Mapping[str, str]], message: str, *, provider: Optional[str] = None
) -> ModelCallError:
    """The error for an HTTP error answer: RetryableModelError (with the server's wait) for 429, 5xx and
    other passing failures, else ModelCallError; for clients and tools that speak HTTP themselves."""
    if status in RETRYABLE_STATUS:
        wait = retry_after_seconds(headers)
        if wait is None and status == 429:
            wait = rate_limit_reset_seconds(headers)
        return RetryableModelError(message, status=status, retry_after=wait, provider=provider)
    return ModelCallError(message, status=status, provider=provider)
