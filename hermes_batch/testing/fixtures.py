"""Pytest helpers for testing hermes-batch and its plugins.

Import the fixture into a ``conftest.py`` to use it::

    from hermes_batch.testing.fixtures import model_server  # noqa: F401
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

import pytest

from .scripts import ToolLoopScript

TEST_API_KEY = "sk-test-canary-3f9c1d"
"""The key the ``model_server`` fixture expects by default; tests check it never reaches a run folder."""


@pytest.fixture
def model_server():
    """Factory: ``model_server(script=..., **options)`` starts a ScriptedModelServer, stopped after the test."""
    from .server import ScriptedModelServer

    servers = []

    def start(script=None, **options):
        options.setdefault("api_key", TEST_API_KEY)
        server = ScriptedModelServer(script or ToolLoopScript(tool_calls=2), **options).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def write_dataset(path: Path, rows) -> Path:
    """Write rows (dicts, or raw strings for broken lines) as a JSONL dataset."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def wait_for(condition: Callable, timeout: float, what: str, proc: Optional[subprocess.Popen] = None):
    """Poll ``condition`` until it is truthy and return its value; fail if ``proc`` ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            _out, err = proc.communicate()
            pytest.fail(f"the run ended (status {proc.returncode}) before {what}:\n{err[-3000:]}")
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")
