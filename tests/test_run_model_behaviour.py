"""``hermes-batch run`` end to end against models that misbehave and endpoints that fail.

Tool errors, turn limits, truncation, the quality filters, every reasoning format,
rate limits, server errors, bad keys, unknown models and unreachable endpoints.
"""

from __future__ import annotations

import json
import re
import socket

import pytest

from hermes_batch.testing import TEST_API_KEY, write_dataset

from hermes_batch.testing import ErrorRule, Reply, RoutedScript, ToolLoopScript

# --- scripted misbehaviour --------------------------------------------------------------------------


def unknown_tool(request):
    if request.turn == 0:
        return Reply(reasoning="Teleporting is fastest.", tool_calls=[("teleport", {"to": "mars"})])
    return Reply(content="I could not teleport.", reasoning="That tool does not exist.")


def bad_arguments(request):
    if request.turn == 0:
        calls = [("terminal", '{"command": "ls"'), ("terminal", {"cmd": "ls"})]  # not JSON; not the schema
        return Reply(reasoning="Listing files.", tool_calls=calls)
    return Reply(content="Both calls failed.", reasoning="The arguments were wrong.")


def never_stops(request):
    return Reply(reasoning=f"Step {request.turn}.", tool_calls=[("terminal", {"command": "echo again"})])


def truncated(request):
    return Reply(content="The answer is cut sho", reasoning="Writing a long answer.", finish_reason="length")


ROUTES = {
    "Use the teleport tool.": unknown_tool,
    "Call the terminal badly.": bad_arguments,
    "Never stop.": never_stops,
    "Write a very long answer.": truncated,
    "Answer without thinking.": ToolLoopScript(tool_calls=1, reasoning=None),
}


@pytest.fixture
def misbehaving(model_server, runner, tmp_path):
    """A dataset with one prompt per kind of misbehaviour, and a server that acts each out."""
    runner.server = model_server(RoutedScript(ROUTES))
    return write_dataset(tmp_path / "prompts.jsonl", [{"prompt": prompt} for prompt in ROUTES])


def by_prompt(records):
    return {(r.get("trajectory") or r)["conversations"][1]["value"]: r for r in records}


def tool_responses(turn: dict) -> list[dict]:
    blocks = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", turn["value"], re.DOTALL)
    return [json.loads(block) for block in blocks]


def requests_for(server, prompt: str) -> list:
    return sorted((r for r in server.requests if r.prompt == prompt), key=lambda r: r.turn)


def test_tool_errors_turn_limits_truncation_and_the_default_filters(misbehaving, runner):
    server = runner.server
    result = runner.invoke(misbehaving, "--max_turns", "2")
    assert result.exit_code == 0, result.output
    kept = by_prompt(runner.records("trajectories.jsonl"))
    discarded = by_prompt(runner.records("discarded.jsonl"))
    assert set(kept) == {"Call the terminal badly.", "Never stop.", "Write a very long answer."}
    assert set(discarded) == {"Use the teleport tool.", "Answer without thinking."}

    # an unknown tool gets an error result the model sees, and the sample is discarded
    second = requests_for(server, "Use the teleport tool.")[1]
    (error,) = [json.loads(r) for r in second.tool_results]
    assert "teleport" in error["error"] and "terminal" in error["error"]
    teleport = discarded["Use the teleport tool."]
    assert teleport["filters"] == ["hallucinated-tools"]
    assert "teleport" in teleport["reasons"][0]
    [invalid] = json.loads(teleport["trajectory"]["metadata"]["invalid_tool_calls"])
    assert invalid == {"id": invalid["id"], "name": "teleport", "reason": "unknown tool"} and invalid["id"]

    # invalid JSON and schema-mismatched arguments: error results, counted as failures
    bad = kept["Call the terminal badly."]
    assert bad["tool_stats"]["terminal"] == {"count": 2, "success": 0, "failure": 2}
    assert bad["tool_error_counts"]["terminal"] == 2
    (tool_turn,) = [t for t in bad["conversations"] if t["from"] == "tool"]
    not_json, wrong_schema = (r["content"]["error"] for r in tool_responses(tool_turn))
    assert "not valid JSON" in not_json
    assert "cmd" in wrong_schema or "command" in wrong_schema
    seen = [json.loads(r)["error"] for r in requests_for(server, "Call the terminal badly.")[1].tool_results]
    assert seen == [not_json, wrong_schema]
    assert (bad["completed"], bad["partial"]) == (True, False)

    # the turn limit and length truncation end a session early: partial, not completed
    endless = kept["Never stop."]
    assert (endless["completed"], endless["partial"], endless["api_calls"]) == (False, True, 2)
    assert endless["tool_stats"]["terminal"] == {"count": 2, "success": 2, "failure": 0}
    assert server.calls_for("Never stop.") == 2
    cut = kept["Write a very long answer."]
    assert (cut["completed"], cut["partial"], cut["api_calls"]) == (False, True, 1)

    # no reasoning in any assistant turn
    assert discarded["Answer without thinking."]["filters"] == ["no-reasoning"]

    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert stats["discarded_by_filter"] == {"empty-answer": 0, "hallucinated-tools": 1, "no-reasoning": 1}
    assert stats["prompts"]["discarded"] == 2 and stats["prompts"]["failed"] == 0


