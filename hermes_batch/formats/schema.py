"""Tool arguments checked against the tool's JSON Schema (any draft, through ``jsonschema``), with a one-line reason."""

from __future__ import annotations

import json
from typing import Any, Optional

import jsonschema
from jsonschema.validators import validator_for

# A reason goes back to the model in a tool result: short, and never a copy of a huge argument.
MAX_REASON_CHARS = 300
_CACHE_SIZE = 1024
_validators: dict[int, tuple[dict, Any]] = {}  # id(schema) -> (schema, validator); the schema is kept so its id stays its own


def _validator(schema: dict):
    cached = _validators.get(id(schema))
    if cached is not None and cached[0] is schema:
        return cached[1]
    if len(_validators) >= _CACHE_SIZE:
        _validators.clear()
    validator = validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
    _validators[id(schema)] = (schema, validator)
    return validator


_checked: dict[str, Optional[str]] = {}  # a schema's JSON text -> check_schema's verdict


def check_schema(schema: Any) -> Optional[str]:
    """None when ``schema`` is a valid JSON Schema of an object, else what is wrong with it.

    Each registry checks every tool's schema against its metaschema, which takes
    tens of milliseconds a tool: a schema seen before (by its JSON text) is not
    checked again.
    """
    if not isinstance(schema, dict):
        return f"expected a JSON object, got {type(schema).__name__}"
    try:
        key = json.dumps(schema, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return _check_schema(schema)
    if key not in _checked and json.loads(key) != schema:  # not plain JSON (a tuple, a key not a str): as it is
        return _check_schema(schema)
    if key not in _checked:
        if len(_checked) >= _CACHE_SIZE:
            _checked.clear()
        _checked[key] = _check_schema(schema)
    return _checked[key]


def _check_schema(schema: dict) -> Optional[str]:
    try:
        validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f"[{p!r}]" for p in exc.absolute_path)
        return f"{where or 'the schema'}: {_one_line(exc.message)}"
    return None


def validate(value: Any, schema: dict, path: str = "$") -> Optional[str]:
    """None when ``value`` matches ``schema``, else the most relevant problem as ``$.path: reason``."""
    error = jsonschema.exceptions.best_match(_validator(schema).iter_errors(value))
    if error is None:
        return None
    where = path + error.json_path[1:]
    if error.validator == "type":
        return f"{where}: expected {error.validator_value}, got {type(error.instance).__name__}"
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = next((name for name in error.validator_value if name not in error.instance), None)
        if missing is not None:
            return f"{where}.{missing}: required"
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = set(error.schema.get("properties", {}))
        extra = next((key for key in error.instance if key not in known), None)
        if extra is not None and not error.schema.get("patternProperties"):
            return f"{where}.{extra}: unexpected argument"
    if error.validator == "enum":
        return _one_line(f"{where}: must be one of {error.validator_value}")
    return _one_line(f"{where}: {error.message}")


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."
