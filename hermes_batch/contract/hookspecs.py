"""The plugin contract of hermes-batch.

Plugins are modules or objects with functions marked ``@hermes_batch.hookimpl``
and are found through the entry-point group ``hermes_batch``.  Two kinds of hook:

* **Registration hooks** (``register_*``) run once when a command starts.
  Each receives a ``register`` callable; call it once per thing the plugin
  provides.  Registering an object of the wrong type, or a name another
  plugin already registered, is an error that names the plugin(s).
* **Observers** (``run_started``, ``prompt_finished``, ``run_finished``) are
  told about a run's progress.  They must be quick: they run in the event
  loop of the process that writes the run folder.

Hooks are synchronous.  The registered objects do their per-prompt work
through ``async`` methods (see :mod:`hermes_batch.contract.interfaces`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Union

import pluggy

from .. import PROJECT_NAME

if TYPE_CHECKING:
    import click

    from .interfaces import Distribution, Executor, Filter, ModelClient, SandboxBackend, Toolset, Verifier, Writer
    from ..formats.records import Discarded, Failure, Trajectory
    from .run_context import RunContext

hookspec = pluggy.HookspecMarker(PROJECT_NAME)


@hookspec
def register_model_clients(register: Callable[[type[ModelClient]], None]) -> None:
    """Register model client classes.

    Called once at start-up.  ``register(cls)`` takes a subclass of
    :class:`hermes_batch.ModelClient`; its ``name`` is what ``--model_client``
    selects, and its ``handles_base_url`` classmethod lets the runner choose it
    automatically from ``--base_url``.
    """


@hookspec
def register_sandbox_backends(register: Callable[[type[SandboxBackend]], None]) -> None:
    """Register sandbox backend classes.

    Called once at start-up.  ``register(cls)`` takes a subclass of
    :class:`hermes_batch.SandboxBackend`; its ``name`` is what ``--sandbox``
    selects and its attrs ``Config`` class receives the ``-S key=value``
    options, structured strictly.  Every backend should pass
    :class:`hermes_batch.testing.SandboxContract`.
    """


@hookspec
def register_toolsets(register: Callable[[Toolset], None]) -> None:
    """Register toolsets.

    Called once at start-up.  ``register(toolset)`` takes a
    :class:`hermes_batch.Toolset`: a name, a description and the
    :class:`~hermes_batch.Tool` classes it switches on.  Tool names must be
    unique across all toolsets, and each tool's ``parameters`` must be a valid
    JSON Schema.  Optionally an attrs ``Config`` class, which receives the
    ``-T name.key=value`` options (structured strictly), and a
    :class:`~hermes_batch.ToolsetRuntime` subclass: the toolset's run-wide
    state, which can declare itself unavailable (left out of sampling) and
    gives each prompt a session that is closed when the prompt ends.
    """


@hookspec
def register_distributions(register: Callable[[Distribution], None]) -> None:
    """Register toolset distributions.

    Called once at start-up.  ``register(distribution)`` takes a
    :class:`hermes_batch.Distribution`: a name, a one-line description and the
    independent inclusion probability of each toolset.  A distribution may
    name toolsets no installed plugin provides; they are shown as unavailable
    and never sampled.
    """


@hookspec
def register_filters(register: Callable[[type[Filter]], None]) -> None:
    """Register quality filters.

    Called once at start-up.  ``register(cls)`` takes a subclass of
    :class:`hermes_batch.Filter`; ``--filter NAME[:OPTIONS]`` selects
    it, the options structured into its attrs ``Config``.  A filter decides from
    the trajectory record alone; a :class:`hermes_batch.contract.run_filters.RunFilter`
    judges the whole run at once and runs only in ``export`` and ``refilter``.
    """


@hookspec
def register_verifiers(register: Callable[[type[Verifier]], None]) -> None:
    """Register verifiers.

    Called once at start-up.  ``register(cls)`` takes a subclass of
    :class:`hermes_batch.Verifier`; ``--verifier NAME[:OPTIONS]`` selects it,
    the options structured into its attrs ``Config``.  Each selected verifier's
    ``verify`` runs after a sample's session ends and before its sandbox
    closes, with that sandbox, the row and the trajectory, and returns a
    :class:`hermes_batch.Verdict` (a reward in [0, 1] and a reason).  One that
    raises, outlasts its ``timeout`` or returns a reward outside [0, 1] gives
    the sample an error, not a reward; the run goes on.
    """


@hookspec
def register_writers(register: Callable[[type[Writer]], None]) -> None:
    """Register output writers.

    Called once at start-up.  ``register(cls)`` takes a subclass of
    :class:`hermes_batch.Writer`; ``--writer NAME[:OPTIONS]`` selects it.
    Writers receive the kept trajectories of the whole run, in
    ``prompt_index`` order, when the run is merged.  A
    :class:`hermes_batch.contract.writers.FileWriter` can write any path, so it is also
    a format of ``hermes-batch export --format NAME``.
    """


@hookspec
def register_executors(register: Callable[[type[Executor]], None]) -> None:
    """Register executors.

    Called once at start-up.  ``register(cls)`` takes a subclass of
    :class:`hermes_batch.Executor`; ``--executor NAME`` selects it and
    ``-E key=value`` options go to its attrs ``Config`` class.
    """


@hookspec
def register_commands(register: Callable[[click.Command], None]) -> None:
    """Register extra command-line commands.

    Called once when a ``hermes-batch`` command that is not built in is looked
    up, and for ``--help``.  ``register(command)`` takes a ``click.Command``
    or ``click.Group`` whose name becomes a subcommand (for example the Docker
    plugin's ``hermes-batch docker cleanup``).  A name that an existing
    command already uses is an error naming the plugin.
    """


@hookspec
def run_started(run: RunContext) -> None:
    """Called once when a run starts, after the dataset was validated and before any prompt is sent.

    ``run`` is the :class:`hermes_batch.RunContext`.  Return value ignored.
    """


@hookspec
def prompt_finished(run: RunContext, outcome: Union[Trajectory, Discarded, Failure]) -> None:
    """Called each time a prompt ends, after its record was written durably.

    ``outcome`` is a :class:`~hermes_batch.Trajectory` (kept), a
    :class:`~hermes_batch.Discarded` or a :class:`~hermes_batch.Failure`.
    Return value ignored.
    """


@hookspec
def run_finished(run: RunContext, statistics: dict) -> None:
    """Called once when a run ends (also after Ctrl-C), after the merge.

    ``statistics`` is the dict written to ``statistics.json``.  Return value ignored.
    """
