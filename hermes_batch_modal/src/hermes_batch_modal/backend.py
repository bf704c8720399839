"""The ``modal`` sandbox backend: one Modal Sandbox per prompt, created at a bounded pace and tagged with its run."""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import uuid
from typing import Optional

from hermes_batch import ConfigError, SandboxBackend, SandboxError, SandboxSpec, build_namespace_helper

from . import connection, leftovers
from ._sdk import modal
from .config import ModalConfig
from .connection import explain, transient
from .leftovers import LIVE_SESSIONS, TAG_RUN_DIR, TAG_SESSION
from .sandbox import KEEP_ALIVE, ModalSandbox, absolute, utf8

log = logging.getLogger("hermes_batch.modal")

BACKOFF_BASE_S = 1.0  # first wait after a transient creation error; doubles up to BACKOFF_MAX_S
BACKOFF_MAX_S = 30.0
SHUTDOWN_WAIT_S = 120.0  # for creations and terminations still under way at the end; the session sweep follows


class CreationPace:
    """At most ``rate`` creations started per second, each at least ``1/rate`` after the one before.

    The spacing is kept between the moments creations are let go, not between
    slots booked in advance: when the event loop was held up past several
    booked slots (hundreds of answers to handle at once), their waiters would
    all go together, the burst Modal throttles.
    """

    def __init__(self, rate: float):
        self.interval = 1.0 / rate
        self._last = float("-inf")
        self._turn = asyncio.Lock()  # first come, first served

    async def wait(self) -> None:
        async with self._turn:
            loop = asyncio.get_running_loop()
            delay = self._last + self.interval - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self._last = loop.time()


