"""``hermes-batch singularity``: commands for the instances of the singularity sandbox."""

from __future__ import annotations

import collections
import subprocess

import click

from . import instances, runtime

STOP_TIMEOUT_S = 60


@click.group("singularity")
def singularity_group():
    """Manage the instances of the singularity sandbox."""


@singularity_group.command("cleanup")
@click.option("--run", "run_name", metavar="NAME", default=None, help="Only the instances of this run.")
@click.option("--force", is_flag=True, help="Also stop instances of runs that may still be in progress.")
@click.option("--binary", metavar="PATH", default=None, help="The apptainer or singularity command (default: found on PATH).")
def cleanup_command(run_name, force, binary):
    """Stop instances left behind by hermes-batch runs that crashed or were killed."""
    binary = runtime.find_binary(binary, "--binary")
    found = instances.ours(runtime.list_instances(binary), run_name)
    busy = [item for item in found if not force and item.owner_alive()]
    stale = [item for item in found if item not in busy]
    stopped, failed = [], []
    for item in stale:
        try:
            done = subprocess.run(
                [binary, "instance", "stop", "--force", item.name],
                capture_output=True, stdin=subprocess.DEVNULL, timeout=STOP_TIMEOUT_S, env=runtime.runtime_environment(),
            )
        except subprocess.TimeoutExpired:
            failed.append((item, f"the runtime did not answer within {STOP_TIMEOUT_S} s"))
            continue
        reason = runtime.Completed(done.returncode, done.stdout, done.stderr).reason()
        if done.returncode == 0 or "no instance found" in reason.lower():
            stopped.append(item)
        else:
            failed.append((item, reason))
    scope = f" of run {run_name!r}" if run_name else ""
    if stopped:
        runs = collections.Counter(item.run_part for item in stopped)
        detail = ", ".join(f"{name}: {count}" for name, count in sorted(runs.items()))
        click.echo(f"Stopped {len(stopped)} leftover instance(s){scope} ({detail}).")
    elif not failed:
        click.echo(f"No leftover instances{scope} found.")
    for item, reason in failed:
        click.echo(f"Could not stop the instance {item.name}: {reason}", err=True)
    if busy:
        owners = ", ".join(sorted({str(item.pid) for item in busy}))
        click.echo(
            f"Left {len(busy)} instance(s) of runs that may still be in progress (process {owners}); "
            "stop those runs first, or pass --force.",
            err=True,
        )
    if failed:
        raise SystemExit(1)
