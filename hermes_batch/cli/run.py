"""``hermes-batch run``: every option of Hermes Agent's batch_runner.py plus the plugin selections."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import traceback

import attrs
import click

from ..run import options
from ..run.config import RunConfig, require_api_key, resolve_api_key
from ..errors import EXIT_FAILED_PROMPTS, EXIT_INTERRUPTED, EXIT_OK, EXIT_TERMINATED, HermesBatchError
from ..formats.jsonguard import TerminalFormatter
from .listing import print_distributions


class _RunCommand(click.Command):
    """Keeps what was parsed, so --list_distributions sees a --distribution_file given after it."""

    def parse_args(self, ctx, args):
        try:
            opts, _rest, _order = self.make_parser(ctx).parse_args(args=list(args))
        except click.UsageError:
            opts = {}  # reported by the real parse below
        ctx.meta["hermes_batch.parsed"] = opts
        return super().parse_args(ctx, args)


def _list_distributions(ctx, _param, value):
    if not value or ctx.resilient_parsing:
        return
    # eager options act in the order they were typed: the file may not have been processed yet
    distribution_file = ctx.params.get("distribution_file") or ctx.meta.get("hermes_batch.parsed", {}).get("distribution_file")
    print_distributions(distribution_file)
    ctx.exit(0)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (click's test runner swaps it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def _setup_logging(verbose: bool) -> None:
    handler = _StderrHandler()
    handler.setFormatter(TerminalFormatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("hermes_batch")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    root.propagate = False
    logging.getLogger("hermes_batch.run.progress").setLevel(logging.INFO)
    logging.getLogger("hermes_batch.run.start").setLevel(logging.INFO)  # the start banner


@click.command("run", cls=_RunCommand, context_settings={"show_default": True})
@options.click_options(RunConfig)
@click.option("--no_filters", "--no-filters", is_flag=False, flag_value=True, default=False, type=click.BOOL,
              metavar="[true|false]", help="Turn all quality filters off.")
@click.option("--list_distributions", "--list-distributions", is_flag=False, flag_value=True, default=False,
              type=click.BOOL, metavar="[true|false]", is_eager=True, expose_value=False,
              callback=_list_distributions, help="Print the distributions and exit.")
def run_command(**values):
    """Run the agent over every prompt of a dataset."""
    _setup_logging(values["verbose"])
    no_filters = values.pop("no_filters")
    if no_filters and values["filters"]:
        raise click.UsageError("--no_filters and --filter contradict each other; pass one of them.")
    ctx = click.get_current_context()
    if values["tasks"] is not None:
        from ..run.task_suite import suite_dataset

        if values["dataset_file"] is not None:
            raise click.UsageError("--tasks and --dataset_file contradict each other; pass one of them.")
        values["dataset_file"] = suite_dataset(values["tasks"], values["output_dir"], values["run_name"])
    if not values["resume"]:  # a resume takes them from run.json
        for name in ("dataset_file", "batch_size"):
            if values[name] is None:
                raise click.MissingParameter(ctx=ctx, param=next(p for p in ctx.command.params if p.name == name))
    given = given_options(ctx) | ({"filters"} if no_filters else set())
    config = options.from_cli(RunConfig, values, **({"filters": ()} if no_filters else {}))
    if config.resume:
        from ..run.run_settings import inherit, require_dataset, require_run_folder

        require_run_folder(config)  # a misspelled --run_name would run every prompt again
        config = inherit(config, given)  # the options not given: as the run was started
        require_dataset(config)
        _setup_logging(config.verbose)
    api_key = resolve_api_key(config.api_key, config.base_url, model_client=config.model_client)
    require_api_key(api_key, config.base_url, config.model_client)
    sys.exit(execute(attrs.evolve(config, api_key=api_key)))


def given_options(ctx: click.Context) -> set:
    """The parameters the user gave (on the command line or through the environment), not click's defaults."""
    defaults = (click.core.ParameterSource.DEFAULT, click.core.ParameterSource.DEFAULT_MAP, None)
    return {name for name in ctx.params if ctx.get_parameter_source(name) not in defaults}


def execute(config: RunConfig) -> int:
    """Prepare (all checks before any model call), run, print the statistics; return the exit status."""
    from ..run.process_guard import protect
    from ..formats.redaction import redact_logging, run_secrets
    from ..run.runner import RunEngine
    from . import plugin_manager, workers_leave_out_disabled

    run = RunEngine(config, plugin_manager())
    protect(run_secrets(config))
    redact_logging(run.redactor)
    try:
        with workers_leave_out_disabled():
            return _execute(run)
    except HermesBatchError as exc:
        if run.redactor.found(str(exc)):
            exc.args = (run.redactor.text(str(exc)),) + exc.args[1:]
        raise


def _execute(run) -> int:
    from rich.console import Console

    from ..run.runner import render

    config = run.config
    run.prepare()

    received = []

    async def main():
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()

        def stop(sig):
            received.append(sig)
            task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop, sig)
        return await run.execute()

    try:
        result = asyncio.run(main())
    except HermesBatchError:
        raise
    except Exception:
        if config.verbose:
            print(run.redactor.text(traceback.format_exc()), file=sys.stderr, end="")
        raise HermesBatchError(
            "hermes-batch hit an internal error (a bug); finished prompts are saved. "
            "Rerun with --verbose for the traceback and --resume to continue."
        )
    if result.exit_code == EXIT_INTERRUPTED and received and received[0] == signal.SIGTERM:
        result = attrs.evolve(result, exit_code=EXIT_TERMINATED)
    if result.statistics is not None:
        render(result.statistics, Console(stderr=True))
    if result.forecast is not None:
        from ..run.forecast import render as render_forecast

        render_forecast(result.forecast, Console(stderr=True))
    if result.message:
        # usage (2) and write (74) errors: the run could not go on
        stopped = result.exit_code not in (EXIT_OK, EXIT_FAILED_PROMPTS, EXIT_INTERRUPTED, EXIT_TERMINATED)
        message = run.redactor.text(result.message)
        click.echo(f"{'Error' if stopped else 'Note'}: {message}", err=True)
    elif result.exit_code == 3:
        failed = result.statistics["prompts"]["failed"]
        click.echo(
            f"Note: {failed} prompt(s) failed (see failed.jsonl in the run folder); "
            "run the same command with --resume to retry them.",
            err=True,
        )
    return result.exit_code
