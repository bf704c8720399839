"""``hermes-batch run`` end to end: the real CLI, the real openai SDK, a scripted HTTP endpoint, local sandboxes.

Model behaviour (tool errors, filters, reasoning formats) and endpoint errors are in
test_run_model_behaviour.py; kill, resume and Ctrl-C in test_resume_durability.py.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from hermes_batch.testing import TEST_API_KEY as API_KEY, Runner, write_dataset

from hermes_batch.cli import cli
from hermes_batch.default_plugins.distributions import SEED_DISTRIBUTIONS
from hermes_batch.contract.plugins import collect, get_plugin_manager
from hermes_batch.testing import Reply, ScriptedModelServer, ToolLoopScript

BUILTIN_DISTRIBUTIONS = (
    "default", "image_gen", "research", "science", "development", "safe", "balanced", "minimal",
    "terminal_only", "terminal_web", "creative", "reasoning", "browser_use", "browser_only",
    "browser_tasks", "terminal_tasks", "mixed_tasks",
)
ALL_TOOLS = ["patch", "read_file", "search_files", "terminal", "write_file"]  # terminal + file toolsets


def every_installed_tool() -> list[str]:
    """The tools every record lists: those of every installed toolset (the plugins of this venv's too)."""
    installed = collect(get_plugin_manager())
    return sorted(tool.name for toolset in installed.names("toolsets") for tool in installed.get("toolsets", toolset).tools)


# Each call appends a line that only a real shell can compute to a file of the prompt's sandbox and
# prints the file: the second result shows both lines only if both calls ran in the same sandbox.
SANDBOX_COMMAND = 'echo "$(( 0x{prompt_hash} % 9973 ))-{turn}" >> log.txt && cat log.txt'


def shell_number(prompt: str) -> int:
    """What ``$(( 0x{prompt_hash} % 9973 ))`` prints for ``prompt``."""
    return int(hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:8], 16) % 9973


def prompts(n: int, prefix: str = "Task") -> list[dict]:
    return [{"prompt": f"{prefix} {i}: inspect the sandbox", "id": f"row-{i}", "topic": "shell", "difficulty": i % 3}
            for i in range(n)]


def tool_responses(turn: dict) -> list[dict]:
    """The JSON payloads of the ``<tool_response>`` blocks of a ``tool`` turn."""
    blocks = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", turn["value"], re.DOTALL)
    return [json.loads(block) for block in blocks]