def test_no_filters_keeps_every_sample(misbehaving, runner, tmp_path, monkeypatch):
    result = runner.invoke(misbehaving, "--max_turns", "2", "--no_filters")
    assert result.exit_code == 0, result.output
    assert set(by_prompt(runner.records("trajectories.jsonl"))) == set(ROUTES)
    assert runner.records("discarded.jsonl") == []
    # unknown tools, raw invalid-JSON arguments and unused tools side by side still load as one table
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    path = runner.folder() / "trajectories.jsonl"
    loaded = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
    assert loaded.num_rows == len(ROUTES)


def test_a_plugin_filter_is_selectable_by_name(misbehaving, runner, example_plugin):
    runner.plugins = (example_plugin,)  # max-tool-failures comes from the example plugin
    result = runner.invoke(misbehaving, "--max_turns", "2", "--filter", "max-tool-failures")
    assert result.exit_code == 0, result.output
    discarded = runner.records("discarded.jsonl")
    assert [d["trajectory"]["conversations"][1]["value"] for d in discarded] == ["Call the terminal badly."]
    assert discarded[0]["filters"] == ["max-tool-failures"]
    assert discarded[0]["reasons"] == ["2 of 2 tool calls failed"]
    # the seed filters are not on: the teleporting and unreasoning samples are kept
    assert len(runner.records("trajectories.jsonl")) == 4


def test_an_unknown_filter_is_a_usage_error(misbehaving, runner):
    result = runner.invoke(misbehaving, "--filter", "nope")
    assert result.exit_code == 2
    assert "nope" in result.output and "no-reasoning" in result.output
    assert runner.server.request_count == 0


@pytest.mark.parametrize("reasoning_format", ["reasoning", "reasoning_details", "reasoning_content", "think_tags", "scratchpad"])
def test_reasoning_in_every_format_ends_up_in_think_blocks(model_server, runner, tmp_path, reasoning_format):
    runner.server = model_server(
        ToolLoopScript(tool_calls=1, reasoning="Pondering step {turn} carefully.", reasoning_format=reasoning_format)
    )
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "Think, then act."}])
    result = runner.invoke(dataset)
    assert result.exit_code == 0, result.output
    (trajectory,) = runner.records("trajectories.jsonl")
    gpt = [t["value"] for t in trajectory["conversations"] if t["from"] == "gpt"]
    assert gpt[0].startswith("<think>\nPondering step 0 carefully.\n</think>\n<tool_call>")
    assert gpt[1].startswith("<think>\nPondering step 1 carefully.\n</think>\nDone: ")
    for value in gpt:
        assert value.count("<think>") == 1 and "REASONING_SCRATCHPAD" not in value
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert stats["kept"]["reasoning"]["share_with_reasoning"] == 1.0


# --- endpoint errors ---------------------------------------------------------------------------------


def test_rate_limits_are_retried_and_every_prompt_finishes(model_server, runner, tmp_path):
    server = runner.server = model_server(
        ToolLoopScript(tool_calls=1), errors=[ErrorRule(status=429, rate=0.3, retry_after=0)], seed=7
    )
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt {i}"} for i in range(20)])
    result = runner.invoke(dataset, "--num_workers", "8")
    assert result.exit_code == 0, result.output
    assert [t["prompt_index"] for t in runner.records("trajectories.jsonl")] == list(range(20))
    assert server.responses_by_status[429] >= 5
    assert server.responses_by_status[200] == 1 + 40  # the preflight, then two calls per prompt
    assert not (runner.folder() / "failed.jsonl").exists()


