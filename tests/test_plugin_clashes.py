"""Two plugins registering one name: qualified names, -p no:NAME, and an error only when the bare name is used
(issue 30 item 1)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import hermes_batch
from hermes_batch import Filter
from hermes_batch.cli import cli
from hermes_batch.errors import EXIT_USAGE, PluginError
from hermes_batch.testing import Reply, write_dataset


def _plugin(plugin_name: str, verdict):
    class Same(Filter):
        name = "same"
        description = f"the filter of {plugin_name}"

        def check(self, trajectory):
            return verdict

    plugin = type(plugin_name, (), {
        "register_filters": hermes_batch.hookimpl(lambda self, register: register(Same)),
    })
    return plugin()


KEEPS, DROPS = _plugin("keeper", None), _plugin("dropper", "dropped by dropper")


def test_a_clash_is_an_error_only_when_the_bare_name_is_used():
    registry = hermes_batch.get_plugin_manager(load_entry_points=False, extra_plugins=(KEEPS, DROPS)).registry()
    assert registry.get("filters", "keeper:same").description == "the filter of keeper"
    assert registry.get("filters", "dropper:same").description == "the filter of dropper"
    assert registry.get("writers", "jsonl")  # everything else works as before
    with pytest.raises(PluginError, match=r"'same' is registered by 2 plugins.*--filter dropper:same or keeper:same"):
        registry.get("filters", "same")


def test_the_listing_shows_the_qualified_names(tmp_path, runner):
    runner.plugins = (KEEPS, DROPS)
    result = runner.cli("filters", "--json")
    assert result.exit_code == 0, result.output
    names = {row["name"] for row in json.loads(result.output)}
    assert {"keeper:same", "dropper:same"} <= names and "same" not in names
    text = runner.cli("filters").output
    assert "keeper:same" in text and "no-reasoning" in names


def test_a_run_picks_one_by_its_qualified_name(tmp_path, runner, model_server):
    runner.plugins = (KEEPS, DROPS)
    server = model_server(lambda r: Reply("Done."))
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    ambiguous = runner.invoke(dataset, "--filter", "same", server=server, run_name="bare")
    assert ambiguous.exit_code == EXIT_USAGE and "--filter dropper:same or keeper:same" in ambiguous.output
    result = runner.invoke(dataset, "--filter", "dropper:same", server=server, run_name="dropped")
    assert result.exit_code == 0, result.output
    assert len(runner.records("discarded.jsonl", run_name="dropped")) == 2
    result = runner.invoke(dataset, "--filter", "keeper:same", server=server, run_name="kept")
    assert result.exit_code == 0, result.output
    assert len(runner.records("trajectories.jsonl", run_name="kept")) == 2


def test_disabling_a_plugin_by_name_removes_the_clash():
    pm = hermes_batch.get_plugin_manager(load_entry_points=False, extra_plugins=(KEEPS, DROPS), disabled=["dropper"])
    assert pm.registry().get("filters", "same").description == "the filter of keeper"


def test_an_installed_plugin_is_disabled_by_p_no_name_or_by_the_environment(monkeypatch):
    pytest.importorskip("hermes_batch_filters")
    monkeypatch.setenv("HERMES_BATCH_DISABLE_PLUGINS", "")  # restored after the test: -p no:NAME sets it
    assert "min-tool-calls" in CliRunner().invoke(cli, ["filters"]).output
    result = CliRunner().invoke(cli, ["-p", "no:filters", "filters"])
    assert result.exit_code == 0, result.output
    assert "min-tool-calls" not in result.output and "no-reasoning" in result.output
    monkeypatch.setenv("HERMES_BATCH_DISABLE_PLUGINS", "hermes-batch-filters")  # a distribution's name works too
    assert "min-tool-calls" not in CliRunner().invoke(cli, ["filters"]).output
    assert CliRunner().invoke(cli, ["-p", "filters", "filters"]).exit_code == EXIT_USAGE


def test_a_plugin_clashing_with_an_installed_one_is_chosen_by_qualified_name():
    pytest.importorskip("hermes_batch_filters")

    class Mine(Filter):
        name = "min-tool-calls"

        def check(self, trajectory):
            return None

    mine = type("mintools", (), {"register_filters": hermes_batch.hookimpl(lambda self, register: register(Mine))})()
    registry = hermes_batch.get_plugin_manager(extra_plugins=(mine,), disabled=()).registry()
    assert registry.get("filters", "mintools:min-tool-calls") is Mine
    theirs = registry.get("filters", "hermes-batch-filters:min-tool-calls")
    assert theirs is registry.get("filters", "filters:min-tool-calls") and theirs is not Mine
    with pytest.raises(PluginError, match="mintools:min-tool-calls"):
        registry.get("filters", "min-tool-calls")


def test_the_plugins_a_command_leaves_out_reach_the_workers_environment(monkeypatch):
    # A Ray actor on another machine has only the environment it is given: the API key and the disabled plugins.
    from hermes_batch import PromptWorker
    from hermes_batch.contract.plugins import DISABLE_ENV

    monkeypatch.delenv(DISABLE_ENV, raising=False)
    assert DISABLE_ENV not in PromptWorker.environment("key")
    monkeypatch.setenv(DISABLE_ENV, "hermes-batch-filters")
    assert PromptWorker.environment(None) == {DISABLE_ENV: "hermes-batch-filters"}
