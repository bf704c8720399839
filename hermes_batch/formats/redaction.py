"""Keeping the run's secrets out of everything it writes, whatever a sandbox managed to read.

The secrets of a run are its API key, the credentials inside ``--base_url``
(user information, and query values whose names look secret), the values of
options whose names look secret (``-S token=...``), and the values of the
runner's environment variables whose names look secret (``*_API_KEY``,
``*_TOKEN``, ``*_SECRET``, ``*PASSWORD*``, ...: the keys of tool providers
too) or that an option names (``-T image_gen.api_key_env=VARIABLE``).  Each is looked for as is and in its obvious encodings (URL, JSON,
base64 at any alignment, hex) and replaced by ``[REDACTED]`` in records,
``run.json``, ``statistics.json``, log lines and error messages.  Values
shorter than 8 characters are not treated as secrets (no real key is that
short, and replacing ``EMPTY`` everywhere would mangle the data).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
from typing import Any, Iterable, Mapping, Optional
from urllib.parse import parse_qsl, quote, quote_plus, unquote, urlencode, urlsplit, urlunsplit

import attrs

REDACTED = "[REDACTED]"
MIN_SECRET_CHARS = 8
_SECRET_NAME = re.compile(
    r"(?:^|[_.-])(?:API[_-]?KEY|KEY|TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?)(?:$|[_.-])", re.IGNORECASE
)
_SECRET_QUERY = re.compile(r"key|token|secret|sig|password|passwd|pwd|auth|credential|code", re.IGNORECASE)


def secret_name(name: str) -> bool:
    """Whether a variable or option called ``name`` holds a secret."""
    return bool(_SECRET_NAME.search(name))


def url_secrets(url: str) -> list:
    """The credentials inside ``url``: its user information and query values whose names look secret."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found = []
    userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
    if userinfo:
        found += [userinfo, unquote(userinfo)]
        found += [unquote(piece) for piece in userinfo.split(":", 1)]
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if _SECRET_QUERY.search(name):
            found += [value, quote_plus(value)]
    return found


