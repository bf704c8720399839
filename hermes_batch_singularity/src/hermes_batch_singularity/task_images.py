"""A Harbor task's image, built from its environment/Dockerfile with a Docker engine and converted once to a SIF.

Apptainer cannot build from a Dockerfile, so the image is built by the Docker engine (with its build cache,
through the docker plugin's builder, which also checks the context's content key and keeps the build log's
tail), saved to an archive and converted with ``apptainer build ... docker-archive://`` into the SIF cache as
``task-<digest>.sif``.  That file is keyed by the build context's content, so a later run (or another process)
finds it and builds nothing; within a run each image is made once, at most ``max_builds`` at a time, and a
failure is the same error for every prompt of that task.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import posixpath
import stat
import uuid
from pathlib import Path
from typing import Optional

from hermes_batch import SandboxError

from .images import ImageCache

log = logging.getLogger("hermes_batch.singularity")

SAVE_CHUNK = 1 << 20
MAX_WORKDIR_BYTES = 4096


def sif_name(digest: str) -> str:
    """The SIF of a build context of this content digest, in the image cache."""
    return f"task-{digest[:32]}.sif"


class TaskImageBuilder:
    """Makes each task image's SIF once: Docker build, ``docker save``, ``apptainer build`` from the archive."""

    def __init__(self, images: ImageCache, thread_pool, max_builds: int):
        self.images = images
        self._thread_pool = thread_pool
        self._slots = asyncio.Semaphore(max_builds)
        self._api = None
        self.workdirs: dict[str, str] = {}  # image -> its Dockerfile's WORKDIR ("" for none), once made or found
        self.made: dict[str, float] = {}  # image -> seconds its build and conversion took (found in the cache: absent)

    async def build(self, image: str, context: str, digest: str, timeout: Optional[float] = None) -> str:
        """The SIF of ``image``; SandboxError (with the build log's tail) when it cannot be made."""
        return await self.images.produce(image, functools.partial(self._make, image, context, digest, timeout))

    async def _make(self, image: str, context: str, digest: str, timeout: Optional[float]) -> str:
        target = self.images.folder / sif_name(digest)
        noted = self.images.folder / workdir_name(digest)
        if target.is_file():  # made by an earlier run or another process
            workdir = read_workdir(noted)
            if workdir is not None:
                self.workdirs[image] = workdir
                return str(target)
        loop = asyncio.get_running_loop()
        try:
            self.images.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SandboxError(f"The image cache folder {self.images.folder} cannot be made ({exc.strerror}); "
                               "give a writable folder with -S cache_dir=PATH.") from exc
        async with self._slots:
            started = loop.time()
            docker_images = await loop.run_in_executor(self._thread_pool, _docker_images)
            if self._api is None:
                self._api = await loop.run_in_executor(self._thread_pool, _connect)
            build = functools.partial(docker_images.build_image, self._api, image, context, digest,
                                      timeout or docker_images.DEFAULT_BUILD_TIMEOUT)
            await loop.run_in_executor(self._thread_pool, build)
            # Harbor's tests expect the agent in the Dockerfile's WORKDIR, which a SIF does not keep: noted beside it
            workdir = await loop.run_in_executor(self._thread_pool, _working_dir, self._api, image)
            await loop.run_in_executor(self._thread_pool, _note_workdir, noted, workdir)
            archive = self.images.folder / f".{sif_name(digest)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tar"
            try:
                await loop.run_in_executor(self._thread_pool, _save, self._api, image, archive)
                path = await self.images.convert(image, f"docker-archive://{archive}", sif_name(digest))
            finally:
                archive.unlink(missing_ok=True)
        took = loop.time() - started
        self.workdirs[image] = workdir
        self.made[image] = took
        log.info("Built and converted the task image %s in %.1f s.", image, took)
        return path

    def close(self) -> None:
        if self._api is not None:
            self._api.close()
            self._api = None


def workdir_name(digest: str) -> str:
    """The file beside the SIF holding its image's WORKDIR."""
    return f"task-{digest[:32]}.workdir"


def read_workdir(path: Path) -> Optional[str]:
    """The WORKDIR noted in ``path`` ("" for none); None when it is missing or not what this module writes
    (a regular file of at most MAX_WORKDIR_BYTES holding an absolute path or nothing), so the image is made again."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return None
        data = handle.read(MAX_WORKDIR_BYTES + 1)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if len(data) > MAX_WORKDIR_BYTES or not _valid_workdir(text):
        return None
    return text


def _valid_workdir(text: str) -> bool:
    return text == "" or (posixpath.isabs(text) and not any(c in text for c in "\0\n\r"))


def _working_dir(api, image: str) -> str:
    from hermes_batch_docker import engine

    try:
        workdir = ((api.inspect_image(image).get("Config") or {}).get("WorkingDir") or "")
    except engine.engine_errors() as exc:
        raise SandboxError(f"The built image {image} cannot be inspected: {exc}.") from exc
    if not isinstance(workdir, str) or not _valid_workdir(workdir) or len(workdir.encode()) > MAX_WORKDIR_BYTES:
        raise SandboxError(f"The built image {image} has the WORKDIR {str(workdir)[:100]!r}, which is not an absolute "
                           "path; fix its Dockerfile.")
    return workdir


def _note_workdir(path: Path, workdir: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temporary, "x", encoding="utf-8") as out:
            out.write(workdir)
        os.replace(temporary, path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise SandboxError(f"The image cache folder {path.parent} cannot be written ({exc.strerror}); "
                           "give a writable folder with -S cache_dir=PATH.") from exc


def _docker_images():
    """The docker plugin's image builder module; SandboxError saying what to install without it."""
    try:
        from hermes_batch_docker import images
    except ImportError as exc:
        raise SandboxError(
            f"The singularity sandbox builds a task's image from its Dockerfile with a Docker engine, and the "
            f"docker plugin is not installed ({exc}); pip install hermes-batch-docker, or convert the image "
            "yourself and name the .sif file in task.toml's [environment] docker_image."
        ) from None
    return images


def _connect():
    from hermes_batch import HermesBatchError
    from hermes_batch_docker import engine

    try:
        return engine.connect(max_pool_size=4)
    except HermesBatchError as exc:
        raise SandboxError(
            f"The singularity sandbox builds a task's image from its Dockerfile with a Docker engine: {exc}"
        ) from None


def _save(api, image: str, archive: Path) -> None:
    """``docker save`` of ``image`` into ``archive`` (a file only this process writes)."""
    from hermes_batch_docker import engine

    try:
        with open(archive, "xb") as out:
            for chunk in api.get_image(image, chunk_size=SAVE_CHUNK):
                out.write(chunk)
    except (OSError, *engine.engine_errors()) as exc:
        raise SandboxError(f"The built image {image} could not be saved to {archive} for Apptainer: {exc}.") from exc
