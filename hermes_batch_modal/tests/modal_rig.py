"""Constants and helpers of the modal backend tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

from hermes_batch.testing import Runner

from standin import ModalStandIn

IMAGE_A = "hermes-batch-test/busybox-a:1"
IMAGE_B = "hermes-batch-test/busybox-b:1"
MISSING_IMAGE = "hermes-batch-test/no-such-image:1"
REPO_ROOT = Path(__file__).resolve().parents[2]
SESSION = uuid.uuid4().hex[:6]


def engine_problem():
    """None when the stand-in can run sandboxes of the test images, else why not."""
    try:
        standin = ModalStandIn().start()
    except Exception as exc:
        return f"no Docker engine answers ({type(exc).__name__}: {exc})"
    try:
        missing = [image for image in (IMAGE_A, IMAGE_B) if not standin.call(standin.engine.image_exists(image))]
    finally:
        standin.stop()
    if missing:
        build = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "docker.sh"), "images"], capture_output=True, text=True)
        if build.returncode != 0:
            return f"the test images could not be built: {build.stderr.strip()[-500:]}"
    return None


def modal_runner(tmp_path: Path, run_name: str) -> Runner:
    """Runs ``hermes-batch run --sandbox modal`` (terminal toolset only) against a scripted model server.

    Runs it spawns reach the same stand-in: the ``standin`` fixture sets the SDK's environment.
    """
    return Runner(tmp_path, run_name=run_name, options=(
        "--distribution", "terminal_only", "--sandbox", "modal", "-S", f"image={IMAGE_A}", "-S", "create_rate=50",
    ))
