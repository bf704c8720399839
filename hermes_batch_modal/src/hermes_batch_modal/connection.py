"""Reaching Modal: credentials from the SDK's usual sources, one client per run, errors without secrets."""

from __future__ import annotations

import asyncio
import os
from typing import Optional

from hermes_batch import ConfigError

from ._sdk import modal

HOW_TO_LOG_IN = "run `modal token new` (or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET)"
HELLO_TIMEOUT_S = 30.0  # the SDK alone retries an unreachable server for about a minute


def transient() -> tuple:
    """Errors of the SDK worth another attempt: throttling, a busy or restarting server, a dropped connection."""
    return (
        modal.exception.ResourceExhaustedError,
        modal.exception.ServiceError,
        modal.exception.InternalError,
        modal.exception.ConnectionError,
        ConnectionError,
        OSError,
    )


def find_credentials() -> tuple[str, str]:
    """The token id and secret from MODAL_TOKEN_ID/MODAL_TOKEN_SECRET or the active profile of the Modal config file."""
    try:
        modal.config._check_config()
        token_id = modal.config.config.get("token_id")
        token_secret = modal.config.config.get("token_secret")
    except modal.exception.Error as exc:
        raise ConfigError(f"The Modal configuration cannot be used ({_first_line(exc)}); fix it or {HOW_TO_LOG_IN}.") from None
    if token_id and token_secret:
        return token_id, token_secret
    missing = " and ".join(name for name, value in (("MODAL_TOKEN_ID", token_id), ("MODAL_TOKEN_SECRET", token_secret)) if not value)
    raise ConfigError(
        f"No Modal credentials were found ({missing} not set in the environment nor in "
        f"{modal.config.user_config_path}); {HOW_TO_LOG_IN} and run again."
    )


def server_url() -> str:
    return modal.config.config.get("server_url")


async def connect() -> modal.Client:
    """A client of Modal's server checked with one ClientHello; ConfigError says what to fix."""
    token_id, token_secret = find_credentials()
    client = None
    try:
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            client = await modal.Client.from_credentials.aio(token_id, token_secret)
            await client.hello.aio()
        return client
    except BaseException as exc:
        if client is not None:
            await close_quietly(client)
        if isinstance(exc, (modal.exception.AuthError, modal.exception.PermissionDeniedError)):
            raise ConfigError(f"Modal refused the token it was given; {HOW_TO_LOG_IN} with a valid token.") from None
        if isinstance(exc, (*transient(), modal.exception.TimeoutError, TimeoutError)):
            reason = f"no answer within {HELLO_TIMEOUT_S:g} s" if isinstance(exc, TimeoutError) else explain(exc)
            raise ConfigError(
                f"Modal's server at {server_url()} is not reachable ({reason}); check the network "
                "(or MODAL_SERVER_URL) and run again."
            ) from None
        raise


async def close_quietly(client: Optional[modal.Client]) -> None:
    if client is None:
        return
    try:
        await client.close.aio()
    except Exception:  # closing releases connections; nothing the run can act on
        pass


def explain(exc: BaseException) -> str:
    """A short reason for an SDK error, with no credential in it."""
    text = " ".join(str(exc).split()) or type(exc).__name__  # the SDK's messages span lines
    return redact(text if len(text) <= 300 else text[:297] + "...")


def redact(text: str) -> str:
    """``text`` with the token id and secret of this process (if any) blanked out."""
    for name in ("MODAL_TOKEN_SECRET", "MODAL_TOKEN_ID"):
        secret = os.environ.get(name)
        if secret and len(secret) >= 6:
            text = text.replace(secret, "[redacted]")
    try:
        for key in ("token_secret", "token_id"):
            secret = modal.config.config.get(key)
            if secret and len(secret) >= 6:
                text = text.replace(secret, "[redacted]")
    except modal.exception.Error:
        pass
    return text


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else ""
