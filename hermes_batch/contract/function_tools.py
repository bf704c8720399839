"""Tools written as typed, documented functions: the ``@hermes_batch.tool`` decorator.

An ``async def`` is awaited on the event loop; a plain ``def`` runs in the run's
thread pool for tools (sized with ``--num_workers``), so a blocking call holds up
no other prompt.

The JSON Schema the model sees is built from the signature (type hints, defaults)
and the docstring (its first paragraph describes the tool; an ``Args:`` section
describes each argument), as llm's ``Tool.function`` does.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
import re
import types
import typing
from typing import Any, Callable, ClassVar, Literal, Optional, Union

from .interfaces import Tool, ToolContext

_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


class FunctionTool(Tool):
    """A Tool whose ``call`` calls a function with the model's arguments as keyword arguments: awaits an ``async``
    one, runs a plain one in the context's thread pool (``ToolContext.thread_pool``)."""

    function: ClassVar[Callable[..., Any]]
    context_parameter: ClassVar[Optional[str]] = None  # the parameter that receives the ToolContext
    integer_parameters: ClassVar[frozenset] = frozenset()

    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        kwargs = {
            # JSON Schema counts 3.0 as an integer; the function's type hint says int
            key: int(value) if key in self.integer_parameters and isinstance(value, float) else value
            for key, value in arguments.items()
        }
        if self.context_parameter:
            kwargs[self.context_parameter] = ctx
        function = type(self).function
        if inspect.iscoroutinefunction(function):
            result = await function(**kwargs)
        else:
            call = functools.partial(contextvars.copy_context().run, function, **kwargs)
            result = await asyncio.get_running_loop().run_in_executor(ctx.thread_pool, call)
        return result if isinstance(result, dict) else {"result": result, "error": None}


def tool_from_function(
    function: Callable[..., Any], *, name: Optional[str] = None, description: Optional[str] = None
) -> type[FunctionTool]:
    """A Tool class calling ``function``; its JSON Schema comes from the type hints, defaults and docstring.

    ``function`` is an ``async def``, awaited on the event loop, or a plain
    ``def``, run in the run's thread pool for tools (its blocking calls hold up
    no other prompt; the sandbox's methods are ``async``, so a function that uses
    the sandbox is an ``async def``).  A parameter annotated ``ToolContext``
    receives the prompt's context (sandbox, toolset sessions) and is not shown
    to the model.  A returned dict is the tool's result as it is; any other
    value is returned as ``{"result": value, "error": None}``.  An exception
    is the model's tool result ``{"error": "ExceptionType: message"}``.
    """
    if not callable(function) or inspect.isclass(function) or inspect.isasyncgenfunction(function) \
            or inspect.isgeneratorfunction(function):
        raise TypeError(f"{function!r} must be a function (def or async def) to become a tool.")
    doc = inspect.getdoc(function) or ""
    summary, arg_docs = _parse_docstring(doc)
    hints = typing.get_type_hints(function)
    properties: dict[str, dict] = {}
    required: list[str] = []
    context_parameter = None
    integers = set()
    for param in inspect.signature(function).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(f"{function.__qualname__}: a tool's parameters must be named; {param.name!r} is not.")
        hint = hints.get(param.name, Any)
        if hint is ToolContext:
            context_parameter = param.name
            continue
        schema = _schema_of(hint, f"{function.__qualname__}({param.name})")
        if hint is int:
            integers.add(param.name)
        if param.name in arg_docs:
            schema["description"] = arg_docs[param.name]
        if param.default is param.empty:
            required.append(param.name)
        elif _is_json(param.default):
            schema["default"] = param.default
        properties[param.name] = schema
    parameters: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        parameters["required"] = required
    tool_name = name or function.__name__
    namespace = {
        "name": tool_name,
        "description": description or summary or tool_name,
        "parameters": parameters,
        "function": staticmethod(function),
        "context_parameter": context_parameter,
        "integer_parameters": frozenset(integers),
        "__doc__": summary or None,
        "__module__": function.__module__,
        "__qualname__": function.__qualname__,
    }
    return type(_class_name(tool_name), (FunctionTool,), namespace)


def _class_name(tool_name: str) -> str:
    return "".join(part.capitalize() for part in re.split(r"[^0-9A-Za-z]+", tool_name) if part) + "Tool"


def _schema_of(hint: Any, where: str) -> dict:
    if hint is Any or hint is inspect.Parameter.empty:
        return {}
    if hint in _SIMPLE:
        return {"type": _SIMPLE[hint]}
    if hint is type(None):
        return {"type": "null"}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        schema: dict[str, Any] = {"enum": list(args)}
        kinds = {_SIMPLE.get(type(a)) for a in args}
        if len(kinds) == 1 and None not in kinds:
            schema["type"] = kinds.pop()
        return schema
    if origin in (Union, types.UnionType):
        options = [_schema_of(arg, where) for arg in args]
        simple = [o.get("type") for o in options if set(o) == {"type"} and isinstance(o.get("type"), str)]
        if len(simple) == len(options):
            return {"type": simple}
        return {"anyOf": options}
    if origin in (list, tuple, set, frozenset) or origin is typing.get_origin(typing.Sequence[int]):
        items = args[0] if args and (origin is not tuple or (len(args) == 2 and args[1] is Ellipsis)) else Any
        schema = {"type": "array"}
        if items is not Any:
            schema["items"] = _schema_of(items, where)
        return schema
    if origin is dict:
        schema = {"type": "object"}
        if len(args) == 2 and args[1] is not Any:
            schema["additionalProperties"] = _schema_of(args[1], where)
        return schema
    raise TypeError(f"{where}: the type {hint!r} has no JSON Schema; use str, int, float, bool, list, dict, Literal or Optional.")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph, {argument: description}) of a Google-style (``Args:``) or Sphinx-style (``:param x:``) docstring."""
    paragraphs = doc.strip().split("\n\n")
    summary = " ".join(paragraphs[0].split()) if paragraphs and not _is_section(paragraphs[0]) else ""
    described: dict[str, str] = {}
    current = None
    in_args = False
    for line in doc.splitlines():
        stripped = line.strip()
        sphinx = re.match(r":param\s+(?:\S+\s+)?(\w+):\s*(.*)", stripped)
        if sphinx:
            current = sphinx.group(1)
            described[current] = sphinx.group(2)
            continue
        if re.fullmatch(r"(Args|Arguments|Parameters):", stripped):
            in_args, current = True, None
            continue
        if in_args:
            item = re.match(r"(\w+)(?:\s*\([^)]*\))?:\s*(.*)", stripped)
            if item and line.startswith(" " * 4) and not line.startswith(" " * 8):
                current = item.group(1)
                described[current] = item.group(2)
            elif stripped and current is not None and line.startswith(" " * 8):
                described[current] += " " + stripped
            elif not stripped:
                current = None
            elif not line.startswith(" "):
                in_args = False
    return summary, {key: " ".join(value.split()) for key, value in described.items()}


def _is_section(paragraph: str) -> bool:
    return bool(re.match(r"\s*(Args|Arguments|Parameters|Returns|Raises):", paragraph)) or paragraph.lstrip().startswith(":param")


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def tool(function: Optional[Callable[..., Any]] = None, *, name: Optional[str] = None, description: Optional[str] = None):
    """A Tool class that awaits ``function``: ``@hermes_batch.tool``, ``@hermes_batch.tool(name="...")`` or ``tool(function)``."""
    if function is None:
        return lambda f: tool_from_function(f, name=name, description=description)
    return tool_from_function(function, name=name, description=description)
