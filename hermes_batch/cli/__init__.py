"""The ``hermes-batch`` command line."""

from __future__ import annotations

import sys

import click

from .. import __version__
from ..errors import HermesBatchError
from .listing import distributions_command, listing_commands, plugins_command
from .run import run_command


class _Group(click.Group):
    """Prints user errors as one sentence; a traceback only for bugs under --verbose."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except HermesBatchError as exc:
            click.echo(f"Error: {exc}", err=True)
            ctx.exit(exc.exit_code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="hermes-batch")
def cli():
    """Run a tool-using LLM agent over a dataset of prompts and save the sessions as training data."""


cli.add_command(run_command)
cli.add_command(distributions_command)
cli.add_command(plugins_command)
for command in listing_commands():
    cli.add_command(command)


def add_plugin_commands(group: click.Group, pm) -> None:
    """Add the commands plugins register through ``register_commands`` to ``group``."""
    from ..errors import PluginError

    for impl in pm.hook.register_commands.get_hookimpls():

        def register(command, _plugin=impl.plugin_name):
            if command.name in group.commands:
                raise PluginError(f"Plugin {_plugin!r} registers the command {command.name!r}, which already exists.")
            group.add_command(command)

        impl.function(register=register)


def _load_plugin_commands() -> None:
    from ..plugins import get_plugin_manager

    try:
        add_plugin_commands(cli, get_plugin_manager())
    except HermesBatchError as exc:  # the command line must still start to say what is wrong
        click.echo(f"Warning: {exc}", err=True)


_load_plugin_commands()


def main(argv=None) -> None:
    """Console-script entry point."""
    try:
        cli.main(args=argv, prog_name="hermes-batch", standalone_mode=True)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
