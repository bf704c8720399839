"""The plugin manager factory and the registries filled by the registration hooks."""

from __future__ import annotations

import importlib.metadata
import logging
import warnings
from typing import Any, Iterable, Optional

import attrs
import pluggy

from . import PROJECT_NAME, hookspecs
from .errors import PluginError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = PROJECT_NAME

DEFAULT_PLUGINS = (
    "hermes_batch.default_plugins.openai_client",
    "hermes_batch.default_plugins.anthropic_client",
    "hermes_batch.default_plugins.local_sandbox",
    "hermes_batch.default_plugins.terminal_tools",
    "hermes_batch.default_plugins.file_tools",
    "hermes_batch.default_plugins.distributions",
    "hermes_batch.default_plugins.filters",
    "hermes_batch.default_plugins.jsonl_writer",
    "hermes_batch.default_plugins.openai_writer",
    "hermes_batch.default_plugins.local_executor",
    "hermes_batch.default_plugins.report",
    "hermes_batch.default_plugins.folder_commands",
)

# registration hook name -> key of the registry it fills
REGISTRATION_HOOKS = {
    "register_model_clients": "model_clients",
    "register_sandbox_backends": "sandboxes",
    "register_toolsets": "toolsets",
    "register_distributions": "distributions",
    "register_filters": "filters",
    "register_writers": "writers",
    "register_executors": "executors",
}


class PluginLoadWarning(UserWarning):
    """A third-party plugin could not be imported and was skipped."""


def get_plugin_manager(
    *,
    load_entry_points: bool = True,
    strict: bool = False,
    extra_plugins: Iterable[Any] = (),
) -> pluggy.PluginManager:
    """Build a fresh plugin manager: hookspecs, default plugins, entry points, then ``check_pending``.

    A plugin whose import fails is skipped with a warning naming its
    distribution; with ``strict=True`` (tests) the error is raised.
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for module_name in DEFAULT_PLUGINS:
        module = importlib.import_module(module_name)
        pm.register(module, name=module_name)
    if load_entry_points:
        _load_entry_points(pm, strict)
    for plugin in extra_plugins:
        pm.register(plugin, name=getattr(plugin, "__name__", type(plugin).__name__))
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"A plugin implements a hook that does not exist: {exc}; check its spelling.") from exc
    return pm


def _load_entry_points(pm: pluggy.PluginManager, strict: bool) -> None:
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else ep.value
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception as exc:
            if strict:
                raise PluginError(f"Plugin {ep.name!r} from distribution {dist!r} failed to import: {exc}") from exc
            warnings.warn(
                f"Skipping plugin {ep.name!r} from distribution {dist!r}: it failed to import ({exc}).",
                PluginLoadWarning,
                stacklevel=2,
            )
            continue
        pm.register(plugin, name=ep.name)
        pm._hermes_dists = getattr(pm, "_hermes_dists", {})  # plugin name -> distribution
        pm._hermes_dists[ep.name] = (dist, ep.dist.version if ep.dist is not None else None)


def plugin_distribution(pm: pluggy.PluginManager, plugin_name: str) -> tuple[Optional[str], Optional[str]]:
    """(distribution name, version) of an entry-point plugin; the core's for default plugins."""
    dists = getattr(pm, "_hermes_dists", {})
    if plugin_name in dists:
        return dists[plugin_name]
    from . import __version__

    return ("hermes-batch", __version__)


@attrs.frozen
class Registered:
    name: str
    obj: Any
    plugin: str  # name of the plugin that registered it


class Registry:
    """Everything the plugins registered, by kind and name."""

    def __init__(self):
        self.kinds: dict[str, dict[str, Registered]] = {key: {} for key in REGISTRATION_HOOKS.values()}

    def add(self, kind: str, obj: Any, plugin: str) -> None:
        name = obj.name
        if not isinstance(name, str) or not name:
            raise PluginError(f"Plugin {plugin!r} registered a {kind[:-1]} without a name.")
        existing = self.kinds[kind].get(name)
        if existing is not None:
            raise PluginError(
                f"Two plugins register the {kind[:-1]} {name!r}: {existing.plugin!r} and {plugin!r}; uninstall one of them."
            )
        self.kinds[kind][name] = Registered(name, obj, plugin)

    def get(self, kind: str, name: str) -> Any:
        return self.kinds[kind][name].obj

    def names(self, kind: str) -> list[str]:
        return sorted(self.kinds[kind])

    def items(self, kind: str) -> list[Registered]:
        return [self.kinds[kind][n] for n in sorted(self.kinds[kind])]

    def tool_owner(self) -> dict[str, str]:
        """tool name -> toolset name, checking that no tool name is used twice."""
        owners: dict[str, str] = {}
        for reg in self.items("toolsets"):
            for tool in reg.obj.tools:
                if tool.name in owners:
                    raise PluginError(
                        f"The tool {tool.name!r} is in two toolsets, {owners[tool.name]!r} and {reg.name!r}; rename one."
                    )
                owners[tool.name] = reg.name
        return owners


def collect(pm: pluggy.PluginManager) -> Registry:
    """Run every registration hook, one plugin at a time, so duplicates can name both plugins."""
    registry = Registry()
    for hook_name, kind in REGISTRATION_HOOKS.items():
        hook = getattr(pm.hook, hook_name)
        for impl in reversed(hook.get_hookimpls()):  # registration order
            plugin_name = impl.plugin_name

            def register(obj, _kind=kind, _plugin=plugin_name):
                registry.add(_kind, obj, _plugin)

            impl.function(register=register)
    registry.tool_owner()
    return registry


def describe_plugins(pm: pluggy.PluginManager) -> list[dict]:
    """What ``hermes-batch plugins`` prints: each plugin, its distribution, version and what it provides."""
    provided: dict[str, dict[str, list[str]]] = {}
    for hook_name, kind in REGISTRATION_HOOKS.items():
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            names: list[str] = []
            impl.function(register=lambda obj, _n=names: _n.append(obj.name))
            if names:
                provided.setdefault(impl.plugin_name, {})[kind] = sorted(names)
    out = []
    for name, plugin in pm.list_name_plugin():
        dist, version = plugin_distribution(pm, name)
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or ())
        out.append({"name": name, "distribution": dist, "version": version, "hooks": hooks, "provides": provided.get(name, {})})
    return sorted(out, key=lambda p: p["name"])
