"""The plugin framework: loading, registration, duplicates, broken and misspelled plugins."""

import importlib.util
import json
import subprocess
import sys
import textwrap
import tomllib
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

import hermes_batch
from hermes_batch.contract import plugins
from hermes_batch.cli import cli
from hermes_batch.errors import PluginError
from hermes_batch.contract.interfaces import Filter, Toolset
from hermes_batch.contract.plugins import PluginLoadWarning, collect, get_plugin_manager


def test_default_plugins_register_the_core_features():
    registry = collect(get_plugin_manager(load_entry_points=False))
    assert registry.names("sandboxes") == ["local"]
    assert registry.names("model_clients") == ["anthropic", "openai"]
    assert {"terminal", "file"} <= set(registry.names("toolsets"))
    assert registry.names("filters") == ["empty-answer", "hallucinated-tools", "no-reasoning", "no-shortcuts", "verified"]
    assert registry.names("writers") == ["dpo", "jsonl", "openai", "rollouts", "sharegpt"]
    assert registry.names("executors") == ["local", "processes"]
    assert "default" in registry.names("distributions")
    owners = registry.tool_owner()
    assert owners["terminal"] == "terminal"
    assert {owners[t] for t in ("read_file", "write_file", "patch", "search_files")} == {"file"}
    assert registry.kinds["sandboxes"]["local"].plugin == "hermes_batch.local_sandbox.backend"


class _Dup:
    """A throwaway plugin registering a filter under a name the core already uses."""

    class NoReasoning(Filter):
        name = "no-reasoning"

        def check(self, trajectory):
            return None

    @hermes_batch.hookimpl
    def register_filters(self, register):
        register(self.NoReasoning)


def test_two_plugins_registering_one_name_is_an_error_naming_both_when_the_name_is_used():
    registry = collect(get_plugin_manager(load_entry_points=False, extra_plugins=[_Dup()]))  # loading is fine
    with pytest.raises(PluginError) as info:
        registry.get("filters", "no-reasoning")
    message = str(info.value)
    assert "'no-reasoning'" in message
    assert "hermes_batch.default_plugins.sample_filters" in message
    assert "'_Dup'" in message and "_Dup:no-reasoning or hermes-batch:no-reasoning" in message


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


