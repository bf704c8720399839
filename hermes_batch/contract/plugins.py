"""The plugin manager and the registry the registration hooks fill, with one table of the kinds of plugin object."""

from __future__ import annotations

import difflib
import importlib.metadata
import logging
import os
import warnings
from typing import Any, Callable, Iterable, Optional

import attrs
import click
import pluggy

from .. import PROJECT_NAME, __version__
from . import hookspecs
from ..errors import PluginError
from .interfaces import Distribution, Executor, Filter, ModelClient, SandboxBackend, Tool, Toolset, Verifier, Writer

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = PROJECT_NAME

DEFAULT_PLUGINS = (
    "hermes_batch.default_plugins.openai_client",
    "hermes_batch.default_plugins.anthropic_client",
    "hermes_batch.local_sandbox.backend",
    "hermes_batch.default_plugins.terminal_tools",
    "hermes_batch.default_plugins.file_tools",
    "hermes_batch.default_plugins.distributions",
    "hermes_batch.default_plugins.sample_filters",
    "hermes_batch.default_plugins.verifiers",
    "hermes_batch.default_plugins.jsonl_writer",
    "hermes_batch.default_plugins.openai_writer",
    "hermes_batch.default_plugins.group_writers",
    "hermes_batch.default_plugins.local_executor",
    "hermes_batch.default_plugins.process_executor",
    "hermes_batch.default_plugins.report",
    "hermes_batch.default_plugins.folder_commands",
)


@attrs.frozen
class Kind:
    """One kind of object plugins register: the hook that registers it, what it must be, how it is chosen."""

    key: str  # its table in the Registry
    hook: str  # the registration hook
    singular: str  # as error messages name one
    plural: str  # as listings name them
    base: type  # what a registered object must subclass (or, with ``instances``, be an instance of)
    instances: bool = False
    option: Optional[str] = None  # the `hermes-batch run` option that selects by name
    listing: Optional[str] = None  # the command that lists them


KINDS: tuple[Kind, ...] = (
    Kind("model_clients", "register_model_clients", "model client", "model clients", ModelClient,
         option="--model_client", listing="model-clients"),
    Kind("sandboxes", "register_sandbox_backends", "sandbox backend", "sandbox backends", SandboxBackend,
         option="--sandbox", listing="sandboxes"),
    Kind("toolsets", "register_toolsets", "toolset", "toolsets", Toolset, instances=True, listing="toolsets"),
    Kind("distributions", "register_distributions", "distribution", "distributions", Distribution,
         instances=True, option="--distribution"),
    Kind("filters", "register_filters", "filter", "quality filters", Filter, option="--filter", listing="filters"),
    Kind("verifiers", "register_verifiers", "verifier", "verifiers", Verifier, option="--verifier",
         listing="verifiers"),
    Kind("writers", "register_writers", "writer", "output writers", Writer, option="--writer", listing="writers"),
    Kind("executors", "register_executors", "executor", "executors", Executor, option="--executor", listing="executors"),
    Kind("commands", "register_commands", "command", "commands", click.Command, instances=True),
)
KIND = {kind.key: kind for kind in KINDS}


@attrs.frozen
class FirstParty:
    """A plugin distribution of this repository: its folder and the names it provides, by kind (KINDS keys)."""

    distribution: str
    path: str  # its folder, from the repository's top folder
    provides: dict[str, tuple[str, ...]]

    @property
    def install(self) -> str:
        """How to install it from a checkout: with the core in the same command, since neither is on an index yet."""
        return f"pip install . ./{self.path}"


# What the first-party plugins provide, so that asking for one that is not installed says which to install.
# tests/test_plugins.py checks it against what the installed distributions really register.
FIRST_PARTY: tuple[FirstParty, ...] = (
    FirstParty("hermes-batch-docker", "hermes_batch_docker", {"sandboxes": ("docker",), "commands": ("docker",)}),
    FirstParty("hermes-batch-singularity", "hermes_batch_singularity",
               {"sandboxes": ("singularity",), "commands": ("singularity",)}),
    FirstParty("hermes-batch-modal", "hermes_batch_modal", {"sandboxes": ("modal",), "commands": ("modal",)}),
    FirstParty("hermes-batch-toolbox", "plugins/hermes_batch_toolbox",
               {"toolsets": ("web", "browser", "vision", "image_gen", "moa")}),
    FirstParty("hermes-batch-filters", "plugins/hermes_batch_filters",
               {"filters": ("max-tool-errors", "min-tool-calls", "final-answer", "repetition", "length",
                            "near-duplicates")}),
    FirstParty("hermes-batch-parquet", "plugins/hermes_batch_parquet", {"writers": ("parquet",)}),
    FirstParty("hermes-batch-ray", "plugins/hermes_batch_ray", {"executors": ("ray",)}),
)
_INSTALL = {dist.distribution: dist.install for dist in FIRST_PARTY}


