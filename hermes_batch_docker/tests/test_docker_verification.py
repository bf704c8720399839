"""Verifiers and samples per prompt in this backend's sandboxes (issue 31): the real Docker engine."""

from __future__ import annotations

import json

import pytest
from pathlib import Path

from hermes_batch.testing import Reply, VerifierContract


class TestDockerVerification(VerifierContract):
    """The shared verification test, through the ``runner`` of conftest.py (--sandbox docker), in an image with
    python3 and pytest, so that the reward-hack corpus runs its Python cases too; the agent is the image's root."""

    corpus_offers = ("python3", "pytest")

    @pytest.fixture
    def run_options(self, python_image):
        return ("-S", f"image={python_image}")


# --- the worked example of docs/verification.md -------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "coding_tasks.jsonl"
# what a model that gets each task right on its second try runs (its first try is wrong)
SOLUTIONS = {
    "rev": ("printf 'echo \"$1\"\\n' > rev.sh", "printf 'echo \"$1\" | rev\\n' > rev.sh"),
    "primes": ("seq 2 29 > primes.txt", "for n in 2 3 5 7 11 13 17 19 23 29; do echo $n; done > primes.txt"),
    "count": ("printf 'wc -l $1\\n' > count.sh", "printf 'wc -l < \"$1\" | tr -d \" \"\\n' > count.sh"),
    "double": ("printf 'echo $(( $1 * 2 ))\\n' > double.sh", "printf 'echo $(( $1 * 2 ))\\n' > double.sh"),
}


def test_the_worked_example_runs_as_documented(tmp_path, runner, model_server):
    rows = {json.loads(line)["prompt"]: json.loads(line)["id"] for line in EXAMPLE.read_text().splitlines()}

    def script(request):
        task = rows[request.prompt]
        if request.turn == 0:
            command = SOLUTIONS[task][min(request.sample, 1)]
            return Reply(reasoning="Writing it.", tool_calls=[("terminal", {"command": command})])
        return Reply(content="Done.", reasoning="Written.")

    server = model_server(script)
    # docs/verification.md: hermes-batch run --dataset_file examples/coding_tasks.jsonl --batch_size 4 ...
    result = runner.invoke(EXAMPLE, "--samples_per_prompt", "4", "--stop_on_success", "--verifier", "command",
                           server=server)
    assert result.exit_code == 0, result.output
    records = runner.records("trajectories.jsonl") + [d["trajectory"] for d in runner.records("discarded.jsonl")]
    samples = {}
    for record in records:
        meta = record["metadata"]
        samples.setdefault(meta["id"], []).append((meta["sample_index"], meta["reward"]))
    assert {task: sorted(found) for task, found in samples.items()} == {
        "rev": [(0, 0.0), (1, 1.0)],
        "primes": [(0, 0.0), (1, 1.0)],
        "count": [(0, 0.0), (1, 1.0)],
        "double": [(0, 1.0)],  # right the first time: one sample
    }


class TestDockerReusedVerification(VerifierContract):
    """The same with containers that serve prompts one after another, each in a view of its own (-S reuse=namespace):
    the tests join the sample's view as root after its processes were stopped, and a process it left cannot forge
    them."""

    corpus_offers = ("python3", "pytest")

    @pytest.fixture
    def run_options(self, python_image):
        return ("-S", f"image={python_image}", "-S", "reuse=namespace")


class TestDockerVerificationAsAUser(VerifierContract):
    """The same with an agent of its own (-S user=), which run-untrusted becomes, in both modes: a user the tests'
    files and the reward's folder do not let in, besides Landlock."""

    corpus_offers = ("python3", "pytest")

    @pytest.fixture(params=["strict", "reuse"])
    def run_options(self, request, python_image):
        reuse = ("-S", "reuse=namespace") if request.param == "reuse" else ()
        return ("-S", f"image={python_image}", "-S", "user=1000:1000", *reuse)


# --- command:clean=true: a fresh container holding only the final working folder ------------------------------

def test_clean_grading_undoes_a_program_a_root_agent_replaced(tmp_path, runner, model_server, python_image):
    """A root agent may replace the container's programs, which in-place tests then call (the README says so): its
    cmp that always agrees passes a wrong rev.sh in place; the fresh container's real cmp fails it, and the entry
    says the two verdicts disagree.  An honest row passes both ways."""
    import json as _json

    from hermes_batch.testing import write_dataset

    tests = '"$HERMES_RUN_UNTRUSTED" sh rev.sh hello > "$TMPDIR/out" && echo olleh | cmp - "$TMPDIR/out"'
    commands = {
        "Forge": "printf 'echo WRONG\\n' > rev.sh; c=$(command -v cmp); rm -f \"$c\"; "
                 "printf '#!/bin/sh\\nexit 0\\n' > \"$c\"; chmod 755 \"$c\"",
        "Honest": "printf 'echo olleh\\n' > rev.sh; mkdir -p deep/er; echo x > deep/er/f; mkfifo pipe; "
                  "ln -s /etc/passwd link",
    }

    def script(request):
        if request.turn == 0:
            return Reply(reasoning="Working.", tool_calls=[("terminal", {"command": commands[request.prompt]})])
        return Reply(content="Done.", reasoning="Done.")

    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": name, "tests": tests} for name in commands])
    # a Debian image: busybox's shell runs its own cmp whatever is on PATH
    result = runner.invoke(dataset, "--verifier", "command:clean=true", "-S", f"image={python_image}",
                           server=model_server(script))
    assert result.exit_code == 0, result.output
    records = runner.records("trajectories.jsonl") + [d["trajectory"] for d in runner.records("discarded.jsonl")]
    entries = {r["conversations"][1]["value"]: _json.loads(r["metadata"]["verifiers"])[0] for r in records}
    assert (entries["Forge"]["reward"], entries["Forge"]["disagree"]) == (0.0, True), entries["Forge"]
    assert entries["Forge"]["reason"].startswith("clean: exit status 1; in place: exit status 0")
    assert (entries["Honest"]["reward"], entries["Honest"]["disagree"]) == (1.0, False), entries["Honest"]


def test_clean_grading_is_refused_with_reused_containers(tmp_path, runner, model_server):
    from hermes_batch.testing import write_dataset

    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "p", "tests": "true"}])
    refused = runner.invoke(dataset, "--verifier", "command:clean=true", "-S", "reuse=namespace",
                            server=model_server(lambda request: Reply(content="Done.", reasoning="Done.")))
    assert refused.exit_code == 2
    assert "docker's -S reuse=none" in refused.output
