"""-T/--tool_option, toolset runtimes and per-prompt toolset sessions, with a throwaway toolset plugin."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Optional

import attrs
import pytest

import hermes_batch
from hermes_batch.run.config import RunConfig
from hermes_batch.default_plugins.openai_client import OpenAIClient
from hermes_batch.errors import ConfigError, UsageError
from hermes_batch.contract.interfaces import Distribution, ModelSettings, Tool, Toolset, ToolsetRuntime, ToolsetSession
from hermes_batch.contract.plugins import get_plugin_manager
from hermes_batch.formats.records import Usage
from hermes_batch.run.runner import RunEngine
from hermes_batch.testing import Reply, RoutedScript, ToolLoopScript
from hermes_batch.contract.toolsets import parse_tool_options

from hermes_batch.testing import TEST_API_KEY as API_KEY, write_dataset

SECRET = "sk-notes-secret-value-7c1e"


@attrs.frozen
class NotesConfig:
    label: str = "notes"
    api_key_env: Optional[str] = None
    delay: float = 0.0


class NotesSession(ToolsetSession):
    def __init__(self, runtime):
        super().__init__(runtime)
        runtime.events.append("open")

    async def close(self):
        self.runtime.events.append("close")


class NotesRuntime(ToolsetRuntime):
    Session = NotesSession

    def __init__(self, config, model):
        super().__init__(config, model)
        self.events = []
        self.key = None

    def unavailable_reason(self):
        import os

        if self.config.api_key_env and not os.environ.get(self.config.api_key_env):
            return f"set {self.config.api_key_env}."
        return None

    async def start(self, run, client):
        import os

        await super().start(run, client)
        self.key = os.environ.get(self.config.api_key_env or "", "")
        self.events.append("start")

    async def shutdown(self):
        self.events.append("shutdown")


class NoteTool(Tool):
    name = "note"
    description = "Write a note."
    parameters = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}

    async def call(self, arguments, ctx):
        session = ctx.session("notes")
        if session.config.delay:
            await asyncio.sleep(session.config.delay)
        ctx.report_usage(Usage(prompt_tokens=1000, completion_tokens=100, cost=0.5))
        return {"note": f"{session.config.label}: {arguments['command']}", "key_length": len(session.runtime.key), "error": None}


class NotesPlugin:
    def __init__(self):
        self.runtimes = []
        plugin = self

        class Recorded(NotesRuntime):
            def __init__(self, config, model):
                super().__init__(config, model)
                plugin.runtimes.append(self)

        self.toolset = Toolset("notes", "Notes.", (NoteTool,), NotesConfig, Recorded)

    @hermes_batch.hookimpl
    def register_toolsets(self, register):
        register(self.toolset)

    @hermes_batch.hookimpl
    def register_distributions(self, register):
        register(Distribution("notes_and_terminal", "Notes and a terminal.", (("notes", 1.0), ("terminal", 1.0))))
        register(Distribution("notes_only", "Notes alone.", (("notes", 1.0),)))


def run_api(tmp_path: Path, server, rows, plugin, *, distribution="notes_and_terminal", **options):
    config = RunConfig(
        dataset_file=write_dataset(tmp_path / "prompts.jsonl", rows), batch_size=10, run_name="notes",
        base_url=server.base_url, model="scripted-model", api_key=API_KEY, output_dir=tmp_path / "out",
        distribution=distribution, progress=False, **options,
    )
    run = RunEngine(config, get_plugin_manager(extra_plugins=[plugin]))
    run.prepare()
    return run, asyncio.run(run.execute())


def records(tmp_path, name="trajectories.jsonl"):
    path = tmp_path / "out" / "notes" / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_options_are_parsed_per_toolset_with_json_values():
    assert parse_tool_options(["web.provider=searxng", "web.max_results=3", "moa.models=[\"a\",\"b\"]", "web.allow_private=true"]) == {
        "web": {"provider": "searxng", "max_results": 3, "allow_private": True}, "moa": {"models": ["a", "b"]},
    }
    with pytest.raises(ConfigError, match="expects TOOLSET.KEY=VALUE"):
        parse_tool_options(["provider=searxng"])


@pytest.mark.parametrize("key", ["api_key", "token", "key", "vision.secret", "password"])
def test_secrets_are_refused_on_the_command_line_without_echoing_them(key):
    item = f"{key if '.' in key else 'web.' + key}={SECRET}"
    with pytest.raises(ConfigError) as info:
        parse_tool_options([item])
    assert SECRET not in str(info.value) and "_env=VARIABLE" in str(info.value)


def test_options_reach_the_toolset_and_its_sessions_close_with_each_prompt(tmp_path, model_server, monkeypatch):
    monkeypatch.setenv("HB_NOTES_KEY", SECRET)
    plugin = NotesPlugin()
    server = model_server(ToolLoopScript(tool_calls=1, tool="note", command="hello"))
    run, result = run_api(tmp_path, server, [{"prompt": f"p{i}"} for i in range(3)], plugin,
                          tool_options={"notes": {"label": "Journal", "api_key_env": "HB_NOTES_KEY"}})
    assert result.exit_code == 0, result.message
    [runtime] = plugin.runtimes
    assert runtime.config == NotesConfig(label="Journal", api_key_env="HB_NOTES_KEY")
    assert runtime.events[0] == "start" and runtime.events[-1] == "shutdown"
    assert runtime.events.count("open") == runtime.events.count("close") == 3
    trajectories = records(tmp_path)
    for traj in trajectories:
        result_turn = next(t for t in traj["conversations"] if t["from"] == "tool")
        assert "Journal: hello" in result_turn["value"] and f'"key_length": {len(SECRET)}' in result_turn["value"]
        # the tool's own model call counts in the prompt's usage
        assert traj["metadata"]["usage"]["cost"] >= 0.5 and traj["metadata"]["usage"]["prompt_tokens"] >= 1000
    # ... and in the run's totals, which come from the call journal
    stats = json.loads((tmp_path / "out" / "notes" / "statistics.json").read_text())
    assert stats["cost"] == pytest.approx(sum(t["metadata"]["usage"]["cost"] for t in trajectories))
    assert stats["cost"] >= 3 * 0.5 and stats["tokens"]["prompt"] >= 3 * 1000
    run_json = json.loads((tmp_path / "out" / "notes" / "run.json").read_text())
    assert run_json["config"]["tool_options"] == {"notes": {"label": "Journal", "api_key_env": "HB_NOTES_KEY"}}
    assert run_json["toolsets"]["notes"] == {"options": {"label": "Journal", "api_key_env": "HB_NOTES_KEY", "delay": 0.0},
                                             "left_out": None}
    for path in (tmp_path / "out" / "notes").rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace"), path


def test_an_unconfigured_toolset_is_reported_once_and_left_out(tmp_path, model_server, monkeypatch, caplog):
    monkeypatch.delenv("HB_NOTES_KEY", raising=False)
    server = model_server(ToolLoopScript(tool_calls=1))
    run, result = run_api(tmp_path, server, [{"prompt": f"p{i}"} for i in range(4)], NotesPlugin(),
                          tool_options={"notes": {"api_key_env": "HB_NOTES_KEY"}})
    assert result.exit_code == 0
    assert [r.getMessage() for r in caplog.records if "left out" in r.getMessage()] == [
        "Toolset notes is left out of sampling: set HB_NOTES_KEY."
    ]
    assert {tuple(t["toolsets_used"]) for t in records(tmp_path)} == {("terminal",)}
    # its tools are still listed (with zeros), as every installed toolset's: one schema for every run
    assert records(tmp_path)[0]["tool_stats"]["note"] == {"count": 0, "success": 0, "failure": 0}
    assert json.loads((tmp_path / "out" / "notes" / "run.json").read_text())["toolsets"]["notes"]["left_out"] == "set HB_NOTES_KEY."


def test_nothing_left_to_sample_is_a_usage_error(tmp_path, model_server, monkeypatch):
    monkeypatch.delenv("HB_NOTES_KEY", raising=False)
    server = model_server(ToolLoopScript(tool_calls=1))
    with pytest.raises(UsageError, match="No toolset of distribution 'notes_only' can run. notes: set HB_NOTES_KEY."):
        run_api(tmp_path, server, [{"prompt": "p"}], NotesPlugin(), distribution="notes_only",
                tool_options={"notes": {"api_key_env": "HB_NOTES_KEY"}})
    assert server.request_count == 0


def test_bad_options_stop_the_run_before_anything_is_sent(tmp_path, model_server):
    server = model_server(ToolLoopScript(tool_calls=1))
    with pytest.raises(ConfigError) as info:
        run_api(tmp_path, server, [{"prompt": "p"}], NotesPlugin(), tool_options={"notes": {"lable": "x"}})
    assert str(info.value).startswith("The notes toolset (-T) has no option 'lable' (it takes ")
    assert str(info.value).endswith("; did you mean -T notes.label=...?")
    with pytest.raises(ConfigError, match="delay"):
        run_api(tmp_path, server, [{"prompt": "p"}], NotesPlugin(), tool_options={"notes": {"delay": "soon"}})
    with pytest.raises(UsageError, match="-T names the toolset 'nots', which is not installed"):
        run_api(tmp_path, server, [{"prompt": "p"}], NotesPlugin(), tool_options={"nots": {"label": "x"}})
    assert server.request_count == 0


def test_a_session_is_closed_when_the_prompt_deadline_cuts_a_tool_call(tmp_path, model_server):
    plugin = NotesPlugin()
    server = model_server(ToolLoopScript(tool_calls=1, tool="note", command="slow"))
    started = time.monotonic()
    run, result = run_api(tmp_path, server, [{"prompt": "p"}], plugin, prompt_timeout=1.0,
                          tool_options={"notes": {"delay": 60}})
    assert time.monotonic() - started < 30
    [traj] = records(tmp_path)
    assert traj["partial"] is True and traj["metadata"]["end_reason"] == "timeout"
    assert plugin.runtimes[0].events == ["start", "open", "close", "shutdown"]


def test_the_cli_takes_tool_options(runner, model_server, tmp_path):
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "p"}])
    result = runner.invoke(dataset, "-T", "nosuch.size=1", server=model_server(ToolLoopScript(tool_calls=0)))
    assert result.exit_code == 2 and "-T names the toolset 'nosuch', which is not installed" in result.output
    result = runner.invoke(dataset, "--tool-option", "web.api_key=" + SECRET, server=model_server(ToolLoopScript(tool_calls=0)))
    assert result.exit_code == 2 and SECRET not in result.output and "-T web.api_key_env=VARIABLE" in result.output


async def test_for_model_shares_the_limiter_and_the_endpoint(model_server):
    server = model_server(RoutedScript({}, default=lambda r: Reply(content=r.model, usage=Usage(cost=0.25)), by="model"))
    client = OpenAIClient(ModelSettings(model="main", base_url=server.base_url, api_key=API_KEY))
    other = client.for_model("other")
    from hermes_batch.formats.records import Message

    answer = await other.complete((Message("user", "hi"),), ())
    assert answer.message.content == "other" and other.limiter is client.limiter and client.limiter.cost == 0.25
    await other.aclose()
    await client.aclose()