def display_url(url: str) -> str:
    """``url`` without its user information, with secret-looking query values replaced by ``[REDACTED]``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED
    netloc = parts.netloc.rpartition("@")[2]
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, REDACTED if _SECRET_QUERY.search(k) else v) for k, v in pairs], safe="[]")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def encodings(secret: str) -> set:
    """``secret`` as it may appear in output: raw, URL-, JSON-, base64- (any alignment) and hex-encoded."""
    raw = secret.encode("utf-8")
    forms = {secret, quote(secret, safe=""), quote_plus(secret), json.dumps(secret, ensure_ascii=False)[1:-1],
             json.dumps(secret)[1:-1], raw.hex(), raw.hex().upper()}
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        for pad in range(3):
            text = encode(b"\0" * pad + raw).decode("ascii")
            # only the characters that depend on the secret's bytes alone, wherever it sat in the stream
            forms.add(text[(8 * pad + 5) // 6:(8 * (pad + len(raw))) // 6])
    return {form for form in forms if len(form) >= MIN_SECRET_CHARS}


def run_secrets(config: Any, environ: Mapping[str, str] = os.environ) -> list:
    """The secret values of a run: its API key, ``--base_url`` credentials, secret options and variables."""
    found = [getattr(config, "api_key", None) or ""]
    found += url_secrets(getattr(config, "base_url", "") or "")
    for field in attrs.fields(type(config)):
        value = getattr(config, field.name)
        if isinstance(value, dict):
            found += _option_secrets(value, environ)
        elif isinstance(value, (tuple, list)):  # NAME:OPTIONS specs (--verifier judge:api_key_env=VARIABLE)
            found += [secret for spec in value if isinstance(spec, str) for secret in _spec_secrets(spec, environ)]
    for name, value in environ.items():
        if secret_name(name) and not value.startswith("/"):  # a path names a secret, it is not one
            found.append(value)
    return sorted({s for s in found if isinstance(s, str) and len(s) >= MIN_SECRET_CHARS}, key=len, reverse=True)


def _option_secrets(options: Mapping, environ: Mapping[str, str]) -> list:
    found = []
    for key, value in options.items():
        if isinstance(value, Mapping):
            found += _option_secrets(value, environ)
        elif isinstance(value, str):
            if _names_variable(key):
                found.append(environ.get(value, ""))  # the variable that holds a key (-T x.api_key_env=...)
            elif secret_name(str(key)):
                found.append(value)
            if "://" in value:
                found += url_secrets(value)
    return found


_SPEC_VARIABLE = re.compile(r"""([A-Za-z0-9_]*env)["']?\s*[=:]\s*["']?([A-Za-z_][A-Za-z0-9_]*)""", re.IGNORECASE)
_SPEC_URL = re.compile(r"""[A-Za-z][A-Za-z0-9+.-]*://[^\s,"'}]+""")


def _spec_secrets(spec: str, environ: Mapping[str, str]) -> list:
    """The secrets a ``NAME:OPTIONS`` spec points at: the variables its ``*_env`` options name, URL credentials."""
    found = [environ.get(name, "") for _key, name in _SPEC_VARIABLE.findall(spec)]
    for url in _SPEC_URL.findall(spec):
        found += url_secrets(url)
    return found


def _names_variable(key: Any) -> bool:
    return str(key).lower().endswith("env")


def public_options(options: Mapping) -> dict:
    """``options`` with the values of secret-looking keys and URL credentials replaced, for run.json."""
    shown = {}
    for key, value in options.items():
        if isinstance(value, Mapping):
            value = public_options(value)
        elif isinstance(value, str) and secret_name(str(key)) and not _names_variable(key):
            value = REDACTED
        elif isinstance(value, str) and "://" in value:
            value = display_url(value)
        shown[key] = value
    return shown


class Redactor:
    """Replaces a run's secrets, in every encoding it knows, by ``[REDACTED]``."""

    def __init__(self, secrets: Iterable[str] = ()):
        needles = set()
        for secret in secrets:
            if isinstance(secret, str) and len(secret) >= MIN_SECRET_CHARS:
                needles |= encodings(secret)
        # longest first, so a secret inside a longer one (user:password and password) goes whole
        self.needles = tuple(sorted(needles, key=len, reverse=True))

    @classmethod
    def for_run(cls, config: Any, environ: Mapping[str, str] = os.environ) -> "Redactor":
        return cls(run_secrets(config, environ))

    def __bool__(self) -> bool:
        return bool(self.needles)

    def found(self, text: str) -> bool:
        """Whether ``text`` holds a secret (a fast scan: one substring search per form)."""
        return any(needle in text for needle in self.needles)

    def text(self, text: str) -> str:
        if not self.found(text):
            return text
        for needle in self.needles:
            text = text.replace(needle, REDACTED)
        return text

    def data(self, value: Any) -> Any:
        """Decoded JSON (or any nest of dicts, lists and tuples) with every string redacted."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {self.data(k) if isinstance(k, str) else k: self.data(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.data(v) for v in value)
        return value

    def record(self, record: Any) -> Any:
        """An attrs record with every string redacted; the same object when it holds no secret."""
        if not self.needles:
            return record
        from .serialization import from_json, record_converter, to_json_line

        if not self.found(to_json_line(record)):
            return record
        return from_json(self.data(record_converter.unstructure(record)), type(record))


class RedactingFilter(logging.Filter):
    """A logging filter that redacts the message, its arguments and any traceback of each record."""

    def __init__(self, redactor: Redactor):
        super().__init__()
        self.redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.redactor.found(message):
            record.msg, record.args = self.redactor.text(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text and self.redactor.found(record.exc_text):
            record.exc_text = self.redactor.text(record.exc_text)
        if record.stack_info and self.redactor.found(record.stack_info):
            record.stack_info = self.redactor.text(record.stack_info)
        return True


def redact_logging(redactor: Redactor, loggers: Iterable[Optional[str]] = ("hermes_batch", None)) -> RedactingFilter:
    """Install a RedactingFilter on the handlers of ``loggers`` (None: the root) and on the last-resort handler."""
    flt = RedactingFilter(redactor)
    handlers = [h for name in loggers for h in logging.getLogger(name).handlers]
    if logging.lastResort is not None:
        handlers.append(logging.lastResort)
    for handler in handlers:
        for old in [f for f in handler.filters if isinstance(f, RedactingFilter)]:
            handler.removeFilter(old)
        handler.addFilter(flt)
    return flt
