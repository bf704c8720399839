"""The shared sandbox contract, against real containers of a real Docker engine."""

from __future__ import annotations

import docker.errors
import pytest

from hermes_batch import RunContext
from hermes_batch.testing import SandboxContract
from hermes_batch_docker import DockerBackend, DockerConfig, DockerSandbox

from docker_rig import IMAGE_A


class TestDockerSandboxContract(SandboxContract):
    image = IMAGE_A
    image_marker = IMAGE_A
    timeout_slack = 3.0
    max_output_chars = 10_100  # the limit below, plus the omission notice
    race_reads = 40  # each file call is an exec or two

    @pytest.fixture
    async def backend(self, tmp_path, run_name, docker_api):
        backend = DockerBackend(DockerConfig(image=IMAGE_A, max_output_bytes=10_000), RunContext(run_name, tmp_path / "run", seed=0))
        await backend.start()
        yield backend
        await backend.shutdown()

    @pytest.fixture(autouse=True)
    def _api(self, docker_api):
        self.api = docker_api

    async def sandbox_exists(self, sandbox: DockerSandbox) -> bool:
        try:
            self.api.inspect_container(sandbox.id)
            return True
        except docker.errors.NotFound:
            return False


class TestDockerPooledSandboxContract(TestDockerSandboxContract):
    """The same contract when every sandbox comes from containers started ahead of need (-S pool=)."""

    @pytest.fixture
    async def backend(self, tmp_path, run_name, docker_api):
        config = DockerConfig(image=IMAGE_A, max_output_bytes=10_000, pool=2)
        backend = DockerBackend(config, RunContext(run_name, tmp_path / "run", seed=0))
        await backend.start()
        yield backend
        await backend.shutdown()
