"""The provider guard: a provider significantly worse than the rest is excluded through OpenRouter's routing
fields, a slightly worse one is not, the exclusion survives a resume, and --routing says where the fields go."""

from __future__ import annotations

import json
import random

import pytest

from hermes_batch.contract.interfaces import ModelSettings
from hermes_batch.default_plugins.openai_client import OpenAIClient
from hermes_batch.formats.records import Message, ModelResponse, ToolCall, ToolSpec
from hermes_batch.model.provider_guard import ProviderGuard, exclusions_from_state, one_sided_p, provider_name
from hermes_batch.testing import ScriptedProvider, ToolLoopScript, write_dataset

TOOLS = (ToolSpec("terminal", "run a command", {"type": "object"}),)


def _answer(provider: str, fails: bool) -> ModelResponse:
    call = ToolCall("c1", "terminal", None if fails else {"command": "ls"}, "{" if fails else '{"command": "ls"}')
    return ModelResponse(message=Message("assistant", "", tool_calls=(call,)), finish_reason="tool_calls",
                         provider=provider)


def _feed(guard: ProviderGuard, rates: dict, calls: int, seed: int = 1) -> None:
    rng = random.Random(seed)
    names = list(rates)
    for _ in range(calls):
        name = rng.choice([n for n in names if n not in guard.excluded])
        guard.answered(_answer(name, rng.random() < rates[name]), TOOLS, 0.5)


def test_a_much_worse_provider_is_excluded_and_a_slightly_worse_one_is_not():
    excluded = []
    guard = ProviderGuard(on_exclude=excluded.append)
    _feed(guard, {"good": 0.03, "slight": 0.06, "bad": 0.5}, 6000)
    assert guard.excluded == ("bad",) and [e.provider for e in excluded] == ["bad"]
    exclusion = excluded[0]
    assert exclusion.answered < 120  # found at one of its first looks
    assert exclusion.failure_rate > 0.3 and exclusion.rest_failure_rate < 0.1
    assert exclusion.p_value < exclusion.threshold
    stats = guard.statistics()
    assert stats["by_provider"]["slight"]["answered"] > 2000
    assert stats["by_provider"]["bad"]["invalid_tool_calls"] == stats["by_provider"]["bad"]["failed"]


def test_no_exclusion_among_equal_providers_over_many_seeds():
    for seed in range(8):
        guard = ProviderGuard()
        _feed(guard, {"a": 0.1, "b": 0.1, "c": 0.1}, 2000, seed)
        assert guard.excluded == (), seed


def test_the_test_needs_its_minimum_of_calls_on_both_sides():
    guard = ProviderGuard()
    _feed(guard, {"bad": 1.0}, 500)  # nobody to compare with
    assert guard.excluded == ()
    assert one_sided_p(40, 50, 1, 500) < 1e-9 and one_sided_p(4, 50, 2, 50) > 0.5


def test_empty_and_cut_answers_and_unoffered_tools_are_failures():
    guard = ProviderGuard()
    empty = ModelResponse(message=Message("assistant", "  "), finish_reason="stop", provider="p")
    cut = ModelResponse(message=Message("assistant", "half an ans"), finish_reason="length", provider="p")
    other = ModelResponse(message=Message("assistant", "", tool_calls=(ToolCall("c", "rm_rf", {}, "{}"),)),
                          finish_reason="tool_calls", provider="p")
    for response in (empty, cut, other, _answer("p", False)):
        guard.answered(response, TOOLS)
    figures = guard.statistics()["by_provider"]["p"]
    assert (figures["empty_answers"], figures["cut_answers"], figures["invalid_tool_calls"]) == (1, 1, 1)
    assert figures["failed"] == 3 and figures["answered"] == 4


def test_a_provider_name_is_a_short_line_of_text():
    assert provider_name(" Together ") == "Together"
    for hostile in (None, 3, "", "x" * 101, "a\nb", "a\x1bb", ["a"]):
        assert provider_name(hostile) is None, hostile


