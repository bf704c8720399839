"""Sampling settings (--temperature, --top_p, --top_k, the penalties, --extra_body): sent by both clients,
kept in run.json and each record's metadata, and refused when a resume changes them."""

from __future__ import annotations

import json

from hermes_batch.testing import write_dataset
from hermes_batch.testing.runner import TEST_API_KEY

SAMPLING = ("--temperature", "0.7", "--top_p", "0.9", "--top_k", "40", "--extra_body", "min_p=0.05",
            "--extra_body", 'chat_template_kwargs={"enable_thinking": false}')


def run(runner, data, server, *extra, base_url=None):
    return runner.cli(
        "run", "--dataset_file", str(data), "--batch_size", "5", "--run_name", "run",
        "--output_dir", str(runner.tmp_path / "out"), "--api_key", TEST_API_KEY, "--no-progress",
        "--model", "scripted-model", "--base_url", base_url or server.base_url, "--distribution", "terminal_only",
        *extra,
    )


def test_the_sampling_settings_reach_every_request_and_every_record(runner, model_server, tmp_path):
    server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}: list the files"} for i in range(3)])

    result = run(runner, data, server, *SAMPLING, "--frequency_penalty", "0.5", "--presence_penalty", "-0.25")
    assert result.exit_code == 0, result.output
    sampled = [r for r in server.requests if not r.preflight]
    assert len(sampled) == 9  # three turns a prompt
    for request in sampled:
        body = request.body
        assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"]) == (0.7, 0.9, 40, 0.05)
        assert (body["frequency_penalty"], body["presence_penalty"]) == (0.5, -0.25)
        assert body["chat_template_kwargs"] == {"enable_thinking": False}
    expected = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "frequency_penalty": 0.5, "presence_penalty": -0.25,
                "extra_body": {"min_p": 0.05, "chat_template_kwargs": {"enable_thinking": False}}}
    records = runner.records("trajectories.jsonl")
    assert len(records) == 3
    assert {r["metadata"]["sampling"] for r in records} == {json.dumps(expected)}  # JSON text, one type
    config = json.loads((runner.folder() / "run.json").read_text())["config"]
    assert {k: config[k] for k in ("temperature", "top_p", "top_k")} == {"temperature": 0.7, "top_p": 0.9, "top_k": 40}
    assert config["extra_body"] == expected["extra_body"]


def test_without_sampling_settings_nothing_is_sent_and_the_record_says_so(runner, model_server, tmp_path):
    server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": "list the files"}])
    assert run(runner, data, server).exit_code == 0
    for request in server.requests:
        assert not {"temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty"} & set(request.body)
    [record] = runner.records("trajectories.jsonl")
    assert record["metadata"]["sampling"] == "{}"


def test_the_anthropic_client_sends_what_its_api_takes_and_refuses_the_rest_at_start(runner, model_server, tmp_path):
    server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": "list the files"}])
    anthropic = ("--model_client", "anthropic")

    result = run(runner, data, server, *anthropic, "--reasoning_disabled", *SAMPLING,
                 base_url=server.anthropic_base_url)
    assert result.exit_code == 0, result.output
    sent = [r for r in server.requests if r.api == "anthropic" and not r.preflight]
    assert sent and all((r.body["temperature"], r.body["top_p"], r.body["top_k"], r.body["min_p"]) == (0.7, 0.9, 40, 0.05)
                        for r in sent)
    count = server.request_count

    penalty = run(runner, data, server, *anthropic, "--reasoning_disabled", "--frequency_penalty", "0.5",
                  "--overwrite", base_url=server.anthropic_base_url)
    assert penalty.exit_code == 2
    assert "The model client 'anthropic' does not send --frequency_penalty" in penalty.output
    thinking = run(runner, data, server, *anthropic, "--temperature", "0.5", "--overwrite",
                   base_url=server.anthropic_base_url)
    assert thinking.exit_code == 2 and "--temperature 0.5" in thinking.output
    assert "--reasoning_disabled" in thinking.output
    assert server.request_count == count  # refused before the preflight


def test_a_resume_that_changes_a_sampling_setting_is_refused(runner, model_server, tmp_path):
    server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(2)])
    assert run(runner, data, server, "--temperature", "0.7").exit_code == 0
    write_dataset(data, [{"prompt": f"task {i}"} for i in range(4)])

    refused = run(runner, data, server, "--resume", "--temperature", "1.0")
    assert refused.exit_code == 2
    assert "--temperature was 0.7 and is 1.0 now" in refused.output
    refused = run(runner, data, server, "--resume", "--extra_body", "min_p=0.1")
    assert refused.exit_code == 2 and "--extra_body was {} and is {\"min_p\": 0.1} now" in refused.output

    resumed = run(runner, data, server, "--resume")  # the run's temperature, from run.json
    assert resumed.exit_code == 0, resumed.output
    records = runner.records("trajectories.jsonl")
    assert len(records) == 4 and {r["metadata"]["sampling"] for r in records} == {'{"temperature": 0.7}'}


def test_extra_body_cannot_set_what_the_run_sends_itself(runner, model_server, tmp_path):
    server = model_server()
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": "x"}])
    result = run(runner, data, server, "--extra_body", "temperature=1", "--extra_body", "messages=[]")
    assert result.exit_code == 2
    assert ("--extra_body cannot set messages, temperature, which the run sends itself; pass --temperature "
            "instead.") in result.output
    assert run(runner, data, server, "--top_p", "1.5").output.strip() == "Error: --top_p must be at most 1, got 1.5."
    assert server.request_count == 0
