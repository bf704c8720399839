"""The packages of hermes_batch are layers of one pipeline: `.importlinter` says which, import-linter checks it.

docs/internals.md lists the layers; a module that imports a layer above its own
fails here with the chain of imports that does it.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / ".importlinter"


def lint(config: Path) -> subprocess.CompletedProcess:
    # in a child: import-linter imports nothing, but grimp's graph is per process and cached by default
    code = textwrap.dedent(f"""
        import sys
        from importlinter.cli import lint_imports
        sys.exit(lint_imports(config_filename={str(config)!r}, no_cache=True, no_logo=True))
    """)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_nothing_imports_upward():
    result = lint(CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout
    assert result.stdout.count("KEPT") == CONFIG.read_text().count("[importlinter:contract:")


def test_an_upward_import_is_caught(tmp_path):
    """The contract can fail: the same layers with the viewer put below the run folder it reads are broken."""
    order = "    hermes_batch.view\n    hermes_batch.folder\n"
    text = CONFIG.read_text()
    assert order in text
    swapped = tmp_path / "importlinter.ini"
    swapped.write_text(text.replace(order, "    hermes_batch.folder\n    hermes_batch.view\n"))
    result = lint(swapped)
    assert result.returncode == 1
    assert "hermes_batch.view is not allowed to import hermes_batch.folder" in result.stdout


def test_every_package_is_a_layer():
    """A new package of hermes_batch is placed in the layers, or nothing checks what it imports or who imports it."""
    text = CONFIG.read_text()
    layers = text.split("[importlinter:contract:layers]", 1)[1].split("layers =", 1)[1].split("ignore_imports", 1)[0]
    listed = {line.strip() for line in layers.splitlines() if line.strip() and not line.strip().startswith("#")}
    packages = {f"hermes_batch.{p.parent.name}" for p in (ROOT / "hermes_batch").glob("*/__init__.py")}
    assert packages - listed == set()
