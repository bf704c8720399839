"""Images built from task environments (a Harbor task's environment/Dockerfile), each distinct one once.

An image is named by the content key of its build context (``hermes-batch-task:<digest>``), so equal
environments are one image and an image already on the engine is never built again.  At most ``max_builds``
builds run at once, each in the run's thread pool with the engine's build cache; the prompts of a failed
build fail with the tail of its log, and the rest of the run goes on.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import tempfile
import time
from typing import Callable, Optional

from hermes_batch import SandboxError, task_folders

from .engine import docker, engine_errors

log = logging.getLogger("hermes_batch.docker")

LABEL_CONTEXT = "hermes-batch.context"  # the content key of the build context an image was built from
LOG_TAIL_LINES = 20
ARCHIVE_IN_MEMORY = 16 << 20
DEFAULT_BUILD_TIMEOUT = 1800.0


class ImageBuilder:
    """Builds each task image once per engine, at most ``max_builds`` at a time; ``build`` may be called ahead
    (while earlier prompts run) and by every prompt of the image, which all wait for the one build."""

    def __init__(self, api: Callable, thread_pool, max_builds: int):
        self._api = api  # () -> the docker.APIClient (set once the backend has started)
        self._thread_pool = thread_pool
        self._slots = asyncio.Semaphore(max_builds)
        self._builds: dict[str, asyncio.Future] = {}
        self.built: dict[str, float] = {}  # image -> seconds its build took (images found on the engine: absent)

    async def build(self, image: str, context: str, digest: str, timeout: Optional[float] = None) -> None:
        """Make ``image`` from the build context ``context`` of content key ``digest`` unless it exists;
        SandboxError with the tail of the build log when it cannot be built (for every caller, once)."""
        future = self._builds.get(image)
        if future is None:
            future = self._builds[image] = asyncio.ensure_future(self._build(image, context, digest, timeout))
            future.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure is the callers' to see
        await asyncio.shield(future)

    async def _build(self, image: str, context: str, digest: str, timeout: Optional[float]) -> None:
        loop = asyncio.get_running_loop()
        async with self._slots:
            call = functools.partial(build_image, self._api(), image, context, digest, timeout or DEFAULT_BUILD_TIMEOUT)
            took = await loop.run_in_executor(self._thread_pool, call)
        if took is not None:
            self.built[image] = took


def build_image(api, image: str, context: str, digest: str, timeout: float) -> Optional[float]:
    """Build ``image`` (blocking) unless the engine has it; the seconds it took, or None when it was there."""
    try:
        api.inspect_image(image)
        return None
    except docker.errors.NotFound:
        pass
    except engine_errors() as exc:
        raise SandboxError(f"The image {image} of the task environment {context} cannot be checked: {exc}.") from exc
    started = time.monotonic()
    tail: collections.deque = collections.deque(maxlen=LOG_TAIL_LINES)
    log.info("Building the image %s from %s.", image, context)
    with tempfile.SpooledTemporaryFile(ARCHIVE_IN_MEMORY) as archive:
        try:
            archived = task_folders.write_context_archive(context, archive)
        except task_folders.TaskError as exc:
            raise SandboxError(f"The task environment {context} cannot be built: {exc}") from None
        if archived != digest:
            raise SandboxError(f"The task environment {context} changed since the task was read; run again.")
        archive.seek(0)
        failed = None
        try:
            stream = api.build(fileobj=archive, custom_context=True, tag=image, rm=True, forcerm=True, pull=False,
                               decode=True, labels={LABEL_CONTEXT: digest}, timeout=timeout)
            for event in stream:
                if not isinstance(event, dict):
                    continue
                text = event.get("stream") or event.get("status") or ""
                for line in str(text).splitlines():
                    if line.strip():
                        tail.append(line.rstrip()[:400])
                if event.get("error"):
                    failed = str(event.get("error"))[:1000]
                    break
                if time.monotonic() - started > timeout:
                    failed = f"it ran past its build_timeout_sec of {timeout:g} s"
                    break
        except engine_errors() as exc:
            failed = str(exc)[:1000]
    if failed is not None:
        lines = "\n".join(tail)
        raise SandboxError(f"The image of the task environment {context} could not be built ({failed}); "
                           f"fix its Dockerfile. The build log ended with:\n{lines}")
    took = time.monotonic() - started
    log.info("Built the image %s in %.1f s.", image, took)
    return took
