"""Errors meant for users: each is one sentence saying what is wrong and what to do; and the exit statuses."""

import signal

# The exit statuses of hermes-batch, in one place (docs/options.md lists them for users).
EXIT_OK = 0  # every prompt ended, or --max_cost was reached and the rest not started
EXIT_USAGE = 2  # usage, configuration or dataset error, or an endpoint the preflight found unusable
EXIT_FAILED_PROMPTS = 3  # the run finished but some prompts failed; --resume retries them
EXIT_IO_ERROR = 74  # EX_IOERR of sysexits.h: the run folder cannot be written
EXIT_INTERRUPTED = 130  # Ctrl-C, after a clean shutdown
EXIT_TERMINATED = 128 + signal.SIGTERM  # SIGTERM, after the same clean shutdown


class HermesBatchError(Exception):
    """Base of every error a user is meant to read; the CLI prints it without a traceback."""

    exit_code = EXIT_USAGE


class UsageError(HermesBatchError):
    """A command-line option or configuration value is wrong."""


class ConfigError(HermesBatchError):
    """A plugin or run configuration is wrong."""


class DatasetError(HermesBatchError):
    """The dataset file cannot be used as it is."""

    def __init__(self, message, problems=()):
        super().__init__(message)
        self.problems = tuple(problems)


class PluginError(HermesBatchError):
    """A plugin could not be loaded or registered something twice."""


class RunFolderError(HermesBatchError):
    """The run folder is in a state this command cannot continue from."""


class RunFolderWriteError(HermesBatchError):
    """Writing the run folder failed (disk full, file too large, quota, I/O error): the run stops, nothing is lost."""

    exit_code = EXIT_IO_ERROR


class FatalModelError(HermesBatchError):
    """The model endpoint refused the whole run (bad key, unknown model): stop at once."""


class PromptFailure(Exception):
    """Infrastructure failure of one prompt; it is written to failed.jsonl and retried by --resume."""

    kind = "infrastructure"


class ModelEndpointError(PromptFailure):
    """The model endpoint kept failing after all retries."""

    kind = "model_endpoint"


class SandboxError(PromptFailure):
    """The sandbox could not start, died, or its image is unavailable."""

    kind = "sandbox"


class PromptTimeout(PromptFailure):
    """--prompt_timeout passed before the model answered once: nothing worth saving, so --resume runs it again."""

    kind = "timeout"


class ModelCallError(Exception):
    """One model call attempt went wrong; raised by ``ModelClient.send``.

    ``provider`` is the upstream provider named in the error, when the endpoint says (OpenRouter does).
    """

    def __init__(self, message: str, *, status: "int | None" = None, provider: "str | None" = None):
        super().__init__(message)
        self.status = status
        self.provider = provider

    def __reduce__(self):
        # pickled with its fields (a --batch_api answer goes from the driver to a worker's session): the default
        # calls cls(*args), which loses the keyword-only fields or fails on a required one (ModelOutcome's reason)
        return _rebuild, (type(self), self.args), self.__dict__


def _rebuild(cls, args):
    return cls.__new__(cls, *args)


class RetryableModelError(ModelCallError):
    """Worth another attempt: 429, 5xx, timeout, dropped connection."""

    def __init__(
        self,
        message: str,
        *,
        status: "int | None" = None,
        retry_after: "float | None" = None,
        provider: "str | None" = None,
    ):
        super().__init__(message, status=status, provider=provider)
        self.retry_after = retry_after

    @property
    def rate_limited(self) -> bool:
        return self.status == 429


class ModelOutcome(ModelCallError):
    """The model side ended the session early (context too long, content filtered): saved as partial."""

    def __init__(self, message: str, *, reason: str, status: "int | None" = None, provider: "str | None" = None):
        super().__init__(message, status=status, provider=provider)
        self.reason = reason
