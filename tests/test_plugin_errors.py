"""A plugin's exception fails the prompt it ran for, naming the plugin, and the run goes on (issue 30 item 2)."""

from __future__ import annotations

import hermes_batch
from hermes_batch import Filter, Writer
from hermes_batch.contract.plugin_errors import IN_A_ROW
from hermes_batch.errors import EXIT_FAILED_PROMPTS, EXIT_OK, EXIT_USAGE
from hermes_batch.testing import Reply, write_dataset


class Picky(Filter):
    name = "picky"
    fails_on: set = set()

    def check(self, trajectory):
        if trajectory.prompt_index in self.fails_on or "all" in self.fails_on:
            raise ValueError(f"cannot judge prompt {trajectory.prompt_index}")
        return None


class Broken(Writer):
    name = "broken"

    def write(self, run_dir, trajectories):
        for _ in trajectories:
            raise KeyError("no such column")
        return None


class Plugin:
    seen: list = []
    observer_fails_on: set = set()

    @hermes_batch.hookimpl
    def register_filters(self, register):
        register(Picky)

    @hermes_batch.hookimpl
    def register_writers(self, register):
        register(Broken)

    @hermes_batch.hookimpl
    def prompt_finished(self, run, outcome):
        if outcome.prompt_index in self.observer_fails_on:
            raise RuntimeError("observer is down")
        self.seen.append(outcome.prompt_index)


def _run(tmp_path, runner, model_server, count, *extra):
    runner.plugins = (Plugin(),)
    server = model_server(lambda r: Reply("Done."))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"task {i}"} for i in range(count)])
    filters = () if "--filter" in extra else ("--no_filters",)  # the default filters would discard these answers
    return runner.invoke(dataset, "--num_workers", "1", *filters, *extra, server=server)


def test_a_filter_that_raises_fails_its_prompt_naming_the_plugin_and_the_run_goes_on(
        tmp_path, runner, model_server, monkeypatch):
    monkeypatch.setattr(Picky, "fails_on", {1})
    result = _run(tmp_path, runner, model_server, 4, "--filter", "picky")
    assert result.exit_code == EXIT_FAILED_PROMPTS, result.output
    assert "internal error" not in result.output
    assert sorted(r["prompt_index"] for r in runner.records("trajectories.jsonl")) == [0, 2, 3]
    [failed] = runner.records("failed.jsonl")
    assert failed["prompt_index"] == 1 and failed["error_kind"] == "plugin" and failed["error_class"] == "ValueError"
    assert "filter 'picky'" in failed["message"] and "Plugin" in failed["message"]
    assert "cannot judge prompt 1" in failed["message"]
    assert failed["api_calls"] == 1 and failed["prompt"] == "task 1"  # what was paid stays counted
    assert "Traceback (most recent call last)" in result.output  # the log, on stderr


def test_a_filter_failing_every_prompt_stops_the_run_with_one_sentence_keeping_what_finished(
        tmp_path, runner, model_server, monkeypatch):
    monkeypatch.setattr(Picky, "fails_on", {"all"})
    result = _run(tmp_path, runner, model_server, IN_A_ROW + 6, "--filter", "picky")
    assert result.exit_code == EXIT_USAGE, result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "filter 'picky'" in error[0] and f"{IN_A_ROW} prompts in a row" in error[0]
    failed = runner.records("failed.jsonl")
    assert len(failed) == IN_A_ROW and {r["error_kind"] for r in failed} == {"plugin"}
    assert "internal error" not in result.output


def test_an_observer_that_raises_is_logged_and_the_prompt_keeps_its_record(
        tmp_path, runner, model_server, monkeypatch):
    monkeypatch.setattr(Plugin, "seen", [])
    monkeypatch.setattr(Plugin, "observer_fails_on", {0})
    result = _run(tmp_path, runner, model_server, 3)
    assert result.exit_code == EXIT_OK, result.output
    assert len(runner.records("trajectories.jsonl")) == 3 and sorted(Plugin.seen) == [1, 2]
    assert "The prompt_finished hook of the plugin 'Plugin'" in result.output and "RuntimeError: observer is down" in result.output


def test_a_writer_that_raises_names_itself_and_the_batch_files_keep_every_record(tmp_path, runner, model_server):
    result = _run(tmp_path, runner, model_server, 3, "--writer", "broken")
    assert result.exit_code == EXIT_USAGE, result.output
    assert "writer 'broken'" in result.output and "KeyError" in result.output
    assert "internal error" not in result.output
    kept = [r for path in sorted(runner.folder().glob("batch_*.jsonl")) for r in runner.records(path.name)]
    assert sorted(r["prompt_index"] for r in kept) == [0, 1, 2]
