"""Verifiers and samples per prompt in this backend's sandboxes (issue 31): the Modal stand-in (fake_modal: Modal's cloud cannot run here)."""

from __future__ import annotations

from hermes_batch.testing import VerifierContract


class TestModalVerification(VerifierContract):
    """The shared verification test, through the ``runner`` of conftest.py (--sandbox modal)."""
