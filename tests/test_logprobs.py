"""--logprobs / --top_logprobs: each assistant turn's token ids and logprobs kept beside the record
(batch_N.tokens.jsonl), checked against the endpoint's tokenizer, and exported with the rollouts; all through the
scripted server and the real openai SDK."""

from __future__ import annotations

import json
import math

import pytest

from hermes_batch.formats import token_ids
from hermes_batch.testing import ToolLoopScript, write_dataset
from hermes_batch.testing.runner import TEST_API_KEY
from hermes_batch.testing.tokens import END, MERGED_IN, encode_text

SCRIPT = ToolLoopScript(tool_calls=1, reasoning=None, final="Finished in time: {last_result}")


def run(runner, data, server, *extra, base_url=None, run_name="run"):
    return runner.cli(
        "run", "--dataset_file", str(data), "--batch_size", "2", "--run_name", run_name,
        "--output_dir", str(runner.tmp_path / "out"), "--api_key", TEST_API_KEY, "--no-progress",
        "--model", "scripted-model", "--base_url", base_url or server.base_url, "--distribution", "terminal_only",
        "--no_filters", *extra,
    )


def side_lines(folder):
    lines = []
    for path in sorted(folder.glob("batch_*.tokens.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines()]
    return lines


def test_token_ids_and_logprobs_are_kept_beside_each_record_and_match_the_tokenizer(runner, model_server, tmp_path):
    server = model_server(SCRIPT, tokenizer="agree")
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(3)])

    result = run(runner, data, server, "--logprobs", "--top_logprobs", "2")
    assert result.exit_code == 0, result.output
    sent = [r for r in server.requests if not r.preflight]
    assert sent and all(r.body["logprobs"] is True and r.body["top_logprobs"] == 2 for r in sent)
    assert all(r.body["return_tokens_as_token_ids"] is True for r in sent)  # vLLM's spelling of the ids

    records = runner.records("trajectories.jsonl")
    assert len(records) == 3
    assert {r["metadata"]["token_check"] for r in records} == {"match"}
    assert all("tokens" not in r and "token_id" not in json.dumps(r) for r in records)  # not in the record
    entries = side_lines(runner.folder())
    assert len(entries) == 3 and [e["prompt_index"] for e in sorted(entries, key=lambda e: e["prompt_index"])] == [0, 1, 2]
    for entry in entries:
        record = next(r for r in records if r["metadata"]["content_key"] == entry["key"])
        gpt = [i for i, turn in enumerate(record["conversations"]) if turn["from"] == "gpt"]
        assert [t["turn"] for t in entry["turns"]] == gpt
        final = entry["turns"][-1]
        text = record["conversations"][gpt[-1]]["value"]
        assert final["ids"] == encode_text(text) + [END]  # the ids the server sampled, not the text re-tokenized
        assert all(math.isfinite(v) and v <= 0 for v in final["logprobs"])
        assert all(len(top) == 2 and top[0][0] == i for top, i in zip(final["top"], final["ids"]))
        sequence = entry["sequence"]
        for turn in entry["turns"]:
            assert sequence[turn["start"]:turn["start"] + len(turn["ids"])] == turn["ids"]
    assert server.tokenize_requests == 3


def test_a_tokenizer_that_drifts_is_flagged_per_record_and_counted(runner, model_server, tmp_path):
    server = model_server(SCRIPT, tokenizer="drift")
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": "task"}])

    assert run(runner, data, server, "--logprobs").exit_code == 0
    [record] = runner.records("trajectories.jsonl")
    assert record["metadata"]["token_check"] == "drift"
    [entry] = side_lines(runner.folder())
    assert entry["check"] == "drift" and MERGED_IN in entry["sequence"]
    assert entry["turns"][-1]["start"] == -1  # the answer's "in" was re-tokenized as one token
    stats = json.loads((runner.folder() / "statistics.json").read_text())
    assert stats["token_check"] == {"match": 0, "drift": 1, "unchecked": 0, "redacted": 0}


@pytest.mark.parametrize("spelling", ["llama.cpp", "openai"])
def test_without_a_tokenizer_the_tokens_are_kept_unchecked(runner, model_server, tmp_path, spelling):
    # llama.cpp's server: ids in each entry's "id"; OpenAI's API: only the tokens' text
    server = model_server(SCRIPT, logprobs=spelling)
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": "task"}])
    assert run(runner, data, server, "--logprobs").exit_code == 0
    [record] = runner.records("trajectories.jsonl")
    assert record["metadata"]["token_check"] == "unchecked"
    [entry] = side_lines(runner.folder())
    assert entry["sequence"] is None
    text = record["conversations"][entry["turns"][-1]["turn"]]["value"]
    if spelling == "llama.cpp":
        assert entry["turns"][-1]["ids"] == encode_text(text) + [END]
    else:
        assert entry["turns"][-1]["ids"] is None and "".join(entry["turns"][-1]["pieces"][:-1]) == text


def test_an_endpoint_that_returns_no_logprobs_is_refused_at_the_preflight(runner, model_server, tmp_path):
    server = model_server(SCRIPT, logprobs=None)
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": "task"}])
    result = run(runner, data, server, "--logprobs")
    assert result.exit_code == 2, result.output
    assert "returned no token logprobs for the preflight request" in result.output
    assert [r for r in server.requests if not r.preflight] == []  # no prompt was paid for


