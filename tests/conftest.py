"""Shared fixtures: a scripted model server and ways to run ``hermes-batch run`` against it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

from hermes_batch.cli import cli
from hermes_batch.testing import ScriptedModelServer

from hermes_batch.testing.fixtures import TEST_API_KEY as API_KEY  # must never appear in a run folder
from hermes_batch.testing.fixtures import model_server, write_dataset  # noqa: F401 (fixture and helper)


@attrs.define
class Runner:
    """Runs ``hermes-batch run`` against a server with sensible test defaults."""

    tmp_path: Path
    server: ScriptedModelServer | None = None

    def args(self, dataset, run_name="run", *extra, server=None) -> list[str]:
        server = server or self.server
        base = [
            "run",
            "--dataset_file", str(dataset),
            "--batch_size", "5",
            "--run_name", run_name,
            "--output_dir", str(self.tmp_path / "out"),
            "--model", "scripted-model",
            "--api_key", API_KEY,
            "--no-progress",
        ]
        if server is not None:
            base += ["--base_url", server.base_url]
        return base + list(extra)

    def folder(self, run_name="run") -> Path:
        return self.tmp_path / "out" / run_name

    def invoke(self, dataset, run_name="run", *extra, server=None):
        """In-process; returns click's Result (exit_code, output)."""
        return CliRunner().invoke(cli, self.args(dataset, run_name, *extra, server=server), catch_exceptions=False)

    def spawn(self, dataset, run_name="run", *extra, server=None, **popen) -> subprocess.Popen:
        """As a separate process, for signals and SIGKILL."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        return subprocess.Popen(
            [sys.executable, "-m", "hermes_batch", *self.args(dataset, run_name, *extra, server=server)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **popen,
        )

    def records(self, name: str, run_name="run") -> list[dict]:
        path = self.folder(run_name) / name
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def runner(tmp_path):
    return Runner(tmp_path)


@pytest.fixture(scope="module")
def shapes_run(tmp_path_factory):
    """A finished run of every ShapeScript shape, three copies each (kept and discarded records), once per module."""
    from hermes_batch.testing.run_folders import SHAPES, ShapeScript, run_shapes, shape_rows

    with ScriptedModelServer(ShapeScript(), api_key=API_KEY) as server:
        return run_shapes(tmp_path_factory.mktemp("shapes"), server, shape_rows(SHAPES, 3))


@pytest.fixture
def shapes_run_dir(shapes_run, tmp_path):
    """A copy of ``shapes_run`` this test may change."""
    import shutil

    copy = tmp_path / "out" / "run"
    shutil.copytree(shapes_run, copy)
    return copy
