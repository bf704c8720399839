"""OpenRouter's ``provider`` routing object goes to OpenRouter only: strict OpenAI-compatible servers refuse it."""

from __future__ import annotations

from hermes_batch.testing import write_dataset

from hermes_batch.default_plugins.openai_client import OpenAIClient
from hermes_batch.model.model_http import is_openrouter
from hermes_batch.contract.interfaces import ModelSettings
from hermes_batch.testing import ToolLoopScript

ROUTING = dict(providers_allowed=("a", "b"), providers_ignored=("c",), providers_order=("b", "a"), provider_sort="price")


def test_only_openrouter_urls_count_as_openrouter():
    assert is_openrouter("https://openrouter.ai/api/v1") and is_openrouter("https://eu.openrouter.ai/api/v1")
    for url in ("http://127.0.0.1:8000/v1", "https://api.openai.com/v1", "http://proxy/openrouter.ai/v1",
                "https://openrouter.ai.example.com/v1", "http://[::1"):
        assert not is_openrouter(url), url


def test_the_routing_object_is_built_for_openrouter_only():
    openrouter = OpenAIClient._routing_body(ModelSettings("m", "https://openrouter.ai/api/v1", **ROUTING))
    assert openrouter["provider"] == {"only": ["a", "b"], "ignore": ["c"], "order": ["b", "a"], "sort": "price"}
    for url in ("http://localhost:8000/v1", "https://api.openai.com/v1"):
        assert "provider" not in OpenAIClient._routing_body(ModelSettings("m", url, **ROUTING)), url


def test_routing_options_for_another_endpoint_are_not_sent_and_a_warning_says_so(model_server, runner, tmp_path):
    server = runner.server = model_server(ToolLoopScript(tool_calls=1))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "one"}, {"prompt": "two"}])
    result = runner.invoke(dataset, "--providers_allowed", "a,b", "--provider_sort", "price")
    assert result.exit_code == 0, result.output
    assert server.request_count == 5
    assert all("provider" not in request.body for request in server.requests)
    warnings = [line for line in result.output.splitlines() if "--providers_allowed, --provider_sort" in line]
    assert len(warnings) == 1 and "not OpenRouter" in warnings[0] and server.base_url in warnings[0]
