"""Fixtures and helpers of the singularity sandbox tests: a real Apptainer, images from local sources, no instance left.

This folder is no package and has no conftest.py, so that its modules never clash with the
``tests`` package or the ``conftest`` module of other test folders; each test module imports
the fixtures it uses from here (a unique module name).  Each module then has its own
session-scoped fixtures, so what is costly (the set-up, the images) is made once and kept here.

Apptainer runs in a Docker container set up by ``scripts/apptainer.sh`` (sourced by
``scripts/test.sh``, which exports ``HERMES_APPTAINER_BIN``); its ``apptainer`` and
``singularity`` commands forward into that container and are put first on PATH for
these tests only.  Without them the tests skip, except in CI (``CI=true``), where they fail.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Optional

import attrs
import pytest
from click.testing import CliRunner

from hermes_batch.cli import cli
from hermes_batch.testing.fixtures import TEST_API_KEY as API_KEY
from hermes_batch.testing.fixtures import model_server, write_dataset  # noqa: F401 (fixture and helper)
from hermes_batch_singularity import instances

REPO_ROOT = Path(__file__).resolve().parents[2]
IMAGE_A = "hermes-batch-test/busybox-a:1"
IMAGE_B = "hermes-batch-test/busybox-b:1"
SESSION = uuid.uuid4().hex[:6]  # run names of this test session start with hbs-SESSION-
_counter = itertools.count()


@functools.cache
def _setup_apptainer() -> tuple[Optional[str], Optional[str]]:
    """(folder of the forwarding commands, None) or (None, why there is none)."""
    if os.environ.get("HERMES_APPTAINER_BIN"):
        return os.environ["HERMES_APPTAINER_BIN"], None
    if os.environ.get("HERMES_APPTAINER_PROBLEM"):
        return None, os.environ["HERMES_APPTAINER_PROBLEM"]
    # Not started by scripts/test.sh: set it up now (quick once the image exists).
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "apptainer.sh")], capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.strip():
        return None, f"scripts/apptainer.sh failed: {done.stderr.strip()[-500:]}"
    return done.stdout.strip().splitlines()[-1], None


@pytest.fixture(scope="session")
def apptainer_bin():
    """The folder holding the ``apptainer`` and ``singularity`` commands; skips (fails in CI) without them."""
    folder, problem = _setup_apptainer()
    if problem:
        message = f"no Apptainer for the tests ({problem}); scripts/test.sh sets one up in a Docker container"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    yield folder
    left = [found for found in _ours(folder) if found.run_part.startswith(f"hbs-{SESSION}-")]
    for found in left:
        _stop(folder, found.name)
    assert not left, f"{len(left)} instance(s) of this test session were left running: {[f.name for f in left]}"


@pytest.fixture(autouse=True)
def _apptainer_on_path(request, monkeypatch):
    """The forwarding commands first on PATH, for the tests (and the runs they spawn) that use Apptainer."""
    if "apptainer_bin" in request.fixturenames:
        folder = request.getfixturevalue("apptainer_bin")
        monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


def _ours(folder: str, run_name: Optional[str] = None) -> list:
    from hermes_batch_singularity import runtime

    return instances.ours(runtime.list_instances(os.path.join(folder, "apptainer")), run_name)


def _stop(folder: str, name: str) -> None:
    subprocess.run([os.path.join(folder, "apptainer"), "instance", "stop", "--force", name], capture_output=True)


def instances_of(apptainer_bin: str, run_name: str) -> list:
    """Names of the running instances of a run."""
    return [found.name for found in _ours(apptainer_bin, run_name)]


@pytest.fixture
def run_name(apptainer_bin):
    """A run name of this test alone; after the test, no instance of that run may be running."""
    name = f"hbs-{SESSION}-{next(_counter)}"
    yield name
    left = instances_of(apptainer_bin, name)
    for instance in left:
        _stop(apptainer_bin, instance)
    assert not left, f"{len(left)} instance(s) of run {name} were left running: {left}"


# --- images from local sources ------------------------------------------------------------------


@attrs.frozen
class Images:
    """The test images, as the backend can be given them."""

    archive_a: str  # docker-archive:// URI of busybox-a
    archive_b: str
    sif_a: str  # a SIF file built from busybox-a
    folder_b: str  # a sandbox folder built from busybox-b


def _docker_images_ready() -> Optional[str]:
    for image in (IMAGE_A, IMAGE_B):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode != 0:
            build = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "docker.sh"), "images"], capture_output=True, text=True)
            if build.returncode != 0:
                return f"the busybox test images could not be built: {build.stderr.strip()[-300:]}"
            break
    return None


@pytest.fixture(scope="session")
def images(apptainer_bin, tmp_path_factory) -> Images:
    """docker-archive:// files of the busybox test images, a SIF and a sandbox folder made from them (under /tmp)."""
    if _made_images:
        return _made_images[0]
    problem = _docker_images_ready()
    if problem:
        pytest.fail(problem)
    folder = tmp_path_factory.mktemp("singularity-images")
    archives = {}
    for key, image in (("a", IMAGE_A), ("b", IMAGE_B)):
        path = folder / f"busybox-{key}.tar"
        subprocess.run(["docker", "save", "-o", str(path), image], check=True, capture_output=True)
        archives[key] = f"docker-archive://{path}"
    apptainer = os.path.join(apptainer_bin, "apptainer")
    sif_a, folder_b = folder / "busybox-a.sif", folder / "busybox-b-sandbox"
    for target, source, extra in ((sif_a, archives["a"], []), (folder_b, archives["b"], ["--sandbox"])):
        done = subprocess.run([apptainer, "build", *extra, str(target), source], capture_output=True, text=True)
        assert done.returncode == 0, f"apptainer build {target} failed: {done.stderr[-800:]}"
    _made_images.append(Images(archives["a"], archives["b"], str(sif_a), str(folder_b)))
    return _made_images[0]


_made_images: list = []  # the Images of this test session, made by the first module that asks


# --- running hermes-batch ----------------------------------------------------------------------------


@attrs.define
class Runner:
    """Runs ``hermes-batch run --sandbox singularity`` against a scripted model server."""

    tmp_path: Path
    run_name: str
    cache_dir: Path

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
            "--sandbox", "singularity",
            "-S", f"cache_dir={self.cache_dir}",
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
    return Runner(tmp_path, run_name, tmp_path / "sif-cache")


@pytest.fixture(scope="session")
def user_apptainer_bin(apptainer_bin):
    """The folder of the commands that run Apptainer as an ordinary user (user namespaces, no setuid)."""
    folder = os.path.join(os.path.dirname(apptainer_bin), "user-bin")
    if not os.path.exists(os.path.join(folder, "apptainer")):
        pytest.fail(f"{folder}/apptainer is missing; scripts/apptainer.sh writes it beside {apptainer_bin}")
    return folder
