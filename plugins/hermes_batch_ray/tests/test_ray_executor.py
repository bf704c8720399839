"""``--executor ray`` on a real local Ray cluster of two nodes, against the scripted model server."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections import Counter

import attrs

from hermes_batch import Usage
from hermes_batch.testing import TEST_API_KEY, ToolLoopScript, batch_records, ended, steady, wait_for, write_dataset

from ray_rig import ray_cluster  # noqa: F401 - the session's cluster

BASE = ("--distribution", "terminal_only", "--seed", "11", "--batch_size", "10")
CALLS = 3  # ToolLoopScript(tool_calls=2)
PREFETCH = 4  # the least a worker queues beyond its sessions (docs/executors.md): the margin for prompts run again


def ray_options(cluster, *extra: str) -> tuple:
    return ("--executor", "ray", "-E", f"address={cluster.address}", *extra)


def prompts_of(n: int) -> list[str]:
    return [f"task {i}: say hello" for i in range(n)]


def human(record: dict) -> str:
    return next(turn["value"] for turn in record["conversations"] if turn["from"] == "human")


def test_the_run_folder_matches_the_local_executors_and_both_nodes_run_prompts(tmp_path, runner, model_server, ray_cluster):
    server = model_server(ToolLoopScript(tool_calls=2), latency=0.01)
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts_of(200)])

    local = runner.invoke(data, *BASE, "--num_workers", "32", server=server, run_name="local")
    assert local.exit_code == 0, local.output
    spread = runner.invoke(data, *BASE, *ray_options(ray_cluster), "--num_workers", "32", "--verbose",
                           server=server, run_name="ray")
    assert spread.exit_code == 0, spread.output[-3000:]

    for name in ("trajectories.jsonl", "failed.jsonl", "discarded.jsonl"):
        assert steady(runner.records(name, "ray")) == steady(runner.records(name, "local")), name
    assert [t["prompt_index"] for t in runner.records("trajectories.jsonl", "ray")] == list(range(200))
    stats = {name: json.loads((runner.folder(name) / "statistics.json").read_text()) for name in ("local", "ray")}
    for key in ("prompts", "finished", "kept", "tokens"):
        assert steady(stats["ray"][key]) == steady(stats["local"][key]), key
    # one actor per node (the default), each on a node of its own
    nodes = set(re.findall(r"Ray worker \d+ on \S+ \(node (\w+)\)", spread.output))
    assert len(nodes) == 2, spread.output[-3000:]
    journal = [json.loads(line) for line in (runner.folder("ray") / "calls.jsonl").read_text().splitlines()]
    assert Counter(e["prompt_index"] for e in journal if e["event"] == "done") == Counter({i: CALLS for i in range(200)})
    for path in runner.folder("ray").rglob("*"):
        if path.is_file():
            assert TEST_API_KEY.encode() not in path.read_bytes(), path


def test_a_killed_actor_loses_only_its_prompts_in_flight(tmp_path, runner, model_server, procs, ray_cluster):
    prompts = prompts_of(60)
    server = model_server(ToolLoopScript(tool_calls=2), latency=0.1)
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    scratch = tmp_path / "node-scratch"
    proc = runner.spawn(data, *BASE, *ray_options(ray_cluster, "-E", "workers=2", "-E", "concurrency_per_worker=3",
                                                   "-E", f"scratch_dir={scratch}"),
                        "--num_workers", "6", server=server)
    procs.append(proc)

    actors = wait_for(lambda: len(ray_cluster.processes("ray::PromptActor")) == 2 and ray_cluster.processes("ray::PromptActor"),
                      120, "two actors", proc)
    wait_for(lambda: len([l for p in runner.folder().glob("batch_*.jsonl") for l in p.read_text().splitlines()]) >= 15,
             120, "fifteen finished prompts", proc)
    os.kill(actors[0], signal.SIGKILL)
    _out, err = proc.communicate(timeout=180)

    assert proc.returncode == 0, err[-3000:]
    assert "was lost" in err
    trajectories = runner.records("trajectories.jsonl")
    assert Counter(human(t) for t in trajectories) == Counter(prompts), "every prompt exactly once"
    calls = {p: server.calls_for(p) for p in prompts}
    assert all(n >= CALLS for n in calls.values())
    again = [p for p, n in calls.items() if n > CALLS]
    assert len(again) <= 3 + PREFETCH, again
    # the surviving actor removed its folder; the killed one's holds only the sandboxes it had open
    left = [path for path in scratch.glob("*/scratch/*") if not path.name.endswith(".ctl")]  # not the helpers'
    assert len(left) <= 3, left


def test_max_cost_reached_the_actors_hand_back_their_queues_unstarted(tmp_path, runner, model_server, ray_cluster):
    usage = Usage(prompt_tokens=10, completion_tokens=5, cost=0.01)
    loop = ToolLoopScript(tool_calls=1)
    server = model_server(lambda request: attrs.evolve(loop(request), usage=usage), latency=0.05)
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts_of(40)])
    result = runner.invoke(data, *BASE, *ray_options(ray_cluster, "-E", "workers=2"), "--num_workers", "2",
                           "--max_cost", "0.05", server=server)
    assert result.exit_code == 0, result.output[-3000:]
    assert "--max_cost" in result.stderr
    # 0.02 a prompt: the budget is reached after 3 prompts; the 2 sessions' prompts may finish too, and a queued
    # one an actor started before the driver's request for its queue came.  Each actor queues PREFETCH prompts:
    # had they run, 3 + 2 + 2 * PREFETCH would have.
    assert 3 <= len(runner.records("trajectories.jsonl")) <= 3 + 2 + 3 < 3 + 2 + 2 * PREFETCH


def test_an_unreachable_cluster_is_one_sentence_and_exit_status_2(tmp_path, runner, model_server):
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": "hi"}])
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = model_server()
    result = runner.invoke(data, "--executor", "ray", "-E", f"address=127.0.0.1:{port}", server=server)
    assert result.exit_code == 2, result.output
    assert "Could not reach the Ray cluster at 127.0.0.1:" in result.output and "Traceback" not in result.output
    assert not runner.folder().exists(), "nothing of the failed start is left behind"
    assert server.request_count <= 1  # the preflight at most


def test_driver_killed_then_resume_loses_nothing_finished(tmp_path, runner, model_server, procs, ray_cluster):
    prompts = prompts_of(50)
    first = model_server(ToolLoopScript(tool_calls=2), latency=0.1)
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    options = ray_options(ray_cluster, "-E", f"scratch_dir={tmp_path / 'node-scratch'}")
    proc = runner.spawn(data, *BASE, *options, "--num_workers", "6", server=first)
    procs.append(proc)
    wait_for(lambda: len(batch_records(runner.folder())) >= 15, 120, "fifteen finished prompts", proc)

    proc.kill()
    ended(proc)
    # Ray ends the actors of a driver that is gone
    wait_for(lambda: not ray_cluster.processes("ray::PromptActor"), 60, "the actors to end")
    saved = Counter(human(t) for t in batch_records(runner.folder()))
    assert saved and max(saved.values()) == 1

    second = model_server(ToolLoopScript(tool_calls=2), latency=0.01)
    result = runner.invoke(data, *BASE, *options, "--num_workers", "6", "--resume", server=second)
    assert result.exit_code == 0, result.output[-3000:]
    assert Counter(human(t) for t in runner.records("trajectories.jsonl")) == Counter(prompts)
    assert not [p for p in saved if second.calls_for(p)], "a prompt finished before the kill was paid again"


def test_ctrl_c_stops_the_actors_and_their_sandboxes(tmp_path, runner, model_server, procs, ray_cluster):
    import uuid

    from hermes_batch.testing import RoutedScript

    prompts = prompts_of(10)
    marker = f"37.{uuid.uuid4().int % 10**9:09d}"  # a sleep no other process runs
    quick = set(prompts[:4])
    slow = ToolLoopScript(tool_calls=1, command=f"sleep {marker}")
    server = model_server(RoutedScript(lambda p: ToolLoopScript(tool_calls=1) if p in quick else slow), latency=0.05)
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    scratch = tmp_path / "node-scratch"
    proc = runner.spawn(data, *BASE, *ray_options(ray_cluster, "-E", f"scratch_dir={scratch}"), "--num_workers", "4",
                        server=server)
    procs.append(proc)

    wait_for(lambda: len(batch_records(runner.folder())) >= 4, 120, "the quick prompts", proc)
    wait_for(lambda: len(ray_cluster.processes(f"sleep {marker}")) >= 4, 60, "four sleeping tool commands", proc)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=120)

    assert proc.returncode == 130, err[-3000:]
    assert "--resume" in err
    wait_for(lambda: not ray_cluster.processes(f"sleep {marker}"), 10, "the tool commands to be killed")
    wait_for(lambda: not ray_cluster.processes("ray::PromptActor"), 60, "the actors to end")
    assert list(scratch.iterdir()) == [], "each actor removed its sandboxes' folders"
    assert Counter(human(t) for t in batch_records(runner.folder())) == Counter(quick)


def test_after_ctrl_c_no_request_counts_as_unanswered(tmp_path, runner, model_server, procs, ray_cluster):
    # as with the local executor: the actors' stop journals the end of the model calls it cut off
    server = model_server(ToolLoopScript(tool_calls=1), hang=lambda request: request.turn == 1)
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts_of(6)])
    proc = runner.spawn(data, *BASE, *ray_options(ray_cluster), "--num_workers", "6", server=server)
    procs.append(proc)
    wait_for(lambda: sum(r.turn == 1 for r in server.requests) == 6, 120, "six requests hanging", proc)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    folder = runner.folder()
    events = Counter(json.loads(line)["event"] for line in (folder / "calls.jsonl").read_text().splitlines())
    assert events["sent"] == events["done"] == 12
    assert json.loads((folder / "statistics.json").read_text())["model_requests"]["unanswered"] == 0


# --- the replay journal (responses.jsonl) through the actors -------------------------------------
# The twin of tests/test_replay_journal.py's processes-executor test: the actors send each answer to the
# driver (("responses", entry) in a poll), which alone writes the journal; after a SIGKILL of the driver,
# --resume replays the cut-off sessions' answers (the tools run for real) and sends only what was never answered.

TURNS = 10  # nine tool calls, then the answer
REPLAY_BASE = ("--distribution", "terminal_only", "--seed", "7", "--max_turns", str(TURNS))


def turns_asked(server, prompt, since=0):
    return [r.turn for r in server.requests[since:] if r.prompt == prompt]


def journaled(folder) -> int:
    """The answers responses.jsonl holds (whole lines only)."""
    path = folder / "responses.jsonl"
    return sum(1 for line in path.read_bytes().split(b"\n") if line.startswith(b'{"p"')) if path.exists() else 0


def test_driver_killed_mid_session_replays_the_journaled_answers_on_resume(tmp_path, runner, model_server, procs,
                                                                           ray_cluster):
    script = ToolLoopScript(tool_calls=TURNS - 1)
    prompts = [f"task {k}: list the files" for k in (2, 6)]
    stop = {p: int(p.split()[1].rstrip(":")) for p in prompts}  # prompt k is killed waiting for its answer of turn k
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts])
    released = threading.Event()
    server = model_server(lambda r: attrs.evolve(script(r), usage=Usage(prompt_tokens=100, completion_tokens=10)),
                          hang=lambda r: not released.is_set() and r.prompt in stop and r.turn == stop[r.prompt])
    options = ray_options(ray_cluster, "-E", "workers=2", "-E", f"scratch_dir={tmp_path / 'node-scratch'}",
                          "--num_workers", "2")
    proc = runner.spawn(data, *REPLAY_BASE, *options, server=server, start_new_session=True)
    procs.append(proc)
    folder = runner.folder()
    try:
        wait_for(lambda: all(stop[p] in turns_asked(server, p) for p in prompts), 180, "every prompt at its turn", proc)
        # an answer reaches the driver in its actor's next poll: kill once the driver has written every one
        wait_for(lambda: journaled(folder) == sum(stop.values()), 60, "every answer in the journal", proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        ended(proc, 60)
    assert proc.returncode == -signal.SIGKILL
    # Ray ends the actors of a driver that is gone; only then may the hung requests be answered
    wait_for(lambda: not ray_cluster.processes("ray::PromptActor"), 60, "the actors to end")
    released.set()
    before = len(server.requests)

    result = runner.invoke(data, *REPLAY_BASE, *options, "--resume", server=server)
    assert result.exit_code == 0, result.output[-3000:]
    saved = {human(t): t for t in batch_records(folder)}
    for prompt, k in stop.items():
        # the request of turn k was never answered: it and the rest are all the resume sends
        assert turns_asked(server, prompt, before) == list(range(k, TURNS)), prompt
        assert saved[prompt]["metadata"]["replayed_turns"] == k
        assert saved[prompt]["api_calls"] == TURNS and saved[prompt]["completed"]
    assert not (folder / "responses.jsonl").exists()  # every prompt has its record


def test_batch_api_the_driver_submits_and_collects_for_every_actor(tmp_path, runner, model_server, ray_cluster):
    """--batch_api: the actors' sessions relay their requests to the driver, whose batches hold both actors'
    requests; the trajectories are a synchronous local run's, and no request is processed twice."""
    from hermes_batch.testing import BatchSettings, tool_outputs

    server = model_server(ToolLoopScript(tool_calls=2), batches=BatchSettings(delay=0.2))
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in prompts_of(40)])
    batch_api = ("--batch_api", "--batch_api_max_wait", "1", "--batch_api_poll_interval", "0.1")

    sync = runner.invoke(data, *BASE, "--num_workers", "40", server=server, run_name="sync")
    assert sync.exit_code == 0, sync.output
    batched = runner.invoke(data, *BASE, *ray_options(ray_cluster, "-E", "workers=2"), "--num_workers", "40",
                            *batch_api, server=server, run_name="batched")
    assert batched.exit_code == 0, batched.output[-3000:]

    assert server.batches.requests_processed == 40 * CALLS
    assert max(server.batches.processed.values()) == 1
    assert max(server.batches.batch_sizes) > 20  # an actor runs 20 sessions: batches hold both actors' requests

    def shapes(run_name):
        return {human(t): ([turn["from"] for turn in t["conversations"]], tool_outputs(t))
                for t in runner.records("trajectories.jsonl", run_name)}

    assert len(shapes("batched")) == 40 and shapes("batched") == shapes("sync")
    stats = json.loads((runner.folder("batched") / "statistics.json").read_text())
    assert stats["batch_api"]["requests"] == 40 * CALLS
    assert stats["model_requests"]["requests"] == 40 * CALLS
