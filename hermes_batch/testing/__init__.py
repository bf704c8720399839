"""The kit for testing hermes-batch plugins: a scripted model server, a CLI runner, records, fixtures, the contract suite.

Install it with ``pip install 'hermes-batch[testing]'`` (it brings pytest and
pytest-asyncio) and load the fixtures in your ``tests/conftest.py``::

    pytest_plugins = ["hermes_batch.testing.fixtures"]

Everything listed in ``__all__`` is importable from here; the modules load on
first use, so that importing this package costs nothing and pulls in neither
pytest nor aiohttp until a helper needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the submodule that defines it
_EXPORTS = {
    "ScriptedModelServer": "server",
    "ScriptedProvider": "server",
    "ErrorRule": "server",
    "BatchSettings": "server",
    "ScriptRequest": "scripts",
    "Reply": "scripts",
    "ToolLoopScript": "scripts",
    "RoutedScript": "scripts",
    "PassRateScript": "scripts",
    "ImageRequest": "scripts",
    "ImageReply": "scripts",
    "REASONING_FORMATS": "scripts",
    "SandboxContract": "sandbox_contract",
    "VerifierContract": "verifier_contract",
    "Runner": "runner",
    "tool_outputs": "runner",
    "make_trajectory": "records",
    "steady": "records",
    "RUN_NOISE": "records",
    "make_filter": "records",
    "ToolsetHarness": "toolsets",
    "TEST_API_KEY": "runner",
    "write_dataset": "fixtures",
    "wait_for": "fixtures",
    "ended": "fixtures",
    "solid_png": "images",
    "png_for": "images",
    "png_size": "images",
    "data_url_bytes": "images",
    "ShapeScript": "run_folders",
    "SHAPES": "run_folders",
    "shape_rows": "run_folders",
    "answer_for": "run_folders",
    "run_shapes": "run_folders",
    "run_cli": "run_folders",
    "read_jsonl": "run_folders",
    "batch_records": "run_folders",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .fixtures import ended, wait_for, write_dataset
    from .images import data_url_bytes, png_for, png_size, solid_png
    from .records import RUN_NOISE, make_filter, make_trajectory, steady
    from .run_folders import SHAPES, ShapeScript, answer_for, read_jsonl, run_cli, run_shapes, shape_rows
    from .runner import TEST_API_KEY, Runner, tool_outputs
    from .sandbox_contract import SandboxContract
    from .verifier_contract import VerifierContract
    from .toolsets import ToolsetHarness
    from .scripts import (REASONING_FORMATS, ImageReply, ImageRequest, PassRateScript, Reply, RoutedScript,
                          ScriptRequest, ToolLoopScript)
    from .server import BatchSettings, ErrorRule, ScriptedModelServer, ScriptedProvider


def __getattr__(name: str) -> Any:
    # Lazily, so that `python -m hermes_batch.testing.server` does not find the module
    # already imported (runpy warns), and pytest and aiohttp load only when used.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
