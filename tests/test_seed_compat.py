"""What users of the seed's batch runner rely on keeps working: its file fields and its command-line habits."""

from __future__ import annotations

import datetime
import json

from conftest import write_dataset


def test_statistics_and_checkpoint_carry_the_seed_fields(runner, model_server, tmp_path):
    runner.server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(7)] + ["{broken"])
    result = runner.invoke(data, "run", "--batch_size", "3", "--skip_invalid")
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
    assert checkpoint["completed_prompts"] == checkpoint["prompts_finished"] == 7
    assert datetime.datetime.fromisoformat(checkpoint["last_updated"]) == datetime.datetime.fromisoformat(
        checkpoint["updated_at"])
