"""Fixtures of the docker sandbox tests: a real engine, locally built images, no container left behind.

The engine and the images come from ``scripts/docker.sh`` (run by ``scripts/test.sh``).
Without an engine the tests skip, except in CI (``CI=true``), where they fail.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Optional

import attrs
import docker
import pytest
from click.testing import CliRunner
from docker.utils import kwargs_from_env

from hermes_batch.cli import cli
from hermes_batch_docker.engine import LABEL_RUN

IMAGE_A = "hermes-batch-test/busybox-a:1"
IMAGE_B = "hermes-batch-test/busybox-b:1"
MISSING_IMAGE = "hermes-batch-test/no-such-image:1"
REPO_ROOT = Path(__file__).resolve().parents[2]
from hermes_batch.testing.fixtures import TEST_API_KEY as API_KEY
from hermes_batch.testing.fixtures import model_server, write_dataset  # noqa: F401 (fixture and helper)
SESSION = uuid.uuid4().hex[:6]  # run names of this test session start with hbtest-SESSION-
_counter = itertools.count()


def _images_missing(client) -> list:
    missing = []
    for image in (IMAGE_A, IMAGE_B):
        try:
            client.inspect_image(image)
        except docker.errors.NotFound:
            missing.append(image)
    return missing


def _engine_problem() -> tuple[Optional[str], Optional[docker.APIClient]]:
    try:
        client = docker.APIClient(**kwargs_from_env(), version="auto", timeout=30)
        client.ping()
    except Exception as exc:
        return f"no Docker engine answers ({type(exc).__name__})", None
    if _images_missing(client):
        build = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "docker.sh"), "images"], capture_output=True, text=True)
        if build.returncode != 0 or _images_missing(client):
            return f"the test images could not be built: {build.stderr.strip()[-500:]}", client
    return None, client


@pytest.fixture(scope="session")
def docker_api():
    """A client of the real engine; skips (fails in CI) when there is none."""
    problem, client = _engine_problem()
    if problem:
        message = f"{problem}; scripts/test.sh installs and starts an engine and builds the images"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    yield client
    leftovers = [
        c for c in client.containers(all=True, filters={"label": LABEL_RUN})
        if c["Labels"].get(LABEL_RUN, "").startswith(f"hbtest-{SESSION}-")
    ]
    for container in leftovers:
        client.remove_container(container["Id"], force=True)
    client.close()
    assert not leftovers, f"{len(leftovers)} container(s) of this test session were left behind"


def containers_of(client, run_name: str) -> list:
    return client.containers(all=True, filters={"label": f"{LABEL_RUN}={run_name}"})


@pytest.fixture
def run_name(docker_api):
    """A run name of this test alone; after the test, no container of that run may remain."""
    name = f"hbtest-{SESSION}-{next(_counter)}"
    yield name
    left = containers_of(docker_api, name)
    for container in left:
        docker_api.remove_container(container["Id"], force=True)
    assert not left, f"{len(left)} container(s) of run {name} were left behind: {[c['Names'] for c in left]}"


@attrs.define
class Runner:
    """Runs ``hermes-batch run --sandbox docker`` against a scripted model server."""

    tmp_path: Path
    run_name: str

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
            "--sandbox", "docker",
            "-S", f"image={IMAGE_A}",
            *extra,
        ]

    @property
    def folder(self) -> Path:
        return self.tmp_path / "out" / self.run_name

    def invoke(self, dataset, server, *extra):
        """In-process; returns click's Result."""
        return CliRunner().invoke(cli, self.args(dataset, server, *extra), catch_exceptions=False)

    def spawn(self, dataset, server, *extra, env=None) -> subprocess.Popen:
        """As a separate process, for signals."""
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


@pytest.fixture
def runner(tmp_path, run_name):
    return Runner(tmp_path, run_name)
