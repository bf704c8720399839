"""Pytest fixtures and helpers for testing hermes-batch and its plugins.

Load them (``model_server``, ``runner``, ``procs``, ``local_sandbox``, ``toolset_harness``)
in your ``tests/conftest.py``::

    pytest_plugins = ["hermes_batch.testing.fixtures"]
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

import pytest
import pytest_asyncio

from .scripts import ToolLoopScript

from .runner import TEST_API_KEY


@pytest.fixture(autouse=True)
def _plugin_under_test(request):
    """The helpers of this kit load the core's plugins and the plugin under test only (``scope``): the one whose
    pyproject.toml is nearest above the test file."""
    from .scope import plugin_entry_points, under_test

    with under_test(plugin_entry_points(Path(str(request.path)))):
        yield


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


@pytest.fixture
def runner(tmp_path):
    """A :class:`~hermes_batch.testing.Runner` writing under ``tmp_path``; pass ``server=`` to its calls."""
    from .runner import Runner

    return Runner(tmp_path)


@pytest.fixture
def procs():
    """A list for the child processes a test starts; any still running after the test is killed."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        ended(proc)


@pytest_asyncio.fixture
async def local_sandbox(tmp_path):
    """An open sandbox of the core's local backend, in ``tmp_path``: for testing tools."""
    from hermes_batch import RunContext, SandboxSpec, get_plugin_manager

    backend_class = get_plugin_manager(load_entry_points=False).registry().get("sandboxes", "local")
    backend = backend_class(backend_class.Config(), RunContext("tool-test", tmp_path / "run", seed=0))
    await backend.start()
    sandbox = await backend.open(SandboxSpec("tool-test", 0, "0123456789abcdef"))
    yield sandbox
    await sandbox.close()
    await backend.shutdown()


@pytest_asyncio.fixture
async def toolset_harness(tmp_path):
    """A :class:`~hermes_batch.testing.ToolsetHarness`; its runtimes are shut down after the test."""
    from .toolsets import ToolsetHarness

    harness = ToolsetHarness(tmp_path / "run")
    yield harness
    await harness.close()


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
            _out, err = ended(proc)
            pytest.fail(f"the run ended (status {proc.returncode}) before {what}:\n{err[-3000:]}")
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def ended(proc: subprocess.Popen, timeout: float = 60) -> tuple:
    """``proc.communicate()``: its output, once it and every process that inherited its pipes have ended.

    Fails after ``timeout`` seconds, naming the processes that still hold
    them (a worker or a sandbox process its end left running), rather than
    wait for ever.
    """
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    # communicate() closes a stream it read to the end: the pipes still held are among the others
    pipes = {f"pipe:[{os.fstat(s.fileno()).st_ino}]" for s in (proc.stdout, proc.stderr) if s and not s.closed}
    holders = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            links = {os.readlink(fd.path) for fd in os.scandir(f"/proc/{entry.name}/fd")}
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if links & pipes:
            holders.append(f"{entry.name}: {cmdline[:200]}")
    pytest.fail(f"{len(holders)} processes still held the output of pid {proc.pid} after {timeout}s: "
                + "; ".join(holders))
