"""hermes-batch-singularity: the ``singularity`` sandbox backend, one Apptainer/SingularityCE instance per prompt.

Installing the distribution is all it takes: ``hermes-batch run --sandbox singularity``
selects the backend and ``hermes-batch singularity cleanup`` stops leftovers.
"""

from __future__ import annotations

import hermes_batch

from .backend import SingularityBackend
from .config import SingularityConfig
from .sandbox import SingularitySandbox

__all__ = ["SingularityBackend", "SingularityConfig", "SingularitySandbox"]


@hermes_batch.hookimpl
def register_sandbox_backends(register):
    register(SingularityBackend)


@hermes_batch.hookimpl
def register_commands(register):
    from .cli import singularity_group

    register(singularity_group)
