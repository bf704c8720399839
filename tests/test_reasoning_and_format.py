"""Reasoning capture in every provider form, and the ShareGPT record layout."""

import json

import pytest

from hermes_batch.formats.conversation import reasoning_counts, to_sharegpt
from hermes_batch.formats.reasoning import extract_reasoning
from hermes_batch.formats.records import Message, ToolCall, ToolSpec
from hermes_batch.formats.schema import validate


@pytest.mark.parametrize(
    "fields, content, reasoning, rest",
    [
        ({"reasoning": "plan A"}, "answer", "plan A", "answer"),
        ({"reasoning_content": "plan B"}, "answer", "plan B", "answer"),
        ({"reasoning_details": [{"type": "reasoning.text", "text": "plan C"}, {"type": "reasoning.encrypted", "data": "x"}]}, "answer", "plan C", "answer"),
        ({"reasoning_details": [{"type": "reasoning.summary", "summary": "plan D"}]}, "answer", "plan D", "answer"),
        ({}, "<think>plan E</think>\nanswer", "plan E", "answer"),
        ({}, "<REASONING_SCRATCHPAD>plan F</REASONING_SCRATCHPAD>answer", "plan F", "answer"),
        ({}, "<think>unterminated plan", "unterminated plan", ""),
        ({}, "no reasoning here", None, "no reasoning here"),
        ({"reasoning": "  "}, "x", None, "x"),
    ],
)
def test_extract_reasoning(fields, content, reasoning, rest):
    assert extract_reasoning(fields, content) == (reasoning, rest)


def test_field_and_inline_reasoning_both_kept_without_duplicates():
    assert extract_reasoning({"reasoning": "a"}, "<think>b</think>c") == ("a\n\nb", "c")
    assert extract_reasoning({"reasoning": "a"}, "<think>a</think>c") == ("a", "c")


def test_sharegpt_layout():
    tools = (ToolSpec("terminal", "Run a command", {"type": "object"}),)
    messages = [
        Message("assistant", "Let me look.", reasoning="I should list files.",
                tool_calls=(ToolCall("c1", "terminal", {"command": "ls"}, '{"command": "ls"}'),
                            ToolCall("c2", "terminal", None, "{broken"))),
        Message("tool", json.dumps({"output": "a.txt", "exit_code": 0, "error": None}), tool_call_id="c1", name="terminal"),
        Message("tool", json.dumps({"error": "bad"}), tool_call_id="c2", name="terminal"),
        Message("assistant", "Done."),
    ]
    turns = to_sharegpt("SYS", tools, "List files", messages)
    assert [t.from_ for t in turns] == ["system", "human", "gpt", "tool", "gpt"]
    assert turns[0].value.startswith("SYS\n\n<tools>\n")
    listed = json.loads(turns[0].value.split("<tools>\n")[1].split("\n</tools>")[0])
    assert listed[0]["function"]["name"] == "terminal"
    gpt = turns[2]
    assert gpt.value.startswith("<think>\nI should list files.\n</think>\nLet me look.\n<tool_call>\n")
    assert gpt.value.count("<tool_call>") == 2
    assert [c.arguments for c in gpt.tool_calls] == [{"command": "ls"}, "{broken"]
    tool = turns[3]
    assert tool.value.count("<tool_response>") == 2
    first = json.loads(tool.value.split("<tool_response>\n")[1].split("\n</tool_response>")[0])
    assert first == {"tool_call_id": "c1", "name": "terminal", "content": {"output": "a.txt", "exit_code": 0, "error": None}}
    assert turns[4].tool_calls is None and turns[4].value == "Done."
    assert reasoning_counts(turns) == (1, 1)


@pytest.mark.parametrize(
    "value, problem",
    [
        ({"command": "ls"}, None),
        ({"command": "ls", "timeout": 5}, None),
        ({}, "$.command: required"),
        ({"command": 3}, "$.command: expected string, got int"),
        ({"command": "ls", "timeout": "5"}, "$.timeout: expected integer, got str"),
        ({"command": "ls", "timeout": True}, "$.timeout: expected integer, got bool"),
        ({"command": "ls", "shell": "bash"}, "$.shell: unexpected argument"),
    ],
)
def test_argument_schema(value, problem):
    schema = {
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
        "required": ["command"],
        "additionalProperties": False,
    }
    assert validate(value, schema) == problem
