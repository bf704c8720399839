"""The shared sandbox contract, against real instances of a real Apptainer."""

from __future__ import annotations

import subprocess

import pytest

from hermes_batch import RunContext
from hermes_batch.testing import SandboxContract
from hermes_batch_singularity import SingularityBackend, SingularityConfig, SingularitySandbox

from singularity_rig import IMAGE_A, instances_of


class TestSingularitySandboxContract(SandboxContract):
    timeout_slack = 3.0
    max_output_chars = 10_100  # the limit below, plus the omission notice
    stops_processes = True
    race_reads = 25  # each file call is an exec of its own (about 0.3 s): 25 rounds are 100 calls
    image_marker = IMAGE_A  # sif_a is made of it

    @pytest.fixture(autouse=True)
    def _image(self, images, apptainer_bin):
        self.image = images.sif_a
        self.apptainer_bin = apptainer_bin

    @pytest.fixture
    async def backend(self, tmp_path, run_name, images):
        config = SingularityConfig(image=images.sif_a, cache_dir=str(tmp_path / "cache"), max_output_bytes=10_000)
        backend = SingularityBackend(config, RunContext(run_name, tmp_path / "run", seed=0))
        await backend.start()
        yield backend
        await backend.shutdown()

    async def sandbox_exists(self, sandbox: SingularitySandbox) -> bool:
        return sandbox.name in instances_of(self.apptainer_bin, sandbox._backend.run.run_name)

    # The boundary classes: --containall (no home, no host /tmp), an instance per prompt.
    not_applicable = {
        "setuid": "commands run as the invoking user through user namespaces; Apptainer itself allows no setuid",
        "memory": "the backend sets no limits (cgroup limits go through -S extra_args=, where the site allows)",
        "pids": "the backend sets no limits (cgroup limits go through -S extra_args=, where the site allows)",
        "disk": "the backend sets no limits (the writable tmpfs is memory)",
        "network_isolation": "-S network=host (the default) is the machine's network namespace: its abstract sockets "
                             "and /proc/net (-S network=none gives each instance its own)",
    }

    @pytest.fixture
    async def offline_backend(self, tmp_path, run_name, images):
        config = SingularityConfig(image=images.sif_a, cache_dir=str(tmp_path / "cache"), max_output_bytes=10_000,
                                   network="none")
        backend = SingularityBackend(config, RunContext(run_name, tmp_path / "offline", seed=0))
        await backend.start()
        yield backend
        await backend.shutdown()


class TestSingularityPooledSandboxContract(TestSingularitySandboxContract):
    """The same contract when every sandbox comes from instances started ahead of need (-S pool=)."""

    @pytest.fixture
    async def backend(self, tmp_path, run_name, images):
        config = SingularityConfig(image=images.sif_a, cache_dir=str(tmp_path / "cache"), max_output_bytes=10_000, pool=2)
        backend = SingularityBackend(config, RunContext(run_name, tmp_path / "run", seed=0))
        await backend.start()
        yield backend
        await backend.shutdown()


class TestSingularityExecRunnerContract(TestSingularitySandboxContract):
    """The shared contract with -S runner=exec: every command and file an apptainer exec of its own."""

    @pytest.fixture
    async def backend(self, tmp_path, run_name, images):
        config = SingularityConfig(image=images.sif_a, cache_dir=str(tmp_path / "cache"), max_output_bytes=10_000,
                                   runner="exec")
        backend = SingularityBackend(config, RunContext(run_name, tmp_path / "run", seed=0))
        await backend.start()
        yield backend
        await backend.shutdown()


class TestSingularityReusedSandboxContract(TestSingularitySandboxContract):
    """The same contract when instances serve prompts one after another, each in a view of its own (-S reuse=namespace)."""

    @pytest.fixture
    async def backend(self, tmp_path, run_name, images):
        config = SingularityConfig(image=images.sif_a, cache_dir=str(tmp_path / "cache"), max_output_bytes=10_000,
                                   reuse="namespace")
        backend = SingularityBackend(config, RunContext(run_name, tmp_path / "run", seed=0))
        await backend.start()
        yield backend
        await backend.shutdown()

    @pytest.fixture
    async def offline_backend(self, tmp_path, run_name, images):
        config = SingularityConfig(image=images.sif_a, cache_dir=str(tmp_path / "cache"), max_output_bytes=10_000,
                                   network="none", reuse="namespace")
        backend = SingularityBackend(config, RunContext(run_name, tmp_path / "offline", seed=0))
        await backend.start()
        yield backend
        await backend.shutdown()

    async def sandbox_exists(self, sandbox: SingularitySandbox) -> bool:
        """Its view, whose tag the helper removes when it ends (the instance outlives it, for the next prompt)."""
        argv = [*sandbox._backend.exec_prefix("/"), f"instance://{sandbox.name}", "test", "-e", sandbox._view.tag]
        return subprocess.run(argv, env=sandbox._backend.env, capture_output=True).returncode == 0
