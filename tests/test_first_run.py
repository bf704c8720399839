"""A new user's first runs: the README's commands work, and the run says plainly what it will not do."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from hermes_batch.contract import plugins
from hermes_batch.run import selection
from hermes_batch.cli import cli
from hermes_batch.testing import TEST_API_KEY, write_dataset

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def without_toolbox(monkeypatch):
    """As on a machine where hermes-batch-toolbox is not installed (the test environment has it)."""
    load = plugins._load_entry_point

    def load_all_but_toolbox(pm, ep, strict):
        if ep.name != "toolbox":
            load(pm, ep, strict)

    monkeypatch.setattr(plugins, "_load_entry_point", load_all_but_toolbox)


READMES = [ROOT / "README.md", *ROOT.glob("hermes_batch_*/README.md"), *ROOT.glob("plugins/*/README.md")]


def commands(text: str, program: str) -> list[list[str]]:
    """The shell commands of the code blocks that run ``program`` (continuation lines joined)."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            words = shlex.split(line) if line else []
            if any(Path(word).name == program for word in words[:2]):
                found.append(words)
    return found


def test_the_quick_start_runs_on_a_file_that_exists():
    runs = [words for words in commands((ROOT / "README.md").read_text(), "hermes-batch") if "run" in words]
    first, resume = runs[:2]
    [path] = [w.split("=", 1)[1] for w in first if w.startswith("--dataset_file=")]
    assert (ROOT / path).is_file(), path
    # the resume names the run only: the dataset and every other option come from its run.json
    assert "--resume" in resume and not [w for w in resume if w.startswith("--dataset_file")]
    assert [w for w in resume if w.startswith("--run_name")] == [w for w in first if w.startswith("--run_name")]


def test_every_pip_command_that_installs_a_plugin_from_the_checkout_installs_the_core_with_it():
    checked = 0
    for readme in READMES:
        for words in commands(readme.read_text(), "pip"):
            paths = [w for w in words[2:] if not w.startswith("-") and ("/" in w or w == ".")]
            for path in paths:
                pyproject = ROOT / path / "pyproject.toml"
                if path == "." or (pyproject.exists() and "hermes-batch" not in tomllib.loads(
                        pyproject.read_text())["project"].get("dependencies", [])):
                    continue
                # a plugin (plugins/hermes_batch_toolbox comes from another branch: assumed one until it is here)
                assert "." in paths, f"{readme.name}: {' '.join(words)} needs the core in the same command"
                checked += 1
    assert checked >= 3


def test_the_distribution_listing_names_the_plugin_of_unavailable_toolsets(without_toolbox):
    result = CliRunner().invoke(cli, ["distributions"])
    assert result.exit_code == 0
    assert result.output.count("hermes-batch-toolbox provides") == 1
    assert "pip install . ./plugins/hermes_batch_toolbox" in result.output
    data = json.loads(CliRunner().invoke(cli, ["distributions", "--json"]).output)
    default = next(d for d in data if d["name"] == "default")
    assert {t["name"]: t.get("plugin") for t in default["toolsets"] if not t["available"]} == dict.fromkeys(
        ["web", "vision", "image_gen", "moa", "browser"], "hermes-batch-toolbox")


def test_a_run_says_once_which_plugin_provides_the_missing_toolsets(runner, model_server, tmp_path, without_toolbox):
    runner.server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(6)])
    result = runner.invoke(data, "--distribution", "default")
    assert result.exit_code == 0, result.output
    # the default distribution names every toolset: what it cannot offer is said once, in the start banner,
    # not warned about (the user asked for none of them by name)
    [line] = [line for line in result.output.splitlines() if "Toolsets of distribution default" in line]
    assert "; not installed: web, vision, image_gen, moa, browser (hermes-batch-toolbox provides" in line
    assert " INFO " in line and not [w for w in result.output.splitlines() if "WARNING" in w and "oolset" in w]
    # a distribution chosen by name warns about what it names and the machine lacks
    research = runner.invoke(data, "--distribution", "research", run_name="research")
    assert research.exit_code == 0, research.output
    [warning] = [line for line in research.output.splitlines() if "names toolsets no installed plugin provides" in line]
    assert "WARNING" in warning and "hermes-batch-toolbox provides" in warning
    refused = runner.invoke(data, "--distribution", "browser_only", run_name="other")
    assert refused.exit_code == 2
    assert "hermes-batch-toolbox provides browser" in refused.output


def test_the_start_banner_names_the_filters_in_force_and_those_a_filter_given_turned_off(runner, model_server, tmp_path):
    runner.server = model_server()
    runner.options = ("--distribution", "terminal_only")
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": "task"}])

    def filters_line(result):
        assert result.exit_code == 0, result.output
        [line] = [line for line in result.output.splitlines() if " INFO Filters: " in line]
        return line.split(" INFO Filters: ", 1)[1]

    defaults = ", ".join(selection.DEFAULT_FILTERS)
    assert filters_line(runner.invoke(data)) == f"{defaults} (the defaults; a --filter replaces them, see docs/options.md)"
    others = [name for name in selection.DEFAULT_FILTERS if name != "no-reasoning"]
    assert filters_line(runner.invoke(data, "--filter", "no-reasoning", run_name="one")) == (
        f"no-reasoning; the default filter{'s' if len(others) > 1 else ''} {', '.join(others)} "
        f"{'are' if len(others) > 1 else 'is'} off, as --filter replaces the defaults "
        f"(add {' '.join(f'--filter {name}' for name in others)} to keep {'them' if len(others) > 1 else 'it'})")
    assert filters_line(runner.invoke(data, "--no_filters", run_name="none")) == "none (--no_filters)"
    every = [f"--filter={name}" for name in selection.DEFAULT_FILTERS]
    assert filters_line(runner.invoke(data, *every, "--filter", "verified", "--verifier", "answer",
                                      run_name="all")) == f"{defaults}, verified"