def first_party(kind: str, name: str) -> Optional[FirstParty]:
    """The first-party distribution that provides the ``kind`` (a KINDS key) named ``name``, or None."""
    return next((dist for dist in FIRST_PARTY if name in dist.provides.get(kind, ())), None)


def where_to_get(kind: str, names: Iterable[str]) -> str:
    """Which first-party plugin provides ``names`` and how to install it.

    'hermes-batch-toolbox provides web, moa (from this repository: pip install . ./plugins/hermes_batch_toolbox)';
    names no first-party plugin provides are said to be so.
    """
    by_dist: dict[str, list[str]] = {}
    unknown = []
    for name in names:
        dist = first_party(kind, name)
        if dist is None:
            unknown.append(name)
        else:
            by_dist.setdefault(dist.distribution, []).append(name)
    parts = [f"{dist} provides {', '.join(found)} (from this repository: {_INSTALL[dist]})" for dist, found in by_dist.items()]
    if unknown:
        parts.append(f"no known plugin provides {', '.join(unknown)}")
    return "; ".join(parts)


def unknown_name(kind: str, name: str, installed: Iterable[str], option: str) -> str:
    """The sentence for ``option NAME`` naming nothing installed: the plugin that provides it, or the closest name."""
    known = ", ".join(sorted(installed)) or "none"
    if first_party(kind, name) is not None:
        return (f"Unknown {option} {name!r}: {where_to_get(kind, [name])}; install it or pass one of the installed "
                f"{KIND[kind].plural}: {known}.")
    close = difflib.get_close_matches(name, sorted(installed), n=1)
    return f"Unknown {option} {name!r}; installed: {known}" + (f"; did you mean {option} {close[0]}?" if close else ".")


class PluginLoadWarning(UserWarning):
    """A third-party plugin could not be loaded and was skipped."""


class PluginManager(pluggy.PluginManager):
    """pluggy's manager with the hermes-batch hookspecs, knowing which distribution each plugin came from."""

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.distributions: dict[str, tuple[str, Optional[str]]] = {}  # plugin name -> (distribution, version)

    def distribution(self, plugin_name: str) -> tuple[Optional[str], Optional[str]]:
        """(distribution name, version) of an entry-point plugin; the core's for the others."""
        return self.distributions.get(plugin_name, ("hermes-batch", __version__))

    def qualifiers(self, plugin_name: str) -> tuple[str, ...]:
        """The names that qualify what ``plugin_name`` registers (``QUALIFIER:NAME``): the plugin's name (its entry
        point's, as ``-p no:NAME`` takes it) and its distribution's; ``hermes-batch`` for the core's own plugins."""
        if plugin_name in DEFAULT_PLUGINS:
            return (PROJECT_NAME.replace("_", "-"),)
        dist = self.distributions.get(plugin_name, (None, None))[0]
        return tuple(dict.fromkeys(q for q in (plugin_name, dist) if q))

    def registry(self) -> "Registry":
        """A new Registry filled by every registration hook."""
        return collect(self)


DISABLE_ENV = "HERMES_BATCH_DISABLE_PLUGINS"
"""The environment variable naming plugins (entry-point or distribution names, comma-separated) not to load."""


def disabled_plugins(extra: Iterable[str] = ()) -> frozenset:
    """The plugin names ``HERMES_BATCH_DISABLE_PLUGINS`` lists, with ``extra``."""
    listed = os.environ.get(DISABLE_ENV, "").replace(",", " ").split()
    return frozenset(name.strip() for name in (*listed, *extra) if name.strip())


def get_plugin_manager(
    *,
    load_entry_points: bool = True,
    strict: bool = False,
    extra_plugins: Iterable[Any] = (),
    disabled: Optional[Iterable[str]] = None,
) -> PluginManager:
    """Build a fresh plugin manager: default plugins, entry points, ``extra_plugins``, then ``check_pending``.

    ``load_entry_points=False`` loads the core's own plugins only, not the
    installed ones (a test then does not depend on what is installed).  An
    entry-point plugin that fails to import, or whose hooks do not match the
    specs, is skipped with a warning naming its distribution; with
    ``strict=True`` (tests) the error is raised.  ``extra_plugins`` (modules,
    classes or objects with hook implementations) are registered last, as a
    test registers a throwaway plugin, named by their ``__name__`` (or their
    class's).  ``disabled`` names plugins not to load (an entry point's name or
    its distribution's, or an extra plugin's name); None takes them from
    ``HERMES_BATCH_DISABLE_PLUGINS``.
    """
    blocked = disabled_plugins() if disabled is None else frozenset(disabled)
    pm = PluginManager()
    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    if load_entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in blocked or (ep.dist is not None and ep.dist.name in blocked):
                pm.set_blocked(ep.name)
                continue
            _load_entry_point(pm, ep, strict)
    for plugin in extra_plugins:
        name = getattr(plugin, "__name__", type(plugin).__name__)
        if name not in blocked:
            pm.register(plugin, name=name)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"A plugin implements a hook that does not exist: {exc}; check its spelling.") from exc
    return pm


