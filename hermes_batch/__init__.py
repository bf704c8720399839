"""hermes-batch: run a tool-using LLM agent over many prompts and keep the sessions as training data.

Everything a plugin needs is importable from here (see ``__all__``); test helpers
are in :mod:`hermes_batch.testing`.  Other modules are internal and may change.
"""

import importlib
from typing import TYPE_CHECKING, Any

import pluggy

__version__ = "0.1.0"

PROJECT_NAME = "hermes_batch"

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marker for plugin hook implementations: ``@hermes_batch.hookimpl``."""

from .errors import (  # noqa: E402 (hookimpl and PROJECT_NAME first: the modules below import them)
    ConfigError,
    FatalModelError,
    HermesBatchError,
    ModelCallError,
    ModelEndpointError,
    ModelOutcome,
    PluginError,
    PromptFailure,
    PromptTimeout,
    RetryableModelError,
    RunFolderError,
    SandboxError,
    UsageError,
)
from .executors.dispatch import WorkerLink, WorkerLost, run_on_workers  # noqa: E402
from .contract.run_filters import RunFilter  # noqa: E402
from .contract.function_tools import tool  # noqa: E402
from .contract.image_demand import ImageDemand  # noqa: E402
from .contract.interfaces import (  # noqa: E402
    Distribution,
    Executor,
    Filter,
    ModelClient,
    ModelSettings,
    NoOptions,
    PromptJob,
    PromptJobs,
    Sandbox,
    SandboxBackend,
    Tool,
    ToolContext,
    Toolset,
    ToolsetRuntime,
    ToolsetSession,
    Verdict,
    Verifier,
    VerifierContext,
    Writer,
)
from .session.command_output import BoundedOutput, FirstBytes  # noqa: E402
from .sandbox_blocks.commands import run_command  # noqa: E402
from .sandbox_blocks.files import SandboxFolder, require_regular_file  # noqa: E402
from .sandbox_blocks.processes import ChildProcess  # noqa: E402
from .sandbox_blocks.pool import WarmPool  # noqa: E402
from .sandbox_blocks.trees import remove_tree  # noqa: E402
from .sandbox_blocks import runner as command_runner  # noqa: E402
from .sandbox_blocks import views as container_views  # noqa: E402
from .sandbox_blocks import grading  # noqa: E402
from .formats import task_folders  # noqa: E402
from .local_sandbox.namespace_init import build as build_namespace_helper  # noqa: E402
from .contract.plugins import PluginManager, get_plugin_manager  # noqa: E402
from .model.ratelimit import CallLimiter  # noqa: E402
from .formats.records import (  # noqa: E402
    SCHEMA_VERSION,
    CallRecord,
    Discarded,
    ExecResult,
    Failure,
    Message,
    Metadata,
    ModelResponse,
    PromptRow,
    SandboxSpec,
    TestsRun,
    ToolCall,
    ToolCallRecord,
    ToolSpec,
    ToolStat,
    Trajectory,
    Turn,
    Usage,
    VerifierResult,
    AuditFinding,
)
from .model.retry import error_for_status  # noqa: E402
from .contract.run_context import RunContext  # noqa: E402
from .formats.serialization import structure_config, trajectory_from_dict, trajectory_to_dict  # noqa: E402
from .contract.writers import FileWriter, LibraryWriter, Sink  # noqa: E402

__all__ = [
    # writing a plugin
    "hookimpl",
    "get_plugin_manager",
    "PluginManager",
    "structure_config",
    # the base classes of what plugins register, and what they are handed
    "ModelClient",
    "ModelSettings",
    "CallLimiter",
    "SandboxBackend",
    "Sandbox",
    "BoundedOutput",
    "FirstBytes",
    # building blocks for sandbox backends
    "SandboxFolder",
    "require_regular_file",
    "run_command",
    "ChildProcess",
    "WarmPool",
    "ImageDemand",
    "remove_tree",
    "command_runner",
    "container_views",
    "grading",
    "task_folders",
    "build_namespace_helper",
    "Toolset",
    "ToolsetRuntime",
    "ToolsetSession",
    "Tool",
    "tool",
    "ToolContext",
    "Distribution",
    "Filter",
    "RunFilter",
    "Verifier",
    "Verdict",
    "VerifierContext",
    "Writer",
    "FileWriter",
    "LibraryWriter",
    "Sink",
    "Executor",
    "PromptJob",
    "PromptJobs",
    "RunPlan",
    "build_processor",
    "NoOptions",
    # executors whose prompts run elsewhere: the driver leases, workers run them
    "run_on_workers",
    "WorkerLink",
    "WorkerLost",
    "WorkerSetup",
    "PromptWorker",
    "RunContext",
    # records
    "SCHEMA_VERSION",
    "Message",
    "ToolCall",
    "ToolSpec",
    "ModelResponse",
    "Usage",
    "CallRecord",
    "ExecResult",
    "SandboxSpec",
    "TestsRun",
    "PromptRow",
    "Trajectory",
    "Turn",
    "ToolCallRecord",
    "Metadata",
    "ToolStat",
    "Discarded",
    "Failure",
    "VerifierResult",
    "AuditFinding",
    # errors
    "HermesBatchError",
    "UsageError",
    "ConfigError",
    "PluginError",
    "RunFolderError",
    "FatalModelError",
    "PromptFailure",
    "PromptTimeout",
    "SandboxError",
    "ModelEndpointError",
    "ModelCallError",
    "RetryableModelError",
    "ModelOutcome",
    "error_for_status",
    "trajectory_to_dict",
    "trajectory_from_dict",
    "__version__",
]

# The run engine loads the model SDKs: imported at first use, so that a plugin's
# ``import hermes_batch`` stays light.
_LAZY = {"RunPlan": "run.plan", "build_processor": "run.plan", "PromptWorker": "executors.worker", "WorkerSetup": "executors.worker"}

if TYPE_CHECKING:
    from .run.plan import RunPlan, build_processor
    from .executors.worker import PromptWorker, WorkerSetup


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