def test_the_local_sandbox_says_once_that_it_ignores_images(runner, model_server, tmp_path):
    runner.server = model_server()
    rows = [{"prompt": f"task {i}", "image": f"python:3.{10 + i % 4}"} for i in range(8)] + [{"prompt": "plain"}]
    data = write_dataset(tmp_path / "data.jsonl", rows)
    result = runner.invoke(data)
    assert result.exit_code == 0, result.output
    [warning] = [line for line in result.output.splitlines() if "container images" in line]
    assert "python:3.10, python:3.11, python:3.12, ..." in warning and "--sandbox docker" in warning
    assert {t["metadata"]["image"] for t in runner.records("trajectories.jsonl")} == {""}  # it ran in no image
    quiet = runner.invoke(write_dataset(tmp_path / "plain.jsonl", [{"prompt": "plain"}]), run_name="plain")
    assert "container images" not in quiet.output


def test_skip_invalid_lists_the_lines_it_skipped(runner, model_server, tmp_path):
    runner.server = model_server()
    rows = []
    for i in range(30):
        rows.append({"prompt": f"task {i}"})
        if i % 2:
            rows.append('{"prompt": "cut sho')  # a line cut short
    data = write_dataset(tmp_path / "data.jsonl", rows)
    result = runner.invoke(data, "--skip_invalid", "--max_samples", "40")
    assert result.exit_code == 0, result.output
    listed = (runner.folder() / "skipped_lines.txt").read_text().splitlines()
    assert len(listed) == 13  # of the first 40 lines
    assert listed[0] == f"{data}:3: invalid JSON: the line ends at column 19 before the JSON does (cut short?)"
    log = result.output
    assert "Skipped 13 invalid line(s)" in log and f"{data}:3: invalid JSON" in log and "... and 3 more" in log
    assert f"{data}:29:" not in log  # the eleventh: in the file only


def test_a_truncated_line_is_reported_where_it_broke(tmp_path):
    from hermes_batch.formats.dataset import validate_dataset

    path = write_dataset(tmp_path / "d.jsonl", ['{"prompt": "fine"}', '{"prompt": "abc", "n": [1, 2', '{"prompt": "x" "y"}'])
    problems = validate_dataset(path).problems
    assert problems == (
        f"{path}:2: invalid JSON: the line ends at column 28 before the JSON does (cut short?)",
        f"{path}:3: invalid JSON: Expecting ',' delimiter at column 16",
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["run", "--sandbox", "singularity"], "Unknown --sandbox 'singularity': hermes-batch-singularity provides "
         "singularity (from this repository: pip install . ./hermes_batch_singularity); install it or pass one of "
         "the installed sandbox backends: local."),
        (["run", "--sandbox", "modal"], "(from this repository: pip install . ./hermes_batch_modal)"),
        (["run", "--executor", "ray"], "hermes-batch-ray provides ray (from this repository: pip install . "
         "./plugins/hermes_batch_ray); install it or pass one of the installed executors: local, processes."),
        (["run", "--filter", "length:min_chars=10"], "hermes-batch-filters provides length (from this repository: "
         "pip install . ./plugins/hermes_batch_filters)"),
        (["run", "--writer", "parquet"], "hermes-batch-parquet provides parquet"),
        (["export", "RUN", "--format", "parquet"], "Unknown --format 'parquet': hermes-batch-parquet provides parquet "
         "(from this repository: pip install . ./plugins/hermes_batch_parquet)"),
        (["refilter", "RUN", "--filter", "near-duplicates"], "hermes-batch-filters provides near-duplicates"),
        (["run", "-T", "web.provider=brave"], "hermes-batch-toolbox provides web (from this repository: "
         "pip install . ./plugins/hermes_batch_toolbox)"),
        (["docker", "cleanup"], "No command 'docker': hermes-batch-docker provides docker (from this repository: "
         "pip install . ./hermes_batch_docker); install it."),
        (["run", "--filter", "no-reasonin"], "Unknown --filter 'no-reasonin'; installed: empty-answer, "
         "hallucinated-tools, no-reasoning, no-shortcuts, verified; did you mean --filter no-reasoning?"),
    ],
)
def test_a_first_party_plugin_that_is_not_installed_is_named_with_its_install_line(
    tmp_path, model_server, monkeypatch, args, says
):
    monkeypatch.setattr(plugins, "_load_entry_point", lambda pm, ep, strict: None)  # the core alone: `pip install .`
    server = model_server()
    run_folder = tmp_path / "out" / "done"
    if args[0] == "run":
        data = write_dataset(tmp_path / "d.jsonl", [{"prompt": "p"}])
        args = ["run", "--dataset_file", str(data), "--batch_size", "1", "--run_name", "r", "--output_dir",
                str(tmp_path / "out"), "--base_url", server.base_url, "--api_key", TEST_API_KEY, *args[1:]]
    elif "RUN" in args:
        data = write_dataset(tmp_path / "d.jsonl", [{"prompt": "p"}])
        done = CliRunner().invoke(cli, ["run", "--dataset_file", str(data), "--batch_size", "1", "--run_name", "done",
                                        "--output_dir", str(tmp_path / "out"), "--base_url", server.base_url,
                                        "--api_key", TEST_API_KEY, "--no_filters", "--no-progress"])
        assert done.exit_code == 0, done.output
        args = [str(run_folder) if arg == "RUN" else arg for arg in args]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split())
