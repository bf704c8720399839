"""OpenAI-compatible endpoints that tools call (vision, image generation): the run's own, or another.

Calls go through a :class:`~hermes_batch.CallLimiter`, so they are
retried with backoff on 429/5xx like the agent's own calls.  On the run's
endpoint the limiter is the run client's: the tools share its rate limits and
budgets, and the cost they are charged counts against ``--max_cost``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import attrs

from hermes_batch import (
    CallLimiter,
    Message,
    ModelCallError,
    ModelResponse,
    PromptFailure,
    RetryableModelError,
    Usage,
    error_for_status,
)

# Bodies of answers are bounded: an image comes back base64-encoded, so allow some megabytes.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024


def read_secret(variable: Optional[str]) -> Optional[str]:
    """The value of the environment variable named ``variable`` (None when unset or empty)."""
    if not variable:
        return None
    return os.environ.get(variable) or None


def usage_from(body: Any) -> Usage:
    """Token usage and cost of an OpenAI-style answer (chat ``usage`` or images ``usage``)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return Usage()

    def number(value) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    prompt = number(usage.get("prompt_tokens")) or number(usage.get("input_tokens"))
    completion = number(usage.get("completion_tokens")) or number(usage.get("output_tokens"))
    details = usage.get("completion_tokens_details") or {}
    cached = usage.get("prompt_tokens_details") or {}
    cost = usage.get("cost")
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        reasoning_tokens=number(details.get("reasoning_tokens")) if isinstance(details, dict) else 0,
        cached_tokens=number(cached.get("cached_tokens")) if isinstance(cached, dict) else 0,
        cost=float(cost) if isinstance(cost, (int, float)) and not isinstance(cost, bool) else None,
    )


@attrs.define
class Endpoint:
    """An OpenAI-compatible API a tool posts to; ``post`` returns the decoded answer and its usage."""

    base_url: str
    api_key: Optional[str] = attrs.field(default=None, repr=False)
    limiter: Optional[CallLimiter] = None
    request_timeout: float = 300.0
    auth_scheme: str = "Bearer"  # FAL wants "Key"
    _session: Any = None  # an aiohttp.ClientSession, made at the first call

    async def post(self, path: str, body: dict) -> tuple[dict, Usage]:
        """POST ``body`` to ``path`` with retries; raises ModelCallError (or PromptFailure after the retries)."""
        response = await self._limiter().call(lambda _m, _t: self._send(path, body), (), ())
        return response.message.provider_data, response.usage

    def _limiter(self) -> CallLimiter:
        if self.limiter is None:
            self.limiter = CallLimiter(max_retries=4)
        return self.limiter

    async def _send(self, path: str, body: dict) -> ModelResponse:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.request_timeout))
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"{self.auth_scheme} {self.api_key}"
        url = self.base_url.rstrip("/") + path
        try:
            async with self._session.post(url, data=json.dumps(body), headers=headers) as http:
                raw = await http.content.read(MAX_RESPONSE_BYTES + 1)
                status, response_headers = http.status, http.headers
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RetryableModelError(f"{url} could not be reached ({type(exc).__name__}: {exc})") from None
        if len(raw) > MAX_RESPONSE_BYTES:
            raise ModelCallError(f"{url} answered with more than {MAX_RESPONSE_BYTES} bytes", status=status)
        try:
            decoded = json.loads(raw) if raw else {}
        except ValueError:
            decoded = None
        if status != 200:
            message = _error_text(decoded) or raw[:200].decode("utf-8", "replace") or f"HTTP {status}"
            raise error_for_status(status, response_headers, f"{url} answered {status}: {message}")
        if not isinstance(decoded, dict):
            raise ModelCallError(f"{url} answered with something that is not a JSON object", status=status)
        provider = decoded.get("provider") if isinstance(decoded.get("provider"), str) else None
        return ModelResponse(Message("assistant", provider_data=decoded), usage=usage_from(decoded), provider=provider)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _error_text(body: Any) -> Optional[str]:
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(body.get("detail"), str):  # FAL and FastAPI services
            return body["detail"]
    return None


def call_error_text(exc: BaseException) -> str:
    """What the model is told when a tool's model call failed."""
    if isinstance(exc, (ModelCallError, PromptFailure)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
