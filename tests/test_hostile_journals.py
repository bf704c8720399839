"""The journals of a run folder read back as untrusted files: tampered with between a kill and a resume.

responses.jsonl, calls.jsonl and batches.jsonl may be replaced by a link to a file elsewhere, a FIFO or a
device, or hold lines of any shape and size.  A resume refuses what is no plain file before it pays for
the preflight, skips and counts what is no line of ours, never crashes on it, and never replays an answer
a model client could not have made.  A prompt that failed keeps the answers it paid for.
"""

from __future__ import annotations

import json
import os
import threading
import types

import pytest

from hermes_batch.contract.interfaces import PREFLIGHT_PROMPT
from hermes_batch.folder import replay_journal
from hermes_batch.folder.batch_journal import read_batches
from hermes_batch.folder.replay_journal import ResponseJournal, decode_response, encode_response
from hermes_batch.formats.records import Message, ModelResponse, ToolCall, Usage
from hermes_batch.testing import ErrorRule, ToolLoopScript, write_dataset

BASE = ("--distribution", "terminal_only", "--seed", "3")
JOURNALS = ("responses.jsonl", "calls.jsonl", "batches.jsonl")


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def finished_run(tmp_path, runner, model_server, n: int = 2):
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {k}: look"} for k in range(n)])
    server = model_server(ToolLoopScript(tool_calls=1))
    result = runner.invoke(data, *BASE, server=server)
    assert result.exit_code == 0, result.output
    return data, server


def victim_file(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious line\nlast line, no newline")
    return victim


# --- what is no plain file ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", JOURNALS)
@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_journal_replaced_by_a_link_is_refused_before_the_preflight_and_its_target_untouched(
        tmp_path, runner, model_server, name, link):
    data, server = finished_run(tmp_path, runner, model_server)
    victim = victim_file(tmp_path)
    path = runner.folder() / name
    path.unlink(missing_ok=True)
    (path.symlink_to if link == "symbolic" else path.hardlink_to)(victim)
    before = server.request_count
    result = runner.invoke(data, *BASE, "--resume", server=server)
    assert result.exit_code == 2, result.output
    assert f"{path} is a {'symbolic link' if link == 'symbolic' else 'hard link to another file'}" in result.output
    assert "move it away" in result.output and "Traceback" not in result.output
    assert victim.read_bytes() == b"precious line\nlast line, no newline"  # not cut, not appended to
    assert server.request_count == before  # refused before the preflight


def test_a_journal_that_is_a_fifo_is_refused_at_once(tmp_path, runner, model_server):
    data, server = finished_run(tmp_path, runner, model_server)
    path = runner.folder() / "responses.jsonl"
    os.mkfifo(path)
    waited = threading.Event()

    def watchdog():  # a resume blocked on the FIFO for 20 s is let go (a writer comes and goes), and fails
        if not done.wait(20):
            waited.set()
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)

    done = threading.Event()
    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    before = server.request_count
    try:
        result = runner.invoke(data, *BASE, "--resume", server=server)
    finally:
        done.set()
        thread.join()
    assert not waited.is_set(), "the resume waited for a writer of the FIFO"
    assert result.exit_code == 2, result.output
    assert f"{path} is a named pipe (FIFO)" in result.output
    assert server.request_count == before


def limited_memory():
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # today's code would read /dev/zero into memory


@pytest.mark.parametrize("name", ["responses.jsonl", "calls.jsonl"])
def test_a_journal_linked_to_a_device_is_refused_not_read_for_ever(tmp_path, runner, model_server, procs, name):
    data, server = finished_run(tmp_path, runner, model_server)
    path = runner.folder() / name
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")
    proc = runner.spawn(data, *BASE, "--resume", server=server, preexec_fn=limited_memory)
    procs.append(proc)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert f"{path} is a symbolic link" in err


# --- lines of any shape --------------------------------------------------------------------------------------

HOSTILE_LINES = [
    '{"p":["x"],"h":"aa","r":{}}',
    '{"p":"k","h":{"a":1},"r":{}}',
    '{"end":["k"]}',
    '{"event":"pending","requests":[[["x"],1,0]]}',
    '{"event":"submitted","batch":{"id":1},"custom_ids":"abc"}',
    '{"event":"done","status":"200","provider":["x"],"latency_s":"fast","prompt_tokens":"9"}',
    '{"event":"journal","first_session":[0]}',
    "[" * 200_000 + "]" * 200_000,
    '{"p":"k","h":"h","r":' + deep(5000) + "}",
    "\x00\xff not json at all",
    '"just a string"',
]


@pytest.mark.parametrize("name", JOURNALS)
def test_lines_of_any_shape_in_a_journal_never_stop_a_resume(tmp_path, runner, model_server, name):
    data, server = finished_run(tmp_path, runner, model_server)
    with open(runner.folder() / name, "a", encoding="utf-8", errors="surrogateescape") as handle:
        handle.write("\n".join(HOSTILE_LINES) + "\n")
    extra = ("--batch_api", "--batch_api_max_wait", "0.2", "--batch_api_poll_interval", "0.1",
             "--allow_changed_settings") if name == "batches.jsonl" else ()
    for _ in range(2):  # and again: nothing the first resume left behind stops the next
        result = runner.invoke(data, *BASE, "--resume", *extra, server=server)
        assert result.exit_code == 0, result.output
        assert "Traceback" not in result.output and "internal error" not in result.output


