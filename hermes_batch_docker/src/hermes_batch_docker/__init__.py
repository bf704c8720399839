"""hermes-batch-docker: the ``docker`` sandbox backend, one hardened container per prompt.

Installing the distribution is all it takes: ``hermes-batch run --sandbox docker``
selects the backend and ``hermes-batch docker cleanup`` removes leftovers.
"""

from __future__ import annotations

import hermes_batch

from .backend import DockerBackend
from .config import DockerConfig
from .sandbox import DockerSandbox

__all__ = ["DockerBackend", "DockerConfig", "DockerSandbox"]


@hermes_batch.hookimpl
def register_sandbox_backends(register):
    register(DockerBackend)


@hermes_batch.hookimpl
def register_commands(register):
    from .cli import docker_group

    register(docker_group)