def test_a_model_that_always_fails_fails_its_prompts_with_exit_3(model_server, runner, tmp_path):
    server = runner.server = model_server(
        ToolLoopScript(), errors=[ErrorRule(status=500, rate=1.0, retry_after=0, message="The GPU caught fire.")]
    )
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt {i}"} for i in range(3)])
    # without the preflight, which would stop the run before any prompt (see test_model_layer.py)
    result = runner.invoke(dataset, "--max_retries", "2", "--no_preflight")
    assert result.exit_code == 3, result.output
    assert server.request_count == 3 * 3  # one attempt and two retries per prompt
    failed = runner.records("failed.jsonl")
    assert sorted(f["prompt_index"] for f in failed) == [0, 1, 2]
    for failure in failed:
        assert failure["error_class"] == "ModelEndpointError"
        assert "500" in failure["message"] and "The GPU caught fire." in failure["message"]
    assert runner.records("trajectories.jsonl") == []
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert stats["prompts"]["failed"] == 3


def test_some_failed_prompts_give_exit_3_and_the_others_are_kept(model_server, runner, tmp_path):
    doomed = lambda request: Reply(status=500, error_message="Overloaded.", headers={"Retry-After": "0"})  # noqa: E731
    runner.server = model_server(RoutedScript({"Doomed prompt": doomed}, default=ToolLoopScript(tool_calls=1)))
    rows = [{"prompt": "Fine prompt 0"}, {"prompt": "Doomed prompt"}, {"prompt": "Fine prompt 2"}]
    result = runner.invoke(write_dataset(tmp_path / "prompts.jsonl", rows), "--max_retries", "1")
    assert result.exit_code == 3, result.output
    assert [t["prompt_index"] for t in runner.records("trajectories.jsonl")] == [0, 2]
    assert [f["prompt_index"] for f in runner.records("failed.jsonl")] == [1]
    assert "1 prompt(s) failed" in result.output and "--resume" in result.output


def test_a_wrong_api_key_stops_the_run_at_once(model_server, runner, tmp_path):
    server = runner.server = model_server(api_key="sk-the-right-key")
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt {i}"} for i in range(40)])
    result = runner.invoke(dataset, "--num_workers", "4")
    assert result.exit_code == 2, result.output
    assert server.request_count == 1  # the preflight, not one refused request per prompt
    assert "API key" in result.stderr and "--api_key" in result.stderr
    assert "Traceback" not in result.output
    assert runner.records("failed.jsonl") == []
    assert runner.records("trajectories.jsonl") == []
    # nothing was achieved, so nothing is left behind: the corrected command runs without --resume
    assert not runner.folder().exists()
    runner.server = model_server(api_key=TEST_API_KEY)
    assert runner.invoke(dataset, "--num_workers", "4").exit_code == 0


def test_an_unknown_model_stops_the_run_at_once(model_server, runner, tmp_path):
    server = runner.server = model_server(models=("some-other-model",))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt {i}"} for i in range(40)])
    result = runner.invoke(dataset, "--num_workers", "4")
    assert result.exit_code == 2, result.output
    assert server.request_count <= 4
    assert "scripted-model" in result.stderr and "--model" in result.stderr
    assert runner.records("failed.jsonl") == []


def test_nothing_listening_without_preflight_fails_the_prompts_with_a_clear_message(runner, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}/v1"
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt {i}"} for i in range(3)])
    result = runner.invoke(dataset, "--base_url", base_url, "--max_retries", "1", "--no_preflight")
    assert result.exit_code == 3, result.output
    failed = runner.records("failed.jsonl")
    assert sorted(f["prompt_index"] for f in failed) == [0, 1, 2]
    for failure in failed:
        assert failure["error_class"] == "ModelEndpointError"
        assert base_url in failure["message"] and "could not be reached" in failure["message"]


def test_context_too_long_ends_the_prompt_as_partial_and_other_400s_fail_it(model_server, runner, tmp_path):
    def script(request):
        if request.prompt == "Long prompt" and request.turn == 1:
            return Reply(status=400, error_message="This model's maximum context length is 8192 tokens.")
        if request.prompt == "Bad request":
            return Reply(status=400, error_message="Unsupported parameter: tools.")
        return ToolLoopScript(tool_calls=1)(request)

    runner.server = model_server(script)
    rows = [{"prompt": "Long prompt"}, {"prompt": "Bad request"}]
    result = runner.invoke(write_dataset(tmp_path / "prompts.jsonl", rows), "--no_filters")
    assert result.exit_code == 3, result.output
    [kept] = runner.records("trajectories.jsonl")
    assert kept["prompt_index"] == 0
    assert (kept["completed"], kept["partial"]) == (False, True)
    assert kept["metadata"]["end_reason"] == "context_length"
    assert kept["api_calls"] == 1
    [failed] = runner.records("failed.jsonl")
    assert failed["prompt_index"] == 1
    assert failed["error_kind"] == "model_request" and "Unsupported parameter" in failed["message"]


