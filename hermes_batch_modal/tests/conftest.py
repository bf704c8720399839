"""Fixtures of the modal backend tests: the real ``modal`` SDK against a local Modal STAND-IN.

The stand-in (``standin/``) runs each sandbox as a container of the local Docker
engine, from the busybox test images that ``scripts/docker.sh`` builds.  Without
an engine the tests skip, except in CI (``CI=true``), where they fail.
"""

from __future__ import annotations

import itertools
import os

import pytest

from modal_rig import SESSION, engine_problem, modal_runner
from standin import ModalStandIn


_counter = itertools.count()


@pytest.fixture(scope="session")
def docker_engine():
    problem = engine_problem()
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
    return modal_runner(tmp_path, run_name)
