"""Helpers for testing hermes-batch and its plugins: a scripted model endpoint.

See :mod:`hermes_batch.testing.server`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "ErrorRule",
    "ImageReply",
    "ImageRequest",
    "REASONING_FORMATS",
    "Reply",
    "RoutedScript",
    "Script",
    "ScriptRequest",
    "ScriptedModelServer",
    "ToolLoopScript",
]

if TYPE_CHECKING:
    from .server import (
        REASONING_FORMATS,
        ErrorRule,
        ImageReply,
        ImageRequest,
        Reply,
        RoutedScript,
        Script,
        ScriptedModelServer,
        ScriptRequest,
        ToolLoopScript,
    )


def __getattr__(name: str) -> Any:
    # Imported lazily so that `python -m hermes_batch.testing.server` does not find
    # the module already imported (runpy warns), and aiohttp loads only when used.
    if name in __all__:
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
