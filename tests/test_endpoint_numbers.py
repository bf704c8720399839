"""A number an endpoint sends cannot poison a run: checked at the boundary, never written, and read back safely.

The scripted server sends each number as an endpoint may spell it (``1e999``,
``NaN``, thirty digits), through the real SDKs; old run folders holding such
values (as versions before the checks wrote them) still resume, and ``stats``
reads them, with those values as not reported.
"""

from __future__ import annotations

import json
import math
import re

import aiohttp
import attrs
import pytest

import hermes_batch
from hermes_batch.folder import record_index
from hermes_batch.contract.interfaces import Distribution, Tool, Toolset
from hermes_batch.folder.journal import CallJournal
from hermes_batch.formats.records import CallRecord, Usage
from hermes_batch.folder.runfolder import RunFolder
from hermes_batch.formats.serialization import to_json_line
from hermes_batch.testing import TEST_API_KEY, ImageReply, ToolLoopScript, write_dataset
from hermes_batch.testing.records import make_trajectory

WARNING = "which no call can have"
BASE = ("--distribution", "terminal_only", "--seed", "7")


def _refuse(name):
    raise ValueError(f"{name} written into a run folder")


def strict(text: str):
    """JSON as every other reader takes it: no NaN or Infinity, no integer beyond 64 bits."""
    value = json.loads(text, parse_constant=_refuse)
    _no_big_ints(value)
    return value


def _no_big_ints(value) -> None:
    if isinstance(value, dict):
        for item in value.values():
            _no_big_ints(item)
    elif isinstance(value, list):
        for item in value:
            _no_big_ints(item)
    elif type(value) is int:
        assert -(2**63) <= value < 2**63, value
    elif type(value) is float:
        assert math.isfinite(value)


def assert_folder_is_clean(folder, old_lines=frozenset()) -> None:
    """Every JSON file of the run folder parses strictly (the journal and the indexes too), but ``old_lines``."""
    paths = [p for p in folder.rglob("*") if p.is_file() and p.suffix in (".jsonl", ".json")]
    assert paths
    for path in paths:
        if path.suffix == ".json":
            strict(path.read_text())
            continue
        for line in path.read_text().splitlines():
            if line.strip() and line not in old_lines:
                strict(line)


def with_usage(raw: str, script=None):
    """Every answer of ``script`` (a one-tool-call loop) reports the usage object ``raw``, spelled as it is."""
    script = script or ToolLoopScript(tool_calls=1)
    return lambda request: attrs.evolve(script(request), raw_usage=raw)


OPENAI_USAGE = {
    "infinite cost": ('{"prompt_tokens": 10, "completion_tokens": 5, "cost": 1e999}', {"cost": None, "prompt": 60}),
    "cost NaN": ('{"prompt_tokens": 10, "completion_tokens": 5, "cost": NaN}', {"cost": None, "prompt": 60}),
    "costs whose sum overflows": ('{"prompt_tokens": 10, "completion_tokens": 5, "cost": 1e308}', {"cost": None}),
    "negative cost": ('{"prompt_tokens": 10, "completion_tokens": 5, "cost": -0.5}', {"cost": None}),
    "thirty-digit tokens": ('{"prompt_tokens": 1000000000000000000000000000000, "completion_tokens": 5, "cost": 0.25}',
                            {"cost": 1.5, "prompt": 0, "completion": 30}),
    "tokens of every wrong kind": ('{"prompt_tokens": 1e30, "completion_tokens": -Infinity, "completion_tokens_details":'
                                   ' {"reasoning_tokens": 2.5}, "prompt_tokens_details": {"cached_tokens": -1}}',
                                   {"prompt": 0, "completion": 0, "reasoning": 0, "cached": 0}),
}


@pytest.mark.parametrize("raw, expected", list(OPENAI_USAGE.values()), ids=list(OPENAI_USAGE))
def test_an_endpoints_impossible_usage_is_not_reported_and_never_written(raw, expected, runner, model_server, tmp_path):
    server = model_server(with_usage(raw))
    data = write_dataset(tmp_path / "d.jsonl", [{"prompt": f"task {i}"} for i in range(3)])
    result = runner.invoke(data, *BASE, "--num_workers", "1", server=server)
    assert result.exit_code == 0, result.output
    assert result.output.count(WARNING) == 1  # one warning for the run, not one per call
    assert "internal error" not in result.output
    folder = runner.folder()
    assert_folder_is_clean(folder)
    stats = json.loads((folder / "statistics.json").read_text())
    for name, value in expected.items():
        assert (stats["cost"] if name == "cost" else stats["tokens"][name]) == value, name

    # the folder resumes and its statistics read, whatever the endpoint sent
    write_dataset(data, [{"prompt": f"task {i}"} for i in range(4)])
    result = runner.invoke(data, *BASE, "--resume", server=server)
    assert result.exit_code == 0, result.output
    assert runner.cli("stats", str(folder)).exit_code == 0
    assert_folder_is_clean(folder)


