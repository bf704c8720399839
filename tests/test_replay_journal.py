"""Nothing paid twice in the middle of a session: responses.jsonl, replayed on --resume with live tools.

A scripted 10-turn session (nine tool calls, then an answer) is cut off at a turn
boundary: its next request hangs at the scripted server while the run is killed
(SIGKILL, Ctrl-C).  The resume must send exactly the requests the killed session
had not been answered yet, and, when a tool prints something else, exactly the
remainder from the first request that differs.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import types

import attrs
import pytest

from hermes_batch.contract.interfaces import PREFLIGHT_PROMPT
from hermes_batch.folder.replay_journal import REPLAY_JOURNAL_NAME, ResponseJournal, decode_response, encode_response
from hermes_batch.formats.records import Message, ModelResponse, ToolCall, Usage
from hermes_batch.testing import ToolLoopScript, write_dataset
from hermes_batch.testing.fixtures import ended, wait_for

TURNS = 10  # nine tool calls, then the answer
BASE = ("--distribution", "terminal_only", "--seed", "7", "--max_turns", str(TURNS))
COST = 0.001
SCRIPT = ToolLoopScript(tool_calls=TURNS - 1)


def priced(script):
    def answer(request):
        return attrs.evolve(script(request), usage=Usage(prompt_tokens=100, completion_tokens=10, cost=COST))

    return answer


def diverging(turn: int):
    """SCRIPT, but the tool call of ``turn`` prints something new each time it runs."""

    def answer(request):
        reply = SCRIPT(request)
        if request.turn == turn:
            reply = attrs.evolve(reply, tool_calls=[("terminal", {"command": "date +%s%N"})])
        return reply

    return answer


def turns_asked(server, prompt, since=0):
    return [r.turn for r in server.requests[since:] if r.prompt == prompt]


def records(folder):
    found = {}
    for path in folder.glob("batch_*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            found[record["conversations"][1]["value"]] = record
    return found


def cut_off(runner, server, data, prompts, stop, extra=(), signum=signal.SIGKILL):
    """Run until prompt i waits for the answer to its request of turn stop[i], then send ``signum``."""
    proc = runner.spawn(data, *BASE, *extra, server=server, start_new_session=True)
    try:
        wait_for(lambda: all(stop[p] in turns_asked(server, p) for p in prompts), 180, "every prompt at its turn", proc)
    finally:
        if signum == signal.SIGKILL:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.send_signal(signum)
        out, err = ended(proc, 60)
    return proc.returncode, err


def hang_at(stop, released):
    return lambda r: not released.is_set() and r.prompt in stop and r.turn == stop[r.prompt]


@pytest.mark.parametrize("client", ["openai", "anthropic"])
def test_sigkill_at_every_turn_boundary_resumes_without_paying_again(tmp_path, runner, model_server, client):
    prompts = [f"task {k}: list the files" for k in range(TURNS)]
    stop = {p: k for k, p in enumerate(prompts)}  # prompt k is killed waiting for its answer of turn k
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    released = threading.Event()
    server = model_server(priced(SCRIPT), hang=hang_at(stop, released))
    extra = ("--model_client", "anthropic", "--base_url", server.anthropic_base_url) if client == "anthropic" else ()
    runner.options = extra
    code, err = cut_off(runner, server, data, prompts, stop, ("--num_workers", "10"))
    assert code == -signal.SIGKILL, err
    released.set()
    folder = runner.folder()
    assert (folder / REPLAY_JOURNAL_NAME).exists()
    before = len(server.requests)

    result = runner.invoke(data, *BASE, "--resume", server=server)
    assert result.exit_code == 0, result.output
    saved = records(folder)
    for prompt, k in stop.items():
        # the killed session's request of turn k was never answered: it and the rest are all that is sent
        assert turns_asked(server, prompt, before) == list(range(k, TURNS)), prompt
        metadata = saved[prompt]["metadata"]
        assert metadata["replayed_turns"] == k
        assert saved[prompt]["api_calls"] == TURNS and saved[prompt]["completed"]
    assert not (folder / REPLAY_JOURNAL_NAME).exists()  # every prompt has its record: the journal is gone
    # statistics count every answer once: what the endpoint served, not what the records replayed
    stats = json.loads((folder / "statistics.json").read_text())
    answered = server.responses_by_status[200] - server.calls_for(PREFLIGHT_PROMPT)
    assert answered == TURNS * TURNS
    assert stats["tokens"]["prompt"] == 100 * answered  # the Anthropic API reports no cost: tokens say the same
    if client == "openai":
        assert stats["cost"] == pytest.approx(COST * answered)
    assert stats["model_requests"]["requests"] == answered + TURNS  # plus the ten hung requests, unanswered


def test_a_tool_that_prints_something_else_sends_exactly_the_remainder(tmp_path, runner, model_server):
    prompt = "task: list the files"
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": prompt}])
    released = threading.Event()
    stop = {prompt: 7}
    server = model_server(priced(diverging(3)), hang=hang_at(stop, released))
    code, err = cut_off(runner, server, data, [prompt], stop)
    assert code == -signal.SIGKILL, err
    released.set()
    before = len(server.requests)
    result = runner.invoke(data, *BASE, "--resume", server=server)
    assert result.exit_code == 0, result.output
    # answers 0 to 3 replayed (their requests match); the tool of turn 3 printed another time, so request 4 differs
    assert turns_asked(server, prompt, before) == list(range(4, TURNS))
    assert records(runner.folder())[prompt]["metadata"]["replayed_turns"] == 4


def cut_off_and_resume(tmp_path, runner, model_server, turns, options, signum, status, resume_options=()):
    """Prompt "task k" is cut off (``signum``) waiting for its answer of turn k, then resumed: each sends only
    turns k and on, and its record says k turns were replayed."""
    prompts = [f"task {k}: list the files" for k in turns]
    stop = dict(zip(prompts, turns))
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    released = threading.Event()
    server = model_server(priced(SCRIPT), hang=hang_at(stop, released))
    code, err = cut_off(runner, server, data, prompts, stop, options, signum=signum)
    assert code == status, err
    released.set()
    before = len(server.requests)
    result = runner.invoke(data, *BASE, *resume_options, "--resume", server=server)
    assert result.exit_code == 0, result.output
    saved = records(runner.folder())
    for prompt, k in stop.items():
        assert turns_asked(server, prompt, before) == list(range(k, TURNS))
        assert saved[prompt]["metadata"]["replayed_turns"] == k


def test_ctrl_c_at_turn_boundaries_resumes_without_paying_again(tmp_path, runner, model_server):
    cut_off_and_resume(tmp_path, runner, model_server, (1, 4, 9), ("--num_workers", "3"), signal.SIGINT, 130)


def test_processes_executor_replays_through_its_driver(tmp_path, runner, model_server):
    processes = ("--executor", "processes", "-E", "workers=2", "--num_workers", "2")
    cut_off_and_resume(tmp_path, runner, model_server, (2, 6), processes, signal.SIGKILL, -signal.SIGKILL, processes)


def test_a_journal_torn_by_a_kill_is_read_up_to_its_last_whole_entry(tmp_path, runner, model_server):
    prompt = "task: list the files"
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": prompt}])
    released = threading.Event()
    stop = {prompt: 6}
    server = model_server(priced(SCRIPT), hang=hang_at(stop, released))
    code, err = cut_off(runner, server, data, [prompt], stop)
    assert code == -signal.SIGKILL, err
    released.set()
    path = runner.folder() / REPLAY_JOURNAL_NAME
    data_bytes = path.read_bytes()
    last = data_bytes.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data_bytes[: last + (len(data_bytes) - last) // 2])  # the answer of turn 5 half written
    before = len(server.requests)
    result = runner.invoke(data, *BASE, "--resume", server=server)
    assert result.exit_code == 0, result.output
    # the five whole answers replayed; the torn one (turn 5) is the one request paid again
    assert turns_asked(server, prompt, before) == list(range(5, TURNS))
    assert records(runner.folder())[prompt]["metadata"]["replayed_turns"] == 5


def test_response_cache_answers_a_second_run_folder(tmp_path, runner, model_server):
    prompts = [f"task {k}: list the files" for k in range(3)]
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    server = model_server(priced(SCRIPT))
    cache = ("--response_cache", str(tmp_path / "cache"))
    result = runner.invoke(data, *BASE, *cache, server=server)
    assert result.exit_code == 0, result.output
    paid = server.request_count - server.calls_for(PREFLIGHT_PROMPT)
    assert paid == 3 * TURNS
    result = runner.invoke(data, *BASE, *cache, "--filter", "no-reasoning", server=server, run_name="second")
    assert result.exit_code == 0, result.output
    assert server.request_count - server.calls_for(PREFLIGHT_PROMPT) == paid  # nothing sent again
    second = records(runner.folder("second"))
    assert all(r["metadata"]["replayed_turns"] == TURNS for r in second.values()) and len(second) == 3
    first = records(runner.folder())
    assert [t["value"] for t in second[prompts[0]]["conversations"]] == \
        [t["value"] for t in first[prompts[0]]["conversations"]]
    stats = json.loads((runner.folder("second") / "statistics.json").read_text())
    assert stats["model_requests"]["requests"] == 0
    assert json.loads((runner.folder("second") / "run.json").read_text())["config"]["response_cache"] == cache[1]
    result = runner.invoke(data, *BASE, "--resume", server=server, run_name="second")  # the option from run.json
    assert result.exit_code == 0, result.output
    # without the option the cache is not asked
    result = runner.invoke(data, *BASE, server=server, run_name="third")
    assert result.exit_code == 0, result.output
    assert server.request_count - server.calls_for(PREFLIGHT_PROMPT) == 2 * paid


# --- the file itself -------------------------------------------------------------------------------


def answer(i: int) -> ModelResponse:
    call = ToolCall(f"call_{i}", "terminal", {"command": f"echo {i}"}, f'{{"command": "echo {i}"}}')
    message = Message("assistant", f"step {i}", reasoning="why", tool_calls=(call,), provider_data=[{"sig": "x"}])
    return ModelResponse(message, "tool_calls", Usage(10, 2, 1, 3, 0.5), "prov", "m")


def test_an_answer_comes_back_as_it_was_written():
    response = answer(1)
    back = decode_response(json.loads(json.dumps(encode_response(response))))
    assert back == attrs.evolve(response, message=attrs.evolve(response.message, provider_data=({"sig": "x"},)))


def test_ended_sessions_are_compacted_away_and_a_finished_run_removes_the_file(tmp_path, monkeypatch):
    from hermes_batch.folder import replay_journal

    monkeypatch.setattr(replay_journal, "COMPACT_BYTES", 4096)
    path = tmp_path / REPLAY_JOURNAL_NAME
    journal = ResponseJournal(path)
    for n in range(200):
        journal.write(f"k{n}", f"h{n}", answer(n))
        if n >= 3:
            journal.end(f"k{n - 3}")  # three sessions in flight at any time
    assert path.stat().st_size < 4 * 4096  # compacted: the sessions in flight and less than as much dead
    journal.close()
    again = ResponseJournal(path)  # a resume: the three cut off, nothing else
    assert again.cut_off == 3
    assert set(again.recorded("k199")) == {"h199"} and again.recorded("k10") is None
    again.close(finished=True)
    assert not path.exists()


def test_a_session_hashes_its_requests_as_the_hasher_does_and_tells_every_field_apart():
    from hermes_batch.contract.interfaces import ModelSettings
    from hermes_batch.formats.records import ToolSpec
    from hermes_batch.session.replay import Replayer, RequestHasher

    class Client:
        name = "openai"
        settings = ModelSettings("m", "http://127.0.0.1/v1")

    hasher = RequestHasher(Client())
    tools = (ToolSpec("terminal", "Run.", {"type": "object"}),)
    replay = Replayer(types.SimpleNamespace(write=lambda *a: None), Client()).session("k")
    messages = (Message("system", "s"), Message("user", "u"))
    seen = set()
    for turn in range(4):
        digest = replay.digest(messages, tools)
        assert digest == hasher.digest(messages, tools) and digest not in seen
        seen.add(digest)
        messages += (answer(turn).message, Message("tool", f"out {turn}", tool_call_id=f"call_{turn}", name="terminal"))
    changed = messages[:-1] + (Message("tool", "other", tool_call_id="call_3", name="terminal"),)
    assert replay.digest(changed, tools) == hasher.digest(changed, tools) != hasher.digest(messages, tools)
    assert hasher.digest(messages, ()) != hasher.digest(messages, tools)

    class Other(Client):
        settings = ModelSettings("m", "http://127.0.0.1/v1", max_tokens=10)

    assert RequestHasher(Other()).digest(messages, tools) != hasher.digest(messages, tools)
