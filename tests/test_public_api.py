"""The public API: what plugins, the docs and the README may import, and that it is all there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import hermes_batch
import hermes_batch.testing

REPO = Path(__file__).resolve().parents[1]
PLUGIN_FOLDERS = ["hermes_batch_docker", "hermes_batch_singularity", "hermes_batch_modal",
                  "plugins/hermes_batch_example", "plugins/hermes_batch_filters", "plugins/hermes_batch_parquet",
                  "plugins/hermes_batch_ray", "plugins/hermes_batch_toolbox"]
PUBLIC_MODULES = {"hermes_batch", "hermes_batch.testing"}
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, re.S)


def hermes_imports(source: str) -> set[str]:
    """Modules of the hermes_batch package that ``source`` imports (``from hermes_batch.x import`` or ``import``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "hermes_batch" or name.startswith("hermes_batch.")}


def test_everything_in_all_is_there():
    for name in hermes_batch.__all__:
        assert getattr(hermes_batch, name) is not None, name
    assert len(set(hermes_batch.__all__)) == len(hermes_batch.__all__)


def test_the_plugin_guide_lists_the_public_api():
    guide = (REPO / "docs" / "plugins.md").read_text()
    table = guide.split("## The public API")[1].split("\n## ")[0].split("| --- | --- |")[1]
    listed = {name for row in table.splitlines() for name in re.findall(r"`(\w+)`", row.split("|")[2] if "|" in row else "")}
    assert listed >= set(hermes_batch.__all__) - {"__version__", "tool"}
    assert listed <= set(hermes_batch.__all__)


@pytest.mark.parametrize("folder", PLUGIN_FOLDERS)
def test_plugins_import_only_the_public_api(folder):
    offending = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        if "build" in path.parts:
            continue
        bad = hermes_imports(path.read_text()) - PUBLIC_MODULES
        if bad:
            offending[str(path.relative_to(REPO))] = sorted(bad)
    assert offending == {}


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_documents_import_only_the_public_api(document):
    for block in python_blocks(document.read_text()):
        assert hermes_imports(block) <= PUBLIC_MODULES, block


def test_the_plugin_guide_examples_run():
    for block in python_blocks((REPO / "docs" / "plugins.md").read_text()):
        if "ScriptedModelServer(" in block or "class Test" in block:
            compile(block, "docs/plugins.md", "exec")  # needs a server or pytest to run
            continue
        exec(compile(block, "docs/plugins.md", "exec"), {"__name__": "docs_example"})


def test_the_testing_kit_shows_its_lazy_exports():
    listed = dir(hermes_batch.testing)
    for name in hermes_batch.testing.__all__:
        assert name in listed
        assert getattr(hermes_batch.testing, name) is not None
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        hermes_batch.testing.nothing  # noqa: B018
