"""report.html at the end of every run, and the ``report`` and ``view`` commands (code in hermes_batch.view)."""

from __future__ import annotations

import logging

import hermes_batch

log = logging.getLogger(__name__)


@hermes_batch.hookimpl
def register_commands(register):
    from hermes_batch.view.commands import report_command, view_command

    register(report_command)
    register(view_command)


@hermes_batch.hookimpl
def run_finished(run, statistics):
    from hermes_batch.view import write_report

    try:
        write_report(run.run_dir)
    except Exception as exc:  # the run's data is safe; a report that cannot be written must not fail it
        log.warning("Could not write report.html (%s); run `hermes-batch report %s` to retry.", exc, run.run_dir)
