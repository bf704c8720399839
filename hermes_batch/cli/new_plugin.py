"""``hermes-batch new-plugin NAME``: a new plugin distribution with a filter, a tool and passing tests."""

from __future__ import annotations

import re
from pathlib import Path

import click

from .. import __version__
from ..errors import UsageError

_NAME = re.compile(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")

PYPROJECT = '''\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "hermes-batch-{name}"
version = "0.1.0"
description = "A hermes-batch plugin: {name}."
readme = "README.md"
requires-python = ">=3.11"
dependencies = ["hermes-batch>={version}"]

[project.optional-dependencies]
test = ["hermes-batch[testing]>={version}"]

[project.entry-points.hermes_batch]
{name} = "{module}"

[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
testpaths = ["tests"]
asyncio_mode = "auto"
asyncio_default_fixture_loop_scope = "function"
addopts = ["-p", "hermes_batch.testing.fixtures"]
'''

README = '''\
# hermes-batch-{name}

A [hermes-batch](https://pypi.org/project/hermes-batch/) plugin. It provides:

- the filter `{name}-answered`: discards samples that did not end in an answer
  (`hermes-batch run --filter {name}-answered`);
- the toolset `{name}` with the tool `{tool}`.

```bash
pip install -e '.[test]'   # with hermes-batch installed from its checkout first (it is on no index yet)
pytest
hermes-batch plugins    # lists "{name}"
```

The guide to writing plugins is docs/plugins.md in the hermes-batch repository.
'''

MODULE = '''\
"""The hermes-batch plugin {name}: a filter and a toolset."""

from __future__ import annotations

from typing import Optional

import hermes_batch
from hermes_batch import Filter, Toolset, Trajectory


@hermes_batch.hookimpl
def register_filters(register):
    register(AnsweredFilter)


@hermes_batch.hookimpl
def register_toolsets(register):
    register(Toolset("{name}", "Count words.", ({tool},)))


class AnsweredFilter(Filter):
    """Discard samples that did not end in an answer."""

    name = "{name}-answered"
    description = "Discard samples that did not end in an answer."

    def check(self, trajectory: Trajectory) -> Optional[str]:
        if trajectory.final_answer is None:
            return f"the session ended without an answer ({{trajectory.metadata.end_reason}})"
        return None


@hermes_batch.tool
async def {tool}(text: str) -> dict:
    """Count the words of a text.

    Args:
        text: The text to count.
    """
    return {{"words": len(text.split()), "error": None}}
'''

TESTS = '''\
"""Tests of the plugin {name}."""

import hermes_batch
import {module}
from hermes_batch import ToolContext
from hermes_batch.testing import Reply, make_trajectory, write_dataset


def test_the_filter_keeps_answers_and_discards_the_rest():
    check = {module}.AnsweredFilter().check
    assert check(make_trajectory()) is None
    cut = make_trajectory(completed=False, partial=True, metadata={{"end_reason": "max_turns"}})
    assert check(cut) == "the session ended without an answer (max_turns)"


async def test_the_tool_counts_words():
    result = await {module}.{tool}().call({{"text": "one two three"}}, ToolContext(sandbox=None))
    assert result == {{"words": 3, "error": None}}


def test_the_plugin_registers_its_filter_and_toolset():
    registry = hermes_batch.get_plugin_manager(load_entry_points=False, extra_plugins=[{module}]).registry()
    assert registry.get("filters", "{name}-answered") is {module}.AnsweredFilter
    assert registry.get("toolsets", "{name}").tools == ({module}.{tool},)


def test_a_run_uses_the_tool(tmp_path, runner, model_server):
    def script(request):  # the model: call the tool once, then answer
        if request.turn == 0:
            return Reply(tool_calls=[("{tool}", {{"text": "a b c"}})])
        return Reply(content=f"The tool said {{request.tool_results[0]}}")

    runner.plugins = ({module},)  # seen without installing the plugin
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{{"prompt": "How many words?"}}])
    distributions = tmp_path / "distributions.toml"
    distributions.write_text('[{name}]\\ndescription = "{name} only"\\ntoolsets = {{ {name} = 100 }}\\n')
    result = runner.invoke(
        dataset, "--distribution_file", str(distributions), "--distribution", "{name}",
        "--filter", "{name}-answered", server=model_server(script),
    )
    assert result.exit_code == 0, result.output
    [trajectory] = runner.records("trajectories.jsonl")
    assert '"words": 3' in trajectory["conversations"][-1]["value"]
'''


@click.command("new-plugin")
@click.argument("name")
@click.option(
    "--directory", "-d", type=click.Path(file_okay=False, path_type=Path), default=Path("."), show_default=True,
    help="Folder to create the plugin's folder in.",
)
def new_plugin_command(name: str, directory: Path) -> None:
    """Start a new plugin distribution, hermes-batch-NAME: a filter, a tool and tests that pass."""
    if not _NAME.fullmatch(name):
        raise UsageError(
            f"{name!r} cannot name a plugin; use lowercase letters, digits and dashes, starting with a letter "
            "(for example my-sandbox)."
        )
    name = name.replace("_", "-")
    module = "hermes_batch_" + name.replace("-", "_")
    tool = name.replace("-", "_") + "_word_count"
    root = directory / f"hermes-batch-{name}"
    if root.exists():
        raise UsageError(f"{root} already exists; choose another name or --directory.")
    fields = {"name": name, "module": module, "tool": tool, "version": __version__}
    files = {
        root / "pyproject.toml": PYPROJECT,
        root / "README.md": README,
        root / "src" / module / "__init__.py": MODULE,
        root / "tests" / f"test_{module.removeprefix('hermes_batch_')}.py": TESTS,
    }
    for path, template in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**fields), encoding="utf-8")
    click.echo(f"Created {root}: cd there, pip install -e '.[test]' (hermes-batch installed from its checkout first) "
               "and run pytest.")
