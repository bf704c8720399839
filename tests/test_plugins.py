"""The plugin framework: loading, registration, duplicates, broken and misspelled plugins."""

import json
import warnings

import pytest
from click.testing import CliRunner

import hermes_batch
from hermes_batch.cli import cli
from hermes_batch.errors import PluginError
from hermes_batch.interfaces import Filter, Toolset
from hermes_batch.plugins import PluginLoadWarning, collect, get_plugin_manager


def test_default_plugins_register_the_core_features():
    registry = collect(get_plugin_manager(load_entry_points=False))
    assert registry.names("sandboxes") == ["local"]
    assert registry.names("model_clients") == ["anthropic", "openai"]
    assert {"terminal", "file"} <= set(registry.names("toolsets"))
    assert registry.names("filters") == ["hallucinated-tools", "no-reasoning"]
    assert registry.names("writers") == ["jsonl", "openai", "sharegpt"]
    assert registry.names("executors") == ["local"]
    assert "default" in registry.names("distributions")
    owners = registry.tool_owner()
    assert owners["terminal"] == "terminal"
    assert {owners[t] for t in ("read_file", "write_file", "patch", "search_files")} == {"file"}
    assert registry.kinds["sandboxes"]["local"].plugin == "hermes_batch.default_plugins.local_sandbox"


class _Dup:
    """A throwaway plugin registering a filter under a name the core already uses."""

    class NoReasoning(Filter):
        name = "no-reasoning"

        def check(self, trajectory):
            return None

    @hermes_batch.hookimpl
    def register_filters(self, register):
        register(self.NoReasoning)


def test_two_plugins_registering_one_name_is_an_error_naming_both():
    pm = get_plugin_manager(load_entry_points=False, extra_plugins=[_Dup()])
    with pytest.raises(PluginError) as info:
        collect(pm)
    message = str(info.value)
    assert "'no-reasoning'" in message
    assert "hermes_batch.default_plugins.filters" in message
    assert "'_Dup'" in message


def test_a_tool_in_two_toolsets_is_an_error():
    from hermes_batch.default_plugins.terminal_tools import TerminalTool

    class Again:
        @hermes_batch.hookimpl
        def register_toolsets(self, register):
            register(Toolset("shell", "again", (TerminalTool,)))

    with pytest.raises(PluginError, match="'terminal' is in two toolsets"):
        collect(get_plugin_manager(load_entry_points=False, extra_plugins=[Again()]))


def test_misspelled_hook_is_an_error():
    class Typo:
        @hermes_batch.hookimpl
        def register_filter(self, register):  # missing "s"
            pass

    with pytest.raises(PluginError, match="register_filter"):
        get_plugin_manager(load_entry_points=False, extra_plugins=[Typo()])


@pytest.fixture
def broken_distribution(tmp_path, monkeypatch):
    """An installed distribution whose hermes_batch entry point cannot be imported."""
    info = tmp_path / "broken_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[hermes_batch]\nbroken = no_such_module_for_hermes_batch\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "broken-plugin"


def test_broken_plugin_is_skipped_with_a_warning_naming_its_distribution(broken_distribution):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = get_plugin_manager()
    messages = [str(w.message) for w in caught if issubclass(w.category, PluginLoadWarning)]
    assert any("broken-plugin" in m and "'broken'" in m for m in messages)
    assert pm.get_plugin("broken") is None
    assert "local" in collect(pm).names("sandboxes")


def test_broken_plugin_raises_in_strict_mode(broken_distribution):
    with pytest.raises(PluginError, match="broken-plugin"):
        get_plugin_manager(strict=True)


def test_example_plugin_is_discovered_listed_and_selectable():
    pm = get_plugin_manager(strict=True)
    assert pm.get_plugin("example") is not None
    result = CliRunner().invoke(cli, ["plugins"])
    assert result.exit_code == 0, result.output
    plugins = {p["name"]: p for p in json.loads(result.output)}
    example = plugins["example"]
    assert example["distribution"] == "hermes-batch-example"
    assert example["version"] == "0.1.0"
    assert example["provides"] == {"filters": ["max-tool-failures"], "toolsets": ["calculator"]}
    assert plugins["hermes_batch.default_plugins.local_sandbox"]["provides"] == {"sandboxes": ["local"]}


@pytest.mark.parametrize(
    "command, expected",
    [
        ("sandboxes", "local"),
        ("filters", "max-tool-failures"),
        ("writers", "jsonl"),
        ("model-clients", "openai"),
        ("executors", "local"),
        ("toolsets", "calculator"),
    ],
)
def test_listing_commands(command, expected):
    result = CliRunner().invoke(cli, [command, "--json"])
    assert result.exit_code == 0, result.output
    assert expected in {row["name"] for row in json.loads(result.output)}


def test_plugins_add_commands():
    import click

    from hermes_batch.cli import add_plugin_commands

    @click.command("hello")
    def hello():
        click.echo("hello from a plugin")

    class Commands:
        @hermes_batch.hookimpl
        def register_commands(self, register):
            register(hello)

    pm = get_plugin_manager(load_entry_points=False, extra_plugins=[Commands()])
    group = click.Group(commands={"run": click.Command("run")})
    add_plugin_commands(group, pm)
    assert CliRunner().invoke(group, ["hello"]).output == "hello from a plugin\n"
    assert {"export", "refilter", "stats"} <= set(group.commands)  # the core's own, through the same hook
    with pytest.raises(PluginError, match="'Commands' registers the command 'hello'"):
        add_plugin_commands(click.Group(commands={"hello": hello}), pm)
