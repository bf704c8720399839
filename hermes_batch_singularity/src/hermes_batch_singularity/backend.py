"""The ``singularity`` sandbox backend: one Apptainer/SingularityCE instance per prompt, named so leftovers are found."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import posixpath
import secrets
from typing import Optional

from hermes_batch import ConfigError, SandboxBackend, SandboxError, SandboxSpec, WarmPool

from . import grading as tests_apart, instances, runtime, views
from .config import DEFAULT_WORKDIR, SingularityConfig
from .images import ImageCache
from .runner import NO_WORKDIR, START_SCRIPT, Runner
from .sandbox import SHELL, SingularitySandbox
from .task_images import TaskImageBuilder

log = logging.getLogger("hermes_batch.singularity")

STOP_TIMEOUT_S = 60.0
MKDIR = 'mkdir -p "$1" && [ -d "$1" ]'


class SingularityBackend(SandboxBackend):
    """Runs each prompt in an instance of its own, started from the row's image or ``-S image=...``."""

    name = "singularity"
    isolation = "container"  # each prompt an instance of its own, --containall (recorded in run.json and metadata)
    description = (
        "One Apptainer/SingularityCE instance per prompt (--containall, writable tmpfs) from a SIF, a sandbox "
        "folder or a docker://, oras://, library://... image converted once into a SIF cache."
    )
    Config = SingularityConfig

    def __init__(self, config: SingularityConfig, run):
        super().__init__(config, run)
        self.binary: Optional[str] = None
        self.version: Optional[str] = None
        self.images: Optional[ImageCache] = None
        self.builder: Optional[TaskImageBuilder] = None  # task images from Dockerfiles, made on first need
        self.env = runtime.runtime_environment()
        self.session = secrets.token_hex(2)
        self._privs = ["--no-privs"] if config.drop_privileges else []
        self._reuse = config.reuse == "namespace"
        if self._reuse and config.drop_privileges:  # what the namespace helper needs; no prompt's process keeps them
            capabilities = views.HELPER_CAPABILITIES + (("CAP_NET_ADMIN",) if config.network == "none" else ())
            self._privs += ["--add-caps", ",".join(capabilities)]
        self._helper: Optional[str] = None  # the namespace helper of -S reuse=namespace
        self._tests_helper: Optional[str] = None  # the static helper a verifier's tests run with (grading.py)
        self._tests_helper_bytes: Optional[bytes] = None
        self._image_binds: dict[str, str] = {}  # image path -> the --bind of its files for the views
        self._finding_binds = asyncio.Lock()  # the first prompts of a run ask at once: one `sif list` per image
        self._starting = asyncio.Semaphore(config.max_starting)
        self._open: set[SingularitySandbox] = set()
        self._background: set[asyncio.Future] = set()  # starts cut short, stops, kills still running
        self._uncertain: set[str] = set()  # instances whose start did not end normally
        self._pools: dict[tuple, WarmPool] = {}  # (image, working folder) -> instances started ahead (-S pool=)
        self._taken: dict[SingularitySandbox, WarmPool] = {}  # open sandboxes of a pool, replaced when closed
        self.demand = None  # the prompts still to come of each image (follow_demand), an ImageDemand

    # --- plumbing --------------------------------------------------------------------------

    async def blocking(self, function, *args):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.run.thread_pool, functools.partial(function, *args))

    def in_background(self, awaitable) -> asyncio.Future:
        """Start work that nobody waits for; ``shutdown`` does."""
        future = asyncio.ensure_future(awaitable)
        self._background.add(future)
        future.add_done_callback(self._background.discard)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return future

    def concurrency(self) -> int:
        """Prompts the run works on at once: the runner's thread pool has 4 threads more than that."""
        return max(1, getattr(self.run.thread_pool, "_max_workers", 8) - 4)

    def pooled(self) -> int:
        """Instances started ahead of need and not yet handed to a prompt, over all images."""
        return sum(pool.ready for pool in self._pools.values())

    def exec_prefix(self, pwd: str) -> list:
        """The start of every ``exec`` on an instance: a clean environment, in ``pwd``."""
        return [self.binary, "exec", *self._privs, "--cleanenv", "--pwd", pwd]

    def tests_prefix(self) -> list:
        """The start of the ``exec`` of a verifier's tests (not in a view): as root, the capabilities they keep."""
        privs = ["--no-privs", "--add-caps", ",".join(tests_apart.TESTS_CAPABILITIES)] if self._privs else []
        return [self.binary, "exec", *privs, "--cleanenv", "--pwd", "/"]

    async def grading_helper(self) -> bytes:
        """The static helper's bytes, read once; NotImplementedError (with why) where the tests cannot run apart."""
        if self.tests_apart_missing or self._tests_helper is None:
            raise NotImplementedError(f"the singularity sandbox cannot run tests apart from the agent here: "
                                      f"{self.tests_apart_missing or 'the backend was not started'}")
        if self._tests_helper_bytes is None:
            self._tests_helper_bytes = await self.blocking(_read_bytes, self._tests_helper)
        return self._tests_helper_bytes

    # --- run lifecycle -------------------------------------------------------------------------

    async def check(self) -> None:
        """Find the runtime and make sure it runs (ConfigError otherwise); check the cache folder."""
        if self.binary is not None:
            return
        binary = runtime.find_binary(self.config.binary)
        self.version = await self.blocking(runtime.version, binary)
        cache = self.config.cache_path
        existing = next((p for p in (cache, *cache.parents) if p.exists()), None)
        if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(
                f"The image cache folder {cache} cannot be made or written to; give another with -S cache_dir=PATH."
            )
        self.images = ImageCache(binary, cache, self.config.convert_timeout)
        if self._reuse:
            self._helper = await self.blocking(views.helper_path, cache)
            self._tests_helper, problem = self._helper, None
        else:  # sent to the instance with the tests: it need not be where the runtime can read it
            self._tests_helper, problem = await self.blocking(tests_apart.build_helper, None)
        self.tests_apart_missing = tests_apart.missing(problem, self.config.drop_privileges)
        self.binary = binary
        log.debug("singularity sandbox: %s (%s), images cached in %s", binary, self.version, cache)

    async def start(self) -> None:
        """Check the runtime if not done yet, then stop leftovers of an earlier process of this run."""
        await self.check()
        instances.LIVE_SESSIONS.add(self.session)
        try:
            stale = [
                found for found in await self._list(self.run.run_name)
                if found.dir_hash == instances.folder_hash(self.run.run_dir) and not found.owner_alive()
            ]
        except Exception as exc:  # leftovers cost memory, not correctness: the run goes on
            log.warning("Could not look for instances left by an earlier process of this run: %s", exc)
            return
        if stale:
            await asyncio.gather(*(self._stop_name(found.name) for found in stale))
            log.warning("Stopped %d instance(s) left behind by an earlier process of run %r.", len(stale), self.run.run_name)

    async def _list(self, run_name: Optional[str] = None) -> list:
        listing = await asyncio.wait_for(self.blocking(runtime.list_instances, self.binary), runtime.LIST_TIMEOUT_S)
        return instances.ours(listing, run_name)

    async def shutdown(self) -> None:
        """Stop every instance of this process, also those whose start was cut short."""
        if self.binary is None:
            return
        try:
            for pool in self._pools.values():
                pool.close()
            await asyncio.gather(*(sandbox.close() for sandbox in list(self._open)), return_exceptions=True)
            while self._background:
                await asyncio.gather(*list(self._background), return_exceptions=True)
            # Starts that were cut short or timed out may have made an instance after all.
            await asyncio.gather(*(self._stop_name(name) for name in self._uncertain), return_exceptions=True)
        finally:
            instances.LIVE_SESSIONS.discard(self.session)
            if self.builder is not None:
                self.builder.close()

    # --- images ---------------------------------------------------------------------------------

    async def prepare_image(self, image: Optional[str]) -> None:
        """Convert the image to a SIF once (cached); every prompt that needs it waits for that one conversion.

        With ``-S pool=``, the image's pool starts filling now, while the first model calls are in flight.
        """
        if self.images is None:
            raise SandboxError("The singularity sandbox backend was not started.")
        name = image or self.config.image
        path = await self.images.path(name)
        if self.config.pool_size(self.concurrency()) > 0:
            self._instance_pool(name, path)
        if self._reuse:
            await self._image_bind(path)

    async def build_image(self, image: str, context: str, digest: str, timeout: Optional[float] = None) -> None:
        """Build a task's image from its environment with the Docker engine and convert it to a SIF, once per
        content (task_images.py); every prompt of it waits for that one build."""
        if self.images is None:
            raise SandboxError("The singularity sandbox backend was not started.")
        if self.builder is None:
            self.builder = TaskImageBuilder(self.images, self.run.thread_pool, self.config.max_builds)
        await self.builder.build(image, context, digest, timeout)

    async def prepare_ahead(self, image: str) -> None:
        """Convert the image to a SIF (cached) while earlier prompts run; no instance is started for it."""
        if self.images is not None:
            await self.images.path(image)

    def follow_demand(self, demand) -> None:
        """Keep each image's pool of ``-S pool=`` no larger than its prompts still to come; drop it once none is."""
        self.demand = demand
        demand.listen(self._demand_fell)

    def _demand_fell(self, image: str) -> None:
        for key, pool in list(self._pools.items()):
            if key[0] != image or pool.size == 0:  # reuse=namespace's pools start nothing ahead
                continue
            pool.trim()
            if not self.demand.left(image) and pool.idle:
                pool.close()
                del self._pools[key]

    def _opening(self, spec: SandboxSpec):
        def opening() -> None:
            if self.demand is not None:
                self.demand.opened(spec.image, spec.prompt_index)
        return opening

    # --- instances ------------------------------------------------------------------------------

    async def open(self, spec: SandboxSpec) -> SingularitySandbox:
        """The prompt's instance: one of the image's pool (``-S pool=``), else started now with its working folder.

        At most ``max_starting`` instances are started at once, for the pools and for prompts.
        """
        if self.images is None:
            raise SandboxError("The singularity sandbox backend was not started.")
        image = spec.image or self.config.image
        path = await self.images.path(image)
        workdir = self._workdir(spec.cwd, image)
        env = {str(key): str(value) for key, value in spec.env.items()}
        # a Harbor task's allow_internet = false: an instance of its own without a network (never a pooled one)
        offline = spec.limits is not None and spec.limits.allow_internet is False and self.config.network != "none"
        if self._reuse:
            if offline:
                raise SandboxError("This task asks for no internet (allow_internet = false), which the shared instances "
                                   "of -S reuse=namespace cannot give one prompt; add -S network=none to the run.")
            return await self._open_view(spec, image, path, workdir, env)
        if spec.cwd is None and not offline and self.config.pool_size(self.concurrency()) > 0:
            pool = self._instance_pool(image, path)
            taken = await pool.take(self._opening(spec))
            if taken is not None:
                name, runner = taken
                sandbox = SingularitySandbox(self, name, workdir, spec.prompt_index, env, image, runner)
                self._open.add(sandbox)
                self._taken[sandbox] = pool
                return sandbox
        else:
            self._opening(spec)()
        name = instances.instance_name(spec.run_name, self.run.run_dir, spec.prompt_index, self.session)
        await self._start_guarded(name, path, image, "none" if offline else None)
        sandbox = SingularitySandbox(self, name, workdir, spec.prompt_index, env, image)
        self._open.add(sandbox)
        try:
            sandbox.attach_runner(await self._runner_or_workdir(name, workdir))
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    async def _runner_or_workdir(self, name: str, workdir: str) -> Optional[Runner]:
        """A new instance's command runner, which makes the working folder; without one, the folder made by an exec."""
        runner = await self.start_runner(name, workdir) if self.config.runner == "agent" else None
        if runner is None:
            await self._make_workdir_of(name, workdir)
        return runner

    async def start_runner(self, name: str, workdir: str, view: Optional[views.View] = None) -> Optional[Runner]:
        """Start the command runner of an instance (in ``view``, made by its exec) and wait for its first line.

        None when it does not run there; SandboxError when it could not make the working folder or the view.
        """
        command = [SHELL, "-c", START_SCRIPT, "hermes-batch-runner", workdir]
        argv = [*self.exec_prefix("/"), f"instance://{name}", *(view.open_argv(command) if view else command)]
        try:
            runner = await Runner.start(argv, self.env, self.in_background)
        except OSError as exc:
            log.debug("No command runner in %s: %s", name, exc)
            return None
        try:
            started = await runner.until_started(self.config.start_timeout)
        except BaseException:
            runner.close()
            raise
        if started:
            return runner
        if runner.proc.returncode == NO_WORKDIR:
            raise SandboxError(f"Could not make the working folder {workdir} in the instance {name}.")
        if view is not None:
            reason = runner.exit_reason()
            if "unshare" in reason and "not permitted" in reason.lower():
                raise SandboxError(views.NOT_ROOT)
            raise SandboxError(f"Could not make the prompt's view in the instance {name}: {reason}.")
        log.debug("No command runner in %s: %s", name, runner.exit_reason())
        return None

    async def _open_view(self, spec: SandboxSpec, image: str, path: str, workdir: str, env: dict) -> SingularitySandbox:
        """-S reuse=namespace: an instance of the image's pool (one whose last prompt's view ended, else one started
        now) with the prompt's own view started in it."""
        pool = self._view_pool(image, path)
        for _attempt in range(3):
            name = await pool.take()
            own = name is None
            if own:  # the pool's start failed: this prompt's own start says why, if it fails too
                name = await self._reuse_instance(image, path)
            view = views.new_view(workdir, self.config.network)
            try:
                runner = await self.start_runner(name, workdir, view)
                if runner is None:
                    raise SandboxError(f"Could not make the prompt's view in the instance {name}.")
            except BaseException as exc:
                # one stopped from outside while it waited is replaced; any other failure is the prompt's
                gone = not own and isinstance(exc, SandboxError) and not await self.instance_exists(name)
                self.in_background(self._stop_name(name))
                if not gone:
                    raise
                log.info("The instance %s was gone when a prompt's view was to start in it; using another.", name)
                pool.release()
                continue
            sandbox = SingularitySandbox(self, name, workdir, spec.prompt_index, env, image, runner, view=view)
            self._open.add(sandbox)
            self._taken[sandbox] = pool
            return sandbox
        raise SandboxError(f"Three instances of the image {image!r} in a row were gone when a prompt's view was to start.")

    async def release(self, sandbox: SingularitySandbox, holder: Optional[Runner]) -> None:
        """-S reuse=namespace: end a prompt's view (close its first process's input and wait, up to VIEW_END_S, until
        the kernel has killed every process left in it); its instance then goes back to its pool for the next
        prompt, or is stopped (when its view did not end, or the pool is closed)."""
        self._open.discard(sandbox)
        pool = self._taken.pop(sandbox, None)
        reusable = pool is not None and not pool.closed
        if reusable:
            pool.expect_back()  # the prompts that ask meanwhile wait for it rather than start another
        ended = holder is not None and await holder.finish(views.VIEW_END_S)
        if ended and reusable:
            pool.give_back(sandbox.name)  # or, the pool closed meanwhile, discarded
            return
        if holder is not None and not ended:
            log.warning("A view of the instance %s did not end within %g s; the instance is stopped.",
                        sandbox.name, views.VIEW_END_S)
        if reusable:
            pool.not_back()
        await asyncio.shield(self.in_background(self._stop_name(sandbox.name)))

    def _instance_pool(self, image: str, path: str) -> WarmPool:
        """-S pool=: the image's instances started ahead of need, each with its runner, for one prompt each."""
        workdir = self._workdir(None, image)
        pool = self._pools.get((image, workdir))
        if pool is None:
            size = self.config.pool_size(self.concurrency())

            async def start() -> tuple:
                name = await self._pool_instance(image, path)
                try:
                    runner = await asyncio.shield(self.in_background(self._runner_or_workdir(name, workdir)))
                except BaseException:
                    self.in_background(self._stop_name(name))
                    raise
                return name, runner

            def discard(made: tuple) -> None:
                name, runner = made
                if runner is not None:
                    runner.close()
                self.in_background(self._stop_name(name))

            wanted = None if self.demand is None else functools.partial(self.demand.left, image)
            pool = self._pools[(image, workdir)] = WarmPool(image, workdir, size, start, discard, what="instance",
                                                            backend="singularity", wanted=wanted)
            pool.fill()
        return pool

    def _view_pool(self, image: str, path: str) -> WarmPool:
        """-S reuse=namespace: the image's instances that serve prompts one after another (their names). None is
        started before a prompt asks (size 0): a run has as many as it has prompts at once, and a prompt that asks
        while one is coming back waits for that one. A start that fails costs the prompt waiting for it a start of
        its own (which says why, if it fails too): the pool never gives up (``give_up=False``), as one start cut
        short on a loaded machine must not end the reuse for the rest of the run."""
        workdir = self._workdir(None, image)
        pool = self._pools.get((image, workdir))
        if pool is None:
            pool = self._pools[(image, workdir)] = WarmPool(
                image, workdir, 0, functools.partial(self._reuse_instance, image, path),
                lambda name: self.in_background(self._stop_name(name)), what="instance", backend="singularity",
                give_up=False,
            )
        return pool

    async def _reuse_instance(self, image: str, path: str) -> str:
        """A new instance for -S reuse=namespace, with the image's files bound for its views."""
        await self._image_bind(path)
        return await self._pool_instance(image, path)

    async def _pool_instance(self, image: str, path: str) -> str:
        name = instances.instance_name(self.run.run_name, self.run.run_dir, "pool", self.session)
        await self._start_guarded(name, path, image)
        return name

    def _workdir(self, cwd: Optional[str], image: Optional[str] = None) -> str:
        """The row's cwd, else -S workdir=, else a task image's WORKDIR (as Docker would start it in), else the
        default."""
        if cwd:
            return "/" + posixpath.normpath(posixpath.join("/", cwd)).lstrip("/")
        built = self.builder.workdirs.get(image) if self.builder is not None and image else None
        return self.config.workdir or built or DEFAULT_WORKDIR

    def _start_argv(self, name: str, path: str, network: Optional[str] = None) -> list:
        network = ["--net", "--network", "none"] if (network or self.config.network) == "none" else []
        binds = ["--bind", f"{self._helper}:{views.HELPER}:ro", "--bind", self._image_binds[path]] if self._reuse else []
        return [
            self.binary, "instance", "start", "--containall", "--writable-tmpfs",
            *self._privs, *network, *binds, *self.config.extra_args, path, name,
        ]

    async def _start_instance(self, name: str, path: str, image: str, network: Optional[str] = None) -> None:
        done = await runtime.run(self._start_argv(name, path, network), env=self.env, timeout=self.config.start_timeout)
        if done.returncode == 0:
            return
        if done.timed_out:
            self._uncertain.add(name)  # it may have got far enough to exist
            raise SandboxError(
                f"Starting an instance of the image {image!r} took longer than {self.config.start_timeout:g} s; "
                "raise -S start_timeout= or look at the runtime's logs."
            )
        raise SandboxError(f"Could not start an instance of the image {image!r}: {done.reason()}.")

    async def _start_guarded(self, name: str, path: str, image: str, network: Optional[str] = None) -> None:
        """Start the instance ``name``, at most ``max_starting`` at once; cancelled, the start goes on and may still
        succeed, so the instance is stopped when it does."""
        async with self._starting:
            starting = self.in_background(self._start_instance(name, path, image, network))
            try:
                await asyncio.shield(starting)
            except asyncio.CancelledError:
                self._uncertain.add(name)
                starting.add_done_callback(functools.partial(self._stop_if_started, name))
                raise

    async def _image_bind(self, path: str) -> str:
        """The ``--bind`` of the image's own files for -S reuse=namespace's views, found once per image."""
        if path in self._image_binds:  # every prompt asks (prepare_image): no lock once it is known
            return self._image_binds[path]
        async with self._finding_binds:
            if path not in self._image_binds:
                self._image_binds[path] = await self.blocking(views.image_bind, self.images.binary, self.env, path)
        return self._image_binds[path]

    def _stop_if_started(self, name: str, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.in_background(self._stop_name(name))

    async def _make_workdir_of(self, name: str, workdir: str) -> None:
        argv = [*self.exec_prefix("/"), f"instance://{name}", "/bin/sh", "-c", MKDIR, "sh", workdir]
        done = await runtime.run(argv, env=self.env, timeout=self.config.start_timeout)
        if done.returncode != 0:
            raise SandboxError(
                f"Could not make the working folder {workdir} in the instance {name}: {done.reason()}."
            )

    async def stop(self, sandbox: SingularitySandbox) -> None:
        """Stop a sandbox's instance, whatever happens to the caller meanwhile."""
        self._open.discard(sandbox)
        stopping = self.in_background(self._stop_name(sandbox.name))
        pool = self._taken.pop(sandbox, None)
        if pool is not None:
            pool.release()
        await asyncio.shield(stopping)

    async def _stop_name(self, name: str) -> None:
        # --force sends SIGKILL to the instance's first process; its pid namespace dies with it.
        done = await runtime.run(
            [self.binary, "instance", "stop", "--force", name], env=self.env, timeout=STOP_TIMEOUT_S
        )
        if done.returncode != 0 and "no instance found" not in done.reason().lower():
            log.warning("Could not stop the instance %s: %s", name, done.reason())

    async def instance_exists(self, name: str) -> bool:
        try:
            listing = await asyncio.wait_for(self.blocking(runtime.list_instances, self.binary), runtime.LIST_TIMEOUT_S)
        except Exception:
            return True  # unknown: report the runtime's own error instead
        return any(item.get("instance") == name for item in listing)


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
