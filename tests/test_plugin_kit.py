"""The plugin author's kit, used as an outside developer would: outside this repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_batch.testing import Runner

REPO = Path(__file__).resolve().parents[1]


def run_its_tests(folder: Path) -> subprocess.CompletedProcess:
    """pytest in ``folder`` as its author runs it, with its own pyproject.toml and nothing of this repository.

    PYTHONPATH puts its src/ first, as ``pip install -e .`` would.
    """
    env = dict(os.environ, PYTHONPATH=str(folder / "src"))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=folder, env=env,
        capture_output=True, text=True, timeout=600,
    )


def test_a_copy_of_the_example_plugin_passes_its_tests_outside_the_repository(tmp_path):
    copy = tmp_path / "my-plugin"
    shutil.copytree(REPO / "plugins" / "hermes_batch_example", copy, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    done = run_its_tests(copy)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


def test_new_plugin_makes_a_distribution_whose_tests_pass(tmp_path):
    result = Runner(tmp_path).cli("new-plugin", "word-tools", "--directory", str(tmp_path))
    assert result.exit_code == 0, result.output
    root = tmp_path / "hermes-batch-word-tools"
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == [
        "README.md", "pyproject.toml", "src/hermes_batch_word_tools/__init__.py", "tests/test_word_tools.py",
    ]
    assert 'word-tools = "hermes_batch_word_tools"' in (root / "pyproject.toml").read_text()
    done = run_its_tests(root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "4 passed" in done.stdout


def test_new_plugin_refuses_a_bad_name_or_an_existing_folder(tmp_path):
    runner = Runner(tmp_path)
    result = runner.cli("new-plugin", "Bad Name!", "--directory", str(tmp_path))
    assert result.exit_code == 2
    assert result.output.startswith("Error: 'Bad Name!' cannot name a plugin; use lowercase letters")
    (tmp_path / "hermes-batch-taken").mkdir()
    result = runner.cli("new-plugin", "taken", "--directory", str(tmp_path))
    assert result.exit_code == 2 and "already exists" in result.output


def test_final_answer_is_the_last_answer_without_its_reasoning():
    from hermes_batch.testing import make_trajectory

    assert make_trajectory(answer="Forty-two.", reasoning="Six sevens.").final_answer == "Forty-two."
    assert make_trajectory(answer="Plain.", reasoning=None).final_answer == "Plain."
    assert make_trajectory(completed=False).final_answer is None  # cut by turns, time or the context


def test_ended_names_the_processes_that_still_hold_a_runs_output():
    from hermes_batch.testing import ended

    marker = "7.123457"  # a sleep no other process runs
    proc = subprocess.Popen(["sh", "-c", f"sleep {marker} & echo started"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(pytest.fail.Exception, match=rf"1 processes still held the output .*sleep {marker}"):
            ended(proc, timeout=0.3)
    finally:
        subprocess.run(["pkill", "-f", f"^sleep {marker}"])
    out, _err = ended(proc)
    assert out == "started\n"
