"""The plugin guide documents the Python side a plugin author uses (issue 30 item 6)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import attrs
import pytest

import hermes_batch

GUIDE = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text()


@pytest.mark.parametrize("parameter", list(inspect.signature(hermes_batch.get_plugin_manager).parameters))
def test_every_argument_of_get_plugin_manager_is_documented(parameter):
    assert f"`{parameter}=" in GUIDE


@pytest.mark.parametrize("record", [hermes_batch.Trajectory, hermes_batch.Turn, hermes_batch.ToolCallRecord,
                                    hermes_batch.Metadata, hermes_batch.Discarded])
def test_the_fields_of_the_records_a_plugin_is_handed_are_documented(record):
    section = GUIDE.split("### The records in Python")[1].split("\n## ")[0]
    public = [f.name for f in attrs.fields(record) if f.name != "schema_version"]
    assert [name for name in public if f"`{name}`" not in section and f"{name}," not in section] == []


def test_the_scaffold_steps_install_the_core_from_a_checkout_before_the_plugin():
    # hermes-batch is on no index: the plugin's test extra (hermes-batch[testing]) resolves only when the core
    # is installed from its checkout first
    commands = re.findall(r"pip install [^\n`#]*", GUIDE.split("## The public API")[0])
    assert [c.strip() for c in commands][:2] == ["pip install '.[testing]'", "pip install -e '.[test]'"]
