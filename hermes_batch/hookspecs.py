"""The plugin contract of hermes-batch.

Plugins are modules or objects with functions marked ``@hermes_batch.hookimpl``
and are found through the entry-point group ``hermes_batch``.  Two kinds of hook:

* **Registration hooks** (``register_*``) run once when a run or a listing
  command starts.  Each receives a ``register`` callable; call it once per
  thing the plugin provides.  Registering a name another plugin already
  registered is an error that names both plugins.
* **Observers** (``hermes_batch_*``) are told about a run's progress.  They
  must be quick: they run in the event loop of the process that writes the
  run folder.

Hooks are synchronous.  The registered objects do their per-prompt work
through ``async`` methods (see :mod:`hermes_batch.interfaces`).
"""

import pluggy

from . import PROJECT_NAME

hookspec = pluggy.HookspecMarker(PROJECT_NAME)


@hookspec
def register_model_clients(register):
    """Register model client classes.

    Called once at start-up.  ``register(cls)`` takes a subclass of
    :class:`hermes_batch.interfaces.ModelClient`; its ``name`` is what
    ``--model_client`` selects, and its ``handles_base_url`` classmethod lets the
    runner choose it automatically from ``--base_url``.
    """


@hookspec
def register_sandbox_backends(register):
    """Register sandbox backend classes.

    Called once at start-up.  ``register(cls)`` takes a subclass of
    :class:`hermes_batch.interfaces.SandboxBackend`; its ``name`` is what
    ``--sandbox`` selects and its attrs ``Config`` class receives the
    ``-S key=value`` options, structured strictly.
    """


@hookspec
def register_toolsets(register):
    """Register toolsets.

    Called once at start-up.  ``register(toolset)`` takes a
    :class:`hermes_batch.interfaces.Toolset`: a name, a description and the
    :class:`~hermes_batch.interfaces.Tool` classes it switches on.  Tool names
    must be unique across all toolsets.  Optionally an attrs ``Config`` class,
    which receives the ``-T name.key=value`` options (structured strictly), and a
    :class:`~hermes_batch.interfaces.ToolsetRuntime` subclass: the toolset's
    run-wide state, which can declare itself unavailable (left out of sampling)
    and gives each prompt a session that is closed when the prompt ends.
    """


@hookspec
def register_distributions(register):
    """Register toolset distributions.

    Called once at start-up.  ``register(distribution)`` takes a
    :class:`hermes_batch.interfaces.Distribution`: a name, a one-line
    description and the independent inclusion probability of each toolset.
    A distribution may name toolsets no installed plugin provides; they are
    shown as unavailable and never sampled.
    """


@hookspec
def register_filters(register):
    """Register quality filters.

    Called once at start-up.  ``register(cls)`` takes a subclass of
    :class:`hermes_batch.interfaces.Filter`; ``--filter NAME[:OPTIONS]`` selects
    it, the options structured into its attrs ``Config``.  A filter decides from
    the trajectory record alone; a :class:`hermes_batch.filtering.RunFilter`
    judges the whole run at once and runs only in ``export`` and ``refilter``.
    """


@hookspec
def register_writers(register):
    """Register output writers.

    Called once at start-up.  ``register(cls)`` takes a subclass of
    :class:`hermes_batch.interfaces.Writer`; ``--writer NAME[:OPTIONS]`` selects it.
    Writers receive the kept trajectories of the whole run, in
    ``prompt_index`` order, when the run is merged.  A
    :class:`hermes_batch.writers.FileWriter` can write any path, so it is also
    a format of ``hermes-batch export --format NAME``.
    """


@hookspec
def register_executors(register):
    """Register executors.

    Called once at start-up.  ``register(cls)`` takes a subclass of
    :class:`hermes_batch.interfaces.Executor`; ``--executor NAME`` selects it
    and ``-E key=value`` options go to its attrs ``Config`` class.
    """


@hookspec
def register_commands(register):
    """Register extra command-line commands.

    Called once when the ``hermes-batch`` command line starts.  ``register(command)``
    takes a ``click.Command`` or ``click.Group`` whose name becomes a subcommand
    (for example the Docker plugin's ``hermes-batch docker cleanup``).  A name
    that an existing command already uses is an error naming the plugin.
    """


@hookspec
def hermes_batch_run_start(run):
    """Called once when a run starts, after the dataset was validated and before any prompt is sent.

    ``run`` is the :class:`hermes_batch.run_context.RunContext`.  Return value ignored.
    """


@hookspec
def hermes_batch_prompt_finished(run, outcome):
    """Called each time a prompt ends, after its record was written durably.

    ``outcome`` is a :class:`~hermes_batch.records.Trajectory` (kept),
    a :class:`~hermes_batch.records.Discarded` or a
    :class:`~hermes_batch.records.Failure`.  Return value ignored.
    """


@hookspec
def hermes_batch_run_end(run, statistics):
    """Called once when a run ends (also after Ctrl-C), after the merge.

    ``statistics`` is the dict written to ``statistics.json``.  Return value ignored.
    """
