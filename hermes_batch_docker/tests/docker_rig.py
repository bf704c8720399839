"""Constants and helpers of the docker sandbox tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path
from typing import Optional

import docker
from docker.utils import kwargs_from_env

from hermes_batch import RunContext, SandboxSpec
from hermes_batch_docker import DockerBackend, DockerConfig
from hermes_batch_docker.engine import LABEL_RUN

IMAGE_A = "hermes-batch-test/busybox-a:1"
IMAGE_B = "hermes-batch-test/busybox-b:1"
MISSING_IMAGE = "hermes-batch-test/no-such-image:1"
IMAGE_PYTHON = "hermes-batch-test/python:1"  # Debian with python3 and pytest (scripts/docker.sh python-image)
REPO_ROOT = Path(__file__).resolve().parents[2]
SESSION = uuid.uuid4().hex[:6]  # run names of this test session start with hbtest-SESSION-


def make_backend(tmp_path, run_name, **options) -> DockerBackend:
    """A backend of the test image, each container made when its prompt asks unless ``pool=`` says otherwise."""
    options.setdefault("image", IMAGE_A)
    options.setdefault("pool", 0)
    return DockerBackend(DockerConfig(**options), RunContext(run_name, tmp_path / "run", seed=0))


def spec(run_name, index=0, image=None, cwd=None, env=None) -> SandboxSpec:
    return SandboxSpec(run_name, index, f"{index:08d}c0ffee", image=image, cwd=cwd, env=dict(env or {}))


def containers_of(client, run_name: str) -> list:
    return client.containers(all=True, filters={"label": f"{LABEL_RUN}={run_name}"})


def _images_missing(client) -> list:
    missing = []
    for image in (IMAGE_A, IMAGE_B):
        try:
            client.inspect_image(image)
        except docker.errors.NotFound:
            missing.append(image)
    return missing


def engine_problem() -> tuple[Optional[str], Optional[docker.APIClient]]:
    """(None, a client of the engine), or (why there is none, ...): the images are built when missing."""
    try:
        client = docker.APIClient(**kwargs_from_env(), version="auto", timeout=30)
        client.ping()
    except Exception as exc:
        return f"no Docker engine answers ({type(exc).__name__})", None
    if _images_missing(client):
        build = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "docker.sh"), "images"], capture_output=True, text=True)
        if build.returncode != 0 or _images_missing(client):
            return f"the test images could not be built: {build.stderr.strip()[-500:]}", client
    return None, client


def python_image_problem(client) -> Optional[str]:
    """None once IMAGE_PYTHON is on the engine (built now when missing, about a minute once per machine), else why not."""
    try:
        client.inspect_image(IMAGE_PYTHON)
        return None
    except docker.errors.NotFound:
        pass
    build = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "docker.sh"), "python-image"], capture_output=True,
                           text=True)
    if build.returncode != 0:
        return f"the Python test image could not be built: {build.stderr.strip()[-500:]}"
    return None
