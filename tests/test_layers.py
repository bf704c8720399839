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
