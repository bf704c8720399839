"""One definition per option: an attrs field carries its default, help and validation; click options come from it.

As datasette's ``SETTINGS`` and llm's generated help do, the configuration class
is the one place an option is written down.  ``option()`` declares a field,
``click_options(cls)`` turns the fields into the options of a click command and
``from_cli(cls, values)`` builds the class from what click parsed.  Validators
raise ``UsageError`` with one sentence naming the option as the user types it.
"""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import attrs
import click

from ..errors import UsageError

_CLI = "hermes_batch.cli"  # the metadata key of a field's command-line spelling


@attrs.frozen
class Cli:
    """How a field is spelled on the command line, when ``--name`` / ``--name-with-dashes`` is not all."""

    decls: tuple[str, ...] = ()  # click's declarations; default: --name and --name-with-dashes
    convert: Optional[Callable[[Any], Any]] = None  # what click parsed -> the field's value
    metavar: Optional[str] = None
    multiple: bool = False
    type: Any = None  # a click type; default: from the field's annotation and validator
    default_text: Optional[str] = None  # what --help shows as the default, when not the default itself
    eager: bool = False
    required: Optional[bool] = None  # None: required when the field has no default; False: the command checks it


def option(default: Any = attrs.NOTHING, *, help: str, validator=None, cli: Cli = Cli(), **kwargs: Any) -> Any:
    """A configuration field that is also a command-line option: default, help and validation in one place."""
    return attrs.field(default=default, validator=validator, metadata={"help": help, _CLI: cli}, **kwargs)


# --- validators: one sentence naming the option ----------------------------------------------


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _finite(attribute, value) -> None:
    # NaN passes every comparison and inf is no limit at all
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"--{attribute.name} must be a finite number, got {value}.")


def at_least(minimum: int):
    """The value (when given) is a finite number of at least ``minimum``."""
    wording = "0 or more" if minimum == 0 else f"at least {minimum}"

    def check(_instance, attribute, value):
        _finite(attribute, value)
        if value is not None and value < minimum:
            raise UsageError(f"--{attribute.name} must be {wording}, got {_number(value)}.")

    return check


def at_most(maximum: float):
    """The value (when given) is a finite number of at most ``maximum``."""

    def check(_instance, attribute, value):
        _finite(attribute, value)
        if value is not None and value > maximum:
            raise UsageError(f"--{attribute.name} must be at most {_number(maximum)}, got {_number(value)}.")

    return check


def finite(_instance, attribute, value) -> None:
    """The value is a finite number (any sign)."""
    _finite(attribute, value)


def positive(_instance, attribute, value) -> None:
    """The value (when given) is a finite number above 0."""
    _finite(attribute, value)
    if value is not None and value <= 0:
        raise UsageError(f"--{attribute.name} must be more than 0, got {_number(value)}.")


def one_of(choices: Iterable[str]):
    """The value (when given) is one of ``choices``; --help lists them."""
    choices = tuple(choices)

    def check(_instance, attribute, value):
        if value is not None and value not in choices:
            raise UsageError(f"--{attribute.name} must be one of {', '.join(choices)}.")

    check.choices = choices
    return check


# --- click ------------------------------------------------------------------------------------


def _base_type(annotation: Any) -> Any:
    """``Optional[int]`` -> ``int``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


class _OrNone(click.ParamType):
    """A number, or ``none`` (``all`` too for a count): no limit, as when the option is not given.

    A resume takes the options not given from run.json; this is how one lifts a limit the run was started with.
    """

    def __init__(self, base: type):
        self.base = click.INT if base is int else click.FLOAT
        self.name = f"{self.base.name}|none"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.strip().lower() in ("none", "all"):
            return None
        return self.base.convert(value, param, ctx)


def _click_type(field: attrs.Attribute, cli: Cli, base: Any) -> Any:
    if cli.type is not None:
        return cli.type
    choices = getattr(field.validator, "choices", None)
    if choices:
        return click.Choice(choices)
    if base in (int, float) and field.default is None:
        return _OrNone(base)
    if base in (int, float, str):
        return base
    return None


def click_option(field: attrs.Attribute, base: Any) -> Callable:
    """The click option of ``field``."""
    cli: Cli = field.metadata[_CLI]
    decls = cli.decls or tuple(dict.fromkeys((f"--{field.name}", f"--{field.name.replace('_', '-')}")))
    # click passes a default through the option's type, so only a plain value can be one; () and {} become None
    default = field.default if isinstance(field.default, (str, int, float, Path)) else None
    kwargs: dict[str, Any] = {"help": field.metadata["help"], "is_eager": cli.eager, "show_default": True}
    if cli.multiple:
        kwargs.update(multiple=True, show_default=False)
    elif any("/" in decl for decl in decls):  # --name/--no-name
        kwargs["default"] = default
    elif base is bool:
        # a flag that also takes the original runner's explicit values: --resume=True, --verbose=false
        kwargs.update(is_flag=False, flag_value=True, default=False, type=click.BOOL, metavar="[true|false]")
    else:
        kwargs["type"] = _click_type(field, cli, base)
        if field.default is attrs.NOTHING:
            kwargs["required"] = cli.required is not False
        else:
            kwargs["default"] = default
    if cli.metavar:
        kwargs["metavar"] = cli.metavar
    if cli.default_text is not None:  # written as click writes a default, without its parentheses
        kwargs.update(help=f"{kwargs['help']}  [default: {cli.default_text}]", show_default=False)
    elif default is None:
        kwargs["show_default"] = False
    return click.option(*decls, field.name, **kwargs)


def click_options(cls: type) -> Callable:
    """A decorator adding a click option for every field of ``cls``, in the order of the fields."""
    hints = typing.get_type_hints(cls)

    def decorate(command: Callable) -> Callable:
        for field in reversed(attrs.fields(cls)):
            command = click_option(field, _base_type(hints[field.name]))(command)
        return command

    return decorate


def from_cli(cls: type, values: dict, **overrides: Any) -> Any:
    """``cls`` built from click's parsed ``values`` (each converted as its field says), then ``overrides``."""
    kwargs = {}
    for field in attrs.fields(cls):
        if field.name not in values:
            continue
        convert = field.metadata[_CLI].convert
        kwargs[field.name] = convert(values[field.name]) if convert is not None else values[field.name]
    return cls(**{**kwargs, **overrides})


def documented(cls: type) -> dict[str, Any]:
    """Option name -> the field's default (``attrs.NOTHING`` when required), for the docs' table and its test."""
    return {f"--{f.name}": f.default for f in attrs.fields(cls)}


def cli_names(cls: type) -> dict[str, tuple[str, ...]]:
    """Field name -> its command-line spellings."""
    names = {}
    for field in attrs.fields(cls):
        decls = field.metadata[_CLI].decls or (f"--{field.name}", f"--{field.name.replace('_', '-')}")
        names[field.name] = tuple(part for decl in decls for part in decl.split("/"))
    return names
