"""``NAME[:OPTIONS]``: how ``--filter``, ``--writer`` and ``export --format`` take a plugin's options.

One syntax for every filter and writer, so nobody learns a second one:

* ``max-tool-errors`` -- the defaults;
* ``max-tool-errors:0.5`` -- a bare value sets the first option of the plugin's
  ``Config`` (its main knob);
* ``length:min_chars=200,max_chars=20000`` -- named options, values read as
  JSON when they parse (``0.5``, ``true``, ``["a","b"]``) and as text otherwise;
* ``length:{"min_chars": 200}`` -- a JSON object;
* ``length:@length.toml`` -- an options file (TOML, or JSON when it ends in ``.json``).

The options are structured strictly into the plugin's attrs ``Config`` class,
so a misspelled key or a wrong type is a one-sentence error.  ``structure_options``
is that step for every kind of plugin option (``-S``, ``-T``, ``-E``, filters and
writers): an unknown key is named with the keys the plugin takes and the closest
of them.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from pathlib import Path
from typing import Any

import attrs

from ..errors import ConfigError, UsageError
from ..formats.serialization import structure_config


@attrs.frozen
class PluginSpec:
    """A parsed ``NAME[:OPTIONS]``: the plugin's name and its options, not yet checked against its Config."""

    name: str
    options: dict = attrs.field(factory=dict)
    primary: Any = None  # a bare value, for the Config's first field
    text: str = ""  # as typed, for messages and run.json


def parse_spec(text: str, option: str) -> PluginSpec:
    """Split ``NAME[:OPTIONS]`` (see the module docstring); UsageError for a malformed one."""
    name, sep, rest = text.partition(":")
    name = name.strip()
    if not name:
        raise UsageError(f"{option} {text!r} names no plugin; write NAME or NAME:OPTIONS.")
    if not sep:
        return PluginSpec(name, text=text)
    rest = rest.strip()
    if not rest:
        raise UsageError(f"{option} {text!r} has a ':' but no options; drop the ':' or add options after it.")
    if rest.startswith("@"):
        return PluginSpec(name, _options_file(Path(rest[1:]), option, text), text=text)
    if rest.startswith("{"):
        try:
            options = json.loads(rest)
        except ValueError as exc:
            raise UsageError(f"{option} {text!r}: the options are not a valid JSON object ({exc}).") from None
        if not isinstance(options, dict):
            raise UsageError(f"{option} {text!r}: the options must be a JSON object.")
        return PluginSpec(name, options, text=text)
    options: dict = {}
    primary = None
    for i, item in enumerate(_split_items(rest)):
        key, eq, raw = item.partition("=")
        if not eq:
            if i != 0:
                raise UsageError(
                    f"{option} {text!r}: only the first option may be a bare value; write {item.strip()!r} as KEY=VALUE."
                )
            primary = _value(item.strip())
            continue
        if not key.strip():
            raise UsageError(f"{option} {text!r}: an option has no name before '='.")
        options[key.strip()] = _value(raw.strip())
    return PluginSpec(name, options, primary, text=text)


def _split_items(text: str) -> list[str]:
    """Split on commas outside brackets and quotes, so a JSON list value can hold commas."""
    items, depth, quote, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if ch == '"' and (i == 0 or text[i - 1] != "\\"):
            quote = not quote
        elif not quote and ch in "[{":
            depth += 1
        elif not quote and ch in "]}":
            depth -= 1
        elif not quote and depth == 0 and ch == ",":
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item.strip()]


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _options_file(path: Path, option: str, text: str) -> dict:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{option} {text!r}: cannot read the options file {path} ({exc.strerror or exc}).") from None
    try:
        options = json.loads(data) if path.suffix == ".json" else tomllib.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        kind = "JSON" if path.suffix == ".json" else "TOML"
        raise UsageError(f"{option} {text!r}: the options file {path} is not valid {kind} ({exc}).") from None
    if not isinstance(options, dict):
        raise UsageError(f"{option} {text!r}: the options file {path} must hold a table of options.")
    return options


def build_config(cls: type, spec: PluginSpec, what: str) -> Any:
    """The plugin's ``Config`` instance for ``spec``; UsageError/ConfigError naming the bad option."""
    config_cls = getattr(cls, "Config", None)
    fields = attrs.fields(config_cls) if config_cls is not None and attrs.has(config_cls) else ()
    options = dict(spec.options)
    if spec.primary is not None:
        if not fields:
            raise UsageError(f"The {what} {spec.name!r} takes no options; write just {spec.name!r}.")
        if fields[0].name in options:
            raise UsageError(f"{spec.text!r} sets {fields[0].name!r} twice; give it once.")
        options[fields[0].name] = spec.primary
    if not fields:
        if options:
            raise UsageError(f"The {what} {spec.name!r} takes no options; write just {spec.name!r}.")
        return config_cls() if config_cls is not None else None
    return structure_options(options, config_cls, f"the {what} {spec.name}", f"{spec.name}:{{key}}=...")


def structure_options(options: dict, config_cls: type, what: str, spelling: str) -> Any:
    """``options`` structured strictly into ``config_cls``; an unknown key is a ConfigError listing the valid ones.

    ``what`` names the plugin ("the docker sandbox"); ``spelling`` is how one
    option is written on the command line, with ``{key}`` for its name
    ("-S {key}=...", "-T web.{key}=...", "length:{key}=...").
    """
    fields = [f.name for f in attrs.fields(config_cls)] if attrs.has(config_cls) else []
    unknown = [key for key in options if key not in fields]
    if unknown:
        raise ConfigError(unknown_options(unknown, fields, what, spelling))
    return structure_config(options, config_cls, f"options for {what}")


def unknown_options(unknown: list, fields: list, what: str, spelling: str) -> str:
    """The sentence for options ``what`` does not take: the valid keys, and the closest one to each typo."""
    named = ", ".join(repr(key) for key in unknown)
    if not fields:
        return f"{what[0].upper()}{what[1:]} takes no options, so not {named}; drop {'it' if len(unknown) == 1 else 'them'}."
    plural = "options" if len(unknown) > 1 else "option"
    guesses = [(key, difflib.get_close_matches(str(key), fields, n=1, cutoff=0.6)) for key in unknown]
    fixes = [spelling.format(key=close[0]) for _key, close in guesses if close]
    fix = f"did you mean {' and '.join(fixes)}?" if fixes else "use one of them."
    return f"{what[0].upper()}{what[1:]} has no {plural} {named} (it takes {', '.join(fields)}); {fix}"
