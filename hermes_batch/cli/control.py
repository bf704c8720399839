"""``hermes-batch ctl``: steer a running run through its control socket (hermes_batch/run/control.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import click

from ..errors import UsageError


@click.command("ctl", context_settings={"ignore_unknown_options": True})
@click.argument("run_dir", type=click.Path(path_type=Path, file_okay=False))
@click.argument("command")
@click.argument("value", required=False)
def ctl_command(run_dir: Path, command: str, value: Optional[str]):
    """Steer a running run: status, pause, resume, workers N, max_cost X, stop.

    RUN_DIR is the run folder (OUTPUT_DIR/RUN_NAME).  Prints the run's status as JSON.
    """
    from ..folder.control_socket import request_of, send

    answer = send(run_dir, request_of(command, value))
    if not answer.get("ok"):
        error = answer.get("error")
        raise UsageError(error if isinstance(error, str) else "The run refused the request.")
    click.echo(json.dumps(answer.get("status"), indent=2))
