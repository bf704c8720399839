"""``hermes-batch modal``: commands for the sandboxes of the modal backend."""

from __future__ import annotations

import asyncio
import collections

import click

from . import connection, leftovers
from .config import DEFAULT_APP


@click.group("modal")
def modal_group():
    """Manage the Modal sandboxes of the modal backend."""


@modal_group.command("cleanup")
@click.option("--run", "run_name", metavar="NAME", default=None, help="Only the sandboxes of this run.")
@click.option("--app", "app_name", metavar="NAME", default=DEFAULT_APP, show_default=True, help="The Modal app the runs used (-S app=...).")
@click.option("--force", is_flag=True, help="Also terminate sandboxes of runs that may still be in progress (here or on another machine).")
def cleanup_command(run_name, app_name, force):
    """Terminate Modal sandboxes left running by hermes-batch runs that crashed or were killed."""
    asyncio.run(_cleanup(run_name, app_name, force))


async def _cleanup(run_name, app_name, force) -> None:
    client = await connection.connect()
    try:
        app_id = await leftovers.lookup_app(client, app_name)
        found = []
        if app_id is not None:
            found = await leftovers.find(client, app_id, **({leftovers.TAG_RUN: run_name} if run_name else {}))
        busy = [(s, tags) for s, tags in found if not force and leftovers.owner_alive(tags)]
        stale = [(s, tags) for s, tags in found if (s, tags) not in busy]
        for sandbox, tags in stale:
            click.echo(f"Terminating {sandbox.object_id} (run {tags.get(leftovers.TAG_RUN, '?')!r}, "
                       f"prompt {tags.get(leftovers.TAG_PROMPT, '?')}).")
        terminated = await leftovers.terminate_all(stale)
    finally:
        await connection.close_quietly(client)
    scope = f" of run {run_name!r}" if run_name else ""
    if terminated:
        runs = collections.Counter(tags.get(leftovers.TAG_RUN, "?") for _s, tags in stale)
        detail = ", ".join(f"{name}: {count}" for name, count in sorted(runs.items()))
        click.echo(f"Terminated {terminated} leftover Modal sandbox(es){scope} in app {app_name!r} ({detail}).")
    else:
        click.echo(f"No leftover Modal sandboxes{scope} found in app {app_name!r}.")
    if busy:
        owners = sorted({f"{tags.get(leftovers.TAG_PID, '?')} on {tags.get(leftovers.TAG_HOST, '?')}" for _s, tags in busy})
        click.echo(
            f"Left {len(busy)} sandbox(es) of runs that may still be in progress (process {', '.join(owners)}); "
            "stop those runs first, or pass --force.",
            err=True,
        )
