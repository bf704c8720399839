"""Choosing the registered plugin objects a run uses, by name, with clear errors."""

from __future__ import annotations

from typing import Optional

from ..errors import UsageError
from ..contract.run_filters import refuse_run_filters
from ..contract.interfaces import Distribution
from ..contract.plugin_options import build_config, parse_spec, structure_options
from ..contract.plugins import KIND, Registry, unknown_name

# The quality filters a run applies when --filter is not given (the default plugin sample_filters registers them).
DEFAULT_FILTERS = ("no-reasoning", "hallucinated-tools", "empty-answer")
# The filters batch_runner.py applied at its merge: what `hermes-batch import` judges its records by by default.
SEED_FILTERS = ("no-reasoning", "hallucinated-tools")


def _pick(registry: Registry, kind: str, name: str, option: Optional[str] = None):
    """The object of ``kind`` named ``name``; ``option`` (default: the kind's run option) names where it was asked for."""
    try:
        return registry.get(kind, name)
    except KeyError:
        raise UsageError(unknown_name(kind, name, registry.names(kind), option or KIND[kind].option)) from None


def model_client_class(registry: Registry, name: Optional[str], base_url: str, option: str = "--model_client"):
    """The client named by --model_client (or ``option``), else the most specific one that handles ``base_url``."""
    if name:
        return _pick(registry, "model_clients", name, option)
    candidates = [reg.obj for reg in registry.items("model_clients") if reg.obj.handles_base_url(base_url)]
    # the generic OpenAI-compatible client claims every URL; a specific client wins over it
    specific = [c for c in candidates if c.name != "openai"]
    if specific:
        return specific[0]
    if candidates:
        return candidates[0]
    raise UsageError(f"No installed model client handles {base_url!r}; pass {option}.")


def sandbox_backend(registry: Registry, name: str, options: dict):
    """(backend class, structured config) for --sandbox and -S options."""
    cls = _pick(registry, "sandboxes", name)
    return cls, structure_options(options, cls.Config, f"the {name} sandbox (-S)", "-S {key}=...")


def executor(registry: Registry, name: str, options: dict):
    cls = _pick(registry, "executors", name)
    return cls(structure_options(options, cls.Config, f"the {name} executor (-E)", "-E {key}=..."))


def plugin(registry: Registry, kind: str, text: str, option: str):
    """An instance of the filter or writer named by ``NAME[:OPTIONS]`` (see plugin_options), its options structured."""
    head, sep, rest = text.partition(":")
    if sep and registry.is_qualifier(kind, head.strip()):  # PLUGIN:NAME[:OPTIONS], one of two plugins' NAME
        spec = parse_spec(rest, option)
        cls = _pick(registry, kind, f"{head.strip()}:{spec.name}", option)
    else:
        spec = parse_spec(text, option)
        cls = _pick(registry, kind, spec.name, option)
    return cls(build_config(cls, spec, KIND[kind].singular))


def filter_specs(names: Optional[tuple]) -> tuple:
    """The ``NAME[:OPTIONS]`` specs of the filters a run applies: ``names``, or DEFAULT_FILTERS when None."""
    return tuple(DEFAULT_FILTERS if names is None else names)


def filters(registry: Registry, names: Optional[tuple], whole_run: bool = False) -> tuple:
    """Instances of the selected filters (``NAME[:OPTIONS]``), in order; None selects DEFAULT_FILTERS.

    Filters that compare trajectories across the run are refused unless ``whole_run`` (export, refilter).
    """
    selected = tuple(plugin(registry, "filters", n, "--filter") for n in filter_specs(names))
    if not whole_run:
        refuse_run_filters(selected)
    return selected


def verifiers(registry: Registry, names: tuple) -> tuple:
    """Instances of the verifiers of ``--verifier NAME[:OPTIONS]``, in order."""
    return tuple(plugin(registry, "verifiers", n, "--verifier") for n in names)


def writers(registry: Registry, names: tuple) -> tuple:
    return tuple(plugin(registry, "writers", n, "--writer") for n in names)


def distribution(registry: Registry, name: str) -> Distribution:
    return _pick(registry, "distributions", name)


def toolset_tools(registry: Registry, toolset_names) -> dict:
    """toolset name -> Tool instances, for the toolsets that are installed."""
    out = {}
    for name in toolset_names:
        if name in registry.kinds["toolsets"]:
            out[name] = tuple(cls() for cls in registry.get("toolsets", name).tools)
    return out