def _load_entry_point(pm: PluginManager, ep: importlib.metadata.EntryPoint, strict: bool) -> None:
    dist = ep.dist.name if ep.dist is not None else ep.value
    if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
        return
    try:
        plugin = ep.load()
        pm.register(plugin, name=ep.name)
        unknown = _unknown_hooks(pm, plugin)
        if unknown:
            pm.unregister(plugin)
            raise PluginError(
                f"it implements {', '.join(unknown)}, which {'is not a hook' if len(unknown) == 1 else 'are not hooks'} "
                f"of hermes-batch {__version__}"
            )
    except Exception as exc:
        if strict:
            raise PluginError(f"Plugin {ep.name!r} from distribution {dist!r} failed to load: {exc}.") from exc
        warnings.warn(
            f"Skipping plugin {ep.name!r} from distribution {dist!r}: {_reason(exc)}; upgrade or uninstall it.",
            PluginLoadWarning,
            stacklevel=3,
        )
        return
    pm.distributions[ep.name] = (dist, ep.dist.version if ep.dist is not None else None)


def _reason(exc: Exception) -> str:
    if isinstance(exc, PluginError):
        return str(exc)
    if isinstance(exc, pluggy.PluginValidationError):
        return f"its hooks do not match the specs ({exc})"
    return f"it failed to import ({exc})"


def _unknown_hooks(pm: PluginManager, plugin: Any) -> list[str]:
    """The hooks ``plugin`` implements that no spec declares (what ``check_pending`` would refuse)."""
    return sorted(
        caller.name
        for caller in pm.get_hookcallers(plugin) or ()
        if not caller.has_spec()
        and any(impl.plugin is plugin and not impl.optionalhook for impl in caller.get_hookimpls())
    )


@attrs.frozen
class Registered:
    name: str
    obj: Any
    plugin: str  # name of the plugin that registered it
    qualified: str = ""  # QUALIFIER:NAME, which names it even when another plugin registers the same name


