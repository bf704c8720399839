"""The messages a user sees for a bad dataset and for a distribution naming missing toolsets, word for word."""

from __future__ import annotations

import hermes_batch
from hermes_batch.formats.dataset import dataset_error, validate_dataset
from hermes_batch.run.distributions import load_distribution_file, unavailable_warning
from hermes_batch.testing import ToolLoopScript, write_dataset


def test_a_bad_dataset_stops_the_run_with_the_dataset_error(tmp_path, runner, model_server):
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "fine"}, "{broken", {"prompt": 3}])
    server = model_server()
    result = runner.invoke(dataset, server=server)
    assert result.exit_code == 2
    assert result.output == f"Error: {dataset_error(validate_dataset(dataset))}\n"
    assert server.request_count == 0


def test_a_distribution_naming_missing_toolsets_is_reported_once(tmp_path, runner, model_server):
    file = tmp_path / "distributions.toml"
    file.write_text('[mostly_terminal]\ndescription = "terminal and a toolset nobody has"\n'
                    "toolsets = { terminal = 100, no_such_toolset = 50 }\n")
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "task"}])
    result = runner.invoke(dataset, "--distribution_file", str(file), "--distribution", "mostly_terminal",
                           server=model_server(ToolLoopScript(tool_calls=1)))
    assert result.exit_code == 0, result.output
    installed = hermes_batch.get_plugin_manager().registry().names("toolsets")
    [distribution] = load_distribution_file(file)
    warning = unavailable_warning(distribution, installed)
    assert "no_such_toolset" in warning
    assert result.output.count(warning) == 1
