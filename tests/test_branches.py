"""Branches from a shared prefix (issue 48, items 3 and 4): --branch_at TURN --branches K runs a row's session to
TURN model calls once, then K sessions from there, each in a copy of the prefix's sandbox, with a seed of its own;
dpo:shared_prefix=true pairs a passing and a failing branch; a kill mid-branch pays neither the prefix nor a
finished branch again."""

from __future__ import annotations

import json
import os
import signal
import threading
import types

import pytest

from hermes_batch.contract.interfaces import PREFLIGHT_PROMPT
from hermes_batch.errors import ConfigError
from hermes_batch.folder.replay_journal import REPLAY_JOURNAL_NAME
from hermes_batch.run.preparation import check_branching
from hermes_batch.session.branches import branch_seed, prefix_key
from hermes_batch.testing import Reply, read_jsonl, write_dataset
from hermes_batch.testing.fixtures import ended, wait_for

BASE = ("--distribution", "terminal_only", "--seed", "7", "--verifier", "answer")


class BranchScript:
    """Turn 0 (the prefix) writes shared.txt; each branch, told apart by the seed its requests carry and numbered
    in the order the server first saw it, writes mine_N.txt and lists the folder, then answers right when N is
    even, wrong when odd."""

    def __init__(self):
        self.order: dict = {}  # prompt -> {seed: branch number}
        self.lock = threading.Lock()

    def branch(self, request) -> int:
        with self.lock:
            seen = self.order.setdefault(request.prompt, {})
            return seen.setdefault(request.body.get("seed"), len(seen))

    def __call__(self, request):
        if request.turn == 0:
            return Reply(content="First the shared file.", reasoning="A file first.", tool_calls=[("terminal", {"command": "echo base > shared.txt"})])
        n = self.branch(request)
        if request.turn == 1:
            return Reply(content=f"Branch {n}.", reasoning="My own file.", tool_calls=[("terminal", {"command": f"echo {n} > mine_{n}.txt; ls"})])
        return Reply(content="The answer is 4" if n % 2 == 0 else "The answer is 5", reasoning="Adding.")


def rows(count: int) -> list[dict]:
    return [{"prompt": f"What is 2 + 2? (task {k})", "answer": 4} for k in range(count)]


def records(folder) -> list[dict]:
    """The records of the run's batch files, or of trajectories.jsonl once they were merged."""
    merged = folder / "trajectories.jsonl"
    if merged.exists():
        return read_jsonl(merged)
    return [record for path in sorted(folder.glob("batch_*.jsonl")) for record in read_jsonl(path)]


def listing(record) -> list[str]:
    """The files the branch's `ls` saw (the tool result of its own first turn)."""
    result = json.loads(record["conversations"][-2]["value"].split("\n", 1)[1].rsplit("\n", 1)[0])
    return sorted(result["content"]["output"].split())


