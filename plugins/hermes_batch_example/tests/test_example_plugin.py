"""The example plugin's own tests: what a third party copies along with the plugin."""

import pytest

import hermes_batch_example
from hermes_batch.interfaces import ToolContext
from hermes_batch.plugins import collect, get_plugin_manager
from hermes_batch.records import Metadata, ToolStat, Trajectory


def _trajectory(count, failure):
    return Trajectory(
        prompt_index=0,
        conversations=(),
        metadata=Metadata(batch_num=0, timestamp="t", model="m", content_key="k"),
        completed=True,
        partial=False,
        api_calls=1,
        toolsets_used=("terminal",),
        tool_stats={"terminal": ToolStat(count, count - failure, failure)},
        tool_error_counts={"terminal": failure},
    )


def test_filter_discards_mostly_failed_samples():
    f = hermes_batch_example.MaxToolFailuresFilter()
    assert f.check(_trajectory(4, 3)) == "3 of 4 tool calls failed"
    assert f.check(_trajectory(4, 2)) is None
    assert f.check(_trajectory(0, 0)) is None


@pytest.mark.parametrize(
    "expression, expected",
    [("(2 + 3) * 4", 20), ("7 // 2", 3), ("-2 ** 2", -4), ("1 / 4", 0.25)],
)
async def test_calculate(expression, expected):
    result = await hermes_batch_example.CalculateTool().call({"expression": expression}, ToolContext(sandbox=None))
    assert result == {"result": expected, "error": None}


@pytest.mark.parametrize("expression", ["__import__('os')", "1 / 0", "2 ** 99999", "x + 1"])
async def test_calculate_refuses(expression):
    result = await hermes_batch_example.CalculateTool().call({"expression": expression}, ToolContext(sandbox=None))
    assert result["result"] is None and result["error"].startswith("cannot evaluate")


def test_registered_through_the_entry_point():
    registry = collect(get_plugin_manager(strict=True))
    assert registry.kinds["filters"]["max-tool-failures"].plugin == "example"
    assert registry.kinds["toolsets"]["calculator"].plugin == "example"
