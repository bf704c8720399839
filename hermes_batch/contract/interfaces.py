"""Base classes of the objects plugins register.

Registration hooks run once at start-up and are synchronous; the registered
objects do the per-prompt I/O through ``async`` methods.  Each selectable class
carries its ``name`` and an attrs ``Config`` class; options given on the command
line (``-S key=value``, ``-E key=value``, ``-T toolset.key=value``) are structured
strictly into it.
"""

from __future__ import annotations

import abc
import concurrent.futures
import functools
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Iterable, Iterator, Optional

import attrs

from ..folder.liveness import owner_alive as _owner_alive
from ..model.retry import MAX_RETRIES  # retries of one failing model call: the retry policy's, also the option's default
from ..formats.records import ExecResult, Message, ModelResponse, SandboxSpec, TestsRun, ToolSpec, Trajectory, Usage

# Defaults of the run options of the same names (RunConfig), also used where a plugin builds these classes itself.
COMMAND_TIMEOUT = 180.0  # seconds one tool command may run
MAX_OUTPUT_CHARS = 20000  # of a tool's output the model sees; the rest is cut with a notice
REQUEST_TIMEOUT = 600.0  # seconds one model request may take before it counts as failed (and is retried)

if TYPE_CHECKING:
    from ..model.batching import BatchAPI
    from ..model.ratelimit import CallLimiter
    from .run_context import RunContext
    from .image_demand import ImageDemand
    from .toolsets import PromptToolsets


@attrs.frozen
class NoOptions:
    """Config of a plugin object that takes no options."""


# --- model clients -----------------------------------------------------------


@attrs.frozen
class ModelSettings:
    """How to reach and drive the model; built from the command line."""

    model: str
    base_url: str
    api_key: Optional[str] = attrs.field(default=None, repr=False)
    max_tokens: Optional[int] = None
    reasoning_effort: Optional[str] = None
    reasoning_disabled: bool = False
    providers_allowed: tuple = ()
    providers_ignored: tuple = ()
    providers_order: tuple = ()
    provider_sort: Optional[str] = None
    routing: str = "auto"  # where OpenRouter's routing fields go (--routing; hermes_batch.model.model_http.sends_routing)
    request_timeout: float = REQUEST_TIMEOUT
    max_retries: int = MAX_RETRIES
    max_concurrent_requests: Optional[int] = None  # starting limit of calls in flight; None: no limit until a 429
    max_requests_per_minute: Optional[float] = None
    max_tokens_per_minute: Optional[float] = None
    http_backend: str = "aiohttp"  # transport under the SDKs: "aiohttp", or "httpx" for its proxy and TLS handling
    # Sampling, sent only when set (the endpoint's defaults otherwise); ``ModelClient.sampling`` names what a client sends.
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    extra_body: dict = attrs.field(factory=dict, hash=False)  # more request fields, sent as given (--extra_body)
    logprobs: bool = False  # ask for each answer's token ids and logprobs (--logprobs)
    top_logprobs: int = 0  # and this many likeliest alternatives of each token (--top_logprobs)

    def sampling(self) -> dict:
        """The sampling settings given, as a record's ``metadata.sampling`` keeps them (``extra_body`` among them)."""
        given = {name: getattr(self, name) for name in SAMPLING_SETTINGS[:-1] if getattr(self, name) is not None}
        if self.extra_body:
            given["extra_body"] = dict(self.extra_body)
        return given


# The ModelSettings fields a client may send as sampling settings (``ModelClient.sampling``), extra_body last.
SAMPLING_SETTINGS = ("temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty", "extra_body")


# The probe sent by ModelClient.preflight; the scripted test server answers it without calling the script.
PREFLIGHT_PROMPT = "This is a connectivity check. Reply with the single word: ready."
PREFLIGHT_MAX_TOKENS = 16
PREFLIGHT_TIMEOUT_S = 120.0
PREFLIGHT_RETRIES = 3


