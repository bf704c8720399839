"""Testing a toolset's tools as a run uses them: options structured, runtime started, a context per prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from hermes_batch import ModelClient, ModelSettings, RunContext, ToolContext, ToolsetRuntime, Usage
from hermes_batch.contract.toolsets import PromptToolsets, build_runtimes

from .runner import TEST_API_KEY
from .scope import plugin_manager as scoped_plugin_manager


class ToolsetHarness:
    """Toolset runtimes built and started as a run starts them, and tool contexts of prompts over them.

    ``usage`` sums what the tools reported through ``ToolContext.report_usage``.
    Call ``close`` (the ``toolset_harness`` fixture does) to shut the runtimes down.
    """

    def __init__(self, run_dir: Path, plugin_manager=None):
        self.run_dir = Path(run_dir)
        # the core's toolsets and the plugin under test's (hermes_batch.testing.scope), unless given another manager
        self.registry = (plugin_manager or scoped_plugin_manager()).registry()
        self.runtimes: list[ToolsetRuntime] = []
        self.usage = Usage()

    @staticmethod
    def settings(**changes: Any) -> ModelSettings:
        """The run's model settings as tools see them; by default an endpoint nothing listens on."""
        return ModelSettings(**{"model": "scripted-model", "base_url": "http://127.0.0.1:9/v1", "api_key": TEST_API_KEY, **changes})

    def build(self, name: str, options: Optional[Mapping[str, Any]] = None, *, settings: Optional[ModelSettings] = None):
        """The toolset's runtime with ``options`` (the ``-T name.key=value`` of a run), not started.

        Raises the errors a run reports before it starts: UsageError for a toolset
        that is not installed, ConfigError for options its Config refuses.
        """
        return build_runtimes(self.registry, [name], {name: dict(options or {})}, settings or self.settings())[name]

    async def start(
        self, name: str, options: Optional[Mapping[str, Any]] = None, *,
        settings: Optional[ModelSettings] = None, client: Optional[ModelClient] = None,
    ) -> ToolsetRuntime:
        """Build and start the toolset's runtime; it must be available (its ``unavailable_reason`` None)."""
        runtime = self.build(name, options, settings=settings)
        reason = runtime.unavailable_reason()
        assert reason is None, reason
        await runtime.start(RunContext("toolset-test", self.run_dir, seed=0), client)
        self.runtimes.append(runtime)
        return runtime

    def context(self, sandbox, *, command_timeout: float = 30, **runtimes: ToolsetRuntime) -> ToolContext:
        """The ToolContext of a new prompt offered the toolsets ``runtimes`` (toolset name -> runtime)."""

        def count(usage: Usage, journaled: bool = False) -> None:
            self.usage = self.usage + usage

        return ToolContext(sandbox, command_timeout=command_timeout, toolsets=PromptToolsets(runtimes, count))

    def model_client(self, settings: ModelSettings, name: str = "openai") -> ModelClient:
        """A model client of the installed plugins, as a run would pick it with --model_client NAME."""
        return self.registry.get("model_clients", name)(settings)

    async def close(self) -> None:
        for runtime in self.runtimes:
            await runtime.shutdown()
        self.runtimes = []
