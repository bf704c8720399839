"""``hermes-batch docker``: commands for the containers of the docker sandbox."""

from __future__ import annotations

import collections

import click

from . import engine


@click.group("docker")
def docker_group():
    """Manage the containers of the docker sandbox."""


@docker_group.command("cleanup")
@click.option("--run", "run_name", metavar="NAME", default=None, help="Only the containers of this run.")
@click.option("--force", is_flag=True, help="Also remove containers of runs that may still be in progress (here or on another machine).")
def cleanup_command(run_name, force):
    """Remove containers left behind by hermes-batch runs that crashed or were killed."""
    client = engine.connect()
    try:
        containers = engine.find_containers(client, run_name)
        busy = [c for c in containers if not force and engine.owner_alive(c.get("Labels", {}))]
        stale = [c for c in containers if c not in busy]
        removed = engine.remove_all(client, stale)
    finally:
        client.close()
    scope = f" of run {run_name!r}" if run_name else ""
    if removed:
        runs = collections.Counter(c.get("Labels", {}).get(engine.LABEL_RUN, "?") for c in stale)
        detail = ", ".join(f"{name}: {count}" for name, count in sorted(runs.items()))
        click.echo(f"Removed {removed} leftover container(s){scope} ({detail}).")
    else:
        click.echo(f"No leftover containers{scope} found.")
    if busy:
        owners = sorted({f"{c['Labels'].get(engine.LABEL_PID, '?')} on {c['Labels'].get(engine.LABEL_HOST, '?')}" for c in busy})
        click.echo(
            f"Left {len(busy)} container(s) of runs that may still be in progress (process {', '.join(owners)}); "
            "stop those runs first, or pass --force.",
            err=True,
        )
