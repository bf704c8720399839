"""Talking to the Docker engine: the connection, the labels on our containers, finding leftovers."""

from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Iterable, Optional

from hermes_batch import ConfigError, SandboxBackend

log = logging.getLogger("hermes_batch.docker")

LABEL_RUN = "org.hermes-batch.run"
LABEL_RUN_DIR = "org.hermes-batch.run-dir"
LABEL_PROMPT = "org.hermes-batch.prompt"
LABEL_CONTENT_KEY = "org.hermes-batch.content-key"
LABEL_HOST = "org.hermes-batch.host"
LABEL_PID = "org.hermes-batch.pid"
LABEL_SESSION = "org.hermes-batch.session"

API_TIMEOUT_S = 120  # one Docker API request; pulls of large images are covered by the engine's own progress

# Sessions of this process whose containers are still in use (several runs can share a process in tests).
LIVE_SESSIONS: set[str] = set()


class _Imported:
    """A module imported at its first attribute access.

    The docker SDK and requests took 0.2 s at the start of every run with this plugin installed, and of
    every worker process, whatever the run's sandbox; now only runs that talk to Docker import them.
    """

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str):
        return getattr(importlib.import_module(self._name), attribute)


docker = _Imported("docker")
requests_exceptions = _Imported("requests.exceptions")


@functools.cache
def engine_errors() -> tuple:
    """What the SDK raises when the engine cannot be reached or refuses a request."""
    return (docker.errors.DockerException, requests_exceptions.RequestException)


def engine_address() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def connect(max_pool_size: int = 64, timeout: float = API_TIMEOUT_S) -> docker.APIClient:
    """A client of the engine named by DOCKER_HOST (else the local socket); ConfigError when it does not answer."""
    try:
        client = docker.APIClient(
            **docker.utils.kwargs_from_env(), version="auto", timeout=timeout, max_pool_size=max_pool_size
        )
        client.ping()
        return client
    except Exception as exc:  # the SDK raises DockerException, requests errors or OSError
        reason = _short_reason(exc)
        raise ConfigError(
            f"The Docker engine at {engine_address()} is not reachable ({reason}); start it "
            "(`sudo systemctl start docker`, or `sudo dockerd &` where there is no systemd) "
            "or point DOCKER_HOST at a running engine."
        ) from exc


def _short_reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    for marker in ("Connection refused", "No such file or directory", "Permission denied", "timed out"):
        if marker.lower() in text.lower():
            return marker.lower()
    return text if len(text) <= 160 else text[:157] + "..."


def owner_alive(labels: dict) -> bool:
    """Whether the hermes-batch process that made a container may still run.

    Only a process of this machine can be checked; one of another machine (an
    engine shared by several hosts) is taken to be running.
    """
    return SandboxBackend.owner_alive(labels.get(LABEL_PID), labels.get(LABEL_HOST, ""),
                                      session=labels.get(LABEL_SESSION), live_sessions=LIVE_SESSIONS)


def find_containers(client: docker.APIClient, run_name: Optional[str] = None, **labels: str) -> list[dict]:
    """Containers (running or not) made by hermes-batch, of one run if ``run_name`` is given."""
    filters = [f"{LABEL_RUN}={run_name}" if run_name is not None else LABEL_RUN]
    filters += [f"{key}={value}" for key, value in labels.items()]
    return client.containers(all=True, filters={"label": filters})


def remove_container(client: docker.APIClient, container_id: str) -> bool:
    """Kill and remove a container with its anonymous volumes; False when it was already gone."""
    try:
        client.remove_container(container_id, force=True, v=True)
        return True
    except docker.errors.NotFound:
        return False
    except docker.errors.APIError as exc:
        if exc.status_code == 409 and "already in progress" in str(exc):
            return False
        raise


def remove_images(client: docker.APIClient, names: Iterable[str]) -> None:
    """Remove images this run made (--branch_at's snapshots); one still used or gone is left, with a warning."""
    for name in list(names):
        try:
            client.remove_image(name, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            log.warning("Could not remove the image %s: %s", name, exc)


def remove_all(client: docker.APIClient, containers: Iterable[dict]) -> int:
    removed = 0
    for container in containers:
        try:
            removed += remove_container(client, container["Id"])
        except docker.errors.APIError as exc:
            log.warning("Could not remove the container %s: %s", container["Id"][:12], exc)
    return removed
