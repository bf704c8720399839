"""Verifiers and samples per prompt in this backend's sandboxes (issue 31): the real Apptainer."""

from __future__ import annotations

import pytest

from hermes_batch.testing import VerifierContract


class TestSingularityVerification(VerifierContract):
    """The shared verification test, through the ``runner`` of conftest.py (--sandbox singularity)."""

    @pytest.fixture
    def run_options(self, images):
        return ("-S", f"image={images.sif_a}")
