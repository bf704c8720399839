"""Fixtures of the toolbox tests: the local website, search stand-ins, a sandbox, started toolsets.

Not a conftest.py: the core's tests import their own ``conftest`` by name, and
a second module of that name on sys.path would shadow it.  Test modules import
the fixtures they use from here.
"""

from __future__ import annotations

import pytest

from hermes_batch.default_plugins.local_sandbox import LocalSandboxBackend, LocalSandboxConfig
from hermes_batch.interfaces import ModelSettings, ToolContext
from hermes_batch.plugins import collect, get_plugin_manager
from hermes_batch.records import SandboxSpec, Usage
from hermes_batch.run_context import RunContext
from hermes_batch.testing.fixtures import TEST_API_KEY, model_server, write_dataset  # noqa: F401
from hermes_batch.toolsets import PromptToolsets, build_runtimes
from hermes_batch_toolbox.testing import LocalWebsite, SearxngStandIn


@pytest.fixture(scope="session")
def site():
    with LocalWebsite() as server:
        yield server


@pytest.fixture(scope="session")
def searxng(site):
    with SearxngStandIn(site.url) as server:
        yield server


@pytest.fixture
async def sandbox(tmp_path):
    backend = LocalSandboxBackend(LocalSandboxConfig(), RunContext("toolbox-test", tmp_path / "run", seed=0))
    await backend.start()
    box = await backend.open(SandboxSpec("toolbox-test", 0, "0123456789abcdef"))
    yield box
    await box.close()
    await backend.shutdown()


class Toolsets:
    """Toolset runtimes started as a run starts them, and prompts' contexts over them."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.runtimes = []
        self.usage = Usage()

    async def start(self, name: str, options: dict, *, settings: ModelSettings | None = None, client=None):
        settings = settings or ModelSettings(model="scripted-model", base_url="http://127.0.0.1:9/v1", api_key=TEST_API_KEY)
        runtime = build_runtimes(collect(get_plugin_manager()), [name], {name: options}, settings)[name]
        reason = runtime.unavailable_reason()
        assert reason is None, reason
        await runtime.start(RunContext("toolbox-test", self.tmp_path / "run", seed=0), client)
        self.runtimes.append(runtime)
        return runtime

    def context(self, sandbox, **runtimes) -> ToolContext:
        def count(usage, journaled=False):
            self.usage = self.usage + usage

        return ToolContext(sandbox, command_timeout=30, toolsets=PromptToolsets(runtimes, count))

    async def close(self):
        for runtime in self.runtimes:
            await runtime.shutdown()


@pytest.fixture
async def toolsets(tmp_path):
    started = Toolsets(tmp_path)
    yield started
    await started.close()
