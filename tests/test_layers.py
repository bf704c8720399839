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
    """The contract can fail: the same layers without an exemption the code needs are broken."""
    exempt = "    hermes_batch.run.runner -> hermes_batch.offline.refilter\n"
    text = CONFIG.read_text()
    assert exempt in text
    stricter = tmp_path / "importlinter.ini"
    stricter.write_text(text.replace(exempt, ""))
    result = lint(stricter)
    assert result.returncode == 1
    assert "hermes_batch.run is not allowed to import hermes_batch.offline" in result.stdout
    assert "hermes_batch.run.runner -> hermes_batch.offline.refilter" in result.stdout
