"""hermes-batch-ray: ``--executor ray`` runs a run's prompts on Ray actors spread over a cluster's nodes."""

from __future__ import annotations

import hermes_batch


@hermes_batch.hookimpl
def register_executors(register):
    from .executor import RayExecutor

    register(RayExecutor)
