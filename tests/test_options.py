"""Each option of ``hermes-batch run`` is defined once (a RunConfig field): the CLI, its defaults and docs/options.md agree."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

from hermes_batch.cli import cli
from hermes_batch.cli import run as run_cli
from hermes_batch.run.config import RunConfig
from hermes_batch.errors import UsageError

OPTIONS_DOC = Path(__file__).resolve().parents[1] / "docs" / "options.md"
TABLE_HEADING = "## The options"


def documented_rows() -> dict[str, str]:
    """Each option spelling in the options table -> the row's default column."""
    text = OPTIONS_DOC.read_text()
    table = text[text.index(TABLE_HEADING):].split("\n\n", 3)[2]  # heading, sentence, table
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        for name in re.findall(r"--[a-z_-]+", cells[0].replace("/--", " --")):
            rows[name] = cells[1]
    return rows


def command_options() -> dict[str, list[str]]:
    """Each parameter of ``run`` -> its spellings."""
    command = cli.commands["run"]
    return {p.name or p.opts[0]: p.opts + p.secondary_opts for p in command.params if "--help" not in p.opts}


def test_every_option_is_documented_and_every_documented_option_exists():
    documented = documented_rows()
    options = command_options()
    undocumented = [spellings[0] for spellings in options.values() if not any(s in documented for s in spellings)]
    assert undocumented == []
    every_spelling = {s for spellings in options.values() for s in spellings}
    assert [name for name in documented if name not in every_spelling] == []


def _shown(default) -> str:
    if default is attrs.NOTHING:
        return "required"  # (--dataset_file and --batch_size: "required; the run's on --resume", checked below)
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    if isinstance(default, int):
        return str(default)
    return f"`{default}`"


def test_the_documented_defaults_are_the_fields_defaults():
    documented = documented_rows()
    checked = 0
    for field in attrs.fields(RunConfig):
        if isinstance(field.default, (bool, int, float, str, Path)) or field.default is attrs.NOTHING:
            if field.name in ("preflight", "provider_guard"):  # documented as --no_NAME, off
                assert documented[f"--no_{field.name}"] == "off"
                continue
            assert documented[f"--{field.name}"].split(";")[0] == _shown(field.default), field.name
            checked += 1
    assert checked > 20


@pytest.fixture
def parsed(monkeypatch, tmp_path):
    """The RunConfig that ``hermes-batch run ARGS`` builds, without running it."""
    seen = []
    monkeypatch.setattr(run_cli, "execute", lambda config: seen.append(config) or 0)

    (tmp_path / "out" / "r").mkdir(parents=True)  # what a --resume continues

    def parse(*args):
        base = ["run", "--dataset_file", str(tmp_path / "d.jsonl"), "--batch_size", "5", "--run_name", "r",
                "--base_url", "http://127.0.0.1:9/v1", "--output_dir", str(tmp_path / "out")]
        result = CliRunner().invoke(cli, base + list(args), catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return seen.pop()

    return parse


def test_the_command_line_defaults_are_the_fields_defaults(parsed, tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    config = parsed()
    assert config == RunConfig(dataset_file=tmp_path / "d.jsonl", batch_size=5, run_name="r",
                               base_url="http://127.0.0.1:9/v1", output_dir=tmp_path / "out")


def test_options_reach_their_fields_converted(parsed, tmp_path):
    config = parsed(
        "--providers_allowed", "a, b", "-S", "memory=1g", "-S", "cpus=2", "-E", "x=1", "-T", "web.provider=searxng",
        "--filter", "no-reasoning", "--writer", "jsonl", "--writer", "other", "--no-preflight", "--resume=True",
        "--no-progress", "--max_cost", "0.5", "--reasoning_effort", "low",
    )
    assert config.providers_allowed == ("a", "b")
    assert config.sandbox_options == {"memory": "1g", "cpus": 2}
    assert config.executor_options == {"x": 1}
    assert config.tool_options == {"web": {"provider": "searxng"}}
    assert (config.filters, config.writers) == (("no-reasoning",), ("jsonl", "other"))
    assert (config.preflight, config.resume, config.progress) == (False, True, False)
    assert (config.max_cost, config.reasoning_effort) == (0.5, "low")
    assert parsed("--no_filters").filters == ()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"batch_size": 0}, "--batch_size must be at least 1, got 0."),
        ({"max_retries": -1}, "--max_retries must be 0 or more, got -1."),
        ({"max_cost": -0.5}, "--max_cost must be 0 or more, got -0.5."),
        ({"request_timeout": 0.0}, "--request_timeout must be more than 0, got 0."),
        ({"provider_sort": "speed"}, "--provider_sort must be one of price, throughput, latency."),
        ({"log_prefix_chars": -5}, "--log_prefix_chars must be 0 or more, got -5."),
        ({"resume": True, "overwrite": True}, "--resume and --overwrite contradict each other; pass one of them."),
    ],
)
def test_a_bad_value_is_one_sentence_naming_the_option(changes, message, tmp_path):
    with pytest.raises(UsageError) as raised:
        RunConfig(**{"dataset_file": tmp_path / "d.jsonl", "batch_size": 5, "run_name": "r", **changes})
    assert str(raised.value) == message


def test_the_same_sentence_reaches_the_command_line(tmp_path):
    result = CliRunner().invoke(cli, ["run", "--dataset_file", str(tmp_path / "d.jsonl"), "--batch_size", "5",
                                      "--run_name", "r", "--base_url", "http://127.0.0.1:9/v1", "--max_turns", "0"])
    assert result.exit_code == 2
    assert result.output == "Error: --max_turns must be at least 1, got 0.\n"


def test_provider_lists_are_commas_or_a_json_list_and_nothing_else(parsed, tmp_path):
    assert parsed("--providers_allowed", '["Anthropic", "Google Vertex"]').providers_allowed == ("Anthropic", "Google Vertex")
    assert parsed("--providers_order", "Anthropic,Google Vertex").providers_order == ("Anthropic", "Google Vertex")
    for value in ('["a", 1]', '["a", "b"', '"a"', "[]x"):
        result = CliRunner().invoke(cli, ["run", "--dataset_file", str(tmp_path / "d.jsonl"), "--batch_size", "5",
                                          "--run_name", "r", "--base_url", "http://127.0.0.1:9/v1",
                                          "--providers_ignored", value])
        assert result.exit_code == 2, value
        assert result.output == (
            f"Error: --providers_ignored takes names separated by commas or a JSON list of names, not {value!r}; "
            "write a,b or '[\"a\", \"b\"]'.\n"
        )