def test_the_anthropic_client_refuses_logprobs_before_any_request(runner, model_server, tmp_path):
    server = model_server(SCRIPT)
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": "task"}])
    result = run(runner, data, server, "--model_client", "anthropic", "--top_logprobs", "3",
                 base_url=server.anthropic_base_url)
    assert result.exit_code == 2
    assert "The model client 'anthropic' cannot return token ids and logprobs" in result.output
    assert server.request_count == 0


def test_the_side_file_resumes_with_the_records(runner, model_server, tmp_path):
    server = model_server(SCRIPT, tokenizer="agree")
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(2)])
    assert run(runner, data, server, "--logprobs", "--max_samples", "1").exit_code == 0
    first = side_lines(runner.folder())
    assert len(first) == 1
    data2 = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}"} for i in range(3)])
    result = run(runner, data2, server, "--resume", "--max_samples", "3")
    assert result.exit_code == 0, result.output
    entries = side_lines(runner.folder())
    assert len(entries) == 3 and entries[0] == first[0]
    assert {r["metadata"]["token_check"] for r in runner.records("trajectories.jsonl")} == {"match"}


def test_export_rollouts_gives_per_turn_ids_a_loss_mask_and_logprobs(runner, model_server, tmp_path):
    server = model_server(SCRIPT, tokenizer="agree")
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": "task"}])
    assert run(runner, data, server, "--logprobs", "--samples_per_prompt", "2").exit_code == 0
    # a refilter moves records between files; the side entries follow them by key and conversation
    assert runner.cli("refilter", str(runner.folder()), "--filter", "hallucinated-tools").exit_code == 0
    out = tmp_path / "export"
    result = runner.cli("export", str(runner.folder()), "--format", "rollouts", "--output", str(out))
    assert result.exit_code == 0, result.output
    [line] = [json.loads(x) for x in next(out.glob("*.jsonl")).read_text().splitlines()]
    assert len(line["samples"]) == 2
    for sample in line["samples"]:
        assert sample["token_check"] == "match"
        ids, mask, logprobs = sample["input_ids"], sample["loss_mask"], sample["logprobs"]
        assert len(ids) == len(mask) == len(logprobs) and 0 < sum(mask) < len(ids)
        for turn in sample["turns"]:
            start = len(turn["prompt_ids"])
            assert ids[:start] == turn["prompt_ids"]
            assert ids[start:start + len(turn["completion_ids"])] == turn["completion_ids"]
            assert mask[start:start + len(turn["completion_ids"])] == [1] * len(turn["completion_ids"])
            assert logprobs[start:start + len(turn["completion_ids"])] == turn["completion_logprobs"]
        assert sum(mask) == sum(len(t["completion_ids"]) for t in sample["turns"])  # assistant tokens only


@pytest.mark.parametrize("logprobs", [
    {"content": [{"token": "a", "logprob": float("nan")}]},
    {"content": [{"token": "token_id:99999999999", "logprob": -0.1}]},
    {"content": [{"token": "a", "logprob": 5.0}]},
    {"content": [{"token": "a", "id": -3, "logprob": -0.1}, {"token": "b" * 1000, "logprob": -0.1}]},
    {"content": "all of them"},
    {"content": [{"token": "a", "id": 1, "logprob": -0.1, "top_logprobs": [{"token": "b", "logprob": 1e999}]}]},
])
def test_numbers_an_endpoint_sends_cannot_poison_a_turn(logprobs):
    assert token_ids.from_openai_logprobs(logprobs, top_wanted=2) is None


def test_a_hostile_side_line_is_not_read_back():
    good = {"key": "k", "digest": "d", "prompt_index": 0, "sample_index": 0, "check": "match", "sequence": [1, 2, 3],
            "turns": [{"turn": 2, "start": 1, "ids": [2, 3], "logprobs": [-0.5, -0.25]}]}
    assert token_ids.read_side_entry(good) is not None
    for bad in ({**good, "sequence": [1, "2"]}, {**good, "check": "fine"},
                {**good, "turns": [{"turn": 2, "start": 2, "ids": [2, 3], "logprobs": [-0.5, -0.25]}]},
                {**good, "turns": [{"turn": 2, "start": 1, "ids": [2, 3], "logprobs": [-0.5]}]},
                {**good, "turns": [{"turn": 2, "start": 1, "ids": [2, 3], "logprobs": [-0.5, float("inf")]}]}):
        assert token_ids.read_side_entry(bad) is None


def test_a_journaled_answer_replays_with_its_token_ids():
    from hermes_batch.folder.replay_journal import decode_response, encode_response
    from hermes_batch.formats.records import Message, ModelResponse

    tokens = token_ids.TurnTokens((5, 6, 2), (-0.5, -0.25, -0.125), (((5, -0.5),), ((6, -0.25),), ((2, -0.125),)))
    response = ModelResponse(Message("assistant", "hi", tokens=tokens), "stop")
    encoded = json.loads(json.dumps(encode_response(response)))
    assert decode_response(encoded).message.tokens == tokens
    encoded["t"]["logprobs"][0] = 3.0  # a journal edited by hand: the turn keeps no tokens, the answer replays
    assert decode_response(encoded).message.tokens is None


def test_turns_are_found_in_order_and_only_on_token_boundaries():
    assert token_ids.find_turns((1, 2, 3, 4, 5, 2, 3), [[2, 3], [2, 3], [9], [4]]) == [1, 5, -1, -1]
    assert token_ids.find_turns((256, 1, 0, 0), [[1]]) == [1]  # not inside the bytes of 256
    # a tokenizer's answer built to make the search quadratic: a million equal tokens
    assert token_ids.find_turns((7,) * 1_000_000, [[7] * 200_000 + [8]]) == [-1]
