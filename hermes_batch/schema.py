"""A small JSON-schema check for tool arguments (the subset tool definitions use)."""

from __future__ import annotations

from typing import Any, Optional

_TYPES = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
    "null": type(None),
}


def _type_ok(value: Any, expected) -> bool:
    names = expected if isinstance(expected, list) else [expected]
    for name in names:
        kind = _TYPES.get(name)
        if kind is None:
            return True
        if isinstance(value, bool) and name in ("integer", "number"):
            continue
        if name == "integer" and isinstance(value, float) and value.is_integer():
            return True
        if isinstance(value, kind):
            return True
    return False


def validate(value: Any, schema: dict, path: str = "$") -> Optional[str]:
    """None when ``value`` matches ``schema``, else the first problem as ``$.path: reason``."""
    expected = schema.get("type")
    if expected is not None and not _type_ok(value, expected):
        return f"{path}: expected {expected}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path}: must be one of {schema['enum']}"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", ()):
            if name not in value:
                return f"{path}.{name}: required"
        for key, item in value.items():
            if key in props:
                problem = validate(item, props[key], f"{path}.{key}")
                if problem:
                    return problem
            elif schema.get("additionalProperties") is False:
                return f"{path}.{key}: unexpected argument"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problem = validate(item, schema["items"], f"{path}[{i}]")
            if problem:
                return problem
    return None
