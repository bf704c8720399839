"""Which plugins the testing kit's helpers load: hermes-batch's own and the plugin under test, unless asked for more.

A plugin's test that resolved a name against every installed plugin would clash with another plugin that
registers the same name (a filter ``final-answer`` of one's own beside hermes-batch-filters'), and would pass
or fail by what else happens to be installed.  The plugin under test is the distribution whose
``pyproject.toml`` is nearest above the test file: its ``[project.entry-points.hermes_batch]``.  A test in a
folder whose nearest ``pyproject.toml`` declares none (hermes-batch's own suite) sees every installed plugin.
The ``fixtures`` module sets it for each test.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import tomllib
from pathlib import Path
from typing import Iterable, Iterator, Optional

ENTRY_POINT_GROUP = "hermes_batch"
EVERY_INSTALLED = None  # what ``entry_points`` is to load every installed plugin
UNDER_TEST = "the plugin under test"  # the default of ``entry_points``: what ``under_test`` set

_under_test: Optional[tuple[str, ...]] = EVERY_INSTALLED


def plugin_entry_points(start: Path) -> Optional[tuple[str, ...]]:
    """The ``hermes_batch`` entry points of the nearest ``pyproject.toml`` above ``start`` (None: it declares
    none, or there is no such file)."""
    for folder in (start if start.is_dir() else start.parent, *start.parents):
        pyproject = folder / "pyproject.toml"
        if not pyproject.is_file():
            continue
        try:
            project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
        except (OSError, ValueError):
            return None
        names = (project.get("entry-points") or {}).get(ENTRY_POINT_GROUP) or {}
        return tuple(sorted(names)) if names else None
    return None


@contextlib.contextmanager
def under_test(entry_points: Optional[tuple[str, ...]]) -> Iterator[None]:
    """Within it, the helpers' default plugins are the core's and ``entry_points`` (None: every installed one)."""
    global _under_test
    before, _under_test = _under_test, entry_points
    try:
        yield
    finally:
        _under_test = before


def current() -> Optional[tuple[str, ...]]:
    """The entry points of the plugin under test (None: every installed plugin)."""
    return _under_test


def resolve(entry_points) -> Optional[tuple[str, ...]]:
    """``entry_points`` with UNDER_TEST replaced by the plugin under test's."""
    return current() if entry_points is UNDER_TEST else entry_points


def others(entry_points: Optional[Iterable[str]]) -> tuple[str, ...]:
    """The installed ``hermes_batch`` entry points not among ``entry_points`` (none when it is None)."""
    entry_points = resolve(entry_points)
    if entry_points is None:
        return ()
    keep = set(entry_points)
    return tuple(sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)} - keep))


def plugin_manager(entry_points=UNDER_TEST, extra_plugins: Iterable = ()):
    """A plugin manager of the core's plugins, the installed ``entry_points`` (default: the plugin under test;
    None: every installed one) and ``extra_plugins``."""
    from hermes_batch.contract.plugins import disabled_plugins, get_plugin_manager

    return get_plugin_manager(disabled=disabled_plugins(others(entry_points)), extra_plugins=extra_plugins)
