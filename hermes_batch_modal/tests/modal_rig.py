"""Fixtures, constants and helpers of the modal backend tests: the real ``modal`` SDK against a local Modal STAND-IN.

The stand-in (``standin/``) runs each sandbox as a container of the local Docker
engine, from the busybox test images that ``scripts/docker.sh`` builds.  Without
an engine the tests skip, except in CI (``CI=true``), where they fail.

There is no conftest.py here on purpose: the core suite's rootless conftest is
imported by name (``from conftest import ...``), and a second one would shadow
it.  The test modules import the fixtures they use from this module.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

from hermes_batch.cli import cli
from hermes_batch.testing.fixtures import TEST_API_KEY as API_KEY
from hermes_batch.testing.fixtures import model_server, write_dataset  # noqa: F401 (re-exported for the tests)

from standin import ModalStandIn

IMAGE_A = "hermes-batch-test/busybox-a:1"
IMAGE_B = "hermes-batch-test/busybox-b:1"
MISSING_IMAGE = "hermes-batch-test/no-such-image:1"
REPO_ROOT = Path(__file__).resolve().parents[2]


@attrs.define
class Runner:
    """Runs ``hermes-batch run --sandbox modal`` against a scripted model server and the stand-in."""

    tmp_path: Path
    run_name: str
    standin: ModalStandIn

    def args(self, dataset, server, *extra) -> list:
        return [
            "run",
            "--dataset_file", str(dataset),
            "--batch_size", "5",
            "--run_name", self.run_name,
            "--output_dir", str(self.tmp_path / "out"),
            "--model", "scripted-model",
            "--api_key", API_KEY,
            "--base_url", server.base_url,
            "--distribution", "terminal_only",
            "--no-progress",
            "--sandbox", "modal",
            "-S", f"image={IMAGE_A}",
            "-S", "create_rate=50",
            *extra,
        ]

    @property
    def folder(self) -> Path:
        return self.tmp_path / "out" / self.run_name

    def invoke(self, dataset, server, *extra):
        """In-process; returns click's Result."""
        return CliRunner().invoke(cli, self.args(dataset, server, *extra), catch_exceptions=False)

    def spawn(self, dataset, server, *extra, env=None) -> subprocess.Popen:
        """As a separate process (for signals), pointed at the same stand-in."""
        return subprocess.Popen(
            [sys.executable, "-m", "hermes_batch", *self.args(dataset, server, *extra)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
        )

    def records(self, name: str) -> list:
        path = self.folder / name
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


SESSION = uuid.uuid4().hex[:6]
_counter = itertools.count()


def _engine_problem():
    try:
        standin = ModalStandIn().start()
    except Exception as exc:
        return f"no Docker engine answers ({type(exc).__name__}: {exc})"
    try:
        missing = [image for image in (IMAGE_A, IMAGE_B) if not standin.call(standin.engine.image_exists(image))]
    finally:
        standin.stop()
    if missing:
        build = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "docker.sh"), "images"], capture_output=True, text=True)
        if build.returncode != 0:
            return f"the test images could not be built: {build.stderr.strip()[-500:]}"
    return None


@pytest.fixture(scope="session")
def docker_engine():
    problem = _engine_problem()
    if problem:
        message = f"{problem}; scripts/test.sh installs and starts an engine and builds the images"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture
def standin(docker_engine, monkeypatch, tmp_path):
    """A fresh Modal stand-in, with the SDK pointed at it (MODAL_SERVER_URL and a stand-in token)."""
    server = ModalStandIn().start()
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "no-modal.toml"))
    yield server
    left = server.running()
    server.stop()
    assert not left, f"{len(left)} sandbox(es) were left running: {[s.tags for s in left]}"
    assert not server.unimplemented, f"the SDK called RPCs the stand-in lacks: {server.unimplemented}"


@pytest.fixture
def run_name():
    return f"hbtest-{SESSION}-{next(_counter)}"


@pytest.fixture
def runner(tmp_path, run_name, standin):
    return Runner(tmp_path, run_name, standin)