class Registry:
    """Everything the plugins registered, by kind (see KINDS) and name.

    Two plugins may register the same name: each is then known by its qualified
    name only (``PLUGIN:NAME``, also ``DISTRIBUTION:NAME``), and asking for the
    bare name is the error that lists them.  ``kinds[kind]`` maps each name a
    user can pass (the bare name, or the qualified ones of a clash) to its entry.
    """

    def __init__(self, qualifiers: Optional[Callable[[str], tuple[str, ...]]] = None) -> None:
        self.kinds: dict[str, dict[str, Registered]] = {kind.key: {} for kind in KINDS}
        self.qualified: dict[str, dict[str, Registered]] = {kind.key: {} for kind in KINDS}
        self.clashes: dict[str, dict[str, list[Registered]]] = {kind.key: {} for kind in KINDS}
        self._qualifiers = qualifiers or (lambda plugin: (plugin,))

    def add(self, kind: str, obj: Any, plugin: str) -> None:
        """Register ``obj`` as a ``kind`` (a KINDS key) on behalf of ``plugin``, checking what it is."""
        what = KIND[kind]
        ok = isinstance(obj, what.base) if what.instances else isinstance(obj, type) and issubclass(obj, what.base)
        if not ok:
            must = "an instance" if what.instances else "a subclass"
            raise PluginError(
                f"Plugin {plugin!r} registered {obj!r} as a {what.singular}, but it must be {must} of "
                f"{what.base.__module__.split('.')[0]}.{what.base.__name__}; fix the plugin's {what.hook} hook."
            )
        name = obj.name
        if not isinstance(name, str) or not name:
            raise PluginError(f"Plugin {plugin!r} registered a {what.singular} without a name; give it a name.")
        qualifiers = self._qualifiers(plugin)
        entry = Registered(name, obj, plugin, f"{qualifiers[0]}:{name}")
        if any(f"{q}:{name}" in self.qualified[kind] for q in qualifiers):
            raise PluginError(f"Plugin {plugin!r} registers the {what.singular} {name!r} twice; register it once.")
        if kind == "toolsets":
            _check_tools(obj, plugin)
        for q in qualifiers:
            self.qualified[kind][f"{q}:{name}"] = entry
        table, clashes = self.kinds[kind], self.clashes[kind]
        existing = table.get(name)
        if existing is not None:  # a clash: both are known by their qualified names only
            del table[name]
            clashes[name] = [existing]
            table[existing.qualified] = existing
        if name in clashes:
            clashes[name].append(entry)
            table[entry.qualified] = entry
        else:
            table[name] = entry

    def get(self, kind: str, name: str) -> Any:
        """The object registered as ``name`` (bare or qualified); KeyError when there is none, PluginError when two
        plugins register the bare ``name``."""
        entry = self.kinds[kind].get(name) or self.qualified[kind].get(name)
        if entry is not None:
            return entry.obj
        if name in self.clashes[kind]:
            raise PluginError(self.clash_message(kind, name))
        raise KeyError(name)

    def clash_message(self, kind: str, name: str) -> str:
        what = KIND[kind]
        entries = sorted(self.clashes[kind][name], key=lambda e: e.qualified)
        plugins = ", ".join(f"{e.plugin!r}" for e in entries)
        choices = " or ".join(e.qualified for e in entries)
        option = what.option or what.plural
        return (f"The {what.singular} {name!r} is registered by {len(entries)} plugins ({plugins}); name the one you "
                f"mean ({option} {choices}) or disable the other (hermes-batch -p no:PLUGIN, or {DISABLE_ENV}=PLUGIN).")

    def is_qualifier(self, kind: str, text: str) -> bool:
        """True when ``text`` qualifies a name of ``kind`` (``text:NAME``) and is not itself such a name."""
        return text not in self.kinds[kind] and any(key.startswith(text + ":") for key in self.qualified[kind])

    def names(self, kind: str) -> list[str]:
        return sorted(self.kinds[kind])

    def items(self, kind: str) -> list[Registered]:
        return [self.kinds[kind][n] for n in sorted(self.kinds[kind])]

    def tool_owner(self) -> dict[str, str]:
        """tool name -> toolset name, checking that no tool name is used twice."""
        owners: dict[str, str] = {}
        clashing = {id(e) for entries in self.clashes["toolsets"].values() for e in entries}
        for reg in self.items("toolsets"):
            if id(reg) in clashing:  # known by qualified name only; their tools are checked when one is chosen
                continue
            for tool in reg.obj.tools:
                if tool.name in owners:
                    raise PluginError(
                        f"The tool {tool.name!r} is in two toolsets, {owners[tool.name]!r} and {reg.name!r}; rename one."
                    )
                owners[tool.name] = reg.name
        return owners


def _check_tools(toolset: Toolset, plugin: str) -> None:
    from ..formats.schema import check_schema

    for tool in toolset.tools:
        if not (isinstance(tool, type) and issubclass(tool, Tool)):
            raise PluginError(
                f"Plugin {plugin!r} put {tool!r} in the toolset {toolset.name!r}, but a toolset's tools must be "
                "subclasses of hermes_batch.Tool; fix the plugin's register_toolsets hook."
            )
        problem = check_schema(tool.parameters)
        if problem:
            raise PluginError(
                f"Plugin {plugin!r}: the parameters of the tool {tool.name!r} are not a valid JSON Schema "
                f"({problem}); fix the tool's parameters."
            )


def collect(pm: pluggy.PluginManager, kinds: Iterable[Kind] = KINDS) -> Registry:
    """Run the registration hooks of ``kinds``, one plugin at a time, so errors can name the plugin."""
    registry = Registry(getattr(pm, "qualifiers", None))
    for kind in kinds:
        for impl in reversed(getattr(pm.hook, kind.hook).get_hookimpls()):  # registration order

            def register(obj, _kind=kind.key, _plugin=impl.plugin_name):
                registry.add(_kind, obj, _plugin)

            impl.function(register=register)
    registry.tool_owner()
    return registry


def describe_plugins(pm: PluginManager) -> list[dict]:
    """What ``hermes-batch plugins`` prints: each plugin, its distribution, version and what it provides."""
    provided: dict[str, dict[str, list[str]]] = {}
    for kind in KINDS:
        for impl in getattr(pm.hook, kind.hook).get_hookimpls():
            names: list[str] = []
            impl.function(register=lambda obj, _n=names: _n.append(obj.name))
            if names:
                provided.setdefault(impl.plugin_name, {})[kind.key] = sorted(names)
    out = []
    for name, plugin in pm.list_name_plugin():
        dist, version = pm.distribution(name)
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or ())
        out.append({"name": name, "distribution": dist, "version": version, "hooks": hooks, "provides": provided.get(name, {})})
    return sorted(out, key=lambda p: p["name"])
