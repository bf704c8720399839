"""Meta-tests of the plugin contract: every hook is documented, typed, and exercised by a throwaway plugin."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import click
import pytest

import hermes_batch
from hermes_batch import Distribution, Filter, Toolset, Writer
from hermes_batch.contract import hookspecs
from hermes_batch.testing import Reply, write_dataset

DOCS = Path(__file__).resolve().parents[1] / "docs"
HOOKS = sorted(name for name, f in vars(hookspecs).items() if hasattr(f, "hermes_batch_spec"))


def test_there_are_hooks():
    assert "register_sandbox_backends" in HOOKS and "run_finished" in HOOKS


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented_in_the_plugin_guide(hook):
    guide = (DOCS / "plugins.md").read_text()
    signature = ", ".join(inspect.signature(getattr(hookspecs, hook)).parameters)
    assert f"`{hook}({signature})`" in guide


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hookspec_is_typed_and_says_when_it_is_called(hook):
    spec = getattr(hookspecs, hook)
    assert all(p.annotation is not inspect.Parameter.empty for p in inspect.signature(spec).parameters.values())
    assert inspect.signature(spec).return_annotation == "None"
    assert "Called" in spec.__doc__


def test_a_throwaway_plugin_exercises_every_hook(tmp_path, runner, model_server):
    registry = hermes_batch.get_plugin_manager(load_entry_points=False).registry()
    calls: dict[str, list] = {hook: [] for hook in HOOKS}

    @hermes_batch.tool
    async def shout(text: str) -> str:
        """Upper-case the text."""
        calls["register_toolsets"].append("called")
        return text.upper()

    class Client(registry.get("model_clients", "openai")):
        name = "throwaway-client"

        async def send(self, messages, tools):
            calls["register_model_clients"].append("sent")
            return await super().send(messages, tools)

    class Backend(registry.get("sandboxes", "local")):
        name = "throwaway-sandbox"

        async def open(self, spec):
            calls["register_sandbox_backends"].append(spec.prompt_index)
            return await super().open(spec)

    class KeepAll(Filter):
        name = "throwaway-filter"

        def check(self, trajectory):
            calls["register_filters"].append(trajectory.prompt_index)
            return None

    class CountingWriter(Writer):
        name = "throwaway-writer"

        def write(self, run_dir, trajectories):
            count = sum(1 for _ in trajectories)
            calls["register_writers"].append(count)
            (Path(run_dir) / "count.txt").write_text(str(count))
            return "count.txt"

    class Rewards(hermes_batch.Verifier):
        name = "throwaway-verifier"

        async def verify(self, ctx):
            calls["register_verifiers"].append(ctx.row.prompt_index)
            return hermes_batch.Verdict(1.0, "fine")

    class Executor(registry.get("executors", "local")):
        name = "throwaway-executor"

        async def run(self, jobs, processor, on_outcome, concurrency):
            calls["register_executors"].append(concurrency)
            await super().run(jobs, processor, on_outcome, concurrency)

    @click.command("throwaway")
    def command():
        calls["register_commands"].append("ran")

    class Throwaway:
        @hermes_batch.hookimpl
        def register_model_clients(self, register):
            register(Client)

        @hermes_batch.hookimpl
        def register_sandbox_backends(self, register):
            register(Backend)

        @hermes_batch.hookimpl
        def register_toolsets(self, register):
            register(Toolset("shouting", "Upper-case text.", (shout,)))

        @hermes_batch.hookimpl
        def register_distributions(self, register):
            calls["register_distributions"].append("registered")
            register(Distribution("throwaway-distribution", "Shouting only.", (("shouting", 1.0),)))

        @hermes_batch.hookimpl
        def register_filters(self, register):
            register(KeepAll)

        @hermes_batch.hookimpl
        def register_writers(self, register):
            register(CountingWriter)

        @hermes_batch.hookimpl
        def register_verifiers(self, register):
            register(Rewards)

        @hermes_batch.hookimpl
        def register_executors(self, register):
            register(Executor)

        @hermes_batch.hookimpl
        def register_commands(self, register):
            register(command)

        @hermes_batch.hookimpl
        def run_started(self, run):
            calls["run_started"].append(run.run_name)

        @hermes_batch.hookimpl
        def prompt_finished(self, run, outcome):
            calls["prompt_finished"].append(outcome.prompt_index)

        @hermes_batch.hookimpl
        def run_finished(self, run, statistics):
            calls["run_finished"].append(statistics["prompts"]["kept"])

    runner.plugins = (Throwaway(),)
    server = model_server(lambda r: Reply(tool_calls=[("shout", {"text": "hi"})]) if r.turn < 1 else Reply("Done."))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"task {i}"} for i in range(3)])
    result = runner.invoke(
        dataset, "--model_client", "throwaway-client", "--sandbox", "throwaway-sandbox", "--distribution",
        "throwaway-distribution", "--filter", "throwaway-filter", "--writer", "throwaway-writer", "--executor",
        "throwaway-executor", "--num_workers", "2", "--verifier", "throwaway-verifier", server=server,
    )
    assert result.exit_code == 0, result.output
    assert runner.cli("throwaway").exit_code == 0

    assert sorted(calls["register_sandbox_backends"]) == [0, 1, 2]
    assert sorted(calls["register_filters"]) == sorted(calls["prompt_finished"]) == [0, 1, 2]
    assert calls["register_writers"] == [3] and (runner.folder() / "count.txt").read_text() == "3"
    assert calls["register_executors"] == [2] and calls["run_started"] == ["run"] and calls["run_finished"] == [3]
    assert len(calls["register_toolsets"]) == 3 and len(calls["register_model_clients"]) >= 6
    assert calls["register_commands"] == ["ran"] and sorted(calls["register_verifiers"]) == [0, 1, 2]
    assert [hook for hook, seen in calls.items() if not seen] == []
    assert json.loads((runner.folder() / "run.json").read_text())["model_client"] == "throwaway-client"
