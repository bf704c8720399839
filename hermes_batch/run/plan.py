"""The plan of a run: what it will do, decided before any model call, and the prompt processor built from it."""

from __future__ import annotations

import difflib
import json
import random
from typing import Any, Callable, Mapping, Optional

import attrs

from ..formats import dataset
from . import distributions, notices, selection
from ..folder import rowkeys
from ..contract import toolsets
from .config import RunConfig, agent_settings, model_settings
from ..formats.dataset import DatasetReport
from ..errors import DatasetError, UsageError
from .inputfiles import load_prefill
from ..contract.interfaces import Distribution
from ..contract.plugins import Registry
from ..session.processor import PromptProcessor
from ..contract.run_context import RunContext
from ..folder.runfolder import RunFolder


@attrs.frozen
class RunPlan:
    """Everything a run decided before its first model call: selected plugins and their configs, toolsets, seed.

    Plain, picklable data (plugins are named, not held), so an executor that runs
    prompts in another process or on a Ray worker sends the plan there and
    rebuilds the prompt processor with ``build_processor``.
    """

    config: RunConfig
    seed: int
    distribution: Distribution
    toolsets: tuple[str, ...]  # sampled among: installed and configured
    unconfigured: Mapping[str, str]  # installed toolsets left out of sampling -> why
    toolset_configs: Mapping[str, Any]  # every toolset with a runtime -> its structured -T options
    tools: Mapping[str, tuple[str, ...]]  # toolset -> the names of its tools
    all_tools: tuple[str, ...]  # every tool of every installed toolset, for the fixed record schema
    sandbox: str
    sandbox_config: Any
    model_client: str
    model: Any  # ModelSettings
    agent: Any  # AgentSettings (its prefill included)
    filters: tuple[str, ...]  # NAME[:OPTIONS] specs as given (or the default filters'), in order
    writers: tuple[str, ...]  # NAME[:OPTIONS] specs
    verifiers: tuple[str, ...]  # NAME[:OPTIONS] specs, in order
    executor: str
    executor_config: Any
    dataset: DatasetReport
    dataset_fingerprint: str


def make_plan(
    config: RunConfig, registry: Registry, folder: RunFolder, concurrency: Optional[int] = None,
    on_validated: Optional[Callable[[rowkeys.Validated], None]] = None,
) -> tuple[RunPlan, dict]:
    """Check everything that can be checked without a model call and decide the run; raises HermesBatchError.

    Returns the plan and the toolset runtimes built to ask them whether they are
    configured (toolset name -> runtime, none started): a run has one runtime
    per toolset, so the runner's processor uses these.  ``registry`` gains the
    distributions of --distribution_file.  ``concurrency`` (default:
    --num_workers) is what the model client's limit of calls in flight starts from.
    ``on_validated`` receives the dataset's validation with its row keys, which a
    resume matches against the finished records and the plan does not carry.
    """
    if config.distribution_file is not None:
        for dist in distributions.load_distribution_file(config.distribution_file):
            registry.add("distributions", dist, f"file {config.distribution_file}")
    distribution = selection.distribution(registry, config.distribution)
    installed = set(registry.names("toolsets"))
    wanted = [name for name, _p in distribution.probabilities]
    available = {name for name in wanted if name in installed}
    if not available:
        raise UsageError(
            f"None of the toolsets of distribution {config.distribution!r} is installed ({', '.join(wanted)}): "
            f"{distributions.where_to_get(wanted)}; install it or choose another --distribution."
        )
    model = model_settings(config, concurrency or config.num_workers)
    runtimes = toolsets.build_runtimes(registry, available, config.tool_options, model)
    unconfigured = {name: reason for name in sorted(available) if (reason := runtimes[name].unavailable_reason())}
    available -= set(unconfigured)
    if not available:
        reasons = " ".join(f"{name}: {reason}" for name, reason in unconfigured.items())
        raise UsageError(f"No toolset of distribution {config.distribution!r} can run. {reasons}")
    tools = {name: tuple(tool.name for tool in found) for name, found in selection.toolset_tools(registry, sorted(available)).items()}
    # every record lists every tool of every installed toolset, as the seed's did: any two runs on this machine
    # (terminal_only and default, or sessions of other distributions) then have one schema and load together
    every_tool = {tool.name for found in selection.toolset_tools(registry, sorted(installed)).values() for tool in found}
    backend_cls, sandbox_config = selection.sandbox_backend(registry, config.sandbox, config.sandbox_options)
    client_cls = selection.model_client_class(registry, config.model_client, config.base_url)
    client_cls.check_settings(model)  # a sampling setting it cannot send stops the run here, not every prompt
    filter_specs = selection.filter_specs(config.filters)
    selection.filters(registry, filter_specs)  # unknown names and bad options stop the run here
    selection.writers(registry, config.writers)
    selection.verifiers(registry, config.verifiers)  # unknown names and bad options stop the run here
    config.check_verifier_needs()  # again: a resume's --verifier is the run's, taken from run.json
    executor = selection.executor(registry, config.executor, config.executor_options)
    if config.batch_api:
        _check_batch_api(client_cls)
    prefill = load_prefill(config.prefill_messages_file)
    notices.routing_elsewhere(config)

    # on a resume over the same file, the report and row keys of the last session (rowkeys.py)
    validated = rowkeys.validate(config.dataset_file, config.max_rows, folder if config.resume else None)
    if on_validated is not None:
        on_validated(validated)
    report = validated.report
    if report.invalid and not config.skip_invalid:
        raise dataset.dataset_error(report)
    if report.valid == 0:
        raise DatasetError(f"{config.dataset_file} holds no valid prompt; add rows with a non-empty \"prompt\".")
    notices.ignored_images(report, backend_cls, config.dataset_file)
    plan = RunPlan(
        config=config,
        seed=_choose_seed(config, folder),
        distribution=distribution,
        toolsets=tuple(sorted(available)),
        unconfigured=unconfigured,
        toolset_configs={name: runtime.config for name, runtime in runtimes.items()},
        tools=tools,
        all_tools=tuple(sorted(every_tool)),
        sandbox=config.sandbox,
        sandbox_config=sandbox_config,
        model_client=client_cls.name,
        model=model,
        agent=agent_settings(config, prefill),
        filters=filter_specs,
        writers=tuple(config.writers),
        verifiers=tuple(config.verifiers),
        executor=executor.name,
        executor_config=executor.config,
        dataset=report,
        dataset_fingerprint=validated.fingerprint,
    )
    return plan, {name: runtimes[name] for name in plan.toolsets}


