"""A resume continues the run as it was started: options not given come from run.json, and options that
change what the data means are refused unless --allow_changed_settings (then run.json keeps each session's)."""

from __future__ import annotations

import json
import os

import attrs

from hermes_batch import hookimpl

from hermes_batch.run.config import RunConfig
from hermes_batch.run.run_settings import COMMAND, MEANING, RUN
from hermes_batch.testing import write_dataset
from hermes_batch.testing.runner import TEST_API_KEY


def test_every_option_has_exactly_one_class():
    # a new option must say whether a resume may change it: add it to MEANING, RUN or COMMAND in run_settings.py
    fields = {f.name for f in attrs.fields(RunConfig)}
    assert MEANING | RUN | COMMAND == fields
    assert not (MEANING & RUN) and not (MEANING & COMMAND) and not (RUN & COMMAND)


def run(runner, data, server, *extra):
    """``hermes-batch run`` with only what this test gives (no --model: the Runner's defaults would give one)."""
    return runner.cli(
        "run", "--dataset_file", str(data), "--batch_size", "5", "--run_name", "run",
        "--output_dir", str(runner.tmp_path / "out"), "--api_key", TEST_API_KEY, "--no-progress",
        "--base_url", server.base_url, *extra,
    )


def prompts(n, start=0):
    return [{"prompt": f"task {i}: say hello"} for i in range(start, start + n)]


def models_of(records):
    return sorted({r["metadata"]["model"] for r in records})