def tool_call_blocks(turn: dict) -> list[dict]:
    return [json.loads(b) for b in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", turn["value"], re.DOTALL)]


# --- one 50-prompt run, inspected by several tests ------------------------------------------------


class PeakConcurrency:
    """Wraps a script; each call takes a little while, and the most calls in progress at once is kept."""

    def __init__(self, script):
        self.script = script
        self.now = self.peak = 0

    async def __call__(self, request):
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(0.01)
            return self.script(request)
        finally:
            self.now -= 1


@pytest.fixture(scope="module")
def fifty(tmp_path_factory):
    """A 50-prompt run with 8 workers, each prompt making 2 terminal calls in its local sandbox."""
    tmp_path = tmp_path_factory.mktemp("fifty")
    rows = prompts(50)
    dataset = write_dataset(tmp_path / "prompts.jsonl", rows)
    script = PeakConcurrency(ToolLoopScript(tool_calls=2, command=SANDBOX_COMMAND))
    with ScriptedModelServer(script, api_key=API_KEY) as server:
        runner = Runner(tmp_path, server)
        # terminal_only: the record's tools must not depend on which toolset plugins are installed
        result = runner.invoke(dataset, "--num_workers", "8", "--sandbox", "local", "--distribution", "terminal_only")
        requests = [r for r in server.requests if not r.preflight]
    return runner, result, rows, requests, script.peak


def test_fifty_prompts_end_with_exit_0_and_merged_in_prompt_order(fifty):
    runner, result, _rows, requests, _peak = fifty
    assert result.exit_code == 0, result.output
    trajectories = runner.records("trajectories.jsonl")
    assert [t["prompt_index"] for t in trajectories] == list(range(50))
    assert len(requests) == 50 * 3
    assert not (runner.folder() / "failed.jsonl").exists()
    assert runner.records("discarded.jsonl") == []
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert stats["prompts"] == {"finished": 50, "kept": 50, "discarded": 0, "failed": 0, "skipped_invalid": 0}
    assert stats["kept"]["tool_usage"]["terminal"]["count"] == 100


def test_num_workers_prompts_run_at_the_same_time(fifty):
    *_, peak = fifty
    assert 6 <= peak <= 8


def test_prompt_i_is_written_to_batch_i_div_batch_size(fifty):
    runner, *_ = fifty
    names = sorted(p.name for p in runner.folder().glob("batch_*.jsonl"))
    assert names == sorted(f"batch_{n}.jsonl" for n in range(10))
    for n in range(10):
        records = runner.records(f"batch_{n}.jsonl")
        assert sorted(r["prompt_index"] for r in records) == list(range(5 * n, 5 * n + 5))
        assert {r["metadata"]["batch_num"] for r in records} == {n}


def test_tool_calls_ran_in_each_prompts_own_sandbox_and_results_reached_the_model(fifty):
    runner, _result, rows, requests, _peak = fifty
    for trajectory in runner.records("trajectories.jsonl"):
        prompt = rows[trajectory["prompt_index"]]["prompt"]
        n = shell_number(prompt)
        # the result of the second call holds both lines: one sandbox per prompt, kept across turns
        first, second = (tool_responses(t)[0]["content"] for t in trajectory["conversations"] if t["from"] == "tool")
        assert first == {"output": f"{n}-0\n", "exit_code": 0, "error": None}
        assert second == {"output": f"{n}-0\n{n}-1\n", "exit_code": 0, "error": None}
        # the final answer quotes the last tool result, so the model got it
        final = trajectory["conversations"][-1]
        assert final["from"] == "gpt" and "tool_calls" not in final
        assert json.loads(final["value"].split("Done: ", 1)[1])["output"] == f"{n}-0\n{n}-1\n"
        last_request = next(r for r in requests if r.prompt == prompt and r.turn == 2)
        assert json.loads(last_request.tool_results[0])["output"] == f"{n}-0\n{n}-1\n"
    assert not (runner.folder() / "scratch").exists()  # sandboxes were removed


def test_every_field_of_the_trajectory_record(fifty):
    runner, _result, rows, _requests, _peak = fifty
    trajectories = runner.records("trajectories.jsonl")
    top_keys = {"prompt_index", "conversations", "metadata", "completed", "partial", "api_calls",
                "toolsets_used", "tool_stats", "tool_error_counts"}
    for t in trajectories:
        assert set(t) == top_keys
        assert sorted(t["tool_stats"]) == every_installed_tool() == sorted(t["tool_error_counts"])

    t = trajectories[17]
    row = rows[17]
    assert t["prompt_index"] == 17
    assert [turn["from"] for turn in t["conversations"]] == ["system", "human", "gpt", "tool", "gpt", "tool", "gpt"]

    system, human = t["conversations"][:2]
    tools_json = re.search(r"<tools>\n(.*)\n</tools>", system["value"], re.DOTALL).group(1)
    offered = json.loads(tools_json)
    assert sorted(spec["function"]["name"] for spec in offered) == ALL_TOOLS
    assert all(spec["type"] == "function" and "parameters" in spec["function"] for spec in offered)
    assert human["value"] == row["prompt"]

    gpt_turns = [turn for turn in t["conversations"] if turn["from"] == "gpt"]
    tool_turns = [turn for turn in t["conversations"] if turn["from"] == "tool"]
    for step, (gpt, tool) in enumerate(zip(gpt_turns, tool_turns)):
        command = SANDBOX_COMMAND.format(prompt_hash=hashlib.sha256(row["prompt"].encode()).hexdigest()[:8], turn=step)
        assert gpt["value"].startswith(f"<think>\nLet me think about step {step}.\n</think>")
        assert tool_call_blocks(gpt) == [{"name": "terminal", "arguments": {"command": command}}]
        (call,) = gpt["tool_calls"]
        assert (call["name"], json.loads(call["arguments"])) == ("terminal", {"command": command})
        (response,) = tool_responses(tool)
        assert response["tool_call_id"] == call["id"] and response["name"] == "terminal"
        assert response["content"]["exit_code"] == 0
    assert gpt_turns[-1]["value"].startswith("<think>\nLet me think about step 2.\n</think>\nDone: ")

    meta = t["metadata"]
    assert meta["batch_num"] == 3
    assert datetime.datetime.fromisoformat(meta["timestamp"]).year >= 2024
    assert meta["model"] == "scripted-model"
    assert meta["id"] == "row-17"
    assert json.loads(meta["row"]) == {"topic": "shell", "difficulty": 17 % 3}
    assert meta["usage"]["prompt_tokens"] > 0 and meta["usage"]["completion_tokens"] > 0
    assert sorted(meta["tools_offered"]) == ALL_TOOLS

    assert (t["completed"], t["partial"], t["api_calls"]) == (True, False, 3)
    assert sorted(t["toolsets_used"]) == ["file", "terminal"]
    assert t["tool_stats"] == {name: {"count": 0, "success": 0, "failure": 0} for name in every_installed_tool()} | {
        "terminal": {"count": 2, "success": 2, "failure": 0}
    }
    assert t["tool_error_counts"] == {name: 0 for name in every_installed_tool()}


def test_huggingface_datasets_loads_the_trajectories(fifty, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    runner, *_ = fifty
    path = runner.folder() / "trajectories.jsonl"
    loaded = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
    assert loaded.num_rows == 50
    assert loaded[17]["prompt_index"] == 17
    assert loaded[17]["tool_stats"]["terminal"] == {"count": 2, "success": 2, "failure": 0}
    assert loaded[17]["tool_stats"]["patch"] == {"count": 0, "success": 0, "failure": 0}


# --- the API key --------------------------------------------------------------------------------


def test_api_key_is_in_no_file_of_the_run_folder_nor_in_verbose_logs(model_server, runner, tmp_path, monkeypatch):
    # The key is also in the runner's environment, where a leaking sandbox would hand it to `env`.
    for name in ("OPENAI_API_KEY", "OPENROUTER_API_KEY", "ANTHROPIC_API_KEY"):
        monkeypatch.setenv(name, API_KEY)
    runner.server = model_server(ToolLoopScript(tool_calls=1, command="env && env > env.txt"))
    dataset = write_dataset(tmp_path / "prompts.jsonl", prompts(3))
    result = runner.invoke(dataset, "--verbose", "--log_prefix_chars", "100000", "-S", "keep=true")
    assert result.exit_code == 0, result.output
    files = [p for p in runner.folder().rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"trajectories.jsonl", "run.json", "statistics.json", "checkpoint.json", "env.txt"} <= names
    for path in files:
        assert API_KEY.encode() not in path.read_bytes(), path
    # the verbose log shows each prompt's toolsets, tool calls and results, but never the key
    assert "[B0:P0]" in result.output and "PATH=" in result.output
    for index in range(3):
        assert re.search(rf"\[B0:P{index}\] toolsets: [a-z_]+(, [a-z_]+)* -> [1-9][0-9]* tools: [a-z_]+", result.output)
    assert API_KEY not in result.output


# --- bad datasets ---------------------------------------------------------------------------------


def write_bad_dataset(path: Path) -> Path:
    lines = [
        b'{"prompt": "first valid prompt"}',  # line 1, prompt_index 0
        b'{"prompt": "unterminated',  # 2: invalid JSON
        b'["a", "list"]',  # 3: not an object
        b"",  # 4: blank, no index
        b'{"id": 4}',  # 5: missing prompt
        b'{"prompt": 5}',  # 6: prompt not a string
        b'{"prompt": ""}',  # 7: empty prompt
        b'{"prompt": "x", "image": 3}',  # 8: image not a string
        b'{"prompt": "x", "cwd": ["a"]}',  # 9: cwd not a string
        b'{"prompt": "caf\xe9"}',  # 10: invalid UTF-8
        b"   ",  # 11: blank
        b'{"prompt": "last valid prompt"}',  # 12, prompt_index 9
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_each_bad_line_is_reported_and_nothing_is_sent(model_server, runner, tmp_path):
    server = runner.server = model_server()
    dataset = write_bad_dataset(tmp_path / "bad.jsonl")
    result = runner.invoke(dataset)
    assert result.exit_code == 2, result.output
    expected = {
        2: "invalid JSON", 3: "expected a JSON object", 5: "missing \"prompt\"", 6: "$.prompt: expected a string",
        7: "$.prompt: is empty", 8: "$.image: expected a string", 9: "$.cwd: expected a string", 10: "invalid UTF-8",
    }
    for line, reason in expected.items():
        assert f"{dataset}:{line}: {reason}" in result.output
    for line in (1, 4, 11, 12):
        assert f"{dataset}:{line}:" not in result.output
    assert "--skip_invalid" in result.output
    assert "Traceback" not in result.output
    assert server.request_count == 0
    assert not runner.folder().exists()


def test_skip_invalid_runs_the_valid_rows_and_counts_the_skipped(model_server, runner, tmp_path):
    server = runner.server = model_server(ToolLoopScript(tool_calls=1))
    dataset = write_bad_dataset(tmp_path / "bad.jsonl")
    result = runner.invoke(dataset, "--skip_invalid")
    assert result.exit_code == 0, result.output
    trajectories = runner.records("trajectories.jsonl")
    # bad rows keep their index, blank lines have none
    assert [(t["prompt_index"], t["conversations"][1]["value"]) for t in trajectories] == [
        (0, "first valid prompt"), (9, "last valid prompt"),
    ]
    assert [t["metadata"]["batch_num"] for t in trajectories] == [0, 1]
    assert server.request_count == 1 + 4  # the preflight, then two calls per prompt
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert stats["prompts"]["skipped_invalid"] == 8
    assert stats["prompts"]["kept"] == 2


# --- the run folder -------------------------------------------------------------------------------


@pytest.mark.parametrize("run_name", ["../escape", "a/b", ".hidden"])
def test_run_names_that_are_not_plain_names_are_refused(model_server, runner, tmp_path, run_name):
    server = runner.server = model_server()
    dataset = write_dataset(tmp_path / "prompts.jsonl", prompts(2))
    result = runner.invoke(dataset, run_name=run_name)
    assert result.exit_code == 2, result.output
    assert "Invalid run name" in result.output
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["prompts.jsonl"]
    assert server.request_count == 0


def test_a_second_run_into_a_used_folder_needs_resume_or_overwrite(model_server, runner, tmp_path):
    server = runner.server = model_server(ToolLoopScript(tool_calls=1))
    first = write_dataset(tmp_path / "first.jsonl", prompts(3, "First"))
    assert runner.invoke(first).exit_code == 0
    requests_after_first = server.request_count

    second = write_dataset(tmp_path / "second.jsonl", prompts(2, "Second"))
    refused = runner.invoke(second)
    assert refused.exit_code == 2
    assert "--resume" in refused.output and "--overwrite" in refused.output
    assert server.request_count == requests_after_first
    assert len(runner.records("trajectories.jsonl")) == 3

    fresh = runner.invoke(second, "--overwrite")
    assert fresh.exit_code == 0, fresh.output
    humans = [t["conversations"][1]["value"] for t in runner.records("trajectories.jsonl")]
    assert humans == ["Second 0: inspect the sandbox", "Second 1: inspect the sandbox"]
    checkpoint = json.loads((runner.folder() / "checkpoint.json").read_text())
    assert len(checkpoint["sessions"]) == 1


# --- listing and option spellings -----------------------------------------------------------------


def test_list_distributions_needs_no_other_option_and_matches_the_distributions_command():
    listed = CliRunner().invoke(cli, ["run", "--list_distributions"])
    assert listed.exit_code == 0, listed.output
    names = re.findall(r"^(\w+): ", listed.output, re.MULTILINE)
    assert sorted(names) == sorted(BUILTIN_DISTRIBUTIONS)
    installed = set(collect(get_plugin_manager()).names("toolsets"))
    seed_toolsets = {name for _description, percents in SEED_DISTRIBUTIONS.values() for name in percents}
    assert "terminal" in listed.output
    assert ("(unavailable)" in listed.output) == bool(seed_toolsets - installed)
    dashed = CliRunner().invoke(cli, ["run", "--list-distributions"])
    command = CliRunner().invoke(cli, ["distributions"])
    assert dashed.output == command.output == listed.output


def test_dashed_option_spellings_work_like_the_underscored_ones(model_server, tmp_path):
    server = model_server(ToolLoopScript(tool_calls=1))
    dataset = write_dataset(tmp_path / "prompts.jsonl", prompts(4))
    outputs = {}
    for style in ("_", "-"):
        def opt(name):
            return "--" + name.replace("_", style)

        args = [
            "run", opt("dataset_file"), str(dataset), opt("batch_size"), "3", opt("run_name"), f"run{style}",
            opt("output_dir"), str(tmp_path / "out"), opt("base_url"), server.base_url, opt("api_key"), API_KEY,
            opt("num_workers"), "2", opt("max_samples"), "3", opt("max_turns"), "4", "--model", "scripted-model",
            "--no-progress",
        ]
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        folder = tmp_path / "out" / f"run{style}"
        outputs[style] = [json.loads(line) for line in (folder / "trajectories.jsonl").read_text().splitlines()]
        assert sorted(p.name for p in folder.glob("batch_*.jsonl")) == ["batch_0.jsonl"]
    for records in outputs.values():
        assert [t["prompt_index"] for t in records] == [0, 1, 2]
    def without_call_ids(records):
        return re.sub(r"call_hb\d+", "call", json.dumps([t["conversations"] for t in records]))

    assert without_call_ids(outputs["_"]) == without_call_ids(outputs["-"])


# --- what is sent but never saved ------------------------------------------------------------------


def test_ephemeral_system_prompt_and_prefill_are_sent_but_never_saved(model_server, runner, tmp_path):
    def script(request):
        # ToolLoopScript would count the prefilled assistant message as a turn of its own
        prompt_at = max(i for i, m in enumerate(request.messages) if m["role"] == "user")
        if any(m["role"] == "tool" for m in request.messages[prompt_at:]):
            return Reply(content="Done.", reasoning="The tool answered.")
        return Reply(reasoning="Let me look.", tool_calls=[("terminal", {"command": "echo hello"})])

    server = runner.server = model_server(script)
    ephemeral = "EPHEMERAL-RULE: answer like a pirate."
    prefill = [
        {"role": "user", "content": "PREFILL-QUESTION: what is 2+2?"},
        {"role": "assistant", "content": "PREFILL-ANSWER: 4."},
    ]
    prefill_file = tmp_path / "prefill.json"
    prefill_file.write_text(json.dumps(prefill))
    dataset = write_dataset(tmp_path / "prompts.jsonl", prompts(3))
    result = runner.invoke(
        dataset, "--ephemeral_system_prompt", ephemeral, "--prefill_messages_file", str(prefill_file)
    )
    assert result.exit_code == 0, result.output

    requests = [r for r in server.requests if not r.preflight]
    assert len(requests) == 6
    for request in requests:
        system, question, answer, prompt = request.messages[:4]
        assert system["role"] == "system" and system["content"].endswith(ephemeral)
        assert (question["role"], question["content"]) == ("user", prefill[0]["content"])
        assert (answer["role"], answer["content"]) == ("assistant", prefill[1]["content"])
        assert prompt["role"] == "user" and prompt["content"].startswith("Task ")

    trajectories = runner.records("trajectories.jsonl")
    assert len(trajectories) == 3
    for t in trajectories:
        assert [turn["from"] for turn in t["conversations"]] == ["system", "human", "gpt", "tool", "gpt"]
        assert t["conversations"][1]["value"].startswith("Task ")
    for path in [runner.folder() / "trajectories.jsonl", *runner.folder().glob("batch_*.jsonl")]:
        text = path.read_text()
        for secret in ("EPHEMERAL-RULE", "PREFILL-QUESTION", "PREFILL-ANSWER"):
            assert secret not in text, (path.name, secret)


# --- OpenRouter routing and reasoning controls ------------------------------------------------------


def test_provider_routing_reasoning_effort_and_max_tokens_reach_the_request(model_server, runner, tmp_path):
    server = runner.server = model_server(ToolLoopScript(tool_calls=1))
    dataset = write_dataset(tmp_path / "prompts.jsonl", prompts(2))
    plain = runner.invoke(dataset, run_name="plain")
    assert plain.exit_code == 0, plain.output
    for request in server.requests:
        if not request.preflight:  # the preflight asks for a few tokens only
            assert not {"provider", "reasoning", "max_tokens"} & set(request.body)

    routed = runner.invoke(
        dataset,
        "--providers_allowed", "a,b", "--providers_ignored", "c", "--providers_order", "b,a",
        "--provider_sort", "price", "--reasoning_effort", "high", "--max_tokens", "123", run_name="routed")
    assert routed.exit_code == 0, routed.output
    routed_requests = [r for r in server.requests if not r.preflight][4:]
    assert len(routed_requests) == 4
    for request in routed_requests:
        assert "provider" not in request.body  # OpenRouter's routing goes to OpenRouter only (test_provider_routing)
        assert request.body["reasoning"] == {"effort": "high"}
        assert request.body["max_tokens"] == 123


def test_reasoning_disabled_turns_reasoning_off_in_the_request(model_server, runner, tmp_path):
    server = runner.server = model_server(ToolLoopScript(tool_calls=1))
    dataset = write_dataset(tmp_path / "prompts.jsonl", prompts(2))
    result = runner.invoke(dataset, "--reasoning_disabled")
    assert result.exit_code == 0, result.output
    assert server.request_count == 1 + 4  # the preflight, then two calls per prompt
    for request in server.requests:
        assert request.body["reasoning"] in ({"enabled": False}, {"effort": "none"})


def test_two_runs_of_different_toolsets_load_together_in_datasets(tmp_path):
    """Every record lists every tool of every installed toolset (as the seed's did), whatever the run offered."""
    import datasets

    runner = Runner(tmp_path)
    (tmp_path / "d.toml").write_text('[alone]\ndescription = "x"\ntoolsets = { terminal = 100 }\n')
    with ScriptedModelServer(ToolLoopScript(tool_calls=1), api_key=API_KEY) as server:
        for name, distribution in (("small", "alone"), ("large", "development")):
            data = write_dataset(tmp_path / f"{name}.jsonl", prompts(2, name))
            result = runner.invoke(data, "--distribution_file", str(tmp_path / "d.toml"), "--distribution",
                                   distribution, "--no_filters", server=server, run_name=name)
            assert result.exit_code == 0, result.output
    every_tool = every_installed_tool()
    small, large = runner.records("trajectories.jsonl", "small"), runner.records("trajectories.jsonl", "large")
    assert {tuple(r["toolsets_used"]) for r in small} == {("terminal",)}
    for record in small + large:
        assert sorted(record["tool_stats"]) == sorted(record["tool_error_counts"]) == every_tool
    assert json.loads((runner.folder("small") / "run.json").read_text())["tools"] == every_tool

    files = [str(runner.folder(name) / "trajectories.jsonl") for name in ("small", "large")]
    loaded = datasets.load_dataset("json", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))
    assert len(loaded) == 4
    assert sorted(loaded[0]["tool_stats"]) == every_tool


FEW_SHOT = [
    {"role": "user", "content": "SHOT: how many files are here?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "shot_1", "type": "function", "function": {"name": "terminal", "arguments": '{"command": "ls | wc -l"}'}}]},
    {"role": "tool", "tool_call_id": "shot_1", "content": '{"output": "3\\n", "exit_code": 0, "error": null}'},
    {"role": "assistant", "content": "SHOT-ANSWER: there are 3 files."},
]


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_few_shot_example_with_tool_calls_is_sent_in_each_clients_format(model_server, runner, tmp_path, api):
    def script(request):
        prompt_at = max(i for i, m in enumerate(request.messages) if m["role"] == "user" and m["content"]
                        and not m["content"].startswith("SHOT"))
        if any(m["role"] == "tool" for m in request.messages[prompt_at:]):
            return Reply(content="Done.", reasoning="The tool answered.")
        return Reply(reasoning="Let me look.", tool_calls=[("terminal", {"command": "echo hello"})])

    server = runner.server = model_server(script)
    prefill = tmp_path / "few_shot.json"
    prefill.write_text(json.dumps(FEW_SHOT))
    dataset = write_dataset(tmp_path / "prompts.jsonl", prompts(2))
    client = (("--model_client", "anthropic", "--base_url", server.anthropic_base_url) if api == "anthropic" else ())
    result = runner.invoke(dataset, "--prefill_messages_file", str(prefill), "--distribution", "terminal_only", *client)
    assert result.exit_code == 0, result.output

    requests = [r for r in server.requests if not r.preflight]
    assert len(requests) == 4 and {r.api for r in requests} == {api}
    for request in requests:
        wire = request.body["messages"]
        if api == "openai":
            assert wire[1] == {"role": "user", "content": "SHOT: how many files are here?"}
            assert wire[2]["role"] == "assistant" and wire[2]["content"] is None
            [call] = wire[2]["tool_calls"]
            assert (call["id"], call["type"], call["function"]["name"]) == ("shot_1", "function", "terminal")
            assert json.loads(call["function"]["arguments"]) == {"command": "ls | wc -l"}
            assert wire[3] == {"role": "tool", "tool_call_id": "shot_1", "content": FEW_SHOT[2]["content"]}
            assert wire[4] == {"role": "assistant", "content": "SHOT-ANSWER: there are 3 files."}
        else:  # tool_use and tool_result blocks, the system prompt outside the messages
            assert wire[0] == {"role": "user", "content": "SHOT: how many files are here?"}
            assert wire[1] == {"role": "assistant", "content": [
                {"type": "tool_use", "id": "shot_1", "name": "terminal", "input": {"command": "ls | wc -l"}}]}
            assert wire[2] == {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "shot_1", "content": FEW_SHOT[2]["content"]}]}
            assert wire[3]["role"] == "assistant" and wire[3]["content"] == [
                {"type": "text", "text": "SHOT-ANSWER: there are 3 files."}]
    for t in runner.records("trajectories.jsonl"):  # never saved
        assert [turn["from"] for turn in t["conversations"]] == ["system", "human", "gpt", "tool", "gpt"]
        assert "SHOT" not in json.dumps(t)


@pytest.mark.parametrize(("messages", "says"), [
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "a", "function": {"name": "terminal",
                                                                                   "arguments": "{}"}}]}],
     "the calls a of the last assistant message have no tool result"),
    ([{"role": "tool", "tool_call_id": "nope", "content": "x"}], "answers no call of the assistant message before it"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "a", "function": {"name": "terminal",
                                                                                   "arguments": "not json"}}]}],
     "the arguments of tool call 0 (terminal) must be a JSON object or its text"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "a", "function": {"name": "terminal"}}]},
      {"role": "user", "content": "next"}], "comes before the tool results of the calls a"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "only an assistant message may make"),
])
def test_a_few_shot_example_with_unanswered_or_broken_calls_is_refused_in_one_sentence(tmp_path, messages, says):
    from hermes_batch.errors import UsageError
    from hermes_batch.run.inputfiles import load_prefill

    path = tmp_path / "few_shot.json"
    path.write_text(json.dumps(messages))
    with pytest.raises(UsageError, match=re.escape(says)):
        load_prefill(path)