def test_branches_continue_one_prefix_each_in_its_own_copy_and_pair_for_dpo(tmp_path, runner, model_server):
    script = BranchScript()
    server = model_server(script)
    data = write_dataset(tmp_path / "data.jsonl", rows(2))
    result = runner.invoke(data, *BASE, "--branch_at", "1", "--branches", "4", "--num_workers", "8", server=server)
    assert result.exit_code == 0, result.output

    saved = records(runner.folder())
    assert len(saved) == 8
    for prompt in (r["prompt"] for r in rows(2)):
        asked = [r.turn for r in server.requests if r.prompt == prompt]
        assert asked.count(0) == 1, "the prefix's model call is made once"
        assert len(asked) == 1 + 2 * 4
    by_row: dict = {}
    for record in saved:
        by_row.setdefault(record["prompt_index"], []).append(record)
    for index, branches in by_row.items():
        meta = [r["metadata"] for r in branches]
        assert sorted(m["sample_index"] for m in meta) == [0, 1, 2, 3]
        row_key = next(m["content_key"] for m in meta if m["sample_index"] == 0)  # sample 0's key is the row's
        assert {m["branch_of"] for m in meta} == {prefix_key(row_key, 1)}
        assert all(m["branch_turn"] == 1 for m in meta)
        seeds = [json.loads(m["sampling"])["seed"] for m in meta]
        assert len(set(seeds)) == 4, "each branch samples with a seed of its own"
        assert {m["sample_index"]: s for m, s in zip(meta, seeds)} == {
            m["sample_index"]: branch_seed(7, m["branch_of"], m["sample_index"]) for m in meta}
        for record in branches:
            files = listing(record)
            # the file written before the branch point is in every branch; each branch's own file in it alone
            assert "shared.txt" in files and len([f for f in files if f.startswith("mine_")]) == 1, files
            assert record["api_calls"] == 3 and record["completed"]
        assert sum(m["passed"] for m in meta) == 2
    assert len({r["metadata"]["branch_of"] for r in saved}) == 2
    assert not (runner.folder() / REPLAY_JOURNAL_NAME).exists()  # every branch recorded: the prefixes' answers go
    # the records' usage sums to what was paid: the prefix's call is on branch 0 only
    calls = sum(len(r["metadata"]["calls"]) for r in saved)
    assert calls == server.request_count - server.calls_for(PREFLIGHT_PROMPT) == 2 * 9

    out = tmp_path / "pairs.jsonl"
    result = runner.cli("export", str(runner.folder()), "--format", "dpo:shared_prefix=true,pairs_per_row=0",
                        "--output", str(out))
    assert result.exit_code == 0, result.output
    pairs = read_jsonl(out)
    assert len(pairs) == 4  # two passing and two failing branches a row
    for pair in pairs:
        assert pair["branch_turn"] == 1 and pair["branch_of"]
        roles = [m["role"] for m in pair["prompt"]]
        assert roles[-3:] == ["user", "assistant", "tool"], "the prompt ends with the shared prefix"
        assert "echo base > shared.txt" in pair["prompt"][-2]["content"]
        assert pair["chosen"][0]["role"] == pair["rejected"][0]["role"] == "assistant"
        assert pair["chosen"][-1]["content"].endswith("The answer is 4")
        assert pair["rejected"][-1]["content"].endswith("The answer is 5")
        assert pair["chosen"] != pair["rejected"]
    # without shared_prefix, the same records pair on the prompt alone, the prefix inside chosen and rejected
    result = runner.cli("export", str(runner.folder()), "--format", "dpo", "--output", str(tmp_path / "plain.jsonl"))
    assert result.exit_code == 0, result.output
    assert all(p["prompt"][-1]["role"] == "user" for p in read_jsonl(tmp_path / "plain.jsonl"))


