"""``--executor ray``: a driver killed mid-session resumes from responses.jsonl without paying an answer twice.

The Ray twin of tests/test_replay_journal.py's processes-executor test: the
actors send each answer to the driver (``("responses", entry)`` in a poll),
which alone writes the replay journal; after a SIGKILL of the driver and
``--resume`` the cut-off sessions replay their journaled answers (tools run for
real) and only the requests never answered are sent.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import attrs
import pytest

from hermes_batch.folder.replay_journal import REPLAY_JOURNAL_NAME
from hermes_batch.formats.records import Usage
from hermes_batch.testing import ToolLoopScript, ended, wait_for, write_dataset

from ray_rig import ray_cluster  # noqa: F401 - the session's cluster

TURNS = 10  # nine tool calls, then the answer
BASE = ("--distribution", "terminal_only", "--seed", "7", "--max_turns", str(TURNS))
SCRIPT = ToolLoopScript(tool_calls=TURNS - 1)


def priced(request):
    return attrs.evolve(SCRIPT(request), usage=Usage(prompt_tokens=100, completion_tokens=10, cost=0.001))


def turns_asked(server, prompt, since=0):
    return [r.turn for r in server.requests[since:] if r.prompt == prompt]


def journaled(folder) -> int:
    """The answers responses.jsonl holds (whole lines only)."""
    path = folder / REPLAY_JOURNAL_NAME
    if not path.exists():
        return 0
    return sum(1 for line in path.read_bytes().split(b"\n") if line.startswith(b'{"p"'))


def records(folder):
    found = {}
    for path in folder.glob("batch_*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            found[record["conversations"][1]["value"]] = record
    return found


@pytest.mark.slow  # runs of hermes-batch in child processes, on the Ray cluster
def test_driver_killed_mid_session_replays_the_journaled_answers_on_resume(tmp_path, runner, model_server, procs,
                                                                           ray_cluster):
    prompts = [f"task {k}: list the files" for k in (2, 6)]
    stop = {p: int(p.split()[1].rstrip(":")) for p in prompts}  # prompt k is killed waiting for its answer of turn k
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    released = threading.Event()
    server = model_server(priced, hang=lambda r: not released.is_set() and r.prompt in stop and r.turn == stop[r.prompt])
    options = ("--executor", "ray", "-E", f"address={ray_cluster.address}", "-E", "workers=2",
               "-E", f"scratch_dir={tmp_path / 'node-scratch'}", "--num_workers", "2")
    proc = runner.spawn(data, *BASE, *options, server=server, start_new_session=True)
    procs.append(proc)
    folder = runner.folder()
    try:
        wait_for(lambda: all(stop[p] in turns_asked(server, p) for p in prompts), 180, "every prompt at its turn", proc)
        # the answers reach the driver in an actor's next poll: kill once it has written every one of them
        wait_for(lambda: journaled(folder) == sum(stop.values()), 60, "every answer in the journal", proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        ended(proc, 60)
    assert proc.returncode == -signal.SIGKILL
    # Ray ends the actors of a driver that is gone; only then may the hung requests be answered
    wait_for(lambda: not ray_cluster.processes("ray::PromptActor"), 60, "the actors to end")
    released.set()
    before = len(server.requests)

    result = runner.invoke(data, *BASE, *options, "--resume", server=server)
    assert result.exit_code == 0, result.output[-3000:]
    saved = records(folder)
    for prompt, k in stop.items():
        # the request of turn k was never answered: it and the rest are all the resume sends
        assert turns_asked(server, prompt, before) == list(range(k, TURNS)), prompt
        assert saved[prompt]["metadata"]["replayed_turns"] == k
        assert saved[prompt]["api_calls"] == TURNS and saved[prompt]["completed"]
    assert not (folder / REPLAY_JOURNAL_NAME).exists()  # every prompt has its record
