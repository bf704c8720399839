"""What users of the seed's batch runner rely on keeps working: its file fields and its command-line habits."""

from __future__ import annotations

import datetime
import json

from hermes_batch.testing import write_dataset


def test_statistics_and_checkpoint_carry_the_seed_fields(runner, model_server, tmp_path):
    runner.server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(7)] + ["{broken"])
    result = runner.invoke(data, "--batch_size", "3", "--skip_invalid")
    assert result.exit_code == 0, result.output
    folder = runner.folder()
    stats = json.loads((folder / "statistics.json").read_text())
    assert {k: stats[k] for k in ("run_name", "distribution", "total_prompts", "total_batches", "batch_size", "model")} == {
        "run_name": "run", "distribution": "default", "total_prompts": 7, "total_batches": 3, "batch_size": 3,
        "model": "scripted-model",
    }
    assert datetime.datetime.fromisoformat(stats["completed_at"]).year >= 2024
    assert stats["duration_seconds"] > 0
    terminal = stats["tool_statistics"]["terminal"]
    assert terminal["count"] == terminal["success"] > 0 and (terminal["success_rate"], terminal["failure_rate"]) == (100.0, 0.0)
    assert stats["reasoning_statistics"]["turns_with_reasoning"] == stats["reasoning_statistics"]["total_assistant_turns"] > 0

    checkpoint = json.loads((folder / "checkpoint.json").read_text())
    # batch_runner.py's completed_prompts is the list of finished prompt indices: never a count under that name
    assert "completed_prompts" not in checkpoint and checkpoint["prompts_finished"] == 7
    assert datetime.datetime.fromisoformat(checkpoint["last_updated"]) == datetime.datetime.fromisoformat(
        checkpoint["updated_at"])


def test_seed_style_boolean_values_are_accepted(runner, model_server, tmp_path):
    runner.server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(3)])
    result = runner.invoke(data, "--verbose=false", "--max_samples", "2")
    assert result.exit_code == 0, result.output
    assert "[B0:P0]" not in result.output
    result = runner.invoke(data, "--resume=True", "--verbose=true", "--skip_invalid=False", "--max_samples=all")
    assert result.exit_code == 0, result.output
    assert "[B0:P2]" in result.output  # --verbose=true logs each prompt's turns
    assert runner.server.calls_for("task 0") == 3  # --resume=True resumed: the finished prompts did not run again
    result = runner.invoke(data, "--resume=maybe")
    assert result.exit_code == 2 and "'maybe' is not a valid boolean" in result.output


def test_list_distributions_reads_the_distribution_file_wherever_it_is_given(tmp_path):
    from click.testing import CliRunner

    from hermes_batch.cli import cli

    path = tmp_path / "mine.toml"
    path.write_text('[mine]\ndescription = "Mine"\ntoolsets = { terminal = 50 }\n')
    for args in (
        ["run", "--list_distributions", "--distribution_file", str(path)],
        ["run", "--distribution_file", str(path), "--list_distributions"],
        ["run", "--list_distributions=True", f"--distribution-file={path}"],
    ):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, (args, result.output)
        assert "mine: Mine" in result.output and "default:" in result.output, args


def test_a_missing_key_for_a_hosted_endpoint_is_reported_at_once(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from hermes_batch.cli import cli

    for name in ("OPENROUTER_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": "hello"}])
    base = ["run", "--dataset_file", str(data), "--batch_size", "1", "--run_name", "r", "--output_dir", str(tmp_path / "out")]
    for extra, variable in (([], "OPENROUTER_API_KEY"), (["--base_url", "https://api.openai.com/v1"], "OPENAI_API_KEY"),
                            (["--base_url", "https://api.anthropic.com"], "ANTHROPIC_API_KEY")):
        result = CliRunner().invoke(cli, base + extra)
        assert result.exit_code == 2, result.output
        [line] = result.output.strip().splitlines()
        assert line.startswith("Error: No API key for ") and f"set {variable} or pass --api_key." in line
        assert not (tmp_path / "out").exists()
    # a local server may need no key: no complaint before the run (here it fails later, at the preflight)
    result = CliRunner().invoke(cli, base + ["--base_url", "http://127.0.0.1:9/v1", "--max_retries", "0"])
    assert "No API key" not in result.output
