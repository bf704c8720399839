"""Verifiers and samples per prompt (issue 31 items 1, 2 and 5), through real runs on the scripted server."""

from __future__ import annotations

import asyncio
import json

import attrs
import pytest

import hermes_batch
from hermes_batch.testing import Reply, RoutedScript, write_dataset

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def solves(content: str):
    """A script whose session writes ``content`` to answer.txt with the terminal tool, then answers."""

    def script(request):
        if request.turn == 0:
            command = f"printf '%s' '{content}' > answer.txt"
            return Reply(reasoning="I will write it.", tool_calls=[("terminal", {"command": command})])
        return Reply(content=f"The answer is {content}.", reasoning="Done.")

    return script


def by_sample(*contents: str):
    """Sample i writes contents[i] (the last one for later samples)."""
    return RoutedScript(lambda sample: solves(contents[min(sample, len(contents) - 1)]), by="sample")


TESTS = "test \"$(cat answer.txt)\" = 42"


def kept(runner, run_name=None) -> list[dict]:
    records = runner.records("trajectories.jsonl", run_name)
    records += [d["trajectory"] for d in runner.records("discarded.jsonl", run_name)]
    return sorted(records, key=lambda r: (r["prompt_index"], r["metadata"]["sample_index"]))


def test_the_command_verifier_rewards_what_the_session_left_in_the_sandbox(runner, model_server, tmp_path):
    runner.server = model_server(by_sample("41", "42"))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "Write 42 to answer.txt", "tests": TESTS}])
    result = runner.invoke(dataset, "--verifier", "command", "--samples_per_prompt", "2")
    assert result.exit_code == 0, result.output
    records = kept(runner)
    meta = [r["metadata"] for r in records]
    assert [m["sample_index"] for m in meta] == [0, 1]
    assert [(m["reward"], m["verified"], m["passed"]) for m in meta] == [(0.0, True, False), (1.0, True, True)]
    results = [json.loads(m["verifiers"]) for m in meta]
    assert [r[0]["reason"] for r in results] == ["exit status 1", "exit status 0"]
    assert meta[0]["content_key"] != meta[1]["content_key"]
    assert all(r[0]["error"] == "" and r[0]["duration_s"] > 0 for r in results)
