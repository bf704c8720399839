"""Toolset options (``-T toolset.key=value``), runtimes, and the toolset sessions of one prompt.

Each toolset declares an attrs ``Config``; ``-T web.provider=searxng`` sets its
``provider`` field, structured strictly like ``-S`` for sandboxes.  Secrets never
travel on the command line: a toolset names the environment variable that holds
its key (``-T web.api_key_env=BRAVE_API_KEY``) and reads it at start.
"""

from __future__ import annotations

import difflib
import logging
import re
from typing import Any, Callable, Iterable, Mapping, Optional

import attrs

from ..formats.endpoint_numbers import checked_usage
from ..errors import ConfigError, UsageError
from .interfaces import ModelSettings, ToolsetRuntime, ToolsetSession
from .plugin_options import structure_options
from .plugins import first_party, where_to_get
from ..formats.records import Usage
from ..formats.serialization import parse_key_values

log = logging.getLogger("hermes_batch.contract.toolsets")

# Keys that would carry a secret's value; the fix is always the *_env variant naming a variable.
_SECRET_KEY = re.compile(r"(^|_)(api_?key|key|token|secret|password)$", re.IGNORECASE)


def parse_tool_options(items: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``("web.provider=brave", "web.count=5")`` -> ``{"web": {"provider": "brave", "count": 5}}``."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in parse_key_values(tuple(items), "-T/--tool_option").items():
        toolset, dot, field = key.partition(".")
        if not dot or not toolset or not field:
            raise ConfigError(f"-T/--tool_option expects TOOLSET.KEY=VALUE (for example -T web.provider=searxng), got {key!r}.")
        if _SECRET_KEY.search(field):
            raise ConfigError(
                f"-T {toolset}.{field} would put a secret on the command line; put it in an environment "
                f"variable and pass its name instead: -T {toolset}.{field}_env=VARIABLE."
            )
        out.setdefault(toolset, {})[field] = value
    return out


def build_runtimes(registry, names: Iterable[str], options: Mapping[str, dict], model: ModelSettings) -> dict:
    """toolset name -> its ToolsetRuntime, for ``names`` and every toolset ``options`` configures.

    Options for a toolset that is not installed, and options its Config does
    not accept, are errors before anything runs.
    """
    installed = set(registry.names("toolsets"))
    unknown = sorted(set(options) - installed)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(installed), n=1)
        fix = (f"; {where_to_get('toolsets', unknown[:1])}." if first_party("toolsets", unknown[0]) is not None
               else f"; did you mean -T {close[0]}.KEY=VALUE?" if close else ".")
        raise UsageError(
            f"-T names the toolset {unknown[0]!r}, which is not installed; installed toolsets: "
            f"{', '.join(sorted(installed)) or 'none'}{fix}"
        )
    runtimes = {}
    for name in sorted((set(names) & installed) | set(options)):
        toolset = registry.get("toolsets", name)
        config = structure_options(dict(options.get(name, {})), toolset.Config, f"the {name} toolset (-T)", f"-T {name}.{{key}}=...")
        runtimes[name] = toolset.runtime(config, model)
    return runtimes


def describe_config(config: Any) -> dict:
    """A toolset's structured options as plain data for run.json (secrets are only ever variable names)."""
    if not attrs.has(type(config)):
        return {}
    return attrs.asdict(config, recurse=True, value_serializer=lambda _i, _a, v: list(v) if isinstance(v, tuple) else v)


class PromptToolsets:
    """The toolset sessions of one prompt: each created at its first use, all closed when the prompt ends."""

    def __init__(self, runtimes: Mapping[str, ToolsetRuntime], on_usage: Optional[Callable[[Usage, bool], None]] = None):
        self._runtimes = runtimes
        self._sessions: dict[str, ToolsetSession] = {}
        self._on_usage = on_usage

    def session(self, toolset: str) -> ToolsetSession:
        session = self._sessions.get(toolset)
        if session is None:
            runtime = self._runtimes.get(toolset)
            if runtime is None:
                raise LookupError(f"The toolset {toolset!r} is not offered to this prompt.")
            session = self._sessions[toolset] = runtime.session()
        return session

    def report_usage(self, usage: Usage, journaled: bool = False) -> None:
        if self._on_usage is not None:
            # what a tool's own endpoint reported: checked like a model client's answer
            self._on_usage(checked_usage(usage), journaled)

    async def aclose(self) -> None:
        """Close every session that was opened; a failing close is logged, never raised."""
        sessions, self._sessions = list(self._sessions.items()), {}
        for name, session in sessions:
            try:
                await session.close()
            except Exception:
                log.warning("closing the %s session of a prompt failed", name, exc_info=True)
