"""A plugin's exception in per-prompt code fails that prompt, naming the plugin; one failing every prompt stops the run.

The per-prompt code of a plugin is a filter's ``check`` and an observer's
``prompt_finished`` (a tool's exception is the model's tool error, see
docs/plugins.md).  Its exception is not a hermes-batch bug: the prompt's
record says ``error_kind: plugin`` with the plugin's distribution and name,
the traceback goes to the log, and the run goes on.  A plugin that fails
``IN_A_ROW`` prompts in a row, none in between passing it, stops the run with
a :class:`PluginError` naming it; every record written before is kept.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ..errors import PluginError
from ..formats.records import Failure, Trajectory

log = logging.getLogger("hermes_batch.plugins")

IN_A_ROW = 5  # a plugin that fails this many prompts in a row stops the run


class PluginFailures:
    """Names the plugins a run calls per prompt and counts the prompts each failed in a row."""

    def __init__(self, pm: Any = None, registry: Any = None, in_a_row: int = IN_A_ROW):
        self.pm = pm
        self.registry = registry
        self.in_a_row = in_a_row
        self.streaks: dict[str, int] = {}
        self.last: dict[str, tuple[str, BaseException]] = {}
        self._names: dict[tuple, str] = {}  # who() is asked for each filter and observer of every prompt

    def who(self, kind: Optional[str], name: str, plugin: Optional[str] = None) -> str:
        """'the filter 'boom' of the plugin 'myplug' (distribution mydist 1.0)'; ``kind`` a KINDS key or None (a hook)."""
        key = (kind, name, plugin)
        found = self._names.get(key)
        if found is None:
            found = self._names[key] = self._name(kind, name, plugin)
        return found

    def _name(self, kind: Optional[str], name: str, plugin: Optional[str]) -> str:
        from .plugins import DEFAULT_PLUGINS, KIND  # imported here: plugins.py is a hub this module need not load

        if plugin is None and kind is not None and self.registry is not None:
            entry = self.registry.kinds.get(kind, {}).get(name)
            plugin = entry.plugin if entry is not None else None
        known = self.pm is not None and (plugin in self.pm.distributions or plugin in DEFAULT_PLUGINS)
        dist, version = self.pm.distribution(plugin) if known else (None, None)  # not a test's extra plugin
        what = f"the {KIND[kind].singular} {name!r}" if kind is not None else f"the {name} hook"
        of = f" of the plugin {plugin!r}" if plugin else ""
        if dist:
            of += f" (distribution {dist}{' ' + version if version else ''})"
        return what + of

    def passed(self, who: str) -> None:
        self.streaks.pop(who, None)

    def failed(self, who: str, exc: BaseException, prompt_index: int) -> str:
        """Log the traceback and count the failure; the sentence for the prompt's record."""
        message = f"{who[0].upper()}{who[1:]} raised {type(exc).__name__}: {exc}"
        log.error("[P%d] %s; the traceback follows.", prompt_index, message, exc_info=exc)
        self.streaks[who] = self.streaks.get(who, 0) + 1
        self.last[who] = (message, exc)
        return message + " (the traceback is in the log)."

    def stop_if_failing(self) -> None:
        """Raise PluginError naming a plugin that failed ``in_a_row`` prompts in a row; called once the prompt's
        record is written, so the run stops with every finished prompt saved."""
        for who, streak in self.streaks.items():
            if streak >= self.in_a_row:
                message, exc = self.last[who]
                raise PluginError(
                    f"{message}, on {streak} prompts in a row, so the run stops (every finished prompt is saved); "
                    "fix the plugin, or leave it out (hermes-batch plugins lists them) and run again with --resume."
                ) from exc

    def filter(self, filters, trajectory: Trajectory, prompt: str):
        """[(filter name, reason)] of the filters that reject ``trajectory``, or a Failure when one raised."""
        rejected = []
        for f in filters:
            who = self.who("filters", f.name)
            try:
                reason = f.check(trajectory)
            except Exception as exc:
                return failure_of(trajectory, prompt, exc, self.failed(who, exc, trajectory.prompt_index))
            self.passed(who)
            if reason is not None:
                rejected.append((f.name, reason))
        return rejected

    def observe(self, hook, prompt_index: int, **kwargs: Any) -> None:
        """Call each implementation of the observer ``hook`` (a pluggy HookCaller); one that raises is logged and
        counted, and the others are still called.  The record they observe was written and stays as it is: a kept
        sample turned into a failure would be paid for again by a resume.  Then :meth:`stop_if_failing`."""
        for impl in reversed(hook.get_hookimpls()):  # registration order, as pluggy calls them
            who = self.who(None, hook.name, impl.plugin_name)
            try:
                impl.function(**{arg: kwargs[arg] for arg in impl.argnames})
            except Exception as exc:
                self.failed(who, exc, prompt_index)
            else:
                self.passed(who)
        self.stop_if_failing()


def failure_of(trajectory: Trajectory, prompt: str, exc: BaseException, message: str) -> Failure:
    """The Failure record of a finished trajectory a plugin failed on: its model calls and usage, which were paid."""
    meta = trajectory.metadata
    return Failure(
        prompt_index=trajectory.prompt_index,
        content_key=meta.content_key,
        batch_num=meta.batch_num,
        error_class=type(exc).__name__,
        error_kind="plugin",
        message=message,
        timestamp=meta.timestamp,
        prompt=prompt,
        api_calls=trajectory.api_calls,
        usage=meta.usage,
        calls=meta.calls,
    )
