"""The ``docker`` sandbox backend: one hardened container per prompt, labelled so leftovers are found."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import posixpath
import re
import socket
import tarfile
import tempfile
import uuid
from pathlib import Path
from typing import Optional


from hermes_batch import (
    ConfigError, ImageDemand, SandboxBackend, SandboxError, SandboxSpec, WarmPool, build_namespace_helper, grading,
)

from . import engine
from .config import BASE_CAPABILITIES, DEFAULT_DISK, DEFAULT_WORKDIR, HELPER_CAPABILITIES, DockerConfig, parse_size
from .engine import (
    LABEL_CONTENT_KEY,
    LABEL_HOST,
    LABEL_PID,
    LABEL_PROMPT,
    LABEL_RUN,
    LABEL_RUN_DIR,
    LABEL_SESSION,
    LIVE_SESSIONS,
    docker,
    engine_errors,
)
from .agent import AGENT_SCRIPT, Agent, exportable
from .images import ImageBuilder
from .sandbox import AGENT_READY_S, SHELL, DockerSandbox
from .views import HELPER, IDENTITY_SCRIPT, VIEW_END_S, VIEW_FOLDER, new_view, parse_identity

SNAPSHOT_REPOSITORY = "hermes-batch-snapshot"  # --branch_at: the images of prefixes' containers

log = logging.getLogger("hermes_batch.docker")

# PID 1 of every container: a shell that idles (and, as PID 1, reaps the orphans of commands).
ARCHIVE_IN_MEMORY = 16 << 20  # bytes of a working folder's archive (command:clean=true) kept in memory, the rest on disk
# a container's first process: it idles, reaps, and never starts a program again (a root agent may replace them)
KEEPALIVE = grading.IDLE_FIRST_PROCESS
DEFAULT_CPUS = 2.0
# Storage drivers that take a per-container size (storage_opt): overlay2 only on xfs mounted with pquota.
_SIZED_DRIVERS = ("btrfs", "zfs", "devicemapper", "windowsfilter")
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]")


class _PullFailed(Exception):
    pass


class DockerBackend(SandboxBackend):
    """Runs each prompt in a container of its own, created from the row's image or ``-S image=...``."""

    name = "docker"
    isolation = "container"  # each prompt a container of its own (recorded in run.json and metadata)
    description = (
        "One container per prompt from the row's image or -S image=..., with capabilities dropped, "
        "no-new-privileges and pids, memory and CPU limits; commands through the Docker API."
    )
    Config = DockerConfig

    @property
    def snapshots_filesystems(self) -> bool:
        """--branch_at: a strict container is committed to an image its branches start from (a view's files are
        not the container's, so -S reuse=namespace cannot)."""
        return self.config.reuse == "none"

    @property
    def copies_workdirs(self) -> bool:
        """command:clean=true: a strict container's working folder is copied into a fresh one (a view's is not the
        container's, so -S reuse=namespace cannot)."""
        return self.config.reuse == "none"

    def __init__(self, config: DockerConfig, run):
        super().__init__(config, run)
        self.api: Optional[docker.APIClient] = None
        self.session = uuid.uuid4().hex[:16]
        self.nano_cpus: Optional[int] = None
        self.storage_opt: Optional[dict] = None
        self._starting = asyncio.Semaphore(config.max_starting)
        self._images: dict[str, asyncio.Future] = {}
        self._open: set[DockerSandbox] = set()
        self._background: set[asyncio.Future] = set()  # creations, removals and kills still running in threads
        self._pools: dict[tuple, WarmPool] = {}  # (image, working folder) -> containers started ahead (-S pool=)
        self._snapshots: set[str] = set()  # --branch_at: images of prefixes' containers, removed at shutdown
        self._taken: dict[DockerSandbox, WarmPool] = {}  # open sandboxes of a pool, replaced (or given back) when closed
        self.helper: Optional[str] = None  # the static namespace helper on this machine (views, tests' supervisor)
        self._helper_program: Optional[asyncio.Future] = None  # its bytes, copied into a container for each grading
        self.tests_apart_missing = "it was not started"  # set at check: "" once the helper is built
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # the run's event loop, for runners started in threads
        self.builder: Optional[ImageBuilder] = None  # task images built from Dockerfiles (made at the first)
        self.demand: Optional[ImageDemand] = None  # the prompts still to come of each image (follow_demand)
        # images this process pulled or built (never one it found on the engine) -> their size, least recently used
        # first: the ones -S image_cache= may remove
        self.own_images: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._using: collections.Counter = collections.Counter()  # image -> its sandboxes whose container is not gone
        self._counted: set[DockerSandbox] = set()  # those sandboxes
        self._removing: dict[str, asyncio.Future] = {}  # images being removed (-S image_cache=)
        self.removed_images: list[str] = []  # what -S image_cache= removed, in order

    # --- plumbing --------------------------------------------------------------------------

    async def blocking(self, function, *args, **kwargs):
        """Run a blocking SDK call in the run's thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.run.thread_pool, functools.partial(function, *args, **kwargs))

    def in_background(self, function, *args) -> asyncio.Future:
        """Start a blocking call that nobody waits for; ``shutdown`` does."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.run.thread_pool, functools.partial(_quiet, function, *args))
        self._background.add(future)
        future.add_done_callback(self._background.discard)
        return future

    def _pool_size(self) -> int:
        pool = self.run.thread_pool
        return getattr(pool, "_max_workers", 32) + 16

    def concurrency(self) -> int:
        """Prompts the run works on at once: the runner's thread pool has 4 threads more than that."""
        return max(1, getattr(self.run.thread_pool, "_max_workers", 8) - 4)

    # --- run lifecycle -------------------------------------------------------------------------

    async def check(self) -> None:
        """Connect to the engine (ConfigError when it is down) and check the options against it."""
        if self.api is not None:
            return
        api = await self.blocking(engine.connect, self._pool_size())
        try:
            info = await self.blocking(api.info)
            self.nano_cpus = int(self._cpus(info.get("NCPU") or os.cpu_count() or 1) * 1e9)
            self.storage_opt = self._storage_opt(info)
            await self._check_network(api)
            if self.config.reuse == "namespace":
                self.helper = await self.blocking(_namespace_helper)
                self.tests_apart_missing = ""
            else:  # only a verifier's tests need it here (Sandbox.run_tests): a run without one goes on without it
                self.helper, why = await self.blocking(build_namespace_helper, None, "hermes-batch-namespace", True)
                self.tests_apart_missing = ""
                if self.helper is None:
                    self.tests_apart_missing = (
                        f"hermes-batch's static namespace helper, which supervises the tests in the container, could "
                        f"not be built ({why}; install gcc and libc6-dev)")
        except BaseException:
            api.close()
            raise
        self.api = api

    async def start(self) -> None:
        """Check the engine if not done yet, then remove leftovers of an earlier process of this run."""
        await self.check()
        self._loop = asyncio.get_running_loop()
        LIVE_SESSIONS.add(self.session)
        try:
            await self._remove_leftovers()
        except engine_errors() as exc:  # leftovers cost disk, not correctness: the run goes on
            log.warning("Could not look for containers left by an earlier process of this run: %s", _explain(exc))

    def _cpus(self, engine_cpus: int) -> float:
        if self.config.cpus is None:
            return min(DEFAULT_CPUS, float(engine_cpus))
        if self.config.cpus > engine_cpus:
            raise ConfigError(
                f"-S cpus={self.config.cpus:g} is more than the {engine_cpus} CPUs of the Docker engine; "
                f"give at most {engine_cpus}."
            )
        return self.config.cpus

    def _storage_opt(self, info: dict) -> Optional[dict]:
        disk = self.config.disk
        if disk == "none":
            return None
        driver = info.get("Driver") or "unknown"
        backing = dict(info.get("DriverStatus") or []).get("Backing Filesystem", "unknown")
        if driver in _SIZED_DRIVERS or (driver in ("overlay2", "overlay") and backing == "xfs"):
            return {"size": str(parse_size(disk or DEFAULT_DISK, "disk"))}
        if disk is not None:
            raise ConfigError(
                f"-S disk={disk}: this Docker engine cannot limit a container's disk (storage driver {driver} on "
                f"{backing}; it takes overlay2 on xfs mounted with pquota, btrfs, zfs or devicemapper); "
                "pass -S disk=none or move Docker's data-root to such a file system."
            )
        log.info(
            "The Docker engine cannot limit a container's disk (%s on %s): a prompt can fill the disk of its "
            "data-root (see -S disk in the README of hermes-batch-docker).", driver, backing,
        )
        return None

    async def _check_network(self, api: docker.APIClient) -> None:
        network = self.config.network
        if network in ("bridge", "none", "default"):
            return
        found = await self.blocking(api.networks, names=[network])
        if not any(n.get("Name") == network for n in found):
            raise ConfigError(
                f"-S network={network}: the Docker engine has no network of that name; "
                f"create it (docker network create {network}) or use bridge or none."
            )

    async def _remove_leftovers(self) -> None:
        run_dir = _run_dir(self.run)

        def sweep() -> int:
            containers = engine.find_containers(self.api, self.run.run_name)
            stale = [
                c for c in containers
                if c.get("Labels", {}).get(LABEL_RUN_DIR) == run_dir and not engine.owner_alive(c.get("Labels", {}))
            ]
            removed = engine.remove_all(self.api, stale)
            # --branch_at's snapshots of a killed process of this run, once their containers are gone
            images = self.api.images(filters={"label": [f"{LABEL_RUN}={self.run.run_name}"]})
            engine.remove_images(self.api, [
                tag for image in images
                if (image.get("Labels") or {}).get(LABEL_RUN_DIR) == run_dir
                and not engine.owner_alive(image.get("Labels") or {})
                for tag in image.get("RepoTags") or () if tag.startswith(SNAPSHOT_REPOSITORY + ":")
            ])
            return removed

        removed = await self.blocking(sweep)
        if removed:
            log.warning(
                "Removed %d container(s) left behind by an earlier process of run %r.", removed, self.run.run_name
            )

    async def shutdown(self) -> None:
        """Remove every container of this process, also those whose creation was cut short."""
        if self.api is None:
            return
        try:
            for pool in self._pools.values():
                pool.close()
            await asyncio.gather(*(sandbox.close() for sandbox in list(self._open)), return_exceptions=True)
            while self._background:
                await asyncio.gather(*list(self._background), return_exceptions=True)

            def sweep() -> int:
                removed = engine.remove_all(self.api, engine.find_containers(self.api, **{LABEL_SESSION: self.session}))
                engine.remove_images(self.api, self._snapshots)  # once no container runs them
                return removed

            await self.blocking(sweep)
        finally:
            LIVE_SESSIONS.discard(self.session)
            self.api.close()

    # --- images ---------------------------------------------------------------------------------

    async def prepare_image(self, image: Optional[str]) -> None:
        """Check the image, pulling it once if missing; every prompt that needs it waits for that one pull.

        With ``-S pool=``, the image's pool starts filling now, while the first model calls are in flight.
        """
        name = image or self.config.image
        info = await self._image(name)
        if self.config.pool_size(self.concurrency()) > 0:
            self._container_pool(name, info)

    async def build_image(self, image: str, context: str, digest: str, timeout: Optional[float] = None) -> None:
        """Build a task's image from its environment once (images.py); every prompt of it waits for that build."""
        if self.api is None:
            raise SandboxError("The docker sandbox backend was not started.")
        if self.builder is None:
            self.builder = ImageBuilder(lambda: self.api, self.run.thread_pool, self.config.max_builds)
        await self.builder.build(image, context, digest, timeout)

    async def prepare_ahead(self, image: str) -> None:
        """Inspect the image, pulling it (or having ``obtain_image`` make it) if missing, while earlier prompts run;
        no container is started for it until its prompts come."""
        await self._image(image)

    def follow_demand(self, demand: ImageDemand) -> None:
        """Keep each image's pool no larger than its prompts still to come, and drop an image's pool once none is."""
        self.demand = demand
        demand.listen(self._demand_fell)

    def _demand_fell(self, image: str) -> None:
        for key, pool in list(self._pools.items()):
            if key[0] == image:
                pool.trim()
        self._drop_pools(image)
        self._evict()

    def _drop_pools(self, image: str) -> None:
        """Close the image's pools once no prompt of it is to come and they hold nothing."""
        if self.demand is None or self.demand.left(image):
            return
        for key, pool in list(self._pools.items()):
            if key[0] == image and pool.idle:
                pool.close()
                del self._pools[key]

    async def _image(self, name: str) -> dict:
        removing = self._removing.get(name)
        if removing is not None:  # removed for -S image_cache= and asked for again: pulled or built anew after
            await asyncio.shield(removing)
        if name in self.own_images:
            self.own_images.move_to_end(name)
        future = self._images.get(name)
        if future is None:
            loop = asyncio.get_running_loop()
            future = self._images[name] = loop.run_in_executor(self.run.thread_pool, self._ensure_image, name)
            # An unavailable image stays unavailable for this run: each of its prompts fails at once.
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
        info = await asyncio.shield(future)
        if name in self.own_images:
            self._evict()
        return info

    def _ensure_image(self, name: str) -> dict:
        """The engine's description of the image, which is pulled (``obtain_image``) if missing (blocking)."""
        try:
            return self.api.inspect_image(name)
        except docker.errors.NotFound:
            pass
        except engine_errors() as exc:
            raise SandboxError(f"The image {name!r} cannot be used: {_explain(exc)}.") from exc
        info = self.obtain_image(name)
        if self._loop is not None:  # the run's own from now on: -S image_cache= may remove it
            self._loop.call_soon_threadsafe(self._owned, name, int(info.get("Size") or 0))
        return info

    def _owned(self, name: str, size: int) -> None:
        self.own_images[name] = size
        self.own_images.move_to_end(name)

    def obtain_image(self, name: str) -> dict:
        """Make the missing image ``name`` available and return its description (blocking): pulled here; a
        backend that builds images (from a task's Dockerfile) overrides this.  What it makes is the run's own."""
        if self.config.pull == "never":
            raise SandboxError(
                f"The image {name!r} is not on the Docker engine and -S pull=never forbids pulling it; "
                f"build or pull it first (docker pull {name})."
            )
        log.info("Pulling the image %s.", name)
        try:
            for event in self.api.pull(name, stream=True, decode=True):
                if isinstance(event, dict) and event.get("error"):
                    raise _PullFailed(event["error"])
            return self.api.inspect_image(name)
        except (_PullFailed, *engine_errors()) as exc:
            raise SandboxError(
                f"The image {name!r} is not on the Docker engine and could not be pulled ({_explain(exc)}); "
                f"build or pull it (docker pull {name}) or fix the prompt's image."
            ) from exc

    def _evict(self) -> None:
        """Remove the least recently used images of this run's own while they hold more than ``-S image_cache=``:
        only those no prompt still to come needs, with no open sandbox or pool (an image found on the engine is
        never removed)."""
        budget = self.config.image_cache_bytes
        if budget is None or self.api is None:
            return
        held = sum(self.own_images.values())
        for name in list(self.own_images):
            if held <= budget:
                return
            if self._using[name] or any(key[0] == name for key in self._pools):
                continue
            if self.demand is not None and self.demand.left(name):
                continue
            held -= self.own_images.pop(name)
            self._images.pop(name, None)
            self.removed_images.append(name)
            log.info("Removing the image %s (-S image_cache=%s).", name, self.config.image_cache)
            future = self._removing[name] = self.in_background(self.api.remove_image, name)
            future.add_done_callback(lambda _f, name=name: self._removing.pop(name, None))

    # --- containers --------------------------------------------------------------------------------

    async def open(self, spec: SandboxSpec) -> DockerSandbox:
        """The prompt's container: one of the image's pool (``-S pool=``), else created and started now.

        At most ``max_starting`` containers are created and started at once, for the pools and for prompts.
        """
        if self.api is None:
            raise SandboxError("The docker sandbox backend was not started.")
        image = spec.image or self.config.image
        info = await self._image(image)
        workdir = self._workdir(spec.cwd, info)
        name = self._name(spec.prompt_index, spec.run_name)
        env = {str(key): str(value) for key, value in spec.env.items()}

        def opening() -> None:
            if self.demand is not None:
                self.demand.opened(spec.image, spec.prompt_index)

        if self.config.reuse == "namespace":
            return await self._open_view(spec, image, info, workdir, env, opening)
        if (spec.cwd is None and spec.limits is None and self.config.pool_size(self.concurrency()) > 0
                and image not in self._snapshots):
            pool = self._container_pool(image, info)
            taken = await pool.take(opening)
            if taken is not None:
                container_id, _pool_name, agent, _view = taken
                # The name tells which prompt has it; the labels, set at creation, name none (see the README).
                self.in_background(self.api.rename, container_id, name)
                sandbox = DockerSandbox(self, container_id, name, workdir, spec.prompt_index, image, env=env, agent=agent)
                self._opened(sandbox)
                self._taken[sandbox] = pool
                if not await sandbox.set_env(env):
                    sandbox.drop_agent()  # its commands run as execs, which take the environment each
                return sandbox
        else:
            opening()
        labels = self._labels(spec.run_name) | {LABEL_PROMPT: str(spec.prompt_index), LABEL_CONTENT_KEY: spec.content_key}
        loop = asyncio.get_running_loop()
        async with self._starting:
            future = loop.run_in_executor(
                self.run.thread_pool,
                functools.partial(self._create, name, image, workdir, env, labels, loop, spec.limits)
            )
            self._background.add(future)
            future.add_done_callback(self._background.discard)
            try:
                container_id, agent = await asyncio.shield(future)
            except asyncio.CancelledError:
                # The thread goes on and may still create the container: remove it when it does.
                future.add_done_callback(self._remove_orphan)
                raise
        sandbox = DockerSandbox(self, container_id, name, workdir, spec.prompt_index, image, agent=agent)
        self._opened(sandbox)
        return sandbox

    def _opened(self, sandbox: DockerSandbox) -> None:
        self._open.add(sandbox)
        self._counted.add(sandbox)
        self._using[sandbox.image] += 1

    def _closed(self, sandbox: DockerSandbox) -> None:
        """Its container is removed (or back in its pool): the image may be removed now (-S image_cache=)."""
        if sandbox in self._counted:
            self._counted.discard(sandbox)
            self._using[sandbox.image] -= 1
            if not self._using[sandbox.image]:
                del self._using[sandbox.image]
                self._drop_pools(sandbox.image)
                self._evict()

    async def _open_view(self, spec: SandboxSpec, image: str, info: dict, workdir: str, env: dict,
                         opening) -> DockerSandbox:
        """A prompt's own view in a container of the image's pool (-S reuse=namespace): no new container.

        The pool's containers wait with a view started (made, like a pooled container, before its prompt was
        known, from the image, having run nothing but its runner), which takes the prompt's environment through
        its runner; a prompt with another working folder, or an environment the runner cannot take, gets a new one.
        """
        pool = self._container_pool(image, info)
        for _attempt in range(3):
            taken = await pool.take(opening)
            own = taken is None
            if own:  # the pool cannot make containers: this prompt makes its own, removed after it
                taken = await self._make_container(image, self._workdir(None, info), self._name(spec.prompt_index))
            container_id, name, agent, view = taken
            pending = env
            if agent is None or agent.dead or view.workdir != workdir or not _fits_runner(env):
                if agent is not None:
                    await self.blocking(agent.finish, VIEW_END_S)
                view = new_view(self.config, workdir, view.user)
                try:
                    agent = await self.blocking(self._start_view, container_id, view, env)
                except (*engine_errors(), SandboxError) as exc:  # it died while idle (killed from outside)
                    log.info("The container %s could not start a prompt's view (%s); using another.", name,
                             _explain(exc))
                    self.discard_container(container_id)
                    if own:
                        raise SandboxError(
                            f"Could not start a view in a container of the image {image!r}: {_explain(exc)}."
                        ) from exc
                    pool.release()
                    continue
                pending = {}
            sandbox = DockerSandbox(
                self, container_id, name, workdir, spec.prompt_index, image, env=env, agent=agent, view=view
            )
            self._opened(sandbox)
            if not own:
                self._taken[sandbox] = pool
            if await sandbox.set_env(pending):
                return sandbox
            await sandbox.close()  # its runner is gone: the container is checked and replaced
        raise SandboxError(
            f"Three containers of the image {image!r} in a row could not start a prompt's view; see the log."
        )

    def _start_view(self, container_id: str, view, env: Optional[dict] = None) -> Agent:
        """Start a view in a container (blocking): one exec, the helper with the view's runner."""
        return self.start_agent(
            container_id, view.workdir, self._loop, {**view.env, **(env or {})} or None, False, view.open_argv, "0"
        )

    async def recycle(self, sandbox: DockerSandbox, agent: Optional[Agent], reusable: bool) -> None:
        """End a prompt's view and give its container, with a new view, to the next prompt; remove it if the
        view did not end cleanly.

        Closing the runner's input ends the view: its first process exits and the kernel kills what is left in its
        namespaces; the exec's stream ends once every one of them is gone.
        """
        self._open.discard(sandbox)
        pool = self._taken.pop(sandbox, None)
        ended = agent is not None and await self.blocking(agent.finish, VIEW_END_S)
        if ended and reusable and pool is not None and not pool.closed:
            pool.expect_back()
            task = asyncio.ensure_future(self._next_view(pool, sandbox.id, sandbox.name, sandbox.view.user))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            self._closed(sandbox)
            return
        future = self.in_background(engine.remove_container, self.api, sandbox.id)
        future.add_done_callback(lambda _f: self._closed(sandbox))
        if pool is not None:
            pool.release()
        await asyncio.shield(future)

    async def _next_view(self, pool: WarmPool, container_id: str, name: str, user: Optional[tuple]) -> None:
        view = new_view(self.config, pool.workdir, user)
        try:
            agent = await self.blocking(self._start_view, container_id, view)
        except (*engine_errors(), SandboxError) as exc:
            log.info("The container %s could not start a view (%s); it is replaced.", name, _explain(exc))
            self.discard_container(container_id)
            pool.not_back()
            return
        pool.give_back((container_id, name, agent, view))

    def _name(self, prompt_index, run_name: Optional[str] = None) -> str:
        run_part = _NAME_UNSAFE.sub("-", run_name or self.run.run_name)[:60]
        return f"hermes-batch-{run_part}-p{prompt_index}-{uuid.uuid4().hex[:8]}"

    def commit_snapshot(self, container_id: str) -> str:
        """--branch_at: the container's filesystem (not its volumes or tmpfs mounts) as an image of this process,
        labelled as its containers are (the commit keeps the container's labels); removed at shutdown."""
        tag = f"{self.session}-{uuid.uuid4().hex[:12]}"
        self.api.commit(container_id, repository=SNAPSHOT_REPOSITORY, tag=tag)
        name = f"{SNAPSHOT_REPOSITORY}:{tag}"
        self._snapshots.add(name)
        return name

    def _labels(self, run_name: Optional[str] = None) -> dict:
        """The labels of every container of this process; the run's leftover sweeps find containers by them."""
        return {
            LABEL_RUN: run_name or self.run.run_name,
            LABEL_RUN_DIR: _run_dir(self.run),
            LABEL_HOST: socket.gethostname(),
            LABEL_PID: str(os.getpid()),
            LABEL_SESSION: self.session,
        }

    def _container_pool(self, image: str, info: dict) -> WarmPool:
        workdir = self._workdir(None, info)
        pool = self._pools.get((image, workdir))
        if pool is None:
            size = self.config.pool_size(self.concurrency())

            async def create() -> tuple:
                return await self._make_container(image, workdir, self._name("pool"))

            wanted = None if self.demand is None else functools.partial(self.demand.left, image)
            pool = self._pools[(image, workdir)] = WarmPool(
                image, workdir, size, create, lambda made: self.discard_container(made[0], made[2]), what="container",
                backend="docker", wanted=wanted,
            )
            pool.fill()
        return pool

    async def _make_container(self, image: str, workdir: str, name: str) -> tuple:
        """(id, name, its runner or None, its view or None) of a container made and started for a pool; with
        -S reuse=namespace, the runner is that of a view started in it."""
        loop = asyncio.get_running_loop()
        if self.config.reuse == "namespace":
            container_id, _, _ = await self._make_container_only(image, workdir, name, None)
            try:
                view = new_view(self.config, workdir, await self.blocking(self._identity, container_id, image))
                agent = await self.blocking(self._start_view, container_id, view)
            except (*engine_errors(), SandboxError) as exc:
                self.discard_container(container_id)
                raise SandboxError(f"Could not start a view in a container of the image {image!r}: {_explain(exc)}.") from exc
            return container_id, name, agent, view
        return (*await self._make_container_only(image, workdir, name, loop), None)

    async def _make_container_only(self, image: str, workdir: str, name: str, runner_loop) -> tuple:
        loop = asyncio.get_running_loop()
        async with self._starting:
            future = loop.run_in_executor(
                self.run.thread_pool,
                functools.partial(self._create, name, image, workdir, {}, self._labels(), runner_loop),
            )
            self._background.add(future)
            future.add_done_callback(self._background.discard)
            try:
                container_id, agent = await asyncio.shield(future)
                return container_id, name, agent
            except asyncio.CancelledError:
                future.add_done_callback(self._remove_orphan)
                raise

    def _identity(self, container_id: str, image: str) -> Optional[tuple]:
        """(uid, gid, home) of the user a reused container's commands run as (-S user=, else the image's USER), or
        None for its root (blocking): the helper runs as root and lowers every command of the views to it."""
        future = self._images.get(image)
        info = future.result() if future is not None and future.done() else self.api.inspect_image(image)
        user = self.config.user or (info.get("Config") or {}).get("User") or ""
        if not user:
            return None
        created = self.api.exec_create(
            container_id, [SHELL, "-c", IDENTITY_SCRIPT], user=user, stdout=True, stderr=True
        )
        output = self.api.exec_start(created["Id"]).decode(errors="replace")
        try:
            if self.api.exec_inspect(created["Id"]).get("ExitCode") == 0:
                return parse_identity(output)
        except ValueError:
            pass
        raise SandboxError(
            f"the user {user} of the container's commands could not be looked up ({output.strip()[:200]})"
        )

    def image_info(self, image: str) -> dict:
        """The engine's description of ``image`` (blocking; as prepared for the run when it was)."""
        future = self._images.get(image)
        return future.result() if future is not None and future.done() and not future.exception() else (
            self.api.inspect_image(image))

    async def helper_program(self) -> bytes:
        """The static helper's bytes, read once (the tests' supervisor of a strict container is a copy of it)."""
        if self._helper_program is None:
            loop = asyncio.get_running_loop()
            self._helper_program = loop.run_in_executor(self.run.thread_pool, Path(self.helper).read_bytes)
        return await asyncio.shield(self._helper_program)

    def pooled(self) -> int:
        """Containers started ahead of need and not yet handed to a prompt, over all images."""
        return sum(pool.ready for pool in self._pools.values())

    def discard_container(self, container_id: str, agent: Optional[Agent] = None) -> None:
        """Remove a container no prompt used (``shutdown`` waits for it)."""
        if agent is not None:
            agent.close()
        self.in_background(engine.remove_container, self.api, container_id)

    def _workdir(self, cwd: Optional[str], image_info: dict) -> str:
        if cwd:
            return "/" + posixpath.normpath(posixpath.join("/", cwd)).lstrip("/")
        if self.config.workdir:
            return self.config.workdir
        return (image_info.get("Config") or {}).get("WorkingDir") or DEFAULT_WORKDIR

    def _create(self, name: str, image: str, workdir: str, env: dict, labels: dict, loop=None, limits=None) -> tuple:
        """Create and start a container; (its id, its command runner or None).

        The runner is started, not waited for: its first answer is awaited by its first request, so that a
        creation does not hold its ``max_starting`` place for it.
        """
        container_id = self._create_container(name, image, workdir, env, labels, limits)
        agent = None
        if self.config.runner == "agent" and loop is not None:
            try:
                agent = self.start_agent(container_id, workdir, loop, wait=False)
            except (*engine_errors(), SandboxError) as exc:  # its commands run as execs
                log.debug("No command runner in %s: %s", name, exc)
        return container_id, agent

    def start_agent(self, container_id: str, workdir: str, loop, env: Optional[dict] = None, wait: bool = True,
                    wrap=None, user: Optional[str] = None) -> Agent:
        """Start a container's command runner (blocking); SandboxError when it does not answer.

        ``wrap`` turns the runner's argv into the exec's (a view's helper), which runs as ``user``.
        """
        argv = [SHELL, "-c", AGENT_SCRIPT, "hermes-batch-runner", workdir]
        created = self.api.exec_create(
            container_id, wrap(argv) if wrap else argv, stdin=True, stdout=True,
            stderr=True, tty=False, user=user if user is not None else self.config.user or "",
            **({"environment": env} if env else {}),
        )
        sock = self.api.exec_start(created["Id"], socket=True)
        agent = Agent(sock, loop, created["Id"])
        if wait and not agent.wait_ready(AGENT_READY_S):
            agent.close()
            raise SandboxError("the command runner did not start (the image lacks setsid or a POSIX sh?)")
        return agent

    def _create_container(self, name: str, image: str, workdir: str, env: dict, labels: dict, limits=None) -> str:
        config = self.config
        memory = config.memory_bytes
        nano_cpus, network = self.nano_cpus, config.network
        if limits is not None:  # a Harbor task's [environment]: its own CPUs, memory and network, within the run's
            if limits.memory_mb:
                memory = limits.memory_mb << 20
            if limits.cpus:
                nano_cpus = int(limits.cpus * 1e9)
            if limits.allow_internet is False:
                network = "none"
        views, helper_capabilities = {}, ()
        if config.reuse == "namespace":  # only the helper holds HELPER_CAPABILITIES; each prompt drops them
            views = {"tmpfs": {VIEW_FOLDER: "size=1m,mode=0700"}, "binds": [f"{self.helper}:{HELPER}:ro"]}
            # with network=none each view has a network namespace of its own, whose loopback the helper brings up
            helper_capabilities = HELPER_CAPABILITIES + (("NET_ADMIN",) if config.network == "none" else ())
        host_config = self.api.create_host_config(
            cap_drop=["ALL"],
            cap_add=list(BASE_CAPABILITIES + config.cap_add + helper_capabilities),
            security_opt=["no-new-privileges"],
            privileged=False,
            pids_limit=config.pids_limit,
            mem_limit=memory,
            memswap_limit=memory,  # no swap beyond the memory limit
            nano_cpus=nano_cpus,
            network_mode=network,
            storage_opt=self.storage_opt,
            **views,
        )
        try:
            created = self.api.create_container(
                image,
                name=name,
                entrypoint=[SHELL, "-c"],
                command=[KEEPALIVE],
                working_dir=workdir,
                environment=env,
                labels=labels,
                host_config=host_config,
                stdin_open=False,
                tty=False,
            )
        except engine_errors() as exc:
            raise SandboxError(f"Could not create a container from the image {image!r}: {_explain(exc)}.") from exc
        container_id = created["Id"]
        try:
            self.api.start(container_id)
            if config.user is not None and workdir != "/":
                # The engine makes a missing working folder as root; the user of -S user= works there.
                self.chown(container_id, workdir)
        except (*engine_errors(), SandboxError) as exc:
            _quiet(engine.remove_container, self.api, container_id)
            raise SandboxError(f"Could not start a container from the image {image!r}: {_explain(exc)}.") from exc
        return container_id

    def chown(self, container_id: str, path: str) -> None:
        """Give ``path`` to the user of ``-S user=`` (the container runs as root; only its commands run as that user)."""
        uid, gid = self.config.uid_gid
        created = self.api.exec_create(
            container_id, [SHELL, "-c", 'chown "$2" -- "$1"', "sh", path, f"{uid}:{gid}"], user="0",
            stdout=True, stderr=True,
        )
        output = self.api.exec_start(created["Id"])
        if self.api.exec_inspect(created["Id"]).get("ExitCode") != 0:
            raise SandboxError(f"{path} could not be given to user {uid}:{gid} ({output.decode(errors='replace').strip()})")

    def _remove_orphan(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            container_id, agent = future.result()
            self.discard_container(container_id, agent)

    async def remove(self, sandbox: DockerSandbox) -> None:
        """Kill and remove a sandbox's container (``shutdown`` sweeps what this misses)."""
        self._open.discard(sandbox)
        future = self.in_background(engine.remove_container, self.api, sandbox.id)
        future.add_done_callback(lambda _f: self._closed(sandbox))
        pool = self._taken.pop(sandbox, None)
        if pool is not None:
            pool.release()
        await asyncio.shield(future)

    def dead_reason(self, container_id: str) -> Optional[str]:
        """Why a container no longer runs, or None while it runs."""
        try:
            state = self.api.inspect_container(container_id).get("State") or {}
        except docker.errors.NotFound:
            return "was removed from outside"
        if state.get("Running") and not state.get("Paused"):
            return None
        if state.get("OOMKilled"):
            return f"was killed for running out of memory (-S memory={self.config.memory})"
        if state.get("Paused"):
            return "was paused from outside"
        return f"was killed or stopped from outside (exit status {state.get('ExitCode')})"

    def set_pids_limit(self, container_id: str, limit: int) -> None:
        """Change a running container's pids limit (the SDK's update_container has no such parameter)."""
        api = self.api
        response = api._post_json(api._url("/containers/{0}/update", container_id), data={"PidsLimit": limit})
        api._raise_for_status(response)

    def put_archive(self, container_id: str, archive, path: str = "/") -> None:
        # The SDK's put_archive cannot refuse to replace a folder by a file (noOverwriteDirNonDir),
        # and without it a write to a folder's path would delete the folder.
        api = self.api
        url = api._url("/containers/{0}/archive", container_id)
        response = api._put(url, params={"path": path, "noOverwriteDirNonDir": True}, data=archive)
        api._raise_for_status(response)

    def folder_archive(self, container_id: str, path: str):
        """A tar archive (an open temporary file, which the caller closes) of the folder ``path`` of a container:
        its folders, regular files and links, FIFOs, sockets and devices left out (command:clean=true)."""
        stream, _stat = self.api.get_archive(container_id, path)
        raw = tempfile.SpooledTemporaryFile(ARCHIVE_IN_MEMORY)
        kept = tempfile.SpooledTemporaryFile(ARCHIVE_IN_MEMORY)
        try:
            for chunk in stream:
                raw.write(chunk)
            raw.seek(0)
            with tarfile.open(fileobj=raw, mode="r|") as source, tarfile.open(fileobj=kept, mode="w|") as target:
                for member in source:
                    if member.isdir() or member.issym() or member.islnk():
                        target.addfile(member)
                    elif member.isreg():
                        target.addfile(member, source.extractfile(member))
        except BaseException:
            kept.close()
            raise
        finally:
            raw.close()
        kept.seek(0)
        return kept


def _fits_runner(env: dict) -> bool:
    """Whether a view's runner can take ``env`` (DockerSandbox.set_env), else the view is started with it."""
    return all(exportable(key) for key in env)


def _namespace_helper() -> str:
    path, why = build_namespace_helper(static=True)
    if path is None:
        raise ConfigError(
            f"-S reuse=namespace needs hermes-batch's namespace helper built statically, and it could not be ({why}); "
            "install a C compiler and a static C library (gcc and libc6-dev), or leave -S reuse=none."
        )
    return path


def _run_dir(run) -> str:
    return str(Path(run.run_dir).resolve())


def _explain(exc: BaseException) -> str:
    text = getattr(exc, "explanation", None) or str(exc) or type(exc).__name__
    text = str(text).strip()
    return text if len(text) <= 300 else text[:297] + "..."


def _quiet(function, *args) -> None:
    try:
        function(*args)
    except Exception:  # a cleanup step; the shutdown sweep retries what is left
        log.debug("docker cleanup step failed", exc_info=True)