class ModalBackend(SandboxBackend):
    """Runs each prompt in a Modal Sandbox of its own, from the row's image or ``-S image=...``."""

    name = "modal"
    isolation = "container"  # each prompt a sandbox of its own in Modal's cloud (recorded in run.json and metadata)
    description = (
        "One Modal Sandbox per prompt (Image.from_registry of the row's image or -S image=...), with timeout, "
        "cpu, memory and -S network=none; created at a bounded pace, tagged with the run, terminated at the end."
    )
    Config = ModalConfig

    def __init__(self, config: ModalConfig, run):
        super().__init__(config, run)
        self.client: Optional[modal.Client] = None
        self.app: Optional[modal.App] = None
        self.session = uuid.uuid4().hex[:16]
        self._starting = asyncio.Semaphore(config.max_starting)
        self._pace = CreationPace(config.create_rate)
        self._images: dict[str, asyncio.Future] = {}
        self._open: set[ModalSandbox] = set()
        self._background: set[asyncio.Future] = set()
        self.created = 0
        self.creation_retries = 0
        self._helper: Optional[str] = None  # the static helper a verifier's tests run with (Sandbox.run_tests)
        self._helper_bytes: Optional[bytes] = None

    # --- run lifecycle -------------------------------------------------------------------------

    async def check(self) -> None:
        """Find the credentials and say hello to Modal's server; ConfigError (exit status 2) otherwise.  Build the static
        helper a verifier's tests run with (once per machine; ``tests_apart_missing`` says why, if it cannot be)."""
        if self.client is None:
            self.client = await connection.connect()
        if self._helper is None:
            loop = asyncio.get_running_loop()
            self._helper, problem = await loop.run_in_executor(None, functools.partial(build_namespace_helper, static=True))
            self.tests_apart_missing = "" if self._helper else (
                f"hermes-batch's static helper, which runs the tests apart, could not be built ({problem})")

    async def grading_helper(self) -> bytes:
        """The static helper's bytes, read once; NotImplementedError (with why) where the tests cannot run apart."""
        if self._helper is None:
            raise NotImplementedError(f"the modal sandbox cannot run tests apart from the agent here: "
                                      f"{self.tests_apart_missing}")
        if self._helper_bytes is None:
            loop = asyncio.get_running_loop()
            self._helper_bytes = await loop.run_in_executor(None, _read_bytes, self._helper)
        return self._helper_bytes

    async def start(self) -> None:
        """Look up (or create) the app once, then terminate what an earlier process of this run left running."""
        await self.check()
        LIVE_SESSIONS.add(self.session)
        try:
            self.app = await modal.App.lookup.aio(self.config.app, create_if_missing=True, client=self.client)
        except modal.exception.Error as exc:
            raise ConfigError(f"The Modal app {self.config.app!r} could not be looked up or created ({explain(exc)}); "
                              "check the account's permissions or choose another -S app=...") from None
        try:
            await self._terminate_leftovers()
        except (modal.exception.Error, *transient()) as exc:  # leftovers cost money, not correctness
            log.warning("Could not look for Modal sandboxes left by an earlier process of this run: %s", explain(exc))

    async def _terminate_leftovers(self) -> None:
        found = await leftovers.find(
            self.client, self.app.app_id, **{leftovers.TAG_RUN: self.run.run_name, TAG_RUN_DIR: leftovers.run_dir_tag(self.run.run_dir)}
        )
        stale = [(sandbox, tags) for sandbox, tags in found if not leftovers.owner_alive(tags)]
        for sandbox, tags in stale:
            log.warning("Terminating the Modal sandbox %s of prompt %s, left running by an earlier process of run %r.",
                        sandbox.object_id, tags.get(leftovers.TAG_PROMPT, "?"), self.run.run_name)
        terminated = await leftovers.terminate_all(stale)
        if terminated:
            log.warning("Terminated %d Modal sandbox(es) left running by an earlier process of run %r.",
                        terminated, self.run.run_name)

    async def shutdown(self) -> None:
        """Terminate every sandbox of this process, also those whose creation was cut short."""
        if self.client is None:
            return
        try:
            for sandbox in list(self._open):
                sandbox.close_soon()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + SHUTDOWN_WAIT_S
            while self._background and loop.time() < deadline:  # terminations may start more (orphans)
                await asyncio.wait(set(self._background), timeout=deadline - loop.time())
            for future in list(self._background):
                future.cancel()  # a server that does not answer: the sweep below, or -S timeout, ends them
            if self.app is not None:
                try:
                    found = await leftovers.find(self.client, self.app.app_id, **{TAG_SESSION: self.session})
                    await leftovers.terminate_all(found)
                except (modal.exception.Error, *transient()) as exc:
                    log.warning("Could not check that every Modal sandbox of this run was terminated: %s", explain(exc))
        finally:
            LIVE_SESSIONS.discard(self.session)
            client, self.client = self.client, None
            await connection.close_quietly(client)

    # --- images ---------------------------------------------------------------------------------

    async def prepare_image(self, image: Optional[str]) -> None:
        """Have Modal build (pull) the image once; every prompt that needs it waits for that one build."""
        await self._image(image or self.config.image)

    async def _image(self, name: str) -> modal.Image:
        future = self._images.get(name)
        if future is None:
            future = self._images[name] = asyncio.ensure_future(self._build(name))
            # A failed image stays failed for this run: each of its prompts fails at once.
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(future)

    async def _build(self, name: str) -> modal.Image:
        if self.app is None:
            raise SandboxError("The modal sandbox backend was not started.")
        image = modal.Image.from_registry(name)
        log.info("Resolving the image %s on Modal.", name)
        try:
            await image.build.aio(self.app)
        except modal.exception.Error as exc:
            raise SandboxError(
                f"Modal could not build or pull the image {name!r} ({explain(exc)}); fix the prompt's image "
                "(or -S image=...) and run again with --resume."
            ) from None
        return image

    # --- sandboxes --------------------------------------------------------------------------------

    async def open(self, spec: SandboxSpec) -> ModalSandbox:
        """Create the prompt's sandbox and wait until it runs commands, at most ``max_starting`` at once."""
        if self.app is None:
            raise SandboxError("The modal sandbox backend was not started.")
        image = await self._image(spec.image or self.config.image)
        workdir = absolute(spec.cwd) if spec.cwd else self.config.workdir
        tags = leftovers.sandbox_tags(spec.run_name, self.run.run_dir, spec.prompt_index, spec.content_key, self.session)
        async with self._starting:
            for attempt in range(self.config.create_retries + 1):
                await self._pace.wait()
                try:
                    return await self._create(spec, image, workdir, tags)
                except transient() as exc:
                    if attempt == self.config.create_retries:
                        raise SandboxError(
                            f"Modal kept refusing to create the sandbox of prompt {spec.prompt_index} "
                            f"({explain(exc)}) after {attempt + 1} attempts; lower -S create_rate or "
                            "-S max_starting, and run again with --resume."
                        ) from None
                    self.creation_retries += 1
                    delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt) * random.uniform(0.5, 1.0)
                    log.debug("Creating the sandbox of prompt %d failed (%s); again in %.1f s.", spec.prompt_index, explain(exc), delay)
                    await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _create(self, spec: SandboxSpec, image: modal.Image, workdir: str, tags: dict) -> ModalSandbox:
        config = self.config
        sandbox: Optional[ModalSandbox] = None
        creating = asyncio.ensure_future(modal.Sandbox.create.aio(
            *KEEP_ALIVE,
            app=self.app,
            image=image,
            tags=tags,
            env={utf8(str(k)): utf8(str(v)) for k, v in spec.env.items()} or None,
            timeout=config.timeout,
            cpu=config.cpu,
            memory=config.memory_mib,
            block_network=config.network == "none",
            client=self.client,
        ))
        self._track(creating)
        try:
            async with asyncio.timeout(config.startup_timeout):
                created = await asyncio.shield(creating)
                self.created += 1
                sandbox = ModalSandbox(self, created, workdir, spec.prompt_index, spec.image or config.image)
                self._open.add(sandbox)
                await sandbox.make_ready()
                return sandbox
        except TimeoutError:
            if sandbox is None:
                creating.add_done_callback(self._terminate_orphan)
            else:
                await sandbox.close()
            raise SandboxError(
                f"The Modal sandbox of prompt {spec.prompt_index} was not ready within -S startup_timeout="
                f"{config.startup_timeout:g} s; run again with --resume to retry the prompt."
            ) from None
        except BaseException:
            if sandbox is None:
                creating.add_done_callback(self._terminate_orphan)  # cancelled, or it failed: terminate it if it exists
            else:
                await sandbox.close()
            raise

    def _track(self, future: asyncio.Future) -> None:
        self._background.add(future)
        future.add_done_callback(self._background.discard)

    def _terminate_orphan(self, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        self._track(asyncio.ensure_future(leftovers.terminate(future.result())))

    def forget(self, sandbox: ModalSandbox) -> None:
        self._open.discard(sandbox)

    def in_background(self, coro) -> asyncio.Future:
        """Start work that nobody waits for; ``shutdown`` does."""
        future = asyncio.ensure_future(coro)
        self._track(future)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return future


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
