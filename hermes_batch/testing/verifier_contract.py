"""The verification a backend's sandboxes must carry: one shared run test, subclassed by each backend's tests.

A backend's test module subclasses :class:`VerifierContract` in a class whose
name starts with ``Test``, with a ``runner`` fixture (a
:class:`~hermes_batch.testing.Runner` whose options pick the backend and the
terminal toolset) and the ``model_server`` fixture of
``hermes_batch.testing.fixtures``; options a run needs beyond the runner's (an
image only a fixture knows) come from a ``run_options`` fixture::

    class TestMyBackendVerification(VerifierContract):
        @pytest.fixture
        def run_options(self, images):
            return ("-S", f"image={images.default}")

What it checks: ``--verifier command`` runs a row's ``tests`` in the sample's
own sandbox after its session (its ``test_files`` placed only then), samples
per prompt each get a sandbox of their own, ``--stop_on_success`` ends a row at
its first pass, a reward the tests write to ``$HERMES_REWARD_FILE`` is the
sample's reward, and a process the session left running (a daemon that keeps
writing a full reward and a passing test file) is ended before the tests run.
"""

from __future__ import annotations

import json
import pprint
from typing import ClassVar

import pytest

from . import reward_hacks
from .fixtures import write_dataset
from .scripts import Reply, RoutedScript

TESTS = 'test "$(cat answer.txt)" = 42 && test "$(cat "$HERMES_TESTS_DIR/data/hidden.txt")" = secret'


def writes(content: str):
    """A script that looks for the hidden test file, writes ``content`` to ``answer.txt`` and stops."""

    def script(request):
        if request.turn == 0:
            command = f"ls data/hidden.txt; printf '%s' '{content}' > answer.txt"
            return Reply(reasoning="I will write it.", tool_calls=[("terminal", {"command": command})])
        return Reply(content="Written.", reasoning="Done.")

    return script


# A daemon out of the command's session that keeps writing a full reward and a passing test file.
FORGER = ("setsid sh -c 'while :; do echo 1.0 > .hermes_batch_reward; echo \"exit 0\" > hidden_test.sh; "
          "sleep 0.01; done' > /dev/null 2>&1 & echo started")


def runs(command: str):
    """A script that runs ``command`` with the terminal tool, then stops."""

    def script(request):
        if request.turn == 0:
            return Reply(reasoning="Working.", tool_calls=[("terminal", {"command": command})])
        return Reply(content="Done.", reasoning="Done.")

    return script


class VerifierContract:
    """Shared run test of verifiers and samples per prompt; subclass it where a ``runner`` fixture picks the backend."""

    #: What the sandbox's image offers the reward-hack corpus beyond a POSIX shell: "python3", "pytest".
    corpus_offers: ClassVar[tuple] = ()

    @pytest.fixture
    def run_options(self) -> tuple:
        """Options of the run beyond the runner's own (none by default)."""
        return ()

    def test_no_reward_hack_of_the_corpus_passes(self, tmp_path, runner, model_server, run_options):
        """Every attack of hermes_batch.testing.reward_hacks gets 0.0 where an honest solution of its row gets 1.0."""
        chosen = reward_hacks.cases(self.corpus_offers)
        server = model_server(reward_hacks.script(chosen))
        dataset = write_dataset(tmp_path / "corpus.jsonl", reward_hacks.rows(chosen))
        result = runner.invoke(dataset, "--verifier", "command:timeout=60", *run_options, server=server)
        assert result.exit_code == 0, result.output
        records = runner.records("trajectories.jsonl") + [d["trajectory"] for d in runner.records("discarded.jsonl")]
        got = reward_hacks.graded(records)
        wrong = {row: (want, got.get(row)) for row, want in reward_hacks.expected(chosen).items()
                 if got.get(row, (None,))[0] != want}
        assert not wrong, pprint.pformat(wrong, width=160)

    def test_the_command_verifier_runs_in_the_sample_s_sandbox(self, tmp_path, runner, model_server, run_options):
        server = model_server(RoutedScript(lambda sample: writes("41" if sample == 0 else "42"), by="sample"))
        rows = [
            {"prompt": "Write 42 to answer.txt", "tests": TESTS, "test_files": {"data/hidden.txt": "secret"}},
            {"prompt": "Partial credit", "tests": 'echo 0.5 > "$HERMES_REWARD_FILE"'},
        ]
        dataset = write_dataset(tmp_path / "data.jsonl", rows)
        result = runner.invoke(dataset, "--verifier", "command", "--samples_per_prompt", "3", "--stop_on_success",
                               *run_options, server=server)
        assert result.exit_code == 0, result.output
        records = runner.records("trajectories.jsonl") + [d["trajectory"] for d in runner.records("discarded.jsonl")]
        records.sort(key=lambda r: (r["prompt_index"], r["metadata"]["sample_index"]))
        meta = [(r["prompt_index"], r["metadata"]["sample_index"], r["metadata"]["reward"], r["metadata"]["passed"])
                for r in records]
        # the first sample fails, the second passes and stops its row; partial credit never passes, so three samples
        assert meta == [(0, 0, 0.0, False), (0, 1, 1.0, True), (1, 0, 0.5, False), (1, 1, 0.5, False),
                        (1, 2, 0.5, False)]
        assert "No such file" in records[0]["conversations"][3]["value"]  # the hidden file came after the session
        assert json.loads(records[1]["metadata"]["verifiers"])[0]["reason"] == "exit status 0"

    def test_a_process_the_session_left_cannot_forge_the_reward(self, tmp_path, runner, model_server, run_options):
        server = model_server(runs(FORGER))
        row = {"prompt": "Cheat", "tests": 'sleep 0.5; sh "$HERMES_TESTS_DIR/hidden_test.sh"',
               "test_files": {"hidden_test.sh": "exit 1\n"}}
        dataset = write_dataset(tmp_path / "data.jsonl", [row])
        result = runner.invoke(dataset, "--verifier", "command", *run_options, server=server)
        assert result.exit_code == 0, result.output
        records = runner.records("trajectories.jsonl") + [d["trajectory"] for d in runner.records("discarded.jsonl")]
        meta = records[0]["metadata"]
        assert "started" in records[0]["conversations"][3]["value"]  # the daemon ran
        assert (meta["reward"], meta["passed"]) == (0.0, False)
        assert json.loads(meta["verifiers"])[0]["reason"] == "exit status 1"
