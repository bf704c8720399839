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
    stops_processes = True
    race_reads = 40  # each file call is an exec or two

    @pytest.fixture
    async def backend(self, tmp_path, run_name, docker_api):
        # pool=0: each container made when its prompt asks (the pooled class below covers -S pool=)
        config = DockerConfig(image=IMAGE_A, max_output_bytes=10_000, pool=0)
        backend = DockerBackend(config, RunContext(run_name, tmp_path / "run", seed=0))
        await backend.start()
        yield backend
        await backend.shutdown()

    @pytest.fixture(autouse=True)
    def _api(self, docker_api):
        self.api = docker_api

    # The boundary classes: a container per prompt, from an image, never the host's files or network.
    limits = {"memory": 64 * 1024 * 1024, "pids": 32, "disk": None}
    not_applicable = {
        "setuid": "commands run as the image's user (root by default) in a container with a reduced capability "
                  "set and no-new-privileges; the container is the boundary",
        "disk": "the common overlay2 on ext4 cannot limit a container's writable layer (-S disk= where the engine can)",
    }

    @pytest.fixture
    async def limited_backend(self, tmp_path, run_name, docker_api):
        config = DockerConfig(image=IMAGE_A, max_output_bytes=10_000, memory="64m", pids_limit=32, pool=0)
        backend = DockerBackend(config, RunContext(run_name, tmp_path / "limited", seed=0))
        await backend.start()
        yield backend
        await backend.shutdown()

    @pytest.fixture
    async def offline_backend(self, tmp_path, run_name, docker_api):
        config = DockerConfig(image=IMAGE_A, max_output_bytes=10_000, network="none", pool=0)
        backend = DockerBackend(config, RunContext(run_name, tmp_path / "offline", seed=0))
        await backend.start()
        yield backend
        await backend.shutdown()

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


class TestDockerExecRunnerSandboxContract(TestDockerSandboxContract):
    """The same contract with one docker exec per command (-S runner=exec) instead of the container's runner."""

    @pytest.fixture
    async def backend(self, tmp_path, run_name, docker_api):
        async for backend in _backend(tmp_path / "run", run_name):
            yield backend

    @pytest.fixture
    async def limited_backend(self, tmp_path, run_name, docker_api):
        async for backend in _backend(tmp_path / "limited", run_name, memory="64m", pids_limit=32):
            yield backend

    @pytest.fixture
    async def offline_backend(self, tmp_path, run_name, docker_api):
        async for backend in _backend(tmp_path / "offline", run_name, network="none"):
            yield backend


async def _backend(run_dir, run_name, **options):
    options = {"runner": "exec", "pool": 0, **options}
    config = DockerConfig(image=IMAGE_A, max_output_bytes=10_000, **options)
    backend = DockerBackend(config, RunContext(run_name, run_dir, seed=0))
    await backend.start()
    try:
        yield backend
    finally:
        await backend.shutdown()


class TestDockerReusedSandboxContract(TestDockerSandboxContract):
    """The same contract when containers serve prompts one after another, each in a view of its own (-S reuse=namespace)."""

    @pytest.fixture
    async def backend(self, tmp_path, run_name, docker_api):
        async for backend in _backend(tmp_path / "run", run_name, reuse="namespace", runner="agent", pool=2):
            yield backend

    @pytest.fixture
    async def limited_backend(self, tmp_path, run_name, docker_api):
        async for backend in _backend(tmp_path / "limited", run_name, reuse="namespace", runner="agent", pool=2,
                                      memory="64m", pids_limit=32):
            yield backend

    @pytest.fixture
    async def offline_backend(self, tmp_path, run_name, docker_api):
        async for backend in _backend(tmp_path / "offline", run_name, reuse="namespace", runner="agent", pool=2,
                                      network="none"):
            yield backend

    async def sandbox_exists(self, sandbox: DockerSandbox) -> bool:
        """Its view's tag, which the helper removes once every process of the view is gone."""
        try:
            created = self.api.exec_create(sandbox.id, ["test", "-e", sandbox.view.tag])
        except docker.errors.APIError:  # the container is gone, or does not run
            return False
        self.api.exec_start(created["Id"])
        return self.api.exec_inspect(created["Id"])["ExitCode"] == 0
