"""Constants and helpers of the singularity sandbox tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import functools
import os
import subprocess
import uuid
from pathlib import Path
from typing import Optional

import attrs

from hermes_batch.testing import Runner
from hermes_batch_singularity import instances

REPO_ROOT = Path(__file__).resolve().parents[2]
IMAGE_A = "hermes-batch-test/busybox-a:1"
IMAGE_B = "hermes-batch-test/busybox-b:1"
SESSION = uuid.uuid4().hex[:6]  # run names of this test session start with hbs-SESSION-


@functools.cache
def setup_apptainer() -> tuple[Optional[str], Optional[str]]:
    """(folder of the forwarding commands, None) or (None, why there is none)."""
    if os.environ.get("HERMES_APPTAINER_BIN"):
        return os.environ["HERMES_APPTAINER_BIN"], None
    if os.environ.get("HERMES_APPTAINER_PROBLEM"):
        return None, os.environ["HERMES_APPTAINER_PROBLEM"]
    # Not started by scripts/test.sh: set it up now (quick once the image exists).
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "apptainer.sh")], capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.strip():
        return None, f"scripts/apptainer.sh failed: {done.stderr.strip()[-500:]}"
    return done.stdout.strip().splitlines()[-1], None


def ours(folder: str, run_name: Optional[str] = None) -> list:
    from hermes_batch_singularity import runtime

    return instances.ours(runtime.list_instances(os.path.join(folder, "apptainer")), run_name)


def stop_instance(folder: str, name: str) -> None:
    subprocess.run([os.path.join(folder, "apptainer"), "instance", "stop", "--force", name], capture_output=True)


def instances_of(apptainer_bin: str, run_name: str) -> list:
    """Names of the running instances of a run."""
    return [found.name for found in ours(apptainer_bin, run_name)]


# --- images from local sources ------------------------------------------------------------------


@attrs.frozen
class Images:
    """The test images, as the backend can be given them."""

    archive_a: str  # docker-archive:// URI of busybox-a
    archive_b: str
    sif_a: str  # a SIF file built from busybox-a
    folder_b: str  # a sandbox folder built from busybox-b


def docker_images_ready() -> Optional[str]:
    for image in (IMAGE_A, IMAGE_B):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode != 0:
            build = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "docker.sh"), "images"], capture_output=True, text=True)
            if build.returncode != 0:
                return f"the busybox test images could not be built: {build.stderr.strip()[-300:]}"
            break
    return None


def singularity_runner(tmp_path: Path, run_name: str) -> Runner:
    """Runs ``hermes-batch run --sandbox singularity`` (terminal toolset only) against a scripted model server."""
    return Runner(tmp_path, run_name=run_name, options=(
        "--distribution", "terminal_only", "--sandbox", "singularity", "-S", f"cache_dir={tmp_path / 'sif-cache'}",
    ))
