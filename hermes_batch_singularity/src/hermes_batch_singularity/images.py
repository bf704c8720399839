"""Images of the singularity sandbox: a SIF file, a sandbox folder, or a URI converted once into a SIF cache.

A URI (``docker://``, ``docker-daemon://``, ``docker-archive://``, ``oras://``,
``library://`` ...) is built into ``<cache_dir>/sif/`` under a file lock, so
however many prompts and processes need it at the same moment it is converted
once, and later runs find it there.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import logging
import os
import re
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

import attrs
from spython.utils import split_uri

from hermes_batch import SandboxError

from . import runtime

log = logging.getLogger("hermes_batch.singularity")

SCHEMES = frozenset(
    {"docker", "docker-daemon", "docker-archive", "oci", "oci-archive", "oras", "library", "shub", "http", "https"}
)
_ARCHIVES = frozenset({"docker-archive", "oci-archive", "oci"})  # local files whose content may change
_SIF_SUFFIXES = (".sif", ".simg", ".img")
_SLUG_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]+")
LOCK_POLL_S = 0.2


@attrs.frozen
class ImageSource:
    """Where an image comes from: ``kind`` is ``file`` (a SIF), ``folder`` (a sandbox) or ``uri``."""

    given: str
    kind: str
    location: str  # the path, or the URI with its scheme


def classify(image: str) -> ImageSource:
    """What the dataset or ``-S image=`` names: a path when it looks like one, a URI, else a Docker name."""
    text = image.strip()
    if "://" in text:
        scheme, rest = split_uri(text)
        if scheme not in SCHEMES:
            raise SandboxError(
                f"The image {image!r} has the scheme {scheme}://, which Apptainer cannot build from; "
                f"use a .sif file, a sandbox folder, or one of {', '.join(s + '://' for s in sorted(SCHEMES))}."
            )
        if scheme in _ARCHIVES:  # a local file or folder: made absolute, so the cache key is one path
            return ImageSource(image, "uri", f"{scheme}://{os.path.abspath(os.path.expanduser(rest))}")
        return ImageSource(image, "uri", f"{scheme}://{rest}")
    if text.startswith(("/", "./", "../", "~")) or text.endswith(_SIF_SUFFIXES):
        path = os.path.abspath(os.path.expanduser(text))
        if os.path.isdir(path):
            return ImageSource(image, "folder", path)
        return ImageSource(image, "file", path)
    return ImageSource(image, "uri", f"docker://{text}")


def cache_file_name(uri: str) -> str:
    """The SIF's file name in the cache: readable, and unique to the URI (and an archive's size and time)."""
    key = uri
    scheme, rest = split_uri(uri)
    if scheme in _ARCHIVES:
        try:
            info = os.stat(rest)
            key = f"{uri}\0{info.st_size}\0{info.st_mtime_ns}"
        except OSError:
            pass
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    slug = _SLUG_UNSAFE.sub("_", rest.rsplit("/", 1)[-1])[:40].strip("._") or "image"
    return f"{slug}-{digest}.sif"


class ImageCache:
    """Gives each image a path the runtime can start an instance from; conversions happen once."""

    def __init__(self, binary: str, cache_dir: Path, convert_timeout: float, on_convert: Optional[Callable] = None):
        self.binary = binary
        self.folder = Path(cache_dir) / "sif"
        self.convert_timeout = convert_timeout
        self.on_convert = on_convert  # called with the URI before each conversion (for tests and logs)
        self._paths: dict[str, asyncio.Future] = {}

    async def path(self, image: str) -> str:
        """The SIF or folder to start from; SandboxError when the image cannot be had.

        Every caller asking for the same image waits for the same work; a failure
        stays a failure for the rest of the run.
        """
        future = self._paths.get(image)
        if future is None:
            future = self._paths[image] = asyncio.ensure_future(self._resolve(image))
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(future)

    async def produce(self, image: str, making) -> str:
        """The path of ``image``, made by the coroutine function ``making`` (called once for the run, by the
        first caller) instead of converted from its name: a task's image built from its Dockerfile.  Later
        ``path(image)`` calls get the same path, or the same error."""
        future = self._paths.get(image)
        if future is None:
            future = self._paths[image] = asyncio.ensure_future(making())
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(future)

    async def _resolve(self, image: str) -> str:
        source = classify(image)
        if source.kind == "folder":
            return source.location
        if source.kind == "file":
            if not os.path.isfile(source.location):
                raise SandboxError(
                    f"The image {image!r} names no SIF file ({source.location} does not exist); "
                    "fix the path, or use a docker:// or other URI to convert."
                )
            return source.location
        return await self.convert(image, source.location)

    async def convert(self, image: str, uri: str, name: Optional[str] = None) -> str:
        """Build the SIF ``name`` (else one named by the URI) in the cache from ``uri``, unless it is there."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SandboxError(
                f"The image cache folder {self.folder} cannot be made ({exc.strerror}); "
                "give a writable folder with -S cache_dir=PATH."
            ) from exc
        name = name or cache_file_name(uri)
        target = self.folder / name
        if target.is_file():
            return str(target)
        try:
            lock = await _lock(self.folder / (name + ".lock"))
        except OSError as exc:
            raise SandboxError(
                f"The lock file of the image cache in {self.folder} cannot be used ({exc.strerror}); "
                "give a writable folder with -S cache_dir=PATH."
            ) from exc
        try:
            if target.is_file():  # converted by another process while we waited
                return str(target)
            for stale in self.folder.glob(f".{name}.*.tmp"):  # left by a conversion that was killed
                stale.unlink(missing_ok=True)
            temporary = self.folder / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
            if self.on_convert is not None:
                self.on_convert(uri)
            log.info("Converting the image %s to a SIF in %s.", uri, self.folder)
            started = time.monotonic()
            try:
                # --disable-cache: Apptainer's own layer cache rewrites one index.json in place at
                # every build, so two builds at once (two images of one run) can read it half
                # written and fail with "unexpected end of JSON input". Each build gets a private
                # cache instead; the converted SIF is what this folder caches.
                done = await runtime.run(
                    [self.binary, "build", "--disable-cache", str(temporary), uri],
                    env=runtime.runtime_environment(proxies=True),
                    timeout=self.convert_timeout,
                    cwd=str(self.folder),
                )
                if done.timed_out:
                    raise SandboxError(
                        f"Converting the image {image!r} to a SIF took longer than {self.convert_timeout:g} s; "
                        "raise -S convert_timeout= or convert it yourself (apptainer build) and name the .sif file."
                    )
                if done.returncode != 0 or not temporary.is_file():
                    raise SandboxError(
                        f"The image {image!r} could not be converted to a SIF ({done.reason()}); "
                        "check its name and that its source can be reached, or name a .sif file instead."
                    )
                os.replace(temporary, target)
            finally:
                temporary.unlink(missing_ok=True)
            log.info("Converted %s in %.1f s.", uri, time.monotonic() - started)
            return str(target)
        finally:
            os.close(lock)


async def _lock(path: Path) -> int:
    """An exclusive lock on ``path`` (its file descriptor), waited for without holding a thread."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            await asyncio.sleep(LOCK_POLL_S)
    except BaseException:
        os.close(fd)
        raise
