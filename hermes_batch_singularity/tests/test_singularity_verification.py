"""Verifiers and samples per prompt in this backend's sandboxes (issue 31), the tests apart from the agent and the
reward-hack corpus (issue 43): the real Apptainer, as root (strict and -S reuse=namespace) and as an ordinary user."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from hermes_batch.testing import VerifierContract


class TestSingularityVerification(VerifierContract):
    """The shared verification test, through the ``runner`` of conftest.py (--sandbox singularity)."""

    @pytest.fixture
    def run_options(self, images):
        return ("-S", f"image={images.sif_a}")


class TestSingularityReusedVerification(TestSingularityVerification):
    """The same when instances serve prompts one after another (-S reuse=namespace): the tests run in the view."""

    @pytest.fixture
    def run_options(self, images):
        return ("-S", f"image={images.sif_a}", "-S", "reuse=namespace")


class TestSingularityUnprivilegedVerification(VerifierContract):
    """The same as an ordinary user (user namespaces, no setuid): the tests run as that user, as the agent did,
    and $HERMES_RUN_UNTRUSTED makes a user namespace of its own."""

    @pytest.fixture
    def run_options(self, images, user_apptainer_bin):
        folder = Path(tempfile.mkdtemp(prefix="unprivileged-", dir=Path(user_apptainer_bin).parent))
        folder.chmod(0o755)
        sif = folder / "busybox-a.sif"
        shutil.copyfile(images.sif_a, sif)
        sif.chmod(0o644)  # the user's to read (pytest's folders are root's alone)
        yield ("-S", f"binary={user_apptainer_bin}/apptainer", "-S", "no_privs=false", "-S", f"image={sif}")
        shutil.rmtree(folder, ignore_errors=True)
