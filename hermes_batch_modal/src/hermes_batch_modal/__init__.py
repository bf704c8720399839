"""hermes-batch-modal: the ``modal`` sandbox backend, one Modal Sandbox per prompt.

Installing the distribution is all it takes: ``hermes-batch run --sandbox modal``
selects the backend and ``hermes-batch modal cleanup`` terminates leftovers.
"""

from __future__ import annotations

import hermes_batch

from .backend import ModalBackend
from .config import ModalConfig
from .sandbox import ModalSandbox

__all__ = ["ModalBackend", "ModalConfig", "ModalSandbox"]


@hermes_batch.hookimpl
def register_sandbox_backends(register):
    register(ModalBackend)


@hermes_batch.hookimpl
def register_commands(register):
    from .cli import modal_group

    register(modal_group)
