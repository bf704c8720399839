"""Fixtures of the toolbox tests: the local website, search stand-ins, a sandbox, started toolsets."""

from __future__ import annotations

import pytest

from hermes_batch_toolbox.testing import LocalWebsite, SearxngStandIn, SecretService


@pytest.fixture(scope="session")
def site():
    with LocalWebsite() as server:
        yield server


@pytest.fixture(scope="session")
def secret():
    """A service on this machine's loopback that no tool may reach (it counts the requests that did)."""
    with SecretService() as server:
        yield server


@pytest.fixture(scope="session")
def searxng(site):
    with SearxngStandIn(site.url) as server:
        yield server


@pytest.fixture
def sandbox(local_sandbox):
    """A local sandbox of the prompt, in the test's tmp_path."""
    return local_sandbox


@pytest.fixture
def toolsets(toolset_harness):
    """Toolsets started as a run starts them (a ToolsetHarness)."""
    return toolset_harness
