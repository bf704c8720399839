"""``hermes-batch run``: every option of the seed's batch runner plus the plugin selections."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import traceback
from pathlib import Path

import attrs
import click

from ..config import (
    DEFAULT_BASE_URL,
    DEFAULT_MODEL,
    HTTP_BACKENDS,
    PROVIDER_SORTS,
    REASONING_EFFORTS,
    RunConfig,
    require_api_key,
    resolve_api_key,
    split_list,
)
from ..errors import HermesBatchError
from ..serialization import parse_key_values
from ..toolsets import parse_tool_options
from .listing import print_distributions


def _opt(name: str, *args, **kwargs):
    """An option spelled as in the seed (``--dataset_file``) and with dashes (``--dataset-file``).

    A flag also takes the seed's explicit values (``--resume=True``, ``--verbose=false``).
    """
    names = [f"--{name}"]
    if "_" in name:
        names.append(f"--{name.replace('_', '-')}")
    if kwargs.pop("is_flag", False):
        kwargs.update(is_flag=False, flag_value=True, default=False, type=click.BOOL, metavar="[true|false]")
    return click.option(*names, *args, name, **kwargs)


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
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("hermes_batch")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    root.propagate = False
    logging.getLogger("hermes_batch.progress").setLevel(logging.INFO)


@click.command("run", cls=_RunCommand, context_settings={"show_default": True})
@_opt("dataset_file", type=click.Path(path_type=Path, dir_okay=True), required=True, help="JSONL file of prompts.")
@_opt("batch_size", type=int, required=True, help="Prompts per batch file and checkpoint unit.")
@_opt("run_name", required=True, help="Name of the run folder and checkpoint identity.")
@_opt("distribution", default="default", help="Toolset distribution to sample from.")
@_opt("distribution_file", type=click.Path(path_type=Path, dir_okay=False), is_eager=True, help="TOML or JSON file of more distributions.")
@_opt("model", default=DEFAULT_MODEL, help="Model name sent to the endpoint.")
@_opt("base_url", default=DEFAULT_BASE_URL, help="API base URL.")
@_opt("api_key", default=None, help="API key [default: ANTHROPIC_API_KEY for Anthropic, else OPENROUTER_API_KEY or OPENAI_API_KEY].", show_default=False)
@_opt("max_turns", type=int, default=10, help="Most model calls per prompt.")
@_opt("max_tool_calls_per_turn", type=int, default=20, help="Tool calls of one model reply that are run; the rest are answered with an error result.")
@_opt("num_workers", type=int, default=4, help="Prompts processed at the same time.")
@_opt("resume", is_flag=True, help="Continue the run from its outputs.")
@_opt("overwrite", is_flag=True, help="Delete the run folder's outputs and start afresh.")
@_opt("verbose", is_flag=True, help="Log each prompt's turns and tool calls.")
@_opt("max_samples", type=int, default=None, help="Only the first N prompts of the dataset.")
@_opt("max_tokens", type=int, default=None, help="Most tokens per model response.")
@_opt("providers_allowed", default=None, help="OpenRouter providers to allow, comma-separated.")
@_opt("providers_ignored", default=None, help="OpenRouter providers to ignore, comma-separated.")
@_opt("providers_order", default=None, help="OpenRouter providers to try in order, comma-separated.")
@_opt("provider_sort", type=click.Choice(PROVIDER_SORTS), default=None, help="Sort OpenRouter providers by this.")
@_opt("reasoning_effort", type=click.Choice(REASONING_EFFORTS), default=None, help="Reasoning effort.")
@_opt("reasoning_disabled", is_flag=True, help="Turn reasoning/thinking off entirely.")
@_opt("ephemeral_system_prompt", default=None, help="System prompt used while running, never saved.")
@_opt("log_prefix_chars", type=int, default=100, help="Characters of tool calls/results shown in logs.")
@_opt("prefill_messages_file", type=click.Path(path_type=Path, dir_okay=False), default=None, help="JSON list of {role, content} few-shot messages.")
@_opt("skip_invalid", is_flag=True, help="Skip invalid dataset lines instead of stopping.")
@_opt("sandbox", default="local", help="Sandbox backend.")
@click.option("-S", "--sandbox_option", "--sandbox-option", "sandbox_option", multiple=True, metavar="KEY=VALUE", help="Sandbox backend option (repeatable).")
@click.option("--filter", "filter_", multiple=True, metavar="NAME", help="Quality filter, in order (repeatable) [default: no-reasoning, hallucinated-tools].")
@_opt("no_filters", is_flag=True, help="Turn all quality filters off.")
@click.option("--writer", "writer", multiple=True, metavar="NAME", help="Output writer (repeatable) [default: jsonl].")
@_opt("model_client", default=None, help="Model client [default: chosen from --base_url].")
@_opt("executor", default="local", help="Executor.")
@click.option("-E", "--executor_option", "--executor-option", "executor_option", multiple=True, metavar="KEY=VALUE", help="Executor option (repeatable).")
@click.option("-T", "--tool_option", "--tool-option", "tool_option", multiple=True, metavar="TOOLSET.KEY=VALUE", help="Toolset option (repeatable), e.g. -T web.provider=searxng; secrets by environment variable name only (-T web.api_key_env=BRAVE_API_KEY).")
@_opt("seed", type=int, default=None, help="Seed for toolset sampling [default: random, recorded in run.json].")
@_opt("output_dir", type=click.Path(path_type=Path, file_okay=False), default=Path("data"), help="Parent folder of the run folder.")
@_opt("command_timeout", type=float, default=180.0, help="Longest a tool command may run, in seconds.")
@_opt("max_retries", type=int, default=6, help="Retries of a failing model call (429, 5xx, timeouts, dropped connections) before its prompt fails.")
@_opt("request_timeout", type=float, default=600.0, help="Longest one model request may take, in seconds, before it is retried.")
@_opt("prompt_timeout", type=float, default=None, help="Wall-clock limit of one prompt's whole session, in seconds; a prompt cut by it is saved as partial [default: none].")
@_opt("max_concurrent_requests", type=int, default=None, help="Model calls in flight at the start; shrinks on 429 and grows back [default: --num_workers].")
@_opt("max_requests_per_minute", type=float, default=None, help="Budget of model requests per minute [default: none].")
@_opt("max_tokens_per_minute", type=float, default=None, help="Budget of prompt + completion tokens per minute [default: none].")
@_opt("max_cost", type=float, default=None, help="Stop starting new prompts once the run's reported cost (USD, across resumes) reaches this [default: none].")
@_opt("http_backend", type=click.Choice(HTTP_BACKENDS), default="aiohttp", help="HTTP transport of the model SDKs; httpx for a SOCKS proxy or a proxy/TLS setup aiohttp does not handle.")
@_opt("no_preflight", is_flag=True, help="Skip the one minimal request that checks endpoint, key and model before the run.")
@click.option("--progress/--no-progress", default=None, help="Live progress display [default: when stderr is a terminal].")
@_opt("list_distributions", is_flag=True, is_eager=True, expose_value=False, callback=_list_distributions, help="Print the distributions and exit.")
def run_command(**options):
    """Run the agent over every prompt of a dataset."""
    verbose = options["verbose"]
    _setup_logging(verbose)
    if options["no_filters"] and options["filter_"]:
        raise click.UsageError("--no_filters and --filter contradict each other; pass one of them.")
    api_key = resolve_api_key(options["api_key"], options["base_url"], model_client=options["model_client"])
    require_api_key(api_key, options["base_url"], options["model_client"])
    config = RunConfig(
        dataset_file=options["dataset_file"],
        batch_size=options["batch_size"],
        run_name=options["run_name"],
        distribution=options["distribution"],
        distribution_file=options["distribution_file"],
        model=options["model"],
        base_url=options["base_url"],
        api_key=api_key,
        max_turns=options["max_turns"],
        max_tool_calls_per_turn=options["max_tool_calls_per_turn"],
        num_workers=options["num_workers"],
        resume=options["resume"],
        overwrite=options["overwrite"],
        verbose=verbose,
        max_samples=options["max_samples"],
        max_tokens=options["max_tokens"],
        providers_allowed=split_list(options["providers_allowed"]),
        providers_ignored=split_list(options["providers_ignored"]),
        providers_order=split_list(options["providers_order"]),
        provider_sort=options["provider_sort"],
        reasoning_effort=options["reasoning_effort"],
        reasoning_disabled=options["reasoning_disabled"],
        ephemeral_system_prompt=options["ephemeral_system_prompt"],
        log_prefix_chars=options["log_prefix_chars"],
        prefill_messages_file=options["prefill_messages_file"],
        skip_invalid=options["skip_invalid"],
        sandbox=options["sandbox"],
        sandbox_options=parse_key_values(options["sandbox_option"], "-S/--sandbox_option"),
        filters=() if options["no_filters"] else (tuple(options["filter_"]) or None),
        writers=tuple(options["writer"]) or ("jsonl",),
        model_client=options["model_client"],
        executor=options["executor"],
        executor_options=parse_key_values(options["executor_option"], "-E/--executor_option"),
        tool_options=parse_tool_options(options["tool_option"]),
        seed=options["seed"],
        output_dir=options["output_dir"],
        command_timeout=options["command_timeout"],
        max_retries=options["max_retries"],
        progress=options["progress"],
        request_timeout=options["request_timeout"],
        prompt_timeout=options["prompt_timeout"],
        max_concurrent_requests=options["max_concurrent_requests"],
        max_requests_per_minute=options["max_requests_per_minute"],
        max_tokens_per_minute=options["max_tokens_per_minute"],
        max_cost=options["max_cost"],
        preflight=not options["no_preflight"],
        http_backend=options["http_backend"],
    )
    sys.exit(execute(config))


def execute(config: RunConfig) -> int:
    """Prepare (all checks before any model call), run, print the statistics; return the exit status."""
    from ..process_guard import protect
    from ..redaction import redact_logging, run_secrets
    from ..runner import Run
    from . import plugin_manager

    run = Run(config, plugin_manager())
    protect(run_secrets(config))
    redact_logging(run.redactor)
    try:
        return _execute(run)
    except HermesBatchError as exc:
        if run.redactor.found(str(exc)):
            exc.args = (run.redactor.text(str(exc)),) + exc.args[1:]
        raise


def _execute(run) -> int:
    from rich.console import Console

    from ..runner import render

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
    if result.exit_code == 130 and received and received[0] == signal.SIGTERM:
        result = attrs.evolve(result, exit_code=128 + signal.SIGTERM)
    if result.statistics is not None:
        render(result.statistics, Console(stderr=True))
    if result.message:
        stopped = result.exit_code not in (0, 3, 130, 128 + signal.SIGTERM)  # 2 and 74: the run could not go on
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
