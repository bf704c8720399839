"""Errors meant for users: each is one sentence saying what is wrong and what to do."""


class HermesBatchError(Exception):
    """Base of every error a user is meant to read; the CLI prints it without a traceback."""

    exit_code = 2


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