ANTHROPIC_USAGE = [
    '{"input_tokens": 1e999, "output_tokens": NaN, "cache_read_input_tokens": -3}',
    '{"input_tokens": "12", "output_tokens": 1000000000000000000000000000000, "output_tokens_details": {"thinking_tokens": 1e30}}',
    '"not an object"',
]


@pytest.mark.parametrize("raw", ANTHROPIC_USAGE)
def test_the_anthropic_client_checks_usage_at_the_boundary_too(raw, runner, model_server, tmp_path):
    server = model_server(with_usage(raw))
    data = write_dataset(tmp_path / "d.jsonl", [{"prompt": "task 0"}, {"prompt": "task 1"}])
    result = runner.invoke(data, *BASE, "--model_client", "anthropic", "--base_url", server.anthropic_base_url,
                           "--num_workers", "1", server=server)
    assert result.exit_code == 0, result.output
    assert "internal error" not in result.output and result.output.count(WARNING) <= 1
    assert_folder_is_clean(runner.folder())
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert stats["tokens"]["prompt"] == stats["tokens"]["completion"] == stats["tokens"]["reasoning"] == 0
    assert runner.cli("stats", str(runner.folder())).exit_code == 0


def test_a_negative_cost_cannot_weaken_max_cost(runner, model_server, tmp_path):
    # each prompt's first call costs a dollar and its second "refunds" it: the budget counts only what was paid
    def answer(request):
        reply = ToolLoopScript(tool_calls=1)(request)
        cost = "1.0" if request.turn == 0 else "-1.0"
        return attrs.evolve(reply, raw_usage=f'{{"prompt_tokens": 10, "completion_tokens": 5, "cost": {cost}}}')

    server = model_server(answer)
    data = write_dataset(tmp_path / "d.jsonl", [{"prompt": f"task {i}"} for i in range(10)])
    result = runner.invoke(data, *BASE, "--num_workers", "1", "--max_cost", "2.5", server=server)
    assert result.exit_code == 0, result.output
    assert "cost budget --max_cost 2.5 was reached" in result.output
    assert len(runner.records("trajectories.jsonl")) == 3
    assert json.loads((runner.folder() / "statistics.json").read_text())["cost"] == 3.0


# --- tools on endpoints of their own ------------------------------------------------------------------


class PaintTool(Tool):
    """Posts to an images endpoint of its own and reports the usage it answered, as a tool plugin would."""

    name = "paint"
    description = "Paint a picture."
    parameters = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
    url = ""

    async def call(self, arguments, ctx):
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TEST_API_KEY}"}) as http:
            async with http.post(self.url, json={"model": "painter", "prompt": arguments["command"]}) as response:
                usage = (await response.json())["usage"]  # json.loads: 1e999 is Infinity, NaN is NaN
        ctx.report_usage(Usage(prompt_tokens=usage.get("input_tokens", 0), cost=usage.get("cost")))
        return {"painted": True, "error": None}


class PaintPlugin:
    @hermes_batch.hookimpl
    def register_toolsets(self, register):
        register(Toolset("paint", "Painting.", (PaintTool,)))

    @hermes_batch.hookimpl
    def register_distributions(self, register):
        register(Distribution("paint_only", "Painting alone.", (("paint", 1.0),)))


@pytest.mark.parametrize("raw", ['{"input_tokens": 1e30, "cost": 1e999}', '{"input_tokens": -5, "cost": NaN}'])
def test_usage_a_tool_reports_from_its_own_endpoint_is_checked_too(raw, runner, model_server, tmp_path, monkeypatch):
    runner.plugins = (PaintPlugin(),)
    server = model_server(ToolLoopScript(tool_calls=1, tool="paint"), images=lambda _r: ImageReply(raw_usage=raw))
    monkeypatch.setattr(PaintTool, "url", server.base_url + "/images/generations")
    data = write_dataset(tmp_path / "d.jsonl", [{"prompt": "task 0"}, {"prompt": "task 1"}])
    result = runner.invoke(data, "--distribution", "paint_only", "--num_workers", "1", server=server)
    assert result.exit_code == 0, result.output
    assert result.output.count(WARNING) == 1
    folder = runner.folder()
    assert_folder_is_clean(folder)
    tool_lines = [strict(line) for line in (folder / "calls.jsonl").read_text().splitlines()
                  if '"event":"usage"' in line]
    assert len(tool_lines) == 2 and all(line["prompt_tokens"] == 0 and "cost" not in line for line in tool_lines)
    assert runner.cli("stats", str(folder)).exit_code == 0


# --- the writers guard what reaches them ----------------------------------------------------------------