def test_read_batches_keeps_the_lines_it_wrote_and_skips_the_rest(tmp_path, caplog):
    path = tmp_path / "batches.jsonl"
    good = [
        {"event": "pending", "session": 0, "requests": [["a" * 40 + "-1", 3, 0], ["b" * 40 + "-2", 4, 1]]},
        {"event": "submitted", "session": 0, "batch": "batch_1", "custom_ids": ["a" * 40 + "-1", "b" * 40 + "-2"]},
    ]
    path.write_text("\n".join([*HOSTILE_LINES, *map(json.dumps, good)]) + "\n", errors="surrogateescape")
    (batch,) = read_batches(path)
    assert (batch.batch, batch.prompts) == ("batch_1", frozenset({3, 4}))
    assert "skipped" in caplog.text


def test_the_readers_never_hold_a_line_past_their_limit():
    import io

    from hermes_batch.formats.lines import TOO_LONG, LineSplitter, read_lines

    data = b"ab\n" + b"x" * 5000 + b"\n\ncd\n" + b"torn"
    assert list(read_lines(io.BytesIO(data), 100)) == [(0, b"ab\n"), (3, TOO_LONG), (5004, b"\n"), (5005, b"cd\n")]
    splitter, lines = LineSplitter(100), []
    for i in range(0, len(data), 7):
        lines += splitter.feed(data[i:i + 7])
        assert sum(map(len, splitter._pending)) <= 100
    assert lines == [b"ab", TOO_LONG, b"", b"cd"] and splitter.end() == b"torn"


def test_a_journal_line_past_the_limit_is_skipped_and_counted_not_read(tmp_path, monkeypatch):
    monkeypatch.setattr(replay_journal, "MAX_LINE_BYTES", 4096)
    path = tmp_path / "responses.jsonl"
    journal = ResponseJournal(path)
    journal.write("k1", "h1", answer(1))
    journal.close()
    with open(path, "ab") as handle:
        handle.write(b'{"p":"k2","h":"h2","r":{"m":"' + b"x" * 10_000 + b'"}}\n')
        handle.write(b'{"p":["x"],"h":"aa","r":{}}\n' + deep(200_000).encode() + b"\n")
    again = ResponseJournal(path)
    assert again.cut_off == 1 and set(again.recorded("k1")) == {"h1"}
    assert sum(again.skipped.values()) == 3 and "longer than 0 MiB" in again.skipped
    assert b"x" * 100 not in path.read_bytes()  # rewritten with the live lines only


# --- what a journaled answer may be ----------------------------------------------------------------------------


def answer(i: int) -> ModelResponse:
    call = ToolCall(f"call_{i}", "terminal", {"command": f"echo {i}"}, f'{{"command": "echo {i}"}}')
    message = Message("assistant", f"step {i}", reasoning="why", tool_calls=(call,), provider_data=[{"sig": "x"}])
    return ModelResponse(message, "tool_calls", Usage(10, 2, 1, 3, 0.5), "prov", "m")


def tampered(change) -> dict:
    data = json.loads(json.dumps(encode_response(answer(1))))
    change(data)
    return data


def _set(path, value):
    def change(data):
        target = data
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
    return change


BAD_ANSWERS = {
    "role user": _set(("m", 0), "user"),
    "role tool": _set(("m", 0), "tool"),
    "content a number": _set(("m", 1), 5),
    "reasoning a list": _set(("m", 2), ["why"]),
    "calls an object": _set(("m", 3), {"id": 1}),
    "a call id a number": _set(("m", 3, 0, 0), 7),
    "a tool name null": _set(("m", 3, 0, 1), None),
    "raw arguments an object": _set(("m", 3, 0, 2), {"command": "ls"}),
    "tool call id a list": _set(("m", 4), ["x"]),
    "provider data a number": _set(("m", 6), 3),
    "provider data nested 500 deep": _set(("m", 6), json.loads(deep(500))),
    "finish reason a number": _set(("f",), 5),
    "model a list": _set(("model",), ["m"]),
    "provider an object": _set(("p",), {"name": "x"}),
    "usage an object": _set(("u",), {"prompt_tokens": 1}),
    "not an object": lambda data: data.clear(),
}


@pytest.mark.parametrize("case", sorted(BAD_ANSWERS))
def test_a_recorded_answer_of_the_wrong_shape_is_not_an_answer(case):
    data = tampered(BAD_ANSWERS[case])
    with pytest.raises(ValueError, match="not a recorded answer"):
        decode_response(data if data else [])


