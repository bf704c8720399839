"""Against Modal's real servers: the contract suite, the verification test with its reward-hack corpus and a 5-prompt
run, when a token is in the environment.

Skipped unless MODAL_TOKEN_ID and MODAL_TOKEN_SECRET are set (they cost a little money:
about two dozen short sandboxes of python:3.11-slim in the app hermes-batch-tests).
"""

from __future__ import annotations

import json
import os

import modal
import pytest

from hermes_batch import RunContext
from hermes_batch.testing import Runner, SandboxContract, ToolLoopScript, VerifierContract, write_dataset
from hermes_batch_modal import ModalBackend, ModalConfig, ModalSandbox


LIVE = bool(os.environ.get("MODAL_TOKEN_ID") and os.environ.get("MODAL_TOKEN_SECRET")) and not os.environ.get("MODAL_SERVER_URL")
pytestmark = pytest.mark.skipif(not LIVE, reason="MODAL_TOKEN_ID and MODAL_TOKEN_SECRET are not set (live Modal tests)")

IMAGE = "python:3.11-slim"
APP = "hermes-batch-tests"


class TestModalSandboxContractLive(SandboxContract):
    image = IMAGE
    timeout_slack = 5.0
    max_output_chars = 10_100
    stops_processes = True

    @pytest.fixture
    async def backend(self, tmp_path, run_name):
        backend = ModalBackend(ModalConfig(app=APP, image=IMAGE, max_output_bytes=10_000, timeout=600),
                               RunContext(run_name, tmp_path / "run", seed=0))
        await backend.start()
        yield backend
        await backend.shutdown()

    async def sandbox_exists(self, sandbox: ModalSandbox) -> bool:
        found = await modal.Sandbox.from_id.aio(sandbox.id)
        return await found.poll.aio() is None


class TestModalVerificationLive(VerifierContract):
    """The shared verification test and its reward-hack corpus under gVisor, which has no Landlock: whether
    $HERMES_RUN_UNTRUSTED can make namespaces there (else it refuses, and the honest cases fail) is what it shows."""

    corpus_offers = ("python3",)  # python:3.11-slim has no pytest

    @pytest.fixture
    def runner(self, tmp_path, run_name):
        return Runner(tmp_path, run_name=run_name, options=(
            "--distribution", "terminal_only", "--sandbox", "modal", "-S", f"app={APP}", "-S", f"image={IMAGE}",
            "-S", "timeout=600"))


def test_five_prompts_run_on_modal(tmp_path, run_name, model_server):
    dataset = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {i}", **({"cwd": "/srv"} if i % 2 else {})} for i in range(5)])
    server = model_server(ToolLoopScript(tool_calls=1, command="pwd; python3 -c 'print(6*7)'"))
    folder = tmp_path / "out" / run_name
    runner = Runner(tmp_path, run_name=run_name, options=("--distribution", "terminal_only", "--sandbox", "modal"))
    result = runner.invoke(dataset, "--num_workers", "5", "-S", f"app={APP}", "-S", f"image={IMAGE}", "-S", "timeout=600",
                           server=server)
    assert result.exit_code == 0, result.output
    trajectories = [json.loads(line) for line in (folder / "trajectories.jsonl").read_text().splitlines()]
    assert sorted(t["prompt_index"] for t in trajectories) == list(range(5))
    for trajectory in trajectories:
        text = json.dumps(trajectory)
        assert "42" in text and ("/srv" in text if trajectory["prompt_index"] % 2 else "/workspace" in text)
    for path in folder.rglob("*"):
        if path.is_file():
            assert os.environ["MODAL_TOKEN_SECRET"].encode() not in path.read_bytes()
    cleanup = runner.cli("modal", "cleanup", "--app", APP, "--run", run_name)
    assert "No leftover Modal sandboxes" in cleanup.output
