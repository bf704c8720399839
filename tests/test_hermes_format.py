"""The Hermes text format is written and read by one module; every reader agrees on what a turn holds."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from hermes_batch.formats import hermes_format
from hermes_batch.formats.openai_format import _assistant_message, split_assistant
from hermes_batch.formats.records import ToolCallRecord, Turn
from hermes_batch.testing import make_trajectory
from hermes_batch.view.render import conversation_html


def test_what_is_written_reads_back():
    calls = [("terminal", {"command": "ls"}), ("read_file", {"path": "a b"})]
    text = hermes_format.assistant_text("Let me look.", "Here goes.", calls)
    reasoning, rest = hermes_format.split_reasoning(text)
    assert reasoning == "Let me look." and hermes_format.strip_calls(rest, calls) == "Here goes."
    assert [json.loads(t) for t in hermes_format.call_texts(text)] == [{"name": n, "arguments": a} for n, a in calls]
    results = [{"tool_call_id": "c1", "name": "terminal", "content": {"output": "x\n</tool_response>"}}]
    assert hermes_format.tool_responses(hermes_format.tool_text(results)) == results
    tools = [{"type": "function", "function": {"name": "terminal"}}]
    assert hermes_format.split_system(hermes_format.system_text("Be brief.", tools)) == ("Be brief.", tools)


def test_the_codec_imports_nothing_of_hermes_batch():
    tree = ast.parse(Path(hermes_format.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {"." * node.level + (node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "json", "re", "typing"}


def test_the_export_the_viewer_and_the_answer_read_reasoning_alike():
    # another writer's layout: no newline inside the tags
    turn = Turn("gpt", "<think>Count the files.</think>There are 3.")
    assert split_assistant(turn) == ("Count the files.", "There are 3.")
    trajectory = make_trajectory(conversations=make_trajectory().conversations[:-1] + (turn,))
    assert trajectory.final_answer == "There are 3."
    assert _assistant_message(turn, "keep", set())["content"] == "<think>\nCount the files.\n</think>\nThere are 3."
    html = conversation_html([{"from": "gpt", "value": turn.value}])
    assert "Reasoning" in html and "&lt;think&gt;" not in html


def test_a_tool_turn_reads_the_same_in_the_record_and_the_viewer():
    call = ToolCallRecord("c1", "terminal", {"command": "echo hi"})
    value = hermes_format.tool_text([{"tool_call_id": call.id, "name": call.name, "content": {"output": "hi"}}])
    assert Turn("tool", value).tool_results == [{"tool_call_id": "c1", "name": "terminal", "content": {"output": "hi"}}]
    assert "hi" in conversation_html([{"from": "tool", "value": value}])
