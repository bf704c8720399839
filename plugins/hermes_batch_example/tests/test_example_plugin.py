"""The example plugin's own tests: copy them along with the plugin."""

import pytest

import hermes_batch
import hermes_batch_example
from hermes_batch import ToolContext, ToolStat
from hermes_batch.testing import ToolLoopScript, make_trajectory, write_dataset


@pytest.mark.parametrize("calls, failures, reason", [(4, 3, "3 of 4 tool calls failed"), (4, 2, None), (0, 0, None)])
def test_filter_discards_mostly_failed_samples(calls, failures, reason):
    trajectory = make_trajectory(tool_stats={"terminal": ToolStat(calls, calls - failures, failures)})
    assert hermes_batch_example.MaxToolFailuresFilter().check(trajectory) == reason


@pytest.mark.parametrize(
    "expression, expected",
    [("(2 + 3) * 4", 20), ("7 // 2", 3), ("-2 ** 2", -4), ("1 / 4", 0.25)],
)
async def test_calculate(expression, expected):
    result = await hermes_batch_example.calculate().call({"expression": expression}, ToolContext(sandbox=None))
    assert result == {"result": expected, "error": None}


@pytest.mark.parametrize("expression", ["__import__('os')", "1 / 0", "2 ** 99999", "x + 1"])
async def test_calculate_refuses(expression):
    result = await hermes_batch_example.calculate().call({"expression": expression}, ToolContext(sandbox=None))
    assert result["result"] is None and result["error"].startswith("cannot evaluate")


def test_the_model_sees_the_docstring_and_the_signature():
    spec = hermes_batch_example.calculate.spec()
    assert spec.name == "calculate"
    assert spec.description.startswith("Evaluate an arithmetic expression")
    assert spec.parameters["properties"]["expression"] == {"type": "string", "description": "For example (2 + 3) * 4"}
    assert spec.parameters["required"] == ["expression"]


def test_registered_through_the_entry_point():
    registry = hermes_batch.get_plugin_manager(strict=True).registry()
    assert registry.kinds["filters"]["max-tool-failures"].plugin == "example"
    assert registry.kinds["toolsets"]["calculator"].plugin == "example"


def test_a_run_with_the_filter(tmp_path, runner, model_server):
    # an empty command is an error, so every tool call fails and the filter discards every sample
    server = model_server(ToolLoopScript(tool_calls=2, command=""))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"task {i}"} for i in range(3)])

    result = runner.invoke(dataset, "--distribution", "terminal_only", "--filter", "max-tool-failures", server=server)

    assert result.exit_code == 0, result.output
    discarded = runner.records("discarded.jsonl")
    assert [d["filters"] for d in discarded] == [["max-tool-failures"]] * 3
    assert runner.records("trajectories.jsonl") == []
