"""The ``hermes-batch`` command line."""

from __future__ import annotations

import contextlib
import gc
import os
import sys

import click

from .. import __version__
from ..contract.plugins import DISABLE_ENV, disabled_plugins
from ..errors import EXIT_INTERRUPTED, HermesBatchError, PluginError
from .control import ctl_command
from .listing import distributions_command, listing_commands, plugins_command
from .tasks import tasks_group
from .new_plugin import new_plugin_command
from .run import run_command
from .seed_import import import_command

_PLUGIN_MANAGER = "hermes_batch.plugin_manager"
_PLUGIN_COMMANDS = "hermes_batch.plugin_commands"


def plugin_manager(ctx: click.Context | None = None):
    """The plugin manager of the command being run, built at its first use: plugins load once per command."""
    from ..contract.plugins import PluginManager, get_plugin_manager

    ctx = ctx or click.get_current_context(silent=True)
    if ctx is None:  # called outside a command (the Python API)
        return get_plugin_manager()
    root = ctx.find_root()
    if isinstance(root.obj, PluginManager):  # a caller's own (tests: ``CliRunner().invoke(cli, args, obj=pm)``)
        return root.obj
    meta = root.meta
    if _PLUGIN_MANAGER not in meta:
        meta[_PLUGIN_MANAGER] = get_plugin_manager(disabled=disabled_plugins(meta.get(_DISABLED, ())))
    return meta[_PLUGIN_MANAGER]


_DISABLED = "hermes_batch.disabled_plugins"


def _disable(ctx: click.Context, _param, values) -> None:
    """``-p no:NAME``: the plugin NAME is not loaded by this command (see ``workers_leave_out_disabled``)."""
    names = []
    for value in values:
        prefix, sep, name = value.partition(":")
        if prefix != "no" or not sep or not name.strip():
            raise click.BadParameter(f"{value!r}: write -p no:NAME to disable the plugin NAME.", ctx)
        names.append(name.strip())
    ctx.find_root().meta[_DISABLED] = tuple(names)


@contextlib.contextmanager
def workers_leave_out_disabled():
    """While a run executes, HERMES_BATCH_DISABLE_PLUGINS also names the -p no:NAME plugins, so the worker
    processes it starts leave them out too; restored after."""
    ctx = click.get_current_context(silent=True)
    names = ctx.find_root().meta.get(_DISABLED, ()) if ctx is not None else ()
    if not names:
        yield
        return
    before = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = ",".join(sorted(disabled_plugins(names)))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(DISABLE_ENV, None)
        else:
            os.environ[DISABLE_ENV] = before


def plugin_commands(group: click.Group, pm) -> dict[str, click.Command]:
    """The commands plugins register through ``register_commands``; a name ``group`` already has is an error."""
    from ..contract.plugins import KIND, collect

    commands = {}
    for reg in collect(pm, kinds=(KIND["commands"],)).items("commands"):
        if reg.name in group.commands:
            raise PluginError(f"Plugin {reg.plugin!r} registers the command {reg.name!r}, which already exists; rename it.")
        commands[reg.name] = reg.obj
    return commands


class _Group(click.Group):
    """Prints user errors as one sentence; looks up plugins' commands only when a name is not built in."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except HermesBatchError as exc:
            click.echo(f"Error: {exc}", err=True)
            ctx.exit(exc.exit_code)

    def list_commands(self, ctx):
        return sorted({*super().list_commands(ctx), *self._plugin_commands(ctx)})

    def get_command(self, ctx, name):
        return super().get_command(ctx, name) or self._plugin_commands(ctx).get(name)

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError:
            from ..contract.plugins import first_party, where_to_get

            if args and first_party("commands", args[0]) is not None:  # a first-party plugin's command group
                raise click.UsageError(f"No command {args[0]!r}: {where_to_get('commands', args[:1])}; install it.", ctx) from None
            raise

    def _plugin_commands(self, ctx) -> dict[str, click.Command]:
        meta = ctx.find_root().meta
        if _PLUGIN_COMMANDS not in meta:
            try:
                meta[_PLUGIN_COMMANDS] = plugin_commands(self, plugin_manager(ctx))
            except HermesBatchError as exc:  # the command line must still start to say what is wrong
                click.echo(f"Warning: {exc}", err=True)
                meta[_PLUGIN_COMMANDS] = {}
        return meta[_PLUGIN_COMMANDS]


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="hermes-batch")
@click.option("-p", "disable", metavar="no:NAME", multiple=True, expose_value=False, is_eager=True, callback=_disable,
              help="Do not load the plugin NAME (an entry point's or a distribution's name), as pytest's -p no:NAME; "
                   "also HERMES_BATCH_DISABLE_PLUGINS=NAME,NAME.")
def cli():
    """Run a tool-using LLM agent over a dataset of prompts and save the sessions as training data."""


cli.add_command(run_command)
cli.add_command(tasks_group)
cli.add_command(distributions_command)
cli.add_command(plugins_command)
cli.add_command(new_plugin_command)
cli.add_command(import_command)
cli.add_command(ctl_command)
for command in listing_commands():
    cli.add_command(command)


def main(argv=None) -> None:
    """Console-script entry point (the process ends when it returns)."""
    try:
        cli.main(args=argv, prog_name="hermes-batch", standalone_mode=True)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        # The command is done and its files are written.  The interpreter's last collection over all it
        # imported took ~0.35 s of every command's wall time; what is frozen is left to the process's end.
        gc.freeze()
