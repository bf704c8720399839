"""The plugin author's kit, used as an outside developer would: outside this repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hermes_batch
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


class _OwnFinalAnswer:
    """A plugin whose filter has a name hermes-batch-filters (installed here) also registers."""

    def __init__(self):
        from hermes_batch import Filter

        class OwnFinalAnswer(Filter):
            name = "final-answer"

            def check(self, trajectory):
                return None

        self.filter = OwnFinalAnswer

    @hermes_batch.hookimpl
    def register_filters(self, register):
        register(self.filter)


def test_the_kit_loads_the_plugin_under_test_only_so_its_names_do_not_clash_with_other_plugins(tmp_path):
    from hermes_batch import PluginError, get_plugin_manager
    from hermes_batch.testing import make_filter
    from hermes_batch.testing.scope import others, plugin_entry_points, plugin_manager, under_test

    # the plugin under test: the entry points of the pyproject.toml nearest above the test file
    (tmp_path / "tests").mkdir()
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "hermes-batch-mine"\n'
                                             '[project.entry-points.hermes_batch]\nexample = "hermes_batch_example"\n')
    assert plugin_entry_points(tmp_path / "tests" / "test_mine.py") == ("example",)
    assert plugin_entry_points(REPO / "plugins" / "hermes_batch_filters" / "tests" / "test_filters.py") == ("filters",)
    assert plugin_entry_points(Path(__file__)) is None  # hermes-batch's own suite: every installed plugin

    own = _OwnFinalAnswer()
    with pytest.raises(PluginError, match="registered by 2 plugins"):  # every installed plugin: two final-answers
        make_filter("final-answer", get_plugin_manager(extra_plugins=[own]))
    with under_test(("example",)):
        assert isinstance(make_filter("final-answer", plugin_manager(extra_plugins=[own])), own.filter)
        assert "filters" in others(("example",))  # what a spawned run leaves out (HERMES_BATCH_DISABLE_PLUGINS)
        runner = Runner(tmp_path)  # the runner fixture's default: the plugin under test
        listed = runner.cli("filters")
        assert listed.exit_code == 0 and "final-answer" not in listed.output and "no-reasoning" in listed.output
        everything = Runner(tmp_path, entry_points=None).cli("filters")  # asked for more: every installed plugin
        assert "final-answer" in everything.output


def test_the_runner_fixture_is_scoped_to_this_suite_which_declares_no_plugin(runner):
    from hermes_batch.testing.scope import current

    assert current() is None  # this repository's own tests see every installed plugin
    assert "final-answer" in runner.cli("filters").output