# --- a thousand tool calls in one reply ----------------------------------------------------------------


def test_tool_calls_beyond_the_per_turn_cap_are_answered_but_not_run(model_server, runner, tmp_path):
    # Each call would take the whole --command_timeout: without the cap the reply holds a worker for hours.
    script = ToolLoopScript(tool_calls=1, calls_per_turn=300, command="echo ran-{call} >> calls.log; sleep 30")
    runner.server = model_server(script)
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "Call everything at once."}])
    result = runner.invoke(dataset, "--max_tool_calls_per_turn", "2", "--command_timeout", "1", "--no_filters")
    assert result.exit_code == 0, result.output
    (trajectory,) = runner.records("trajectories.jsonl")
    responses = [
        r["content"] for turn in trajectory["conversations"] if turn["from"] == "tool" for r in tool_responses(turn)
    ]
    assert len(responses) == 300  # every call answered, as the APIs require
    ran, skipped = responses[:2], responses[2:]
    assert all(r["error"] == "Command timed out after 1 s" for r in ran)
    assert all(r == {"error": "Not run: this reply made 300 tool calls and only the first 2 of a reply are run "
                     "(--max_tool_calls_per_turn); make fewer calls per reply."} for r in skipped)
    assert trajectory["tool_stats"]["terminal"]["count"] == 2
    second = requests_for(runner.server, "Call everything at once.")[-1]
    assert len(second.tool_results) == 300


def test_the_per_turn_cap_must_be_positive(runner, tmp_path):
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "hi"}])
    result = runner.invoke(dataset, "--max_tool_calls_per_turn", "0")
    assert result.exit_code == 2
    assert "--max_tool_calls_per_turn must be at least 1, got 0." in result.output


def test_an_empty_reply_or_an_unparsed_tool_call_ends_without_an_answer_and_is_discarded(model_server, runner, tmp_path):
    """As Qwen behind llama.cpp did for 89 of 164 HumanEval problems: each was recorded as completed and kept."""
    unparsed = '<tool_call>\n{"name": "terminal", "arguments": {"command": "ls"\n</tool_call>'  # cut JSON

    def script(request):
        if request.prompt == "Say nothing.":
            return Reply(content="", reasoning="I have nothing to add.")
        if request.prompt == "Call in your own syntax.":
            return Reply(content=unparsed, reasoning="Let me look.")
        if request.prompt == "Stop with tool_calls.":  # a server that said it made calls and sent none
            return Reply(content="", reasoning="Calling.", finish_reason="tool_calls")
        return Reply(content="Here it is.", reasoning="Easy.")

    runner.server = model_server(script)
    prompts = ["Say nothing.", "Call in your own syntax.", "Stop with tool_calls.", "Answer."]
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    result = runner.invoke(data, "--distribution", "terminal_only")
    assert result.exit_code == 0, result.output

    [kept] = runner.records("trajectories.jsonl")
    assert kept["metadata"]["end_reason"] == "final_answer" and (kept["completed"], kept["partial"]) == (True, False)
    discarded = {r["trajectory"]["conversations"][1]["value"]: r for r in runner.records("discarded.jsonl")}
    ends = {prompt: discarded[prompt]["trajectory"]["metadata"]["end_reason"] for prompt in prompts[:3]}
    assert ends == {"Say nothing.": "empty_answer", "Call in your own syntax.": "unparsed_tool_call",
                    "Stop with tool_calls.": "unparsed_tool_call"}
    for prompt in prompts[:3]:
        record = discarded[prompt]
        assert (record["trajectory"]["completed"], record["trajectory"]["partial"]) == (False, True)
        assert record["filters"] == ["empty-answer"]
    assert discarded["Say nothing."]["reasons"] == ["the session ended in an empty reply"]
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert stats["finished"]["partial_by_reason"] == {"empty_answer": 1, "unparsed_tool_call": 2}
    assert stats["discarded_by_filter"]["empty-answer"] == 3

    # kept without the filter, still saying why they ended
    kept_all = runner.invoke(data, "--distribution", "terminal_only", "--filter", "no-reasoning", run_name="all")
    assert kept_all.exit_code == 0, kept_all.output
    assert sorted(r["metadata"]["end_reason"] for r in runner.records("trajectories.jsonl", "all")) == [
        "empty_answer", "final_answer", "unparsed_tool_call", "unparsed_tool_call"]
