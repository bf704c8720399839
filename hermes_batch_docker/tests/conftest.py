"""Fixtures of the docker sandbox tests: a real engine, locally built images, no container left behind.

The engine and the images come from ``scripts/docker.sh`` (run by ``scripts/test.sh``).
Without an engine the tests skip, except in CI (``CI=true``), where they fail.
"""

from __future__ import annotations

import itertools
import os

import pytest

from hermes_batch.testing import Runner
from hermes_batch_docker.engine import LABEL_RUN

from docker_rig import IMAGE_A, IMAGE_PYTHON, SESSION, containers_of, engine_problem, make_backend, python_image_problem


_counter = itertools.count()


@pytest.fixture(scope="session")
def docker_api():
    """A client of the real engine; skips (fails in CI) when there is none."""
    problem, client = engine_problem()
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


@pytest.fixture(scope="session")
def python_image(docker_api):
    """The name of the test image with python3 and pytest; skips (fails in CI) when it cannot be built."""
    problem = python_image_problem(docker_api)
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(problem)
        pytest.skip(problem)
    return IMAGE_PYTHON


@pytest.fixture
def run_name(docker_api):
    """A run name of this test alone; after the test, no container of that run may remain."""
    name = f"hbtest-{SESSION}-{next(_counter)}"
    yield name
    left = containers_of(docker_api, name)
    for container in left:
        docker_api.remove_container(container["Id"], force=True)
    assert not left, f"{len(left)} container(s) of run {name} were left behind: {[c['Names'] for c in left]}"


@pytest.fixture
def runner(tmp_path, run_name):
    """Runs ``hermes-batch run --sandbox docker`` (terminal toolset only) against a scripted model server."""
    return Runner(tmp_path, run_name=run_name, options=(
        "--distribution", "terminal_only", "--sandbox", "docker", "-S", f"image={IMAGE_A}",
    ))


@pytest.fixture
async def backend(tmp_path, run_name, docker_api):
    """A started backend with the defaults of ``make_backend``; shut down after the test."""
    backend = make_backend(tmp_path, run_name)
    await backend.start()
    yield backend
    await backend.shutdown()