def test_a_recorded_answer_of_the_wrong_shape_sends_the_session_live():
    from hermes_batch.contract.interfaces import ModelSettings
    from hermes_batch.session.replay import Replayer

    class Client:
        name = "openai"
        settings = ModelSettings("m", "http://127.0.0.1/v1")

    written = []
    replayer = Replayer(types.SimpleNamespace(write=lambda *a: written.append(a)), Client())
    messages = (Message("system", "s"), Message("user", "u"))
    request = replayer.hasher.digest(messages, ())
    session = replayer.session("k", {request: tampered(BAD_ANSWERS["role user"])})
    assert session.lookup(messages, ()) is None and session.recorded is None and session.replayed == 0
    # numbers no call can report read as not reported, as in calls.jsonl
    odd = tampered(_set(("u",), ["many", float("nan"), -5, 10**30, "free"]))
    assert decode_response(odd).usage == Usage()


# --- a failed prompt keeps what it paid for ---------------------------------------------------------------------


def test_a_failed_prompt_keeps_its_answers_and_the_resume_replays_them(tmp_path, runner, model_server):
    """Prompts that fail on their third request (500s beyond --max_retries): a resume pays for that request
    and what follows only, and replays the two answers before it."""
    prompts = [f"task {k}: look" for k in range(3)]
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    server = model_server(ToolLoopScript(tool_calls=3),
                          errors=[ErrorRule(status=500, rate=1.0, match=lambda request: request.turn == 2)])
    result = runner.invoke(data, *BASE, "--max_retries", "1", server=server)
    assert result.exit_code == 3, result.output
    assert len(runner.records("failed.jsonl")) == 3
    assert (runner.folder() / "responses.jsonl").exists()  # kept: the failed prompts run again
    server.errors = ()
    before = len(server.requests)
    result = runner.invoke(data, *BASE, "--max_retries", "1", "--resume", server=server)
    assert result.exit_code == 0, result.output
    again = [r for r in server.requests[before:] if r.prompt != PREFLIGHT_PROMPT and not r.preflight]
    assert sorted(r.turn for r in again) == [2, 2, 2, 3, 3, 3]  # 6 requests where the first two turns are replayed
    kept = runner.records("trajectories.jsonl")
    assert len(kept) == 3 and all(r["metadata"]["replayed_turns"] == 2 for r in kept)
    assert not (runner.folder() / "responses.jsonl").exists()  # every prompt has its record now


def test_tampered_answers_of_a_failed_prompt_are_paid_again_not_replayed(tmp_path, runner, model_server):
    """The answers a failed prompt kept, edited before the resume: each one that is no answer of the model
    (another role, fields of the wrong types) is not replayed; the session goes live there, and its record
    is a well-formed conversation."""
    prompts = [f"task {k}: look" for k in range(3)]
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    server = model_server(ToolLoopScript(tool_calls=3),
                          errors=[ErrorRule(status=500, rate=1.0, match=lambda request: request.turn == 2)])
    result = runner.invoke(data, *BASE, "--max_retries", "1", server=server)
    assert result.exit_code == 3, result.output
    path = runner.folder() / "responses.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    changes = [BAD_ANSWERS["role user"], BAD_ANSWERS["content a number"], BAD_ANSWERS["a call id a number"]]
    first_of = {}
    for line in lines:
        if "p" in line and line["p"] not in first_of:  # the first answer of each prompt
            first_of[line["p"]] = line
            changes.pop(0)(line["r"])
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    server.errors = ()
    before = len(server.requests)
    result = runner.invoke(data, *BASE, "--resume", server=server)
    assert result.exit_code == 0, result.output
    again = [r for r in server.requests[before:] if not r.preflight]
    assert sorted(r.turn for r in again) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]  # each went live at its first answer
    kept = runner.records("trajectories.jsonl")
    assert len(kept) == 3 and len(runner.records("failed.jsonl")) == 3  # the first run's failures only
    for record in kept:
        roles = [turn["from"] for turn in record["conversations"]]
        assert roles == ["system", "human", "gpt", "tool", "gpt", "tool", "gpt", "tool", "gpt"], roles


def test_the_journal_a_run_leaves_for_its_failed_prompts_holds_their_answers_only(tmp_path, runner, model_server):
    """Finished prompts' answers (which may quote anything the model saw) are not left behind in the file kept
    for the failed ones; a failed prompt without an answer keeps nothing."""
    prompts = ["task 0: look", "task 1: look", "task 2: look"]
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    rules = [ErrorRule(status=500, rate=1.0, match=lambda r: r.prompt == prompts[1] and r.turn == 1),
             ErrorRule(status=500, rate=1.0, match=lambda r: r.prompt == prompts[2] and r.turn == 0)]
    server = model_server(ToolLoopScript(tool_calls=2), errors=rules)
    result = runner.invoke(data, *BASE, "--max_retries", "0", server=server)
    assert result.exit_code == 3, result.output
    lines = [json.loads(line) for line in (runner.folder() / "responses.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and "end" not in lines[0]  # prompt 1's first answer; nothing of prompt 0, nor an end
    failed = {r["prompt"]: r["content_key"] for r in runner.records("failed.jsonl")}
    assert lines[0]["p"] == failed[prompts[1]]
