"""--branch_at with the docker sandbox (issue 48): each branch a container of its own started from an image of the
prefix's container (its whole filesystem, not only the working folder), removed when the run ends; -S
reuse=namespace, whose working folders are views, refuses before any model call."""

from __future__ import annotations

import json
import threading

from hermes_batch.testing import Reply, write_dataset


def branch_script():
    """Turn 0 writes shared.txt; each branch (told apart by its seed) writes its own file and lists the folder."""
    order, lock = {}, threading.Lock()

    def script(request):
        if request.turn == 0:
            command = "echo base > shared.txt; mkdir -p /opt/prefix && echo x > /opt/prefix/outside.txt"
            return Reply(reasoning="A file first.", tool_calls=[("terminal", {"command": command})])
        with lock:
            n = order.setdefault(request.body.get("seed"), len(order))
        if request.turn == 1:
            command = f"echo {n} > mine_{n}.txt; ls; ls /opt/prefix"
            return Reply(reasoning="Mine.", tool_calls=[("terminal", {"command": command})])
        return Reply(content="The answer is 4", reasoning="Adding.")

    return script


def test_branches_start_from_an_image_of_the_prefix_container(tmp_path, runner, model_server, docker_api, run_name):
    server = model_server(branch_script())
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "What is 2 + 2?", "answer": 4}])
    result = runner.invoke(dataset, "--verifier", "answer", "--branch_at", "1", "--branches", "3", server=server)
    assert result.exit_code == 0, result.output
    records = runner.records("trajectories.jsonl")
    assert sorted(r["metadata"]["sample_index"] for r in records) == [0, 1, 2]
    assert len({r["metadata"]["branch_of"] for r in records}) == 1
    assert [r.turn for r in server.requests if r.prompt == "What is 2 + 2?"].count(0) == 1
    for record in records:
        value = record["conversations"][-2]["value"]
        output = json.loads(value.split("\n", 1)[1].rsplit("\n", 1)[0])["content"]["output"].split()
        assert "shared.txt" in output and len([f for f in output if f.startswith("mine_")]) == 1, output
        assert "outside.txt" in output, "a file the prefix wrote outside the working folder is in every branch"
    assert not docker_api.images(filters={"label": [f"org.hermes-batch.run={run_name}"]}), "the snapshots are removed"


def test_reused_containers_refuse_branches_before_any_model_call(tmp_path, runner, model_server):
    server = model_server(branch_script())
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "What is 2 + 2?", "answer": 4}])
    refused = runner.invoke(dataset, "--verifier", "answer", "--branch_at", "1", "--branches", "2",
                            "-S", "reuse=namespace", server=server)
    assert refused.exit_code == 2, refused.output
    assert "--branch_at copies each row's prefix sandbox" in refused.output
    assert server.request_count == 0
