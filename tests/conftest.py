"""Fixtures of the core's tests (the testing kit's, such as model_server and runner, come from the root conftest.py)."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE_SOURCE = Path(__file__).resolve().parents[1] / "plugins" / "hermes_batch_example" / "src"


@pytest.fixture
def example_plugin(monkeypatch):
    """The example plugin's module, imported from its source folder: the core's tests do not need it installed."""
    monkeypatch.syspath_prepend(str(EXAMPLE_SOURCE))
    module = sys.modules.get("hermes_batch_example") or importlib.import_module("hermes_batch_example")
    assert Path(module.__file__).resolve().is_relative_to(EXAMPLE_SOURCE.resolve())
    return module


@pytest.fixture(scope="module")
def shapes_run(tmp_path_factory):
    """A finished run of every ShapeScript shape, three copies each (kept and discarded records), once per module."""
    from hermes_batch.testing import ScriptedModelServer
    from hermes_batch.testing.run_folders import SHAPES, ShapeScript, run_shapes, shape_rows
    from hermes_batch.testing.runner import TEST_API_KEY

    with ScriptedModelServer(ShapeScript(), api_key=TEST_API_KEY) as server:
        return run_shapes(tmp_path_factory.mktemp("shapes"), server, shape_rows(SHAPES, 3))


@pytest.fixture
def shapes_run_dir(shapes_run, tmp_path):
    """A copy of ``shapes_run`` this test may change."""
    copy = tmp_path / "out" / "run"
    shutil.copytree(shapes_run, copy)
    return copy


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size)``: a real tmpfs of ``size`` ("600k") mounted inside tmp_path (we are root), to fill up;
    unmounted afterwards.  The test is skipped where no tmpfs can be mounted."""
    mounted = []

    def mount(size: str):
        where = tmp_path / f"disk{len(mounted) or ''}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)
