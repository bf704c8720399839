"""Toolset distributions: the per-prompt sampler, distribution files, and listing.

A distribution gives each toolset an independent inclusion probability.  In
files and in the built-in table probabilities are written as percents (0 to
100); a :class:`~hermes_batch.contract.interfaces.Distribution` holds them as fractions
(0 to 1).

Distribution file format (``--distribution_file``, ``.toml`` or ``.json``): a
table of distributions by name, each with an optional one-line
``description`` and a ``toolsets`` table of toolset name -> percent::

    [code_heavy]
    description = "Mostly terminal and files, web now and then"
    toolsets = { terminal = 95, file = 90, web = 20 }
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import tomllib
from typing import Any, Iterable, Mapping, Optional, Union

from ..contract import plugins
from ..errors import ConfigError
from .inputfiles import read_text_file
from ..contract.interfaces import Distribution
from ..formats.jsonguard import value_problem

PathLike = Union[str, "os.PathLike[str]"]

_FILE_KEYS = frozenset({"description", "toolsets"})

_JSON_TYPES = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "a table"}


def rng_for(seed: int, content_key: str) -> random.Random:
    """A random generator fixed by the run seed and a prompt's content key, the same in every process."""
    digest = hashlib.sha256(f"{seed}\x00{content_key}".encode("utf-8")).digest()
    return random.Random(int.from_bytes(digest[:16], "big"))


def sample_toolsets(distribution: Distribution, available: set[str], rng: random.Random) -> tuple[str, ...]:
    """One coin per available toolset; if none comes up, the most likely one; in the distribution's order."""
    candidates = [(name, p) for name, p in distribution.probabilities if name in available]
    if not candidates:
        needed = ", ".join(name for name, _ in distribution.probabilities)
        raise ConfigError(
            f"The distribution {distribution.name!r} needs one of the toolsets {needed}, but no installed plugin "
            "provides any of them; install a plugin that does or choose another --distribution."
        )
    chosen = tuple(name for name, p in candidates if rng.random() < p)
    if chosen:
        return chosen
    # max() keeps the first of equal probabilities, i.e. the distribution's order breaks ties.
    return (max(candidates, key=lambda pair: pair[1])[0],)


def unavailable_toolsets(distribution: Distribution, available: Iterable[str]) -> tuple[str, ...]:
    """The toolsets of ``distribution`` that no installed plugin provides, in its order."""
    have = set(available)
    return tuple(name for name, _ in distribution.probabilities if name not in have)


def where_to_get(toolsets: Iterable[str]) -> str:
    """Which plugin provides ``toolsets`` and how to install it: 'hermes-batch-toolbox provides web, moa (pip ...)'."""
    return plugins.where_to_get("toolsets", toolsets)


def unavailable_warning(distribution: Distribution, available: Iterable[str]) -> Optional[str]:
    """The one warning a run prints when its distribution names missing toolsets, or None."""
    have = set(available)
    missing = unavailable_toolsets(distribution, have)
    if not missing:
        return None
    usable = [name for name, _ in distribution.probabilities if name in have]
    return (
        f"The distribution {distribution.name!r} names toolsets no installed plugin provides "
        f"({', '.join(missing)}), so prompts sample only among {', '.join(usable) or 'none'}; "
        f"{where_to_get(missing)}."
    )


def distribution_from_percent(name: str, description: str, toolsets: Mapping[str, Any], source: str = "") -> Distribution:
    """A Distribution from toolset -> percent (0 to 100), checked strictly; ``source`` names the file in errors."""
    where = f"{source}: distribution {name!r}" if source else f"Distribution {name!r}"
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{source or 'A distribution'}: distribution names must be non-empty strings.")
    if not isinstance(description, str):
        raise ConfigError(f"{where}: 'description' must be a string, got {_json_type(description)}.")
    if not isinstance(toolsets, Mapping):
        raise ConfigError(f"{where}: 'toolsets' must be a table of toolset name -> percent, got {_json_type(toolsets)}.")
    if not toolsets:
        raise ConfigError(f"{where}: 'toolsets' is empty; give at least one toolset with a percent from 0 to 100.")
    pairs = []
    for toolset, percent in toolsets.items():
        if not isinstance(toolset, str) or not toolset.strip():
            raise ConfigError(f"{where}: toolset names must be non-empty strings.")
        if isinstance(percent, bool) or not isinstance(percent, (int, float)):
            raise ConfigError(f"{where}: toolset {toolset!r} must have a number from 0 to 100, got {_json_type(percent)}.")
        if not (math.isfinite(percent) and 0 <= percent <= 100):
            raise ConfigError(f"{where}: toolset {toolset!r} has {percent}, outside 0 to 100 (probabilities are percents).")
        pairs.append((toolset, percent / 100))
    if all(p == 0 for _, p in pairs):
        raise ConfigError(f"{where}: every toolset has 0%; give at least one a percent above 0.")
    return Distribution(name, description, tuple(pairs))