def test_a_resume_without_the_options_continues_with_those_of_run_json(runner, model_server, tmp_path):
    server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", prompts(3))
    first = run(runner, data, server, "--model", "model-a", "--distribution", "terminal_only", "--max_turns", "4")
    assert first.exit_code == 0, first.output
    write_dataset(data, prompts(6))  # three rows more
    sent = len(server.requests)

    resumed = run(runner, data, server, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert {r.model for r in server.requests[sent:]} == {"model-a"}  # not the default model
    records = runner.records("trajectories.jsonl")
    assert len(records) == 6 and models_of(records) == ["model-a"]
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert (stats["model"], stats["models"], stats["distribution"]) == ("model-a", ["model-a"], "terminal_only")
    config = json.loads((runner.folder() / "run.json").read_text())["config"]
    assert (config["model"], config["max_turns"]) == ("model-a", 4)


def test_a_resume_that_changes_the_model_is_refused_naming_both(runner, model_server, tmp_path):
    server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", prompts(3))
    assert run(runner, data, server, "--model", "model-a").exit_code == 0
    write_dataset(data, prompts(6))
    sent, before = len(server.requests), (runner.folder() / "batch_0.jsonl").read_bytes()

    refused = run(runner, data, server, "--resume", "--model", "model-b", "--max_turns", "3")
    assert refused.exit_code == 2, refused.output
    [line] = refused.output.strip().splitlines()
    assert '--model was "model-a" and is "model-b" now' in line and "--max_turns was 10 and is 3 now" in line
    assert "--allow_changed_settings" in line
    assert len(server.requests) == sent and (runner.folder() / "batch_0.jsonl").read_bytes() == before

    # options that change only how the run goes may change
    resumed = run(runner, data, server, "--resume", "--num_workers", "2", "--request_timeout", "30")
    assert resumed.exit_code == 0, resumed.output
    assert models_of(runner.records("trajectories.jsonl")) == ["model-a"]


def test_allowed_changes_are_kept_per_session_and_the_statistics_name_every_model(runner, model_server, tmp_path):
    server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", prompts(3))
    assert run(runner, data, server, "--model", "model-a").exit_code == 0
    write_dataset(data, prompts(6))

    resumed = run(runner, data, server, "--resume", "--model", "model-b", "--allow_changed_settings")
    assert resumed.exit_code == 0, resumed.output
    assert 'allowed by --allow_changed_settings' in resumed.output
    records = runner.records("trajectories.jsonl")
    assert {r["prompt_index"]: r["metadata"]["model"] for r in records} == {
        0: "model-a", 1: "model-a", 2: "model-a", 3: "model-b", 4: "model-b", 5: "model-b"}
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert stats["model"] is None and stats["models"] == ["model-a", "model-b"]
    history = json.loads((runner.folder() / "run.json").read_text())["settings_history"]
    assert [(h["session"], h["settings"]["model"]) for h in history] == [(0, "model-a"), (1, "model-b")]

    # the next resume continues with the last session's settings, and compares against them
    write_dataset(data, prompts(7))
    again = run(runner, data, server, "--resume")
    assert again.exit_code == 0, again.output
    assert runner.records("trajectories.jsonl")[-1]["metadata"]["model"] == "model-b"


def test_the_ephemeral_system_prompt_is_compared_but_never_saved(runner, model_server, tmp_path):
    server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", prompts(2))
    secret = "Always answer in the voice of a pirate captain"
    assert run(runner, data, server, "--ephemeral_system_prompt", secret).exit_code == 0
    assert secret not in (runner.folder() / "run.json").read_text()
    write_dataset(data, prompts(3))

    refused = run(runner, data, server, "--resume")  # run.json cannot give it back
    assert refused.exit_code == 2 and "--ephemeral_system_prompt was given and is not given now" in refused.output
    assert secret not in refused.output
    assert run(runner, data, server, "--resume", "--ephemeral_system_prompt", secret).exit_code == 0


def test_a_limit_taken_from_run_json_can_be_lifted(runner, model_server, tmp_path):
    server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", prompts(4))
    assert run(runner, data, server, "--max_samples", "2").exit_code == 0
    assert run(runner, data, server, "--resume").exit_code == 0
    assert len(runner.records("trajectories.jsonl")) == 2  # --max_samples 2 still
    assert run(runner, data, server, "--resume", "--max_samples", "all").exit_code == 0
    assert len(runner.records("trajectories.jsonl")) == 4


def test_a_run_whose_filter_discards_everything_says_so_at_start_and_at_the_end(runner, model_server, tmp_path):
    from hermes_batch.testing import ToolLoopScript

    server = model_server(ToolLoopScript(tool_calls=1, reasoning=None))  # a model that gives no reasoning
    data = write_dataset(tmp_path / "data.jsonl", prompts(3))
    result = run(runner, data, server, "--model", "plain", "--reasoning_disabled")
    assert result.exit_code == 0, result.output
    start, end = result.output.index("--reasoning_disabled turns reasoning off"), result.output.index("discarded 3 of")
    assert start < end
    assert "the no-reasoning filter will discard every sample" in result.output
    assert "--filter hallucinated-tools" in result.output
    assert "The no-reasoning filter discarded 3 of the 3 finished samples (100%" in result.output
    assert runner.records("trajectories.jsonl") == []

    # the way out it names: a refilter keeps them, and later resumes judge by the refilter's filters
    refiltered = runner.cli("refilter", str(runner.folder()), "--filter", "hallucinated-tools")
    assert refiltered.exit_code == 0, refiltered.output
    write_dataset(data, prompts(5))
    resumed = run(runner, data, server, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert "discarded" not in resumed.output.split("Tool usage")[0]
    assert len(runner.records("trajectories.jsonl")) == 5


def test_no_word_when_the_filters_keep_most(runner, model_server, tmp_path):
    server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", prompts(3))
    result = run(runner, data, server, "--model", "thinker")
    assert result.exit_code == 0 and "filter discarded" not in result.output and "turns reasoning off" not in result.output


def test_a_resume_needs_only_the_run_name_and_takes_the_dataset_and_batch_size_from_run_json(
        runner, model_server, tmp_path, monkeypatch):
    server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", prompts(3))
    assert run(runner, data, server, "--batch_size", "2").exit_code == 0
    write_dataset(data, prompts(5))  # two rows more
    monkeypatch.chdir(tmp_path)  # the dataset's path as run.json recorded it (absolute here) needs no cwd

    resumed = runner.cli("run", "--run_name", "run", "--resume", "--output_dir", str(tmp_path / "out"),
                         "--api_key", TEST_API_KEY, "--no-progress", "--base_url", server.base_url)
    assert resumed.exit_code == 0, resumed.output
    assert len(runner.records("trajectories.jsonl")) == 5
    assert sorted(p.name for p in runner.folder().glob("batch_*.jsonl")) == ["batch_0.jsonl", "batch_1.jsonl",
                                                                             "batch_2.jsonl"]  # two a batch, kept

    # without --resume both are required, as click says it
    fresh = runner.cli("run", "--run_name", "other", "--output_dir", str(tmp_path / "out"), "--base_url",
                       server.base_url)
    assert fresh.exit_code == 2 and "Missing option '--dataset_file' / '--dataset-file'." in fresh.output
    fresh = runner.cli("run", "--run_name", "other", "--dataset_file", str(data), "--base_url", server.base_url)
    assert fresh.exit_code == 2 and "Missing option '--batch_size' / '--batch-size'." in fresh.output


def test_a_resume_of_a_folder_without_run_json_asks_for_the_dataset(runner, model_server, tmp_path):
    (tmp_path / "out" / "run").mkdir(parents=True)  # a first session killed before it wrote run.json
    resumed = runner.cli("run", "--run_name", "run", "--resume", "--output_dir", str(tmp_path / "out"),
                         "--api_key", TEST_API_KEY, "--base_url", model_server().base_url)
    assert resumed.exit_code == 2
    assert "has no run.json to take --dataset_file and --batch_size from" in resumed.output


def test_a_resume_of_a_run_name_without_a_folder_is_refused_naming_the_closest(runner, model_server, tmp_path):
    server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", prompts(2))
    assert run(runner, data, server).exit_code == 0  # out/run
    (tmp_path / "out" / "notes").mkdir()  # not a run folder
    sent = len(server.requests)

    typo = runner.cli("run", "--dataset_file", str(data), "--batch_size", "5", "--run_name", "rnu", "--resume",
                      "--output_dir", str(tmp_path / "out"), "--api_key", TEST_API_KEY, "--base_url", server.base_url)
    assert typo.exit_code == 2, typo.output
    [line] = typo.output.strip().splitlines()
    assert line == (f"Error: There is no run folder {tmp_path}/out/rnu to resume, so --resume would pay for every "
                    "prompt again; the closest run folders there are run. Check --run_name and --output_dir, or "
                    "leave out --resume to start a new run.")
    assert len(server.requests) == sent and not (tmp_path / "out" / "rnu").exists()

    elsewhere = runner.cli("run", "--dataset_file", str(data), "--batch_size", "5", "--run_name", "run", "--resume",
                           "--output_dir", str(tmp_path / "empty"), "--api_key", TEST_API_KEY)
    assert elsewhere.exit_code == 2 and f"{tmp_path}/empty holds no run folder" in elsewhere.output


class _Gadget:
    """A throwaway plugin: the toolset gadget, which can run only where GADGET_READY is set (as a browser
    toolset needs Chromium)."""

    def __init__(self):
        import hermes_batch

        @hermes_batch.tool
        async def gadget(text: str) -> dict:
            """Do nothing.

            Args:
                text: Anything.
            """
            return {"error": None}

        class Runtime(hermes_batch.ToolsetRuntime):
            def unavailable_reason(self):
                return None if os.environ.get("GADGET_READY") else "GADGET_READY is not set."

        self.toolset = hermes_batch.Toolset("gadget", "A gadget.", (gadget,), runtime=Runtime)

    @hookimpl
    def register_toolsets(self, register):
        register(self.toolset)


def test_a_resume_on_a_machine_that_offers_other_toolsets_is_refused(runner, model_server, tmp_path, monkeypatch):
    monkeypatch.delenv("GADGET_READY", raising=False)
    server = model_server()
    runner.plugins = (_Gadget(),)
    distributions = tmp_path / "d.toml"
    distributions.write_text('[both]\ndescription = "x"\ntoolsets = { terminal = 100, gadget = 100 }\n')
    data = write_dataset(tmp_path / "data.jsonl", prompts(2))
    first = run(runner, data, server, "--distribution_file", str(distributions), "--distribution", "both")
    assert first.exit_code == 0, first.output
    assert {tuple(r["toolsets_used"]) for r in runner.records("trajectories.jsonl")} == {("terminal",)}
    write_dataset(data, prompts(4))
    sent = len(server.requests)

    monkeypatch.setenv("GADGET_READY", "1")  # the machine now offers gadget, as after installing Chromium
    refused = run(runner, data, server, "--resume")
    assert refused.exit_code == 2, refused.output
    assert ('the toolsets this machine can offer (installed plugins, Chromium, -T providers and keys) was '
            '["terminal"] and is ["gadget", "terminal"] now; give this machine the toolsets the run had, or pass '
            '--allow_changed_settings') in refused.output
    assert len(server.requests) == sent

    allowed = run(runner, data, server, "--resume", "--allow_changed_settings")
    assert allowed.exit_code == 0, allowed.output
    history = json.loads((runner.folder() / "run.json").read_text())["settings_history"]
    assert [entry["settings"]["toolsets"] for entry in history] == [["terminal"], ["gadget", "terminal"]]


def test_the_samples_of_a_row_share_its_toolsets_unless_asked_otherwise(runner, model_server, tmp_path):
    server = model_server()
    coin = tmp_path / "coin.toml"  # every toolset a coin flip: independent draws would differ within a row
    coin.write_text('[coin]\ndescription = "x"\ntoolsets = { terminal = 50, file = 50 }\n')
    data = write_dataset(tmp_path / "data.jsonl", prompts(4))
    options = ("--distribution_file", str(coin), "--distribution", "coin", "--samples_per_prompt", "6", "--seed", "7",
               "--no_filters")

    def toolsets_by_row(run_name):
        rows: dict = {}
        for record in runner.records("trajectories.jsonl", run_name):
            rows.setdefault(record["prompt_index"], set()).add(tuple(record["toolsets_used"]))
        return rows

    shared = runner.cli("run", "--dataset_file", str(data), "--batch_size", "5", "--run_name", "shared",
                        "--output_dir", str(tmp_path / "out"), "--api_key", TEST_API_KEY, "--no-progress",
                        "--base_url", server.base_url, *options)
    assert shared.exit_code == 0, shared.output
    rows = toolsets_by_row("shared")
    assert len(rows) == 4 and all(len(draws) == 1 for draws in rows.values()), rows
    assert len({draws.pop() for draws in rows.values()}) > 1  # still drawn per row

    own = runner.cli("run", "--dataset_file", str(data), "--batch_size", "5", "--run_name", "own",
                     "--output_dir", str(tmp_path / "out"), "--api_key", TEST_API_KEY, "--no-progress",
                     "--base_url", server.base_url, *options, "--toolsets_per_sample")
    assert own.exit_code == 0, own.output
    assert any(len(draws) > 1 for draws in toolsets_by_row("own").values())


def test_a_run_folder_from_before_shared_toolsets_resumes_drawing_them_per_sample(tmp_path):
    folder = tmp_path / "out" / "old"
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"config": {"dataset_file": "d.jsonl", "batch_size": 5,
                                                            "samples_per_prompt": 4}}))
    from hermes_batch.run.run_settings import inherit

    config = RunConfig(dataset_file=None, batch_size=None, run_name="old", output_dir=tmp_path / "out", resume=True)
    assert inherit(config, {"run_name", "output_dir", "resume"}).toolsets_per_sample is True
    (folder / "run.json").write_text(json.dumps({"config": {"dataset_file": "d.jsonl", "batch_size": 5,
                                                            "toolsets_per_sample": False}}))
    assert inherit(config, {"run_name", "output_dir", "resume"}).toolsets_per_sample is False


def test_a_run_of_an_earlier_version_resumes_with_the_default_filters_it_had(runner, model_server, tmp_path):
    server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", prompts(2))
    assert run(runner, data, server, "--distribution", "terminal_only").exit_code == 0
    # as a version whose default filters were the two of the seed wrote it: no --filter given, resolved to those two
    path = runner.folder() / "run.json"
    run_json = json.loads(path.read_text())
    assert run_json["config"]["filters"] is None
    for entry in run_json["settings_history"]:
        entry["settings"]["filters"] = ["no-reasoning", "hallucinated-tools"]
    path.write_text(json.dumps(run_json))
    write_dataset(data, prompts(3))

    resumed = run(runner, data, server, "--resume")
    assert resumed.exit_code == 0, resumed.output  # not refused as a change of the filters
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert sorted(stats["discarded_by_filter"]) == ["hallucinated-tools", "no-reasoning"]
    assert stats["prompts"]["finished"] == 3
