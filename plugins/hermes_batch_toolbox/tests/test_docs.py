"""The README documents every toolset, tool and option, so the docs cannot drift from the code."""

from __future__ import annotations

from pathlib import Path

import attrs

from hermes_batch_toolbox import TOOLSETS
from hermes_batch_toolbox.search import BUILTIN

README = (Path(__file__).parents[1] / "README.md").read_text()


def section(name: str) -> str:
    return README.split(f"### `{name}`", 1)[1].split("\n### ", 1)[0]


def test_every_toolset_tool_and_option_is_documented():
    for toolset in TOOLSETS:
        assert f"| `{toolset.name}` |" in README
        text = section(toolset.name)
        for tool in toolset.tools:
            assert f"`{tool.name}" in README, tool.name
        for field in attrs.fields(toolset.Config):
            assert f"| `{field.name}` |" in text, (toolset.name, field.name)


def test_every_search_provider_is_documented():
    for name in BUILTIN:
        assert f"| `{name}` |" in section("web")


def test_documented_defaults_match_the_code():
    for toolset in TOOLSETS:
        text = section(toolset.name)
        for field in attrs.fields(toolset.Config):
            if isinstance(field.default, (int, float)) and not isinstance(field.default, bool):
                row = next(line for line in text.splitlines() if line.startswith(f"| `{field.name}` |"))
                shown = str(field.default) if isinstance(field.default, int) else f"{field.default:g}"
                assert f"| {shown} |" in row, (toolset.name, field.name, row)
