"""The shared sandbox contract, through the real ``modal`` SDK against the local Modal stand-in."""

from __future__ import annotations

import pytest

from hermes_batch import RunContext
from hermes_batch.testing import SandboxContract
from hermes_batch_modal import ModalBackend, ModalConfig, ModalSandbox

from modal_rig import IMAGE_A


class TestModalSandboxContractAgainstStandIn(SandboxContract):
    image = IMAGE_A
    image_marker = IMAGE_A
    timeout_slack = 3.0
    max_output_chars = 10_100  # the limit below, plus the omission notice
    stops_processes = True
    race_reads = 40  # each file call is an exec through the stand-in server (about 90 ms): 160 calls, not 1,600

    @pytest.fixture
    async def backend(self, tmp_path, run_name, standin):
        self.standin = standin
        config = ModalConfig(image=IMAGE_A, max_output_bytes=10_000, create_rate=100)
        backend = ModalBackend(config, RunContext(run_name, tmp_path / "run", seed=0))
        await backend.start()
        yield backend
        await backend.shutdown()

    async def sandbox_exists(self, sandbox: ModalSandbox) -> bool:
        return any(s.id == sandbox.id for s in self.standin.running())

    # The boundary classes: a Modal sandbox per prompt (the stand-in: a container per sandbox).
    limits = {"memory": 128 * 1024 * 1024, "pids": None, "disk": None}
    not_applicable = {
        "setuid": "commands run as the image's user in Modal's own sandbox (gVisor); the sandbox is the boundary",
        "pids": "Modal sets no process limit the backend can ask for",
        "disk": "Modal sets no disk limit the backend can ask for",
    }

    @pytest.fixture
    async def limited_backend(self, tmp_path, run_name, standin):
        config = ModalConfig(image=IMAGE_A, max_output_bytes=10_000, create_rate=100, memory="128m")
        backend = ModalBackend(config, RunContext(run_name, tmp_path / "limited", seed=0))
        await backend.start()
        yield backend
        await backend.shutdown()

    @pytest.fixture
    async def offline_backend(self, tmp_path, run_name, standin):
        config = ModalConfig(image=IMAGE_A, max_output_bytes=10_000, create_rate=100, network="none")
        backend = ModalBackend(config, RunContext(run_name, tmp_path / "offline", seed=0))
        await backend.start()
        yield backend
        await backend.shutdown()
