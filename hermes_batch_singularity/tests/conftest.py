"""Fixtures of the singularity sandbox tests: a real Apptainer, images from local sources, no instance left.

Apptainer runs in a Docker container set up by ``scripts/apptainer.sh`` (sourced by
``scripts/test.sh``, which exports ``HERMES_APPTAINER_BIN``); its ``apptainer`` and
``singularity`` commands forward into that container and are put first on PATH for
these tests only.  Without them the tests skip, except in CI (``CI=true``), where they fail.
"""

from __future__ import annotations

import itertools
import os
import subprocess

import pytest

from singularity_rig import (
    IMAGE_A,
    IMAGE_B,
    SESSION,
    Images,
    docker_images_ready,
    instances_of,
    ours,
    setup_apptainer,
    singularity_runner,
    stop_instance,
)


_counter = itertools.count()


@pytest.fixture(scope="session")
def apptainer_bin():
    """The folder holding the ``apptainer`` and ``singularity`` commands; skips (fails in CI) without them."""
    folder, problem = setup_apptainer()
    if problem:
        message = f"no Apptainer for the tests ({problem}); scripts/test.sh sets one up in a Docker container"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    yield folder
    left = [found for found in ours(folder) if found.run_part.startswith(f"hbs-{SESSION}-")]
    for found in left:
        stop_instance(folder, found.name)
    assert not left, f"{len(left)} instance(s) of this test session were left running: {[f.name for f in left]}"


@pytest.fixture(autouse=True)
def _apptainer_on_path(request, monkeypatch):
    """The forwarding commands first on PATH, for the tests (and the runs they spawn) that use Apptainer."""
    if "apptainer_bin" in request.fixturenames:
        folder = request.getfixturevalue("apptainer_bin")
        monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture
def run_name(apptainer_bin):
    """A run name of this test alone; after the test, no instance of that run may be running."""
    name = f"hbs-{SESSION}-{next(_counter)}"
    yield name
    left = instances_of(apptainer_bin, name)
    for instance in left:
        stop_instance(apptainer_bin, instance)
    assert not left, f"{len(left)} instance(s) of run {name} were left running: {left}"


@pytest.fixture(scope="session")
def images(apptainer_bin, tmp_path_factory) -> Images:
    """docker-archive:// files of the busybox test images, a SIF and a sandbox folder made from them (under /tmp)."""
    problem = docker_images_ready()
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
    return Images(archives["a"], archives["b"], str(sif_a), str(folder_b))


@pytest.fixture
def runner(tmp_path, run_name):
    return singularity_runner(tmp_path, run_name)


@pytest.fixture(scope="session")
def user_apptainer_bin(apptainer_bin):
    """The folder of the commands that run Apptainer as an ordinary user (user namespaces, no setuid)."""
    folder = os.path.join(os.path.dirname(apptainer_bin), "user-bin")
    if not os.path.exists(os.path.join(folder, "apptainer")):
        pytest.fail(f"{folder}/apptainer is missing; scripts/apptainer.sh writes it beside {apptainer_bin}")
    return folder