def test_no_record_or_journal_line_is_ever_written_with_nan_or_infinity(tmp_path):
    # a plugin's client or executor may build records past the checks: what is written still parses everywhere
    trajectory = make_trajectory()
    meta = attrs.evolve(
        trajectory.metadata, duration_s=math.inf,
        usage=Usage(prompt_tokens=10**30, completion_tokens=math.nan, cost=math.nan),
        calls=(CallRecord("p", math.nan, 200),),
    )
    line = strict(to_json_line(attrs.evolve(trajectory, metadata=meta)))
    assert line["metadata"]["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "reasoning_tokens": 0,
                                         "cached_tokens": 0, "cost": 0.0, "cost_reported": False}
    assert line["metadata"]["duration_s"] == 0.0 and line["metadata"]["calls"][0]["latency_s"] == 0.0

    journal = CallJournal(tmp_path / "calls.jsonl", 0)
    journal.done(CallRecord("p", math.inf, 200), Usage(prompt_tokens=1, cost=math.inf))
    journal.relay({"event": "done", "session": 1, "status": 200, "cost": math.nan, "latency_s": math.nan})
    journal.close()
    assert journal.cost is None
    assert [strict(line)["event"] for line in (tmp_path / "calls.jsonl").read_text().splitlines()] == [
        "journal", "done", "done"]


# --- run folders written before the checks ---------------------------------------------------------------


def _poison_lines(path, replacements) -> None:
    text = path.read_text()
    for old, new in replacements:
        assert old in text, (path, old)
        text = text.replace(old, new)
    path.write_text(text)


def test_a_run_folder_that_already_holds_such_values_resumes_with_them_unknown(runner, model_server, tmp_path):
    server = model_server(with_usage('{"prompt_tokens": 10, "completion_tokens": 5, "cost": 0.25}'))
    data = write_dataset(tmp_path / "d.jsonl", [{"prompt": f"task {i}"} for i in range(4)])
    assert runner.invoke(data, *BASE, "--num_workers", "1", "--batch_size", "2", server=server).exit_code == 0
    folder = runner.folder()
    # what an older version wrote when the endpoint sent 1e999, NaN, 1e308 and thirty digits
    usage = '"usage":{"prompt_tokens":20,"completion_tokens":10,"reasoning_tokens":0,"cached_tokens":0,"cost":0.5,'
    _poison_lines(folder / "batch_0.jsonl", [
        (usage, usage.replace('"cost":0.5', '"cost":Infinity').replace('"prompt_tokens":20', '"prompt_tokens":NaN')),
        ('"latency_s":', '"latency_s":NaN,"was":'),
    ])
    _poison_lines(folder / "batch_1.jsonl", [
        (usage, usage.replace('"prompt_tokens":20', '"prompt_tokens":1' + "0" * 30).replace('"cost":0.5', '"cost":1e308')),
    ])
    _poison_lines(folder / "calls.jsonl", [
        ('"cost":0.25', '"cost":NaN'), ('"prompt_tokens":10', '"prompt_tokens":1e999'),
        ('"latency_s":', '"latency_s":Infinity,"was":'),
    ])
    checkpoint = folder / "checkpoint.json"
    checkpoint.write_text(re.sub(r'"cost":[0-9.]+', '"cost":Infinity', checkpoint.read_text()))
    # batch_1's index as an older version saved it: the sums of two records of 10**30 tokens and 1e308 dollars
    old = record_index.FileIndex(folder / "batch_1.jsonl", "kept")
    old.catch_up()
    old.seal()
    old.aggregate.prompt_tokens = 2 * 10**30
    old.aggregate.cost.add(1e308)
    old.aggregate.cost.add(1e308)
    run_index = record_index.RecordIndex(RunFolder(folder.parent, folder.name))
    run_index.save(old)
    # ... and the journal's totals as an older version saved them from those lines
    run_index.journal_totals()
    saved = folder / "index" / "calls.json"
    state = json.loads(saved.read_text())
    state["totals"]["usage"] = [10**30, 40, 0, 0, math.nan]
    state["totals"]["cost_by_session"] = [[0, math.inf]]
    saved.write_text(json.dumps(state))

    result = runner.cli("stats", str(folder))
    assert result.exit_code == 0, result.output

    write_dataset(data, [{"prompt": f"task {i}"} for i in range(5)])
    old_lines = {line for name in ("batch_0.jsonl", "batch_1.jsonl", "calls.jsonl") for line in (folder / name).read_text().splitlines()}
    paid = server.request_count
    result = runner.invoke(data, *BASE, "--num_workers", "1", "--batch_size", "2", "--resume", server=server)
    assert result.exit_code == 0, result.output
    assert "internal error" not in result.output
    assert server.request_count - paid == 3  # the preflight and the new row's two calls: nothing paid twice
    assert_folder_is_clean(folder, old_lines)  # the old lines stay as they were; nothing written since holds such values
    stats = json.loads((folder / "statistics.json").read_text())
    assert stats["prompts"]["finished"] == 5
    # the old calls' poisoned values are unknown, the new row's count
    assert stats["cost"] == 0.5 and stats["tokens"]["prompt"] == 20
    assert all(s["cost"] is None for s in stats["duration"]["sessions"][:1])
    result = runner.cli("stats", str(folder))
    assert result.exit_code == 0 and "internal error" not in result.output