def _check_batch_api(client_cls: type) -> None:
    from .batch_client import has_batch_api

    if not has_batch_api(client_cls):
        raise UsageError(f"The model client {client_cls.name!r} has no batch API; run without --batch_api, or with "
                         "--model_client openai or anthropic.")


def _choose_seed(config: RunConfig, folder: RunFolder) -> int:
    """--seed, else the seed run.json recorded (a resume samples as the first session did), else a random one."""
    if config.seed is not None:
        return config.seed
    if config.resume and folder.run_json.exists():
        try:
            recorded = json.loads(folder.run_json.read_text())["seed"]
            if isinstance(recorded, int):
                return recorded
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return random.SystemRandom().randrange(2**32)


def build_processor(
    plan: RunPlan, run: RunContext, registry: Registry, runtimes: Optional[Mapping] = None, batcher: Any = None,
) -> PromptProcessor:
    """The prompt processor of ``plan``: a new model client and sandbox backend, neither started.

    ``registry`` holds the plugins installed where the processor runs (they must
    include those the plan names); ``runtimes`` are the toolset runtimes
    ``make_plan`` returned, in the runner's process, else new ones are built.
    Start the processor with ``processor.start()`` before the first prompt and
    end it with ``processor.aclose()`` after the last.  ``batcher``: under
    ``--batch_api``, what the client's calls go to instead of a Batcher of its
    own (a worker's relay to the driver's).
    """
    if runtimes is None:
        runtimes = {
            name: registry.get("toolsets", name).runtime(plan.toolset_configs[name], plan.model) for name in plan.toolsets
        }
    client = registry.get("model_clients", plan.model_client)(plan.model)
    if plan.config.batch_api:
        from .batch_client import BatchingClient, batch_options

        client = BatchingClient(client, batch_options(plan.config), batcher)
    return PromptProcessor(
        run_name=run.run_name,
        model=plan.config.model,
        seed=plan.seed,
        client=client,
        backend=registry.get("sandboxes", plan.sandbox)(plan.sandbox_config, run),
        toolsets={name: tuple(cls() for cls in registry.get("toolsets", name).tools) for name in plan.tools},
        all_tools=plan.all_tools,
        agent=plan.agent,
        verbose=plan.config.verbose,
        runtimes=dict(runtimes),
        run=run,
        plan=plan,
        verifiers=selection.verifiers(registry, plan.verifiers),
        min_reward=plan.config.min_reward,
        model_client=lambda name, settings: _other_client(registry, client, name, settings),
        sampling=plan.model.sampling(),
        branch_at=plan.config.branch_at,
    )


def _other_client(registry: Registry, run_client, name: str, settings) -> Any:
    """A client of the installed model client ``name`` ("" picks it by ``settings.base_url``) on an endpoint of its
    own (a verifier's judge): its own limiter, its requests journaled in the run's calls.jsonl."""
    installed = registry.names("model_clients")
    if name and name not in installed:
        close = difflib.get_close_matches(name, sorted(installed), n=1)
        raise UsageError(f"No model client {name!r} is installed (installed: {', '.join(sorted(installed))}); "
                         + (f"did you mean {close[0]!r}?" if close else "install it or name one of them."))
    client = selection.model_client_class(registry, name or None, settings.base_url)(settings)
    client.journal = run_client.journal  # set by the runner (or a worker) before the processor starts
    return client