def _install(folder, monkeypatch, dist: str, entry_point: str, module: str, source: str = "") -> str:
    """Make ``folder`` hold an installed distribution ``dist`` whose entry point ``entry_point`` is ``module``."""
    info = folder / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[hermes_batch]\n{entry_point} = {module}\n")
    if source:
        (folder / f"{module}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(folder))
    return dist


@pytest.fixture
def broken_distribution(tmp_path, monkeypatch):
    """An installed distribution whose hermes_batch entry point cannot be imported."""
    return _install(tmp_path, monkeypatch, "broken-plugin", "broken", "no_such_module_for_hermes_batch")


@pytest.fixture
def outdated_distribution(tmp_path, monkeypatch):
    """An installed distribution whose plugin implements a hook under a name hermes-batch does not have."""
    return _install(tmp_path, monkeypatch, "outdated-plugin", "outdated", "outdated_hermes_plugin", """
        import hermes_batch

        @hermes_batch.hookimpl
        def hermes_batch_run_start(run):
            pass
    """)


@pytest.fixture
def throwaway_distribution(tmp_path, monkeypatch):
    """An installed distribution providing the filter ``throwaway``."""
    return _install(tmp_path, monkeypatch, "throwaway-plugin", "throwaway", "throwaway_hermes_plugin", """
        import hermes_batch

        class Throwaway(hermes_batch.Filter):
            name = "throwaway"
            description = "Keeps everything."

            def check(self, trajectory):
                return None

        @hermes_batch.hookimpl
        def register_filters(register):
            register(Throwaway)
    """)


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


def test_a_plugin_with_an_unknown_hook_is_skipped_with_a_warning_naming_its_distribution(outdated_distribution):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = get_plugin_manager()
    (message,) = [str(w.message) for w in caught if issubclass(w.category, PluginLoadWarning)]
    assert message.startswith("Skipping plugin 'outdated' from distribution 'outdated-plugin': it implements ")
    assert "hermes_batch_run_start, which is not a hook of hermes-batch" in message
    assert pm.get_plugin("outdated") is None
    assert "local" in pm.registry().names("sandboxes")  # the rest still works
    with pytest.raises(PluginError, match="'outdated' from distribution 'outdated-plugin'.*hermes_batch_run_start"):
        get_plugin_manager(strict=True)


def test_an_entry_point_plugin_is_discovered_listed_and_selectable(throwaway_distribution):
    pm = get_plugin_manager(strict=True)
    assert pm.distribution("throwaway") == ("throwaway-plugin", "1.0")
    result = CliRunner().invoke(cli, ["plugins"])
    assert result.exit_code == 0, result.output
    plugins = {p["name"]: p for p in json.loads(result.output)}
    assert plugins["throwaway"]["distribution"] == "throwaway-plugin"
    assert plugins["throwaway"]["version"] == "1.0"
    assert plugins["throwaway"]["provides"] == {"filters": ["throwaway"]}
    assert plugins["hermes_batch.local_sandbox.backend"]["provides"] == {"sandboxes": ["local"]}
    listed = CliRunner().invoke(cli, ["filters"])
    assert "Keeps everything.  (from throwaway)" in listed.output


@pytest.mark.parametrize(
    "command, expected",
    [
        ("sandboxes", "local"),
        ("filters", "no-reasoning"),
        ("writers", "jsonl"),
        ("model-clients", "openai"),
        ("executors", "local"),
        ("toolsets", "terminal"),
    ],
)
def test_listing_commands(command, expected):
    result = CliRunner().invoke(cli, [command, "--json"])
    assert result.exit_code == 0, result.output
    assert expected in {row["name"] for row in json.loads(result.output)}


def test_every_kind_has_its_hook_and_a_listing_or_a_command():
    from hermes_batch.contract import hookspecs
    from hermes_batch.contract.plugins import KINDS

    registration_hooks = {name for name in dir(hookspecs) if name.startswith("register_")}
    assert {kind.hook for kind in KINDS} == registration_hooks
    listed = {command for command in cli.commands}
    for kind in KINDS:
        assert kind.listing in listed or kind.key in ("distributions", "commands"), kind
    assert "distributions" in listed


@pytest.mark.parametrize(
    "hook, obj, message",
    [
        ("register_sandbox_backends", Filter, "registered <class 'hermes_batch.contract.interfaces.Filter'> as a sandbox backend, "
         "but it must be a subclass of hermes_batch.SandboxBackend"),
        ("register_filters", object(), "must be a subclass of hermes_batch.Filter"),
        ("register_toolsets", "terminal", "registered 'terminal' as a toolset, but it must be an instance of hermes_batch.Toolset"),
        ("register_toolsets", Toolset("t", "d", (str,)), "put <class 'str'> in the toolset 't'"),
        ("register_commands", print, "must be an instance of click.Command"),
    ],
)
def test_registering_the_wrong_kind_of_object_names_the_plugin(hook, obj, message):
    Wrong = type("Wrong", (), {hook: hermes_batch.hookimpl(lambda self, register: register(obj))})
    with pytest.raises(PluginError, match="Plugin 'Wrong'") as info:
        collect(get_plugin_manager(load_entry_points=False, extra_plugins=[Wrong()]))
    assert message in str(info.value)


def test_a_tool_whose_parameters_are_no_json_schema_names_the_plugin():
    class Broken(hermes_batch.Tool):
        name, description = "broken", "A broken tool."
        parameters = {"type": "object", "properties": {"x": {"type": "strnig"}}}

        async def call(self, arguments, ctx):
            return {}

    class Plugin:
        @hermes_batch.hookimpl
        def register_toolsets(self, register):
            register(Toolset("broken", "Broken.", (Broken,)))

    with pytest.raises(PluginError, match="Plugin 'Plugin': the parameters of the tool 'broken' are not a valid JSON Schema"):
        collect(get_plugin_manager(load_entry_points=False, extra_plugins=[Plugin()]))


def test_a_nameless_object_is_named_by_its_kind():
    class Nameless(Filter):
        name = ""

        def check(self, trajectory):
            return None

    Plugin = type("Plugin", (), {"register_filters": hermes_batch.hookimpl(lambda self, register: register(Nameless))})
    with pytest.raises(PluginError, match="registered a filter without a name"):
        collect(get_plugin_manager(load_entry_points=False, extra_plugins=[Plugin()]))


def test_importing_the_command_line_loads_no_plugin():
    code = "import sys, hermes_batch.cli; print(sorted(m for m in sys.modules if m.startswith('hermes_batch_')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_local_run_imports_no_library_only_other_plugins_use(tmp_path, runner, model_server):
    # With the docker and filters plugins installed, every run and every worker process imported the
    # docker SDK (with requests) and numpy at start: 0.4 s each time, for a sandbox and a filter unused.
    from hermes_batch.testing import ToolLoopScript, write_dataset

    modules = {"hermes_batch_docker.backend", "hermes_batch_filters.near_duplicates"}
    if any(importlib.util.find_spec(name.split(".")[0]) is None for name in modules):
        pytest.skip("hermes-batch-docker and hermes-batch-filters are not installed")
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": "list the files"}])
    child = runner.spawn(data, "--distribution", "terminal_only", server=model_server(ToolLoopScript(tool_calls=1)),
                         env={"PYTHONPROFILEIMPORTTIME": "1"})
    _out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
    assert modules <= imported  # the profile is there, and both plugins were loaded
    assert not imported & {"docker", "requests", "numpy"}


@pytest.mark.parametrize("args", [["sandboxes"], ["plugins"], ["--help"], ["distributions"], ["nosuch"]])
def test_plugins_load_once_per_command(monkeypatch, args):
    import hermes_batch.contract.plugins

    built = []
    real = hermes_batch.contract.plugins.get_plugin_manager
    monkeypatch.setattr(hermes_batch.contract.plugins, "get_plugin_manager", lambda **kw: built.append(kw) or real(**kw))
    CliRunner().invoke(cli, args)
    assert len(built) == 1


def test_a_run_loads_plugins_once(monkeypatch, tmp_path):
    import hermes_batch.contract.plugins

    built = []
    real = hermes_batch.contract.plugins.get_plugin_manager
    monkeypatch.setattr(hermes_batch.contract.plugins, "get_plugin_manager", lambda **kw: built.append(kw) or real(**kw))
    (tmp_path / "d.jsonl").write_text('{"prompt": "x"}\n')
    # stops at the preflight (nothing listens on port 9), after the run was prepared
    result = CliRunner().invoke(cli, ["run", "--dataset_file", str(tmp_path / "d.jsonl"), "--batch_size", "1",
                                      "--run_name", "r", "--output_dir", str(tmp_path), "--api_key", "k",
                                      "--base_url", "http://127.0.0.1:9/v1", "--max_retries", "0", "--no-progress"])
    assert result.exit_code == 2, result.output
    assert len(built) == 1


def test_plugins_add_commands():
    import click

    from hermes_batch.cli import plugin_commands

    @click.command("hello")
    def hello():
        click.echo("hello from a plugin")

    class Commands:
        @hermes_batch.hookimpl
        def register_commands(self, register):
            register(hello)

    pm = get_plugin_manager(load_entry_points=False, extra_plugins=[Commands()])
    commands = plugin_commands(click.Group(commands={"run": click.Command("run")}), pm)
    assert commands.pop("hello") is hello
    assert set(commands) == {"export", "refilter", "stats", "report", "view"}  # the core's own, through the same hook
    assert CliRunner().invoke(cli, ["hello"], obj=pm).output == "hello from a plugin\n"
    with pytest.raises(PluginError, match="Plugin 'Commands' registers the command 'hello', which already exists"):
        plugin_commands(click.Group(commands={"hello": hello}), pm)


def test_the_first_party_table_is_what_the_repositorys_plugins_register():
    # scripts/test.sh installs every plugin of the repository, so the table is checked against the real thing.
    root = Path(__file__).resolve().parents[1]
    folders = {str(p.parent.relative_to(root)) for p in [*root.glob("hermes_batch_*/pyproject.toml"),
                                                            *root.glob("plugins/*/pyproject.toml")]}
    folders.discard("plugins/hermes_batch_example")  # a template to copy, not a plugin to install
    assert {dist.path for dist in plugins.FIRST_PARTY} == folders
    registered = {p["distribution"]: p["provides"] for p in plugins.describe_plugins(get_plugin_manager())}
    for dist in plugins.FIRST_PARTY:
        project = tomllib.loads((root / dist.path / "pyproject.toml").read_text())["project"]
        assert project["name"] == dist.distribution
        assert dist.distribution in registered, f"{dist.distribution} is not installed; run scripts/test.sh"
        provided = {kind: tuple(sorted(names)) for kind, names in dist.provides.items()}
        assert provided == {kind: tuple(names) for kind, names in registered[dist.distribution].items()}, dist.distribution