class ModelClient(abc.ABC):
    """Sends a conversation to a model and returns its next message."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    # Top-level packages its first request imports (its SDK): worker processes that start warm import them ahead.
    packages: ClassVar[tuple[str, ...]] = ()
    # The ModelSettings sampling fields (SAMPLING_SETTINGS) its requests send; a run refuses the others when given.
    sampling: ClassVar[tuple[str, ...]] = ()
    # Whether its requests carry a session's own ``seed`` (hermes_batch.model.session_sampling: --branches).
    sends_seed: ClassVar[bool] = False
    # True when its answers can carry each turn's token ids and logprobs (``Message.tokens``, --logprobs)
    token_logprobs: ClassVar[bool] = False
    _limiter = None
    journal = None  # the run's CallJournal (calls.jsonl), set by run/session_journals.py
    guard = None  # the run's ProviderGuard (hermes_batch.model.provider_guard), set by the engine on its own client

    def __init__(self, settings: ModelSettings):
        self.settings = settings

    @classmethod
    def handles_base_url(cls, base_url: str) -> bool:
        """True when this client should be picked automatically for ``base_url``."""
        return False

    @classmethod
    def check_settings(cls, settings: ModelSettings) -> None:
        """Before the run: raise ConfigError for settings this client cannot send (a sampling setting not in
        ``sampling``, by default), rather than failing every prompt."""
        from ..errors import ConfigError

        if settings.logprobs and not cls.token_logprobs:
            raise ConfigError(
                f"The model client {cls.name!r} cannot return token ids and logprobs (its API has none), so "
                "--logprobs and --top_logprobs cannot be used with it; leave them out or use an OpenAI-compatible "
                "endpoint that returns logprobs (vLLM, SGLang, llama.cpp's server)."
            )
        given = [name for name in settings.sampling() if name not in cls.sampling]
        if given:
            sent = f"it sends {', '.join(cls.sampling)}" if cls.sampling else "it sends no sampling setting"
            raise ConfigError(
                f"The model client {cls.name!r} does not send {', '.join(f'--{name}' for name in given)} ({sent}); "
                "leave it out or choose another --model_client."
            )

    @abc.abstractmethod
    async def send(self, messages: tuple[Message, ...], tools: tuple[ToolSpec, ...]) -> ModelResponse:
        """One attempt at a model call, no retries.

        Raises FatalModelError (bad key, unknown model: the run stops),
        RetryableModelError (429, 5xx, timeouts), ModelOutcome (the model side
        ended the session: context too long, content filtered) or
        ModelCallError (any other refusal: the prompt fails).
        """

    async def complete(
        self, messages: tuple[Message, ...], tools: tuple[ToolSpec, ...], *, calls: Optional[list] = None
    ) -> ModelResponse:
        """``send`` through the run's limiter: retries with backoff, adaptive concurrency, per-minute budgets.

        Each attempt is appended to ``calls`` (a CallRecord: provider, latency, status), and to the run's
        journal when there is one.
        """
        guard = self.guard
        if guard is not None and calls is None:
            calls = []  # the guard reads the answer's latency from it
        if self.journal is not None:
            response = await self.journal.complete(self, messages, tools, calls)
        else:
            response = await self.limiter.call(self.send, messages, tools, calls=calls)
        if guard is not None:
            guard.answered(response, tools, calls[-1].latency_s if calls else 0.0)
        return response

    @property
    def limiter(self) -> "CallLimiter":
        """The gate every call of this client goes through (see :mod:`hermes_batch.model.ratelimit`)."""
        if self._limiter is None:
            from ..model.ratelimit import CallLimiter

            self._limiter = CallLimiter.from_settings(self.settings)
        return self._limiter

    async def preflight(self) -> None:
        """One minimal request before any prompt runs, to check the endpoint, the key and the model name.

        Raises FatalModelError for a refused key, an unknown model, or an endpoint
        that still fails or cannot be reached after a few attempts.  The default
        sends PREFLIGHT_PROMPT without tools through a copy of this client whose
        settings ask for at most PREFLIGHT_MAX_TOKENS tokens.
        """
        from ..model.ratelimit import check_endpoint

        settings = attrs.evolve(
            self.settings,
            max_tokens=PREFLIGHT_MAX_TOKENS,
            request_timeout=min(self.settings.request_timeout, PREFLIGHT_TIMEOUT_S),
        )
        probe = type(self)(settings)
        answers: list = []

        async def send(messages, tools):
            answers.append(await probe.send(messages, tools))
            return answers[-1]

        try:
            messages = (Message("user", PREFLIGHT_PROMPT),)
            await check_endpoint(send, messages, min(settings.max_retries, PREFLIGHT_RETRIES))
        finally:
            await probe.aclose()
        if settings.logprobs and answers and answers[-1].message.tokens is None:
            from ..errors import FatalModelError

            raise FatalModelError(
                f"The model endpoint at {settings.base_url} returned no token logprobs for the preflight request, "
                "so --logprobs would keep nothing; use an endpoint that returns them (vLLM, SGLang, llama.cpp's "
                "server, OpenAI) or leave --logprobs out."
            )

    async def tokenize(self, messages: tuple[Message, ...], tools: tuple[ToolSpec, ...]) -> Optional[tuple[int, ...]]:
        """The token ids of the conversation ``messages`` as the endpoint's own tokenizer and chat template
        encode it (its ``/tokenize``), or None when the endpoint offers no such thing (the default)."""
        return None

    def for_model(self, model: str) -> "ModelClient":
        """A client of the same endpoint and key for ``model``, for tools that consult other models.

        Its calls go through this client's limiter, so they share the run's rate
        limits and budgets and their reported cost counts against ``--max_cost``.
        Close it with ``aclose`` when done.
        """
        other = type(self)(attrs.evolve(self.settings, model=model))
        other._limiter = self.limiter
        other.journal = self.journal  # its requests are the run's requests
        return other

    def excludes_providers(self) -> bool:
        """True when its requests can leave out the providers ``guard`` excluded (OpenRouter's routing fields)."""
        return False

    def batch_api(self) -> "Optional[BatchAPI]":
        """The endpoint's batch API for ``--batch_api`` (see :mod:`hermes_batch.model.batching`), None without one."""
        return None

    async def aclose(self) -> None:
        """Release connections."""


# --- sandboxes ---------------------------------------------------------------


# The shell's own kill (Linux's kill(-1) spares the caller) ends every other process it may signal in its
# PID namespace, its first process excepted; again while one was found (a child forked during a round is
# not in it), a few rounds at most (zombies not yet reaped count as found).
KILL_EVERY_OTHER_PROCESS = "for round in 1 2 3 4 5; do kill -9 -1 2>/dev/null || break; done; exit 0"
STOP_PROCESSES_TIMEOUT_S = 30.0


class Sandbox(abc.ABC):
    """The isolated environment of one prompt.

    One sandbox is one process namespace (or what stands for it): every command
    of the prompt runs in it, so a later command sees, signals and talks to the
    processes earlier ones left running.  A process a command starts in the
    background (``server > log 2>&1 &``) lives on after that command's ``exec``
    returned, until :meth:`close`, which ends every one of them.  The building
    blocks ``SandboxFolder``, ``run_command`` and ``ChildProcess`` of
    ``hermes_batch`` do the hard parts for a backend whose files and processes
    are on this machine (docs/plugins.md).
    """

    @abc.abstractmethod
    async def exec(self, command: str, timeout: float) -> ExecResult:
        """Run ``command`` in a non-login shell (``/bin/sh -c``), stdin empty, in :attr:`workdir`.

        Returns when the command ends, even if a process it left in the
        background still holds its output open (that output is then no longer
        read: a background process's output belongs in a file).  ``output`` is
        stdout and stderr merged, decoded as UTF-8 with replacement characters,
        bounded (the first and last halves, see ``BoundedOutput``);
        ``exit_code`` is the shell's status (128 + N for signal N).  At
        ``timeout`` seconds, or when the caller is cancelled, the command's
        whole process tree is killed and the result has ``timed_out=True``
        and ``exit_code=None``; what it left in the background before is not.
        Raises ``SandboxError`` once the sandbox is closed or cannot run it.
        """

    @abc.abstractmethod
    async def read_file(self, path: str, max_bytes: Optional[int] = None) -> bytes:
        """At most ``max_bytes`` bytes from the start of ``path`` (None: all of it).

        Relative paths are relative to the working directory.  Memory must stay
        bounded by ``max_bytes``, whatever the file's size.  Raises
        FileNotFoundError when ``path`` does not exist, IsADirectoryError for a
        folder, and at once, without ever blocking, ``OSError(errno.EINVAL,
        "<one sentence for the model>")`` for anything but a regular file (FIFO,
        socket, device).
        """

    @abc.abstractmethod
    async def write_file(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path``, creating parent folders.

        Refuses, at once and without blocking, to write through anything that is
        not a regular file or a new file (the same EINVAL OSError as ``read_file``).
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Remove the sandbox and end every process it started; safe to call more than once.

        That includes processes that left the command's process group or session
        (``setsid``, daemons that fork twice) and those its commands left
        running in the background, which live until now.  After it, ``exec``
        raises ``SandboxError``.
        """

    #: Whether the sandbox is one PID namespace of its own (a container's), in which a command's
    #: ``kill -9 -1`` ends every process but the namespace's first and the command itself: the default
    #: :meth:`stop_processes` then does that.
    own_pid_namespace: ClassVar[bool] = False

    async def stop_processes(self) -> bool:
        """End every process the prompt's commands left running, keeping the sandbox's files and commands.

        Background jobs, daemons that forked twice or left their session: after
        it none of them runs, and ``exec`` works as before.  The session's end
        calls it before the verifiers, so that nothing the model left behind can
        change the tests' files or write their reward while they run.  Returns
        False when the backend cannot (the default, unless
        :attr:`own_pid_namespace`); raises ``SandboxError`` like ``exec``.
        """
        if not self.own_pid_namespace:
            return False
        result = await self.exec(KILL_EVERY_OTHER_PROCESS, STOP_PROCESSES_TIMEOUT_S)
        return result.exit_code == 0

    async def run_tests(self, command: str, files: tuple, timeout: float) -> TestsRun:
        """Run a verifier's tests apart from what the session left; NotImplementedError where the backend cannot.

        Called once :meth:`stop_processes` ended the session's processes.  The
        tests run under an identity of their own that the agent's leftovers
        (file modes, read-only folders) cannot stop, in a clean context: the
        environment of :func:`hermes_batch.grading.tests_environment` (no start-up
        hooks, no PATH entry of the agent's), a fresh HOME and TMPDIR.  First
        ``files`` ((relative path, text), ...) are written into a fresh folder
        named by ``$HERMES_TESTS_DIR``, which the agent never had, then
        ``command`` runs with ``/bin/sh -c`` in :attr:`workdir`, its standard
        error joined to its output.  ``$HERMES_RUN_UNTRUSTED CMD ARGS...`` runs
        CMD as the agent's identity, with no way to the reward and nothing of it
        left running when it returns.  The reward is what the tests wrote to
        ``$HERMES_REWARD_FILE``, read after every process of the tests ended,
        from a place nothing the session left can reach.  At ``timeout`` the
        tests are killed (``timed_out``).  The compiled helper's supervisor
        (``-G``) and :mod:`hermes_batch.sandbox_blocks.grading` do the work
        inside a sandbox; ``VerifierContract``'s reward-hack corpus
        (``hermes_batch.testing.reward_hacks``) holds a backend to this.
        Raises ``SandboxError`` like :meth:`exec`.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot run tests apart from the agent")

    async def copy_workdir_to(self, other: "Sandbox") -> None:
        """Make ``other``'s working folder (a fresh sandbox of the same backend) what this one's is now.

        For ``--verifier command:clean=true``: called once the session's
        processes ended; ``other``'s working folder is emptied first, then this
        one's folders, regular files and links are copied in as they are (modes
        kept, owned by ``other``'s user; FIFOs, sockets and devices left out),
        links never followed.  NotImplementedError where the backend cannot.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot copy its working folder to another sandbox")

    async def snapshot(self) -> Optional[str]:
        """An image holding this sandbox's whole filesystem now, from which ``SandboxBackend.open`` opens a fresh
        sandbox (as ``SandboxSpec.image``); None where the backend makes none (the default).

        For ``--branch_at``: called once the prefix's processes ended (they are never in it); a backend that
        sets ``SandboxBackend.snapshots_filesystems`` makes one (Docker: a committed image), removes the images it
        made at ``shutdown``, and else the branches get a copy of the working folder (:meth:`copy_workdir_to`).
        """
        return None

    async def ready(self) -> "Sandbox":
        """The sandbox once it can run commands; raises SandboxError when it cannot be opened.

        A backend's sandboxes are ready when ``open`` returns them; the one a
        prompt's tools see is opened beside its first model request, and the
        agent awaits this before a tool call, off the tool's clock.
        """
        return self

    @property
    def workdir(self) -> str:
        """The working directory commands start in, as the sandbox sees it."""
        return "."

    @property
    def image(self) -> str:
        """The container image the sandbox actually runs (the row's, or the backend's default), "" for none."""
        return ""


class SandboxBackend(abc.ABC):
    """Opens one sandbox per prompt. One instance per run."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    Config: ClassVar[type] = NoOptions
    ignores_images: ClassVar[bool] = False  # True: rows' images are not used (the run warns once)
    # What separates a prompt's commands from the machine, recorded in run.json and each record's metadata
    # ("container" for a container backend; the local one sets it at check: namespace, pid-namespace or process).
    isolation: str = ""
    isolation_details: dict = {}  # what run.json records besides (the local backend: its network, missing protections)
    # Why this backend's sandboxes cannot run a verifier's tests apart from the agent (Sandbox.run_tests), or ""
    # when they can: the command verifier refuses to start otherwise (unless command:apart=false).
    tests_apart_missing: str = "it does not implement Sandbox.run_tests"
    # Whether its sandboxes copy a working folder into a fresh one (Sandbox.copy_workdir_to, command:clean=true).
    copies_workdirs: ClassVar[bool] = False
    # Whether its sandboxes make an image of their whole filesystem a fresh one opens from (Sandbox.snapshot,
    # --branch_at); False: a branch gets a copy of the working folder where ``copies_workdirs``.
    snapshots_filesystems: ClassVar[bool] = False
    # True: a prompt's sandbox starts opening beside its first model request; False: at its first tool call,
    # for backends where a sandbox costs more than the wait (a prompt that calls no tool then never opens one)
    open_early: ClassVar[bool] = True

    # Whether the run that left a container, instance or sandbox behind may still run: ``start`` and a
    # cleanup command remove only what this says is gone (see hermes_batch/folder/liveness.py).
    owner_alive = staticmethod(_owner_alive)

    def __init__(self, config: Any, run: "RunContext"):
        self.config = config
        self.run = run

    async def check(self) -> None:
        """Called once before the model preflight and before the run folder exists.

        Verify that the engine is reachable and the options fit it; raise
        ConfigError with one sentence otherwise.  Leave nothing behind.
        """

    async def start(self) -> None:
        """Called once before any prompt, after ``check``: remove leftovers of a crashed run."""

    async def prepare_image(self, image: Optional[str]) -> None:
        """Make ``image`` available (pull once); raises SandboxError if it cannot be had."""

    async def build_image(self, image: str, context: str, digest: str, timeout: Optional[float] = None) -> None:
        """Build ``image`` from the Dockerfile of the build context folder ``context`` (whose content key is
        ``digest``: equal contexts are one image), once for every prompt that asks and at most a few at a time;
        raises SandboxError (with the tail of the build log) when it cannot be built.  May be called ahead of
        the prompts that need it.  Backends that cannot build raise SandboxError saying so."""
        from ..errors import SandboxError

        raise SandboxError(f"The {self.name} sandbox cannot build a task's image from its Dockerfile; "
                           "use --sandbox docker.")

    async def prepare_ahead(self, image: str) -> None:
        """Called in the background for the image whose prompts come next, while earlier prompts run: get it
        ready (pull, build, convert) so that its first prompt does not wait; start nothing that costs while
        idle.  Its errors are ignored: the prompts' own ``prepare_image`` reports them.  ``image`` is as
        ``image_for`` names it."""

    def follow_demand(self, demand: "ImageDemand") -> None:
        """Called once before the first prompt by a run that orders its prompts by image (not for
        ``ignores_images``): ``demand.left(image)`` is how many prompts read ahead of ``image`` have not opened
        a sandbox yet; a backend that starts sandboxes ahead of need keeps no more than that of an image, and
        calls ``demand.opened(spec.image, spec.prompt_index)`` as it opens one.  Not called in the processes of
        an executor that runs prompts elsewhere."""

    def image_for(self, spec: SandboxSpec) -> str:
        """The image a sandbox opened for ``spec`` runs, as the prompt's ``metadata.image`` records it.

        The row's image, else the backend's default (its Config's ``image``, the ``-S image=`` option);
        "" for a backend that runs no image (``ignores_images``).  A sandbox's ``image`` property is the
        same; override both when the backend chooses its image otherwise.
        """
        if self.ignores_images:
            return ""
        return spec.image or getattr(self.config, "image", None) or ""

    @abc.abstractmethod
    async def open(self, spec: SandboxSpec) -> Sandbox:
        """Open the sandbox of one prompt; raises SandboxError."""

    async def shutdown(self) -> None:
        """Called once after the last prompt, also on Ctrl-C."""


# --- tools -------------------------------------------------------------------


class ToolsetSession:
    """One prompt's state of a toolset, such as its browser context.

    Created (without I/O) at the prompt's first call of one of the toolset's
    tools, and closed when the prompt ends, also on errors, deadlines and
    Ctrl-C.  Open expensive resources lazily inside the tools' calls.
    """

    def __init__(self, runtime: "ToolsetRuntime"):
        self.runtime = runtime

    @property
    def config(self) -> Any:
        """The toolset's structured ``-T`` options."""
        return self.runtime.config

    async def close(self) -> None:
        """Release what the prompt held; called once, must not raise."""


class ToolsetRuntime:
    """The run-wide side of a toolset: its ``-T`` options, shared connections, a browser...

    One instance per run and toolset, built before anything is sent to a model.
    Subclass it when a toolset needs a provider, shared connections or per-prompt
    state (``Session``); toolsets without one get this base class.
    """

    Session: ClassVar[type] = ToolsetSession

    def __init__(self, config: Any, model: ModelSettings):
        self.config = config
        self.model = model  # the run's endpoint, key and model, for tools that call a model themselves
        self.run: Optional["RunContext"] = None
        self.client: Optional[ModelClient] = None

    def unavailable_reason(self) -> Optional[str]:
        """None when the toolset can run, else one sentence saying what is missing and how to configure it.

        Called once before the run starts, without I/O.  An unavailable toolset
        is reported once and left out of sampling.
        """
        return None

    def files_needed(self) -> int:
        """Most descriptors the toolset holds in the run's process at once, however many prompts run (0 by default).

        A toolset whose descriptors do not grow with the prompts in flight (a
        browser's proxies, a pool of connections) says so here; the run counts
        them, with its per-prompt estimate, against the open-files limit before
        it starts.  Called once before the run starts, without I/O.
        """
        return 0

    async def start(self, run: "RunContext", client: ModelClient) -> None:
        """Called once before the first prompt (only for available toolsets); ``client`` is the run's model client."""
        self.run, self.client = run, client

    def session(self) -> ToolsetSession:
        """A new session for one prompt; no I/O here."""
        return self.Session(self)

    async def shutdown(self) -> None:
        """Called once after the last prompt, also on Ctrl-C; must not raise."""


@attrs.frozen
class ToolContext:
    """What a tool call can use: the prompt's sandbox, the run's settings and the prompt's toolset sessions."""

    sandbox: Sandbox
    command_timeout: float = COMMAND_TIMEOUT
    max_output_chars: int = MAX_OUTPUT_CHARS
    toolsets: Optional["PromptToolsets"] = None  # None outside a run (unit tests of a tool)
    thread_pool: Optional[concurrent.futures.Executor] = None  # the run's pool for tools' blocking calls; None: the loop's default

    def session(self, toolset: str) -> ToolsetSession:
        """This prompt's session of ``toolset`` (created at the first call; see ToolsetSession)."""
        if self.toolsets is None:
            raise LookupError(f"No toolset sessions in this context, so none for {toolset!r}.")
        return self.toolsets.session(toolset)

    def report_usage(self, usage: Usage, *, journaled: bool = False) -> None:
        """Count a model call the tool made (tokens, cost) in the prompt's usage and the run's totals.

        Pass ``journaled=True`` when the call went through a ModelClient of the
        run (the tool's ``model.client`` or its ``for_model``): the run's call
        journal already counted it as a request, so only the prompt's usage grows.
        """
        if self.toolsets is not None:
            self.toolsets.report_usage(usage, journaled=journaled)


class Tool(abc.ABC):
    """A function the model can call."""

    name: ClassVar[str]
    description: ClassVar[str]
    parameters: ClassVar[dict]
    runs_commands: ClassVar[bool] = False  # calls ``Sandbox.exec``: the sandbox may then start what commands need as it opens

    @classmethod
    def spec(cls) -> ToolSpec:
        """What the model is told of the tool; one object per class, so its request JSON is made once a run."""
        return _spec_of(cls)

    @abc.abstractmethod
    async def call(self, arguments: dict, ctx: ToolContext) -> dict:
        """Run the tool; the result is JSON.  A failure is reported as a non-null ``error``."""


@attrs.frozen
class Toolset:
    """A named group of tools that a distribution switches on or off together.

    ``Config`` is the attrs class the ``-T name.key=value`` options are structured
    into (strictly); ``runtime`` the ToolsetRuntime subclass that holds the
    toolset's run-wide state and per-prompt sessions.
    """

    name: str
    description: str
    tools: tuple  # of Tool classes
    Config: type = NoOptions
    runtime: type = ToolsetRuntime


@attrs.frozen
class Distribution:
    """Independent inclusion probabilities (0..1) of toolsets."""

    name: str
    description: str
    probabilities: tuple  # of (toolset name, probability) pairs


# --- filters, writers, executors ----------------------------------------------


class Filter(abc.ABC):
    """Decides whether a finished trajectory is kept.

    ``Config`` receives the options of ``--filter name:options`` (see
    :mod:`hermes_batch.contract.plugin_options`), structured strictly.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    Config: ClassVar[type] = NoOptions

    def __init__(self, config: Any = None):
        self.config = self.Config() if config is None else config

    @abc.abstractmethod
    def check(self, trajectory: Trajectory) -> Optional[str]:
        """None to keep the trajectory, else the reason it is discarded."""


@attrs.frozen
class Verdict:
    """What a verifier returns: the sample's reward (1.0 passes by default), a short reason, and what it printed."""

    reward: float  # in [0, 1]: anything else (1.5, NaN, True) is the verifier's error, and the sample is not verified
    reason: str = ""
    output: str = ""  # kept in the record (bounded): the tests' output, say
    disagree: Optional[bool] = None  # two verdicts of one verifier (command:clean=true) that differ: True


@attrs.frozen
class VerifierContext:
    """What a verifier works with: the sample's sandbox (still open), its row and trajectory, the run's model client."""

    sandbox: Sandbox
    row: Any  # PromptRow: its ``extra`` holds the row's other fields (tests, answer, rubric, test_files...)
    trajectory: Trajectory
    client: ModelClient
    report_usage: Callable[..., None]  # (usage, journaled=False): a model call's usage, counted in the sample's
    calls: list = attrs.field(factory=list)  # the sample's CallRecords, which calls made here join
    # Opens another sandbox of the sample's spec (its image; nothing of its session's), which the caller closes.
    fresh_sandbox: Optional[Callable[[], Awaitable["Sandbox"]]] = None

    async def complete(self, messages: tuple[Message, ...], tools: tuple[ToolSpec, ...] = ()) -> ModelResponse:
        """One model call through the run's client (limiter, retries, journal), its usage counted in the sample's;
        ``tools`` are offered to the model (the judge's ``grade`` function)."""
        response = await self.client.complete(messages, tools, calls=self.calls)
        self.report_usage(response.usage, journaled=True)
        return response


VERIFIER_TIMEOUT = 300.0  # seconds a verifier may take when its Config has no ``timeout``


class Verifier(abc.ABC):
    """Gives a finished sample a reward, after its session and before its sandbox closes.

    ``Config`` receives the options of ``--verifier name:options``; a ``timeout``
    field (seconds) bounds the verifier, else VERIFIER_TIMEOUT does.  A verifier that
    raises or runs out of time gives the sample an error, never a reward.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    Config: ClassVar[type] = NoOptions

    def __init__(self, config: Any = None):
        self.config = self.Config() if config is None else config

    @property
    def timeout(self) -> float:
        return getattr(self.config, "timeout", None) or VERIFIER_TIMEOUT

    @abc.abstractmethod
    async def verify(self, ctx: VerifierContext) -> Verdict:
        """The sample's reward and why."""

    async def start(
        self, run: "RunContext", client: ModelClient, model_client: Callable[[str, ModelSettings], ModelClient],
    ) -> None:
        """Before the first sample, once per run (per process): ``client`` is the run's model client;
        ``model_client(name, settings)`` builds another installed model client ("" picks it by
        ``settings.base_url``), its calls journaled in calls.jsonl and counted in ``--max_cost``.  A
        HermesBatchError raised here stops the run before any prompt."""

    async def shutdown(self) -> None:
        """After the last sample, also on Ctrl-C: release what ``start`` opened."""

    def check_backend(self, backend: SandboxBackend) -> None:
        """Before the first sample, once the sandbox backend started: raise HermesBatchError (one sentence) when
        this verifier cannot work with ``backend`` (the command verifier refuses one whose sandboxes cannot run
        tests apart from the agent)."""


class Writer(abc.ABC):
    """Writes the merged output of a run (kept trajectories in prompt_index order).

    ``Config`` receives the options of ``--writer name:options``.  Writers that can
    also write any path (``hermes-batch export``) subclass
    :class:`hermes_batch.FileWriter`, or :class:`hermes_batch.LibraryWriter` when a
    library writes the file by path (SQLite, Arrow).
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    Config: ClassVar[type] = NoOptions

    def __init__(self, config: Any = None):
        self.config = self.Config() if config is None else config

    can_append: ClassVar[bool] = False
    """True when :meth:`append` can add trajectories to the end of ``filename``: a resume then merges only
    the new batches instead of writing everything again."""
    filename: ClassVar[Optional[str]] = None  # the main file, in the run folder (required with can_append)

    @abc.abstractmethod
    def write(self, run_dir, trajectories: Iterable[Trajectory]) -> Optional[str]:
        """Write the output files into ``run_dir``; return the main file's name."""

    def append(self, path, trajectories: Iterable[Trajectory]) -> None:
        """Add ``trajectories`` at the end of the file ``path`` durably (flushed and fsynced), writing nothing
        else: the merge may cut the file back to an earlier size before it calls this."""
        raise NotImplementedError(f"the {self.name} writer cannot append")


@attrs.frozen
class PromptJob:
    """One prompt to process, as the executor hands it to a worker."""

    row: Any  # PromptRow
    batch_num: int
    toolsets: tuple
    sample_index: int = 0  # which of the row's --samples_per_prompt samples
    replay: Optional[dict] = None  # answers of this prompt's cut-off session, by request hash (folder.replay_journal)

    @property
    def content_key(self) -> str:
        """The sample's key: the row's content key for sample 0, a key of its own for each other sample."""
        from ..formats.records import sample_key

        return sample_key(self.row.content_key, self.sample_index)


class PromptJobs(Iterator[PromptJob]):
    """The jobs of a run, one at a time, as ``Executor.run`` receives them.

    ``halted`` turns true when the run stops handing out jobs before the
    dataset's end (``--max_cost`` was reached): an executor holding jobs it has
    not started drops them rather than start them.
    """

    def __init__(self, jobs: Iterable[PromptJob]):
        self._jobs = iter(jobs)
        self.halted = False
        self.exhausted = False  # set by run/scheduler.py's jobs once every prompt left was handed out

    def __next__(self) -> PromptJob:
        return next(self._jobs)

    def halt(self) -> None:
        self.halted = True


@functools.lru_cache(maxsize=None)
def _spec_of(tool: type) -> ToolSpec:
    return ToolSpec(tool.name, tool.description, tool.parameters)


def stop_if_cancelled() -> None:
    """Raise CancelledError when the current task was told to stop, though the prompt it ran ended normally.

    An executor's loop calls it after each prompt: on Python 3.11 ``asyncio.wait_for``
    (in a sandbox's code, say) loses a cancel that comes as what it waits for ends,
    and the loop would then take the next prompt, or wait for one for ever, when it
    should have stopped.
    """
    import asyncio

    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()


class Executor(abc.ABC):
    """Runs the prompt jobs of a run and reports each outcome as it ends."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    Config: ClassVar[type] = NoOptions

    def __init__(self, config: Any):
        self.config = config

    async def start(self, processor: Any) -> None:
        """Start what takes time before prompts can run (worker processes, a cluster's connection).

        Called once as the run starts, beside the sandbox engine's check and the
        preflight request, before ``run``; raise a HermesBatchError (a UsageError
        for a cluster that cannot be reached) to stop the run before any prompt
        runs (the preflight is not sent when the error comes before the engine's
        check ends).  The default does nothing.
        """

    async def shutdown(self) -> None:
        """Stop what ``start`` and ``run`` left running; called once at the end of every run that called
        ``start``, also after errors and Ctrl-C.  The default does nothing."""

    @abc.abstractmethod
    async def run(
        self,
        jobs: PromptJobs,
        processor: Any,
        on_outcome: Callable[[PromptJob, Any], Awaitable[None]],
        concurrency: int,
    ) -> None:
        """Await ``processor.process(job)`` for every job, at most ``concurrency`` at once.

        ``jobs`` is a lazy iterator, a PromptJobs (a million-row dataset is
        never in memory); take the next job only when a slot is free, or a few
        ahead to queue them, and drop the queued ones once ``jobs.halted``.
        Each outcome (a Trajectory or a Failure) is handed to ``on_outcome`` in
        this process as soon as its prompt ends.  ``processor.plan`` is the
        run's RunPlan, plain picklable data: an executor that runs prompts in
        other processes sends it there and rebuilds the processor with
        ``build_processor``.  Cancelling ``run`` must cancel every prompt in flight.
        """