def load_distribution_file(path: PathLike) -> tuple[Distribution, ...]:
    """Read distributions from a ``.toml`` or ``.json`` file (format in this module's docstring)."""
    name = os.fspath(path)
    data = _read_file(name)
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: expected a table of distributions by name, got {_json_type(data)}.")
    if not data:
        raise ConfigError(f"{name}: the file defines no distributions; add at least one table with 'toolsets'.")
    out = []
    for dist_name, body in data.items():
        if not isinstance(body, dict):
            raise ConfigError(
                f"{name}: distribution {dist_name!r} must be a table with 'description' and 'toolsets', got {_json_type(body)}."
            )
        unknown = sorted(set(body) - _FILE_KEYS)
        if unknown:
            raise ConfigError(
                f"{name}: distribution {dist_name!r} has unknown key {', '.join(map(repr, unknown))}; "
                "only 'description' and 'toolsets' are allowed."
            )
        if "toolsets" not in body:
            raise ConfigError(f"{name}: distribution {dist_name!r} has no 'toolsets' table of toolset name -> percent.")
        out.append(distribution_from_percent(dist_name, body.get("description", ""), body["toolsets"], source=name))
    return tuple(out)


def format_distributions(distributions: Iterable[Distribution], available_toolsets: Iterable[str]) -> str:
    """The text of ``--list_distributions``: each distribution, its description, its toolsets highest first."""
    have = set(available_toolsets)
    blocks = []
    missing: dict[str, None] = {}
    for dist in distributions:
        lines = [f"{dist.name}: {dist.description}" if dist.description else dist.name]
        ranked = _ranked(dist)
        width = max(len(name) for name, _ in ranked)
        for toolset, p in ranked:
            mark = "" if toolset in have else "  (unavailable)"
            if toolset not in have:
                missing[toolset] = None
            lines.append(f"    {toolset:<{width}}  {_percent_text(p):>5}{mark}")
        blocks.append("\n".join(lines))
    if missing:
        blocks.append(f"Unavailable toolsets are not installed: {where_to_get(missing)}.")
    return "\n\n".join(blocks)


def distributions_as_json(distributions: Iterable[Distribution], available_toolsets: Iterable[str]) -> list[dict]:
    """Plain data for ``hermes-batch distributions --json``; toolsets highest first, probabilities 0 to 1."""
    have = set(available_toolsets)
    return [
        {
            "name": dist.name,
            "description": dist.description,
            "toolsets": [
                {"name": toolset, "probability": p, "percent": _percent(p), "available": toolset in have}
                | ({} if toolset in have else {"plugin": _distribution_of(toolset)})
                for toolset, p in _ranked(dist)
            ],
            "unavailable": list(unavailable_toolsets(dist, have)),
        }
        for dist in distributions
    ]


def _distribution_of(toolset: str) -> Optional[str]:
    found = plugins.first_party("toolsets", toolset)
    return found.distribution if found is not None else None


def _ranked(dist: Distribution) -> list[tuple[str, float]]:
    # sorted() is stable, so equal probabilities keep the distribution's order.
    return sorted(dist.probabilities, key=lambda pair: -pair[1])


def _percent(p: float) -> float:
    value = round(p * 100, 6)  # 0.07 * 100 is 7.000000000000001
    return int(value) if value == int(value) else value


def _percent_text(p: float) -> str:
    return f"{_percent(p)}%"


def _read_file(name: str) -> Any:
    ext = os.path.splitext(name)[1].lower()
    if ext not in (".toml", ".json"):
        raise ConfigError(f"The distribution file {name} must end in .toml or .json.")
    text = read_text_file(name, "distribution file", "--distribution_file", ConfigError)
    if ext == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{name}:{exc.lineno}: invalid JSON: {exc.msg} at column {exc.colno}.") from exc
        except _DuplicateKey as exc:
            raise ConfigError(f"{name}: the key {exc.args[0]!r} is given twice in one object; keep one.") from exc
        except (ValueError, RecursionError) as exc:  # an integer of 4300 digits; nesting past the decoder's limit
            raise ConfigError(f"{name}: invalid JSON ({str(exc) or 'nested too deeply'}).") from exc
    else:
        try:
            data = tomllib.loads(text)
        except (tomllib.TOMLDecodeError, ValueError, RecursionError) as exc:
            raise ConfigError(f"{name}: invalid TOML: {str(exc) or 'nested too deeply'}.") from exc
    problem = value_problem(data, int_range=False)
    if problem is not None:
        raise ConfigError(f"{name}: {problem}.")
    return data


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out



def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)
