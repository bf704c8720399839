"""The commands over a run folder (export, refilter, stats), registered like any plugin's commands."""

import hermes_batch


@hermes_batch.hookimpl
def register_commands(register):
    from hermes_batch.cli.folder_commands import COMMANDS

    for command in COMMANDS:
        register(command)
