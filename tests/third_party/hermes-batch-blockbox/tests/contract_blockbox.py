"""The shared sandbox contract over the blockbox backend."""

import pytest

from hermes_batch import RunContext
from hermes_batch.testing import SandboxContract
from hermes_batch_blockbox import BlockboxBackend


class TestBlockboxContract(SandboxContract):
    stops_processes = True

    @pytest.fixture
    async def backend(self, tmp_path):
        backend = BlockboxBackend(BlockboxBackend.Config(), RunContext("contract", tmp_path / "run", seed=0))
        await backend.check()
        await backend.start()
        yield backend
        await backend.shutdown()

    async def sandbox_exists(self, sandbox) -> bool:
        return sandbox.root.exists()

    # blockbox runs commands as plain processes of the runner's user: a folder per prompt, not a boundary
    not_applicable = dict.fromkeys(
        ("neighbours", "home", "run_folder", "write_outside", "setuid", "memory", "pids", "disk", "network", "groups",
         "keyring", "ipc", "network_isolation", "first_process"),
        "blockbox runs commands as plain processes of the runner's user",
    )