def test_provider_guard_json_read_back_is_checked():
    good = {"excluded": [{"provider": "bad", "answered": 50, "failure_rate": 0.6, "rest_failure_rate": 0.03,
                          "p_value": 1e-12, "threshold": 1e-4}]}
    assert [e.provider for e in exclusions_from_state(good)] == ["bad"]
    for hostile in ([], {"excluded": "bad"}, {"excluded": [{"provider": "a\nb"}]},
                    {"excluded": [dict(good["excluded"][0], answered=float("nan"))]},
                    {"excluded": [dict(good["excluded"][0], p_value="0")]},
                    {"excluded": [good["excluded"][0]] * 101}):
        with pytest.raises(ValueError):
            exclusions_from_state(hostile)


def test_routing_fields_go_where_routing_says():
    settings = dict(providers_ignored=("c",))
    local = "http://127.0.0.1:9/v1"
    assert "provider" not in OpenAIClient._routing_body(ModelSettings("m", local, **settings))
    assert OpenAIClient._routing_body(ModelSettings("m", local, routing="openrouter", **settings))["provider"] == {
        "ignore": ["c"]}
    assert "provider" not in OpenAIClient._routing_body(
        ModelSettings("m", "https://openrouter.ai/api/v1", routing="none", **settings))
    # the guard's exclusions join the user's own ignore list
    client = OpenAIClient(ModelSettings("m", local, routing="openrouter", **settings))
    client.guard = ProviderGuard()
    client.guard.excluded, client.guard.version = ("bad",), 1
    body = json.loads(client._request((Message("user", "hi"),), ()))
    assert body["provider"] == {"ignore": ["c", "bad"]}


PROVIDERS = (
    ScriptedProvider("good", invalid_tool_calls=0.02),
    ScriptedProvider("slight", invalid_tool_calls=0.06),
    ScriptedProvider("bad", weight=2.0, invalid_tool_calls=0.7),
)


def _run_with_providers(model_server, runner, tmp_path, rows: int, *extra):
    server = model_server(ToolLoopScript(tool_calls=2), providers=PROVIDERS, seed=7)
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(rows)])
    result = runner.invoke(dataset, "--routing", "openrouter", "--num_workers", "8", "--no_filters",
                           "--max_turns", "4", *extra, server=server)
    return server, result


def test_a_bad_provider_is_excluded_in_a_run_and_stays_excluded_on_resume(model_server, runner, tmp_path):
    server, result = _run_with_providers(model_server, runner, tmp_path, 80, "--max_samples", "60")
    assert result.exit_code in (0, 1), result.output
    folder = runner.folder()
    stats = json.loads((folder / "statistics.json").read_text())["provider_guard"]
    assert [e["provider"] for e in stats["excluded"]] == ["bad"], stats
    assert "Provider bad excluded for the rest of the run" in result.output
    assert json.loads((folder / "run.json").read_text())["excluded_providers"] == ["bad"]
    # the server served bad until the exclusion, and then only the calls already in flight (at most a worker's each)
    served = server.provider_calls
    answered_then = stats["excluded"][0]["answered"]
    assert served["bad"] <= answered_then + 8
    asked_to_ignore = [r for r in server.requests if "bad" in (r.body.get("provider") or {}).get("ignore", ())]
    assert asked_to_ignore and served["good"] + served["slight"] >= len(asked_to_ignore)

    resumed, result = _run_with_providers(model_server, runner, tmp_path, 80, "--resume", "--max_samples", "80")
    assert result.exit_code in (0, 1), result.output
    assert "stay excluded" in result.output
    assert resumed.provider_calls["bad"] == 0 and resumed.provider_calls["good"] > 0
    assert all(r.body["provider"]["ignore"] == ["bad"] for r in resumed.requests if not r.preflight)


def test_a_resume_refuses_a_hostile_provider_guard_json(model_server, runner, tmp_path):
    server, result = _run_with_providers(model_server, runner, tmp_path, 3, "--max_samples", "2")
    assert result.exit_code in (0, 1), result.output
    (runner.folder() / "provider_guard.json").write_text('{"excluded": [{"provider": "x\\ny"}]}')
    _, result = _run_with_providers(model_server, runner, tmp_path, 3, "--resume")
    assert result.exit_code != 0 and "provider_guard.json is not what a run writes" in result.output
