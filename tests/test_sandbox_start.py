"""A prompt's sandbox opens beside its first model request; tools wait for it, nothing else does."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from hermes_batch.testing import TEST_API_KEY as API_KEY

import hermes_batch
from hermes_batch.run.config import RunConfig
from hermes_batch.local_sandbox.backend import LocalSandboxBackend
from hermes_batch.errors import SandboxError
from hermes_batch.contract.plugins import get_plugin_manager
from hermes_batch.run.runner import RunEngine
from hermes_batch.testing import ToolLoopScript
from hermes_batch.testing.fixtures import write_dataset

OPEN_DELAY = 0.6  # seconds each open of the slow backend takes


class SlowOpens:
    """A plugin: the local sandbox, with an open that takes OPEN_DELAY seconds and an event log."""

    def __init__(self, fail: bool = False, early: bool = True):
        self.events: list[tuple[float, str, int]] = []
        plugin = self

        class SlowBackend(LocalSandboxBackend):
            name = "slow-local"
            open_early = early

            async def open(self, spec):
                plugin.events.append((time.monotonic(), "open", spec.prompt_index))
                await asyncio.sleep(OPEN_DELAY)
                if fail:
                    raise SandboxError("The slow engine refused to open a sandbox.")
                sandbox = await super().open(spec)
                plugin.events.append((time.monotonic(), "opened", spec.prompt_index))
                close = sandbox.close

                async def recorded_close():
                    plugin.events.append((time.monotonic(), "close", spec.prompt_index))
                    await close()

                sandbox.close = recorded_close
                return sandbox

        self.backend = SlowBackend

    @hermes_batch.hookimpl
    def register_sandbox_backends(self, register):
        register(self.backend)

    def count(self, event: str) -> int:
        return sum(1 for _t, name, _p in self.events if name == event)


class Arrivals:
    """A script that notes when each request reached the server (same process, same clock)."""

    def __init__(self, script):
        self.script = script
        self.arrivals: list[float] = []

    def __call__(self, request):
        self.arrivals.append(time.monotonic())
        return self.script(request)


def make_run(tmp_path: Path, server, rows, plugin, **options) -> RunEngine:
    config = RunConfig(
        dataset_file=write_dataset(tmp_path / "prompts.jsonl", rows), batch_size=10, run_name="lazy",
        base_url=server.base_url, model="scripted-model", api_key=API_KEY, output_dir=tmp_path / "out",
        distribution="terminal_only", progress=False, sandbox="slow-local", preflight=False, **options,
    )
    run = RunEngine(config, get_plugin_manager(extra_plugins=[plugin]))
    run.prepare()
    return run


def run_api(tmp_path: Path, server, rows, plugin, **options):
    run = make_run(tmp_path, server, rows, plugin, **options)
    started = time.monotonic()
    result = asyncio.run(run.execute())
    return result, time.monotonic() - started


def records(tmp_path, name="trajectories.jsonl"):
    path = tmp_path / "out" / "lazy" / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_first_model_request_does_not_wait_for_the_sandbox(tmp_path, model_server):
    plugin = SlowOpens()
    script = Arrivals(ToolLoopScript(tool_calls=1))
    server = model_server(script)  # the script is called when the request arrives (before any latency)
    result, elapsed = run_api(tmp_path, server, [{"prompt": "p0"}], plugin)
    assert result.exit_code == 0, result.message
    [traj] = records(tmp_path)
    assert traj["completed"] and traj["api_calls"] == 2
    tool_turn = next(t for t in traj["conversations"] if t["from"] == "tool")
    assert '"exit_code": 0' in tool_turn["value"], tool_turn["value"]  # the command ran in the sandbox
    # the first request reached the model while the sandbox was still opening
    [(opening, _, _)] = [e for e in plugin.events if e[1] == "open"]
    [(opened, _, _)] = [e for e in plugin.events if e[1] == "opened"]
    assert opening < script.arrivals[0] < opened, (opening, script.arrivals, opened)
    assert script.arrivals[1] > opened  # the second came after the tool ran in it
    assert plugin.count("open") == plugin.count("opened") == plugin.count("close") == 1


def test_a_prompt_whose_model_calls_no_tool_never_waits_for_its_sandbox(tmp_path, model_server):
    plugin = SlowOpens()
    server = model_server(ToolLoopScript(tool_calls=0), latency=0.05)
    result, _ = run_api(tmp_path, server, [{"prompt": f"p{i}"} for i in range(4)], plugin, num_workers=4)
    assert result.exit_code == 0, result.message
    trajectories = records(tmp_path)
    assert len(trajectories) == 4
    for traj in trajectories:
        assert traj["metadata"]["duration_s"] < OPEN_DELAY - 0.2, traj["metadata"]["duration_s"]
    # each sandbox was still closed, once it was open, before the run ended
    assert plugin.count("open") == plugin.count("opened") == plugin.count("close") == 4


def test_a_backend_that_opens_late_never_opens_a_sandbox_no_tool_needs(tmp_path, model_server):
    plugin = SlowOpens(early=False)
    server = model_server(ToolLoopScript(tool_calls=0))
    result, _ = run_api(tmp_path, server, [{"prompt": f"p{i}"} for i in range(3)], plugin)
    assert result.exit_code == 0, result.message
    assert len(records(tmp_path)) == 3 and plugin.events == []


def test_a_late_backend_opens_at_the_first_tool_call(tmp_path, model_server):
    plugin = SlowOpens(early=False)
    server = model_server(ToolLoopScript(tool_calls=2))
    result, _ = run_api(tmp_path, server, [{"prompt": "p0"}], plugin)
    assert result.exit_code == 0, result.message
    [traj] = records(tmp_path)
    assert traj["completed"] and traj["metadata"]["duration_s"] >= OPEN_DELAY
    assert plugin.count("open") == plugin.count("close") == 1


def test_waiting_for_the_sandbox_is_not_on_the_tool_calls_clock(tmp_path, model_server, monkeypatch):
    # the open takes longer than the tool call may: the call still runs its command once the sandbox is open
    from hermes_batch.session import agent

    monkeypatch.setattr(agent, "TOOL_GRACE_S", 0.05)
    plugin = SlowOpens(early=False)
    server = model_server(ToolLoopScript(tool_calls=1))
    result, _ = run_api(tmp_path, server, [{"prompt": "p0"}], plugin, command_timeout=OPEN_DELAY / 3)
    assert result.exit_code == 0, result.message
    [traj] = records(tmp_path)
    tool_turn = next(t for t in traj["conversations"] if t["from"] == "tool")
    assert '"exit_code": 0' in tool_turn["value"], tool_turn["value"]


def test_a_sandbox_that_cannot_open_fails_the_prompts_that_call_a_tool(tmp_path, model_server):
    plugin = SlowOpens(fail=True)
    server = model_server(ToolLoopScript(tool_calls=1))
    result, _ = run_api(tmp_path, server, [{"prompt": "p0"}, {"prompt": "p1"}], plugin)
    assert result.exit_code == 3, result.message
    failures = records(tmp_path, "failed.jsonl")
    assert len(failures) == 2 and records(tmp_path) == []
    for failure in failures:
        assert failure["error_kind"] == "sandbox" and "refused to open a sandbox" in failure["message"]
        assert failure["api_calls"] == 1  # the first request went out beside the open


def test_a_sandbox_no_tool_needed_that_cannot_open_fails_nothing(tmp_path, model_server):
    plugin = SlowOpens(fail=True)
    server = model_server(ToolLoopScript(tool_calls=0))
    result, _ = run_api(tmp_path, server, [{"prompt": "p0"}], plugin)
    assert result.exit_code == 0, result.message
    [traj] = records(tmp_path)
    assert traj["completed"] and traj["metadata"]["image"] == ""


def test_a_deadline_while_the_sandbox_opens_still_closes_it(tmp_path, model_server):
    plugin = SlowOpens()
    server = model_server(ToolLoopScript(tool_calls=0), latency=5)
    result, elapsed = run_api(tmp_path, server, [{"prompt": "p0"}], plugin, prompt_timeout=0.2)
    assert result.exit_code == 3, result.message
    assert elapsed < 4  # the model call was abandoned at the deadline, not waited for
    assert plugin.count("open") == plugin.count("opened") == plugin.count("close") == 1


def test_ctrl_c_while_sandboxes_open_closes_every_one(tmp_path, model_server):
    plugin = SlowOpens()
    server = model_server(ToolLoopScript(tool_calls=0), latency=30)
    run = make_run(tmp_path, server, [{"prompt": f"p{i}"} for i in range(3)], plugin, num_workers=3)

    async def interrupt_while_opening():
        task = asyncio.create_task(run.execute())  # the CLI cancels its task on SIGINT the same way
        while plugin.count("open") < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        return await task

    result = asyncio.run(interrupt_while_opening())
    assert result.exit_code == 130, result.message
    assert plugin.count("open") == plugin.count("opened") == plugin.count("close") == 3
