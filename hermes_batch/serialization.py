"""The one place where records become JSON and back (cattrs converters).

``record_converter`` reads leniently (unknown keys ignored, so files written by
newer versions still load); ``config_converter`` is strict (unknown keys and
wrong types are errors, ``"false"`` is not a bool).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override
from cattrs.v import format_exception

from .errors import ConfigError
from .records import Trajectory, Turn

T = TypeVar("T")


def _make_record_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=False)
    conv.register_unstructure_hook(
        Turn,
        make_dict_unstructure_fn(Turn, conv, from_=override(rename="from"), tool_calls=override(omit_if_default=True)),
    )
    conv.register_structure_hook(Turn, make_dict_structure_fn(Turn, conv, from_=override(rename="from")))
    # tool_calls arguments and metadata.row are free JSON
    conv.register_structure_hook(Any, lambda v, _: v)
    return conv


record_converter = _make_record_converter()


def _strict_bool(value, _type):
    if isinstance(value, bool):
        return value
    raise TypeError(f"expected a bool (true or false), got {value!r}")


def _make_config_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_structure_hook(bool, _strict_bool)

    def strict_scalar(kind):
        def hook(value, _type):
            if isinstance(value, bool) or not isinstance(value, kind):
                raise TypeError(f"expected {_type.__name__}, got {value!r}")
            return _type(value)

        return hook

    conv.register_structure_hook(int, strict_scalar(int))
    conv.register_structure_hook(float, strict_scalar((int, float)))
    conv.register_structure_hook(str, strict_scalar(str))
    return conv


config_converter = _make_config_converter()


def to_json_line(record: Any) -> str:
    """One record as one JSON line (with the trailing newline)."""
    return json.dumps(record_converter.unstructure(record), ensure_ascii=False, separators=(",", ":")) + "\n"


def from_json(data: Any, cls: type[T]) -> T:
    """Structure decoded JSON into a record class (lenient)."""
    return record_converter.structure(data, cls)


def trajectory_to_dict(traj: Trajectory) -> dict:
    return record_converter.unstructure(traj)


def _format_exception(exc: BaseException, type_) -> str:
    # A validator's ValueError (raised by the class itself, so no type) is a sentence meant for the user.
    if isinstance(exc, ValueError) and type_ is None and str(exc):
        return str(exc)
    return format_exception(exc, type_)


def describe_structure_error(exc: BaseException, path: str = "$") -> str:
    """A short message for a cattrs error: ``$.field: reason``."""
    if isinstance(exc, (cattrs.ClassValidationError, cattrs.IterableValidationError)):
        messages = cattrs.transform_error(exc, path=path, format_exception=_format_exception)
        return "; ".join(m.removesuffix(" @ ") for m in messages)
    return f"{path}: {exc}"


def structure_config(data: dict, cls: type[T], what: str) -> T:
    """Structure options strictly into an attrs Config class; a ConfigError names the bad key."""
    try:
        return config_converter.structure(data, cls)
    except Exception as exc:  # cattrs raises several exception types
        raise ConfigError(f"Invalid {what}: {describe_structure_error(exc, path='')}.") from exc


def parse_key_values(items: tuple[str, ...], option: str) -> dict:
    """``("a=1", "b=x")`` -> ``{"a": 1, "b": "x"}``; values are JSON when they parse as JSON."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{option} expects KEY=VALUE, got {item!r}.")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out[key.strip()] = value
    return out
