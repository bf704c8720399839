"""Backoff for model calls: exponential with full jitter, honouring Retry-After."""

from __future__ import annotations

import email.utils
import random
import time
from typing import Mapping, Optional

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
        parsed = email.utils.parsedate_to_datetime(raw) if raw else None
        return max(0.0, parsed.timestamp() - time.time()) if parsed else None


def backoff_delay(attempt: int, retry_after: Optional[float], *, base: float = 1.0, cap: float = 60.0) -> float:
    """Delay before retry number ``attempt`` (0-based): the server's wish, else jittered exponential."""
    if retry_after is not None:
        return min(retry_after, cap * 5) + random.uniform(0, 0.1 * base)
    return random.uniform(0, min(cap, base * (2**attempt)))


async def call_with_retries(client, messages, tools):
    """``client.send`` until it succeeds, retrying RetryableModelError up to ``settings.max_retries`` times."""
    import asyncio

    from .errors import ModelEndpointError, RetryableModelError

    settings = client.settings
    attempt = 0
    while True:
        try:
            return await client.send(messages, tools)
        except RetryableModelError as exc:
            if attempt >= settings.max_retries:
                raise ModelEndpointError(f"{exc} (gave up after {attempt + 1} attempts)") from exc
            delay = backoff_delay(attempt, exc.retry_after)
        attempt += 1
        await asyncio.sleep(delay)