def test_a_kill_mid_branch_pays_neither_the_prefix_nor_a_finished_branch_again(tmp_path, runner, model_server, procs):
    script = BranchScript()
    released = threading.Event()
    prompt = rows(1)[0]["prompt"]

    def hang(request):  # the third branch's answer never comes before the kill
        return (not released.is_set() and request.turn == 2
                and script.order.get(request.prompt, {}).get(request.body.get("seed")) == 2)

    server = model_server(script, hang=hang)
    data = write_dataset(tmp_path / "data.jsonl", rows(1))
    args = (*BASE, "--branch_at", "1", "--branches", "3", "--num_workers", "3")
    proc = runner.spawn(data, *args, server=server, start_new_session=True)
    procs.append(proc)
    batch = runner.folder() / "batch_0.jsonl"
    try:
        wait_for(lambda: batch.exists() and len(batch.read_text().splitlines()) == 2
                 and any(hang(r) for r in server.requests), 120, "two branches recorded, the third waiting", proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        ended(proc, 60)
    released.set()
    assert (runner.folder() / REPLAY_JOURNAL_NAME).exists()
    before = len(server.requests)
    assert [r.turn for r in server.requests if r.prompt == prompt].count(0) == 1

    result = runner.invoke(data, *args, "--resume", server=server)
    assert result.exit_code == 0, result.output
    again = [r.turn for r in server.requests[before:] if r.prompt == prompt]
    # the prefix and the third branch's first answer replayed from responses.jsonl; the two finished branches
    # skipped: only the request the kill left unanswered is sent again
    assert again == [2]
    saved = records(runner.folder())
    assert sorted(r["metadata"]["sample_index"] for r in saved) == [0, 1, 2]
    assert len({r["metadata"]["branch_of"] for r in saved}) == 1
    for record in saved:
        assert "shared.txt" in listing(record)
    assert not (runner.folder() / REPLAY_JOURNAL_NAME).exists()


def test_a_session_that_ends_before_the_branch_point_is_each_branchs_record(tmp_path, runner, model_server):
    server = model_server(lambda request: Reply(content="The answer is 4", reasoning="Easy."))
    data = write_dataset(tmp_path / "data.jsonl", rows(1))
    result = runner.invoke(data, *BASE, "--branch_at", "2", "--branches", "3", server=server)
    assert result.exit_code == 0, result.output
    saved = records(runner.folder())
    assert len(saved) == 3 and server.request_count - server.calls_for(PREFLIGHT_PROMPT) == 1
    assert all(r["metadata"]["branch_turn"] == 1 and r["completed"] and r["metadata"]["passed"] for r in saved)


@pytest.mark.parametrize("args, says", [
    (("--branch_at", "2"), "go together"),
    (("--branches", "3"), "go together"),
    (("--branch_at", "10", "--branches", "2"), "below --max_turns"),
    (("--branch_at", "1", "--branches", "2", "--samples_per_prompt", "2"), "leave --samples_per_prompt out"),
])
def test_branch_options_are_checked_before_anything_runs(tmp_path, runner, model_server, args, says):
    server = model_server(BranchScript())
    data = write_dataset(tmp_path / "data.jsonl", rows(1))
    result = runner.invoke(data, *BASE, *args, server=server)
    assert result.exit_code != 0 and says in result.output, result.output
    assert server.request_count == 0


def test_a_backend_that_cannot_copy_a_working_folder_refuses_branches():
    backend = types.SimpleNamespace(name="apptainer", copies_workdirs=False, snapshots_filesystems=False)
    with pytest.raises(ConfigError, match="--branch_at copies each row's prefix sandbox"):
        check_branching(types.SimpleNamespace(backend=backend, branch_at=1))
    check_branching(types.SimpleNamespace(backend=backend, branch_at=None))
    local = types.SimpleNamespace(name="local", copies_workdirs=True, snapshots_filesystems=False)
    check_branching(types.SimpleNamespace(backend=local, branch_at=1))


def test_a_rows_prefix_answers_die_with_its_last_branch_unless_one_failed(tmp_path, runner, model_server):
    script = BranchScript()
    failing = rows(2)[1]["prompt"]

    def answer(request):  # task 1's second branch meets a broken endpoint at its last turn
        if request.prompt == failing and request.turn == 2 and script.branch(request) == 1:
            return Reply(status=500, error_message="broken")
        return script(request)

    server = model_server(answer)
    data = write_dataset(tmp_path / "data.jsonl", rows(2))
    result = runner.invoke(data, *BASE, "--branch_at", "1", "--branches", "2", "--max_retries", "0", server=server)
    assert result.exit_code == 3, result.output  # a prompt failed
    # the run's end keeps only the live answers in the file
    journal = [json.loads(line) for line in (runner.folder() / REPLAY_JOURNAL_NAME).read_text().splitlines()]
    live = {entry["p"] for entry in journal if "p" in entry}
    # which sample meets the broken endpoint depends on the order the branches' seeds reach the server:
    # the row's prefix is named by whichever of its records there is
    prefixes = {r["conversations"][1]["value"]: r["metadata"]["branch_of"] for r in records(runner.folder())}
    assert all(key.endswith("@1") for key in prefixes.values()), prefixes
    assert prefixes[rows(2)[0]["prompt"]] not in live, "both branches of task 0 recorded: its prefix is dead"
    assert prefixes[failing] in live, "task 1's failed branch runs again on --resume, from its prefix"

    result = runner.invoke(data, *BASE, "--branch_at", "1", "--branches", "2", "--resume", server=model_server(script))
    assert result.exit_code == 0, result.output
    assert len(records(runner.folder())) == 4
