"""The configuration of one run, as given on the command line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlsplit

import attrs
import click

from ..session.agent import MAX_TOOL_CALLS_PER_TURN, MAX_TURNS, AgentSettings
from ..formats.conversation import DEFAULT_SYSTEM_PROMPT
from ..errors import UsageError
from ..contract.interfaces import COMMAND_TIMEOUT, MAX_RETRIES, REQUEST_TIMEOUT, SAMPLING_SETTINGS, ModelSettings
from ..formats.jsonguard import has_lone_surrogate
from ..model.batching import MAX_REQUESTS as MAX_BATCH_REQUESTS, MAX_WAIT_S as MAX_BATCH_WAIT_S
from ..model.batching import POLL_INTERVAL_S as BATCH_POLL_INTERVAL_S
from ..model.model_http import HTTP_BACKENDS, ROUTINGS
from .options import Cli, at_least, at_most, finite, one_of, option, positive
from ..contract.run_context import LOG_PREFIX_CHARS
from ..formats.serialization import parse_key_values

DEFAULT_MODEL = "anthropic/claude-sonnet-4.6"
DEFAULT_BASE_URL = "https://openrouter.ai/api/v1"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
PROVIDER_SORTS = ("price", "throughput", "latency")
RESUME_TAKES = "required; with --resume, the run's (run.json)"
ALLOCATIONS = ("fixed", "adaptive")


class CostOrAuto(click.ParamType):
    """--max_cost: a number of USD, ``none`` (no budget: lifts the one a resume took from run.json) or ``auto``."""

    name = "float|none|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.strip().lower() in ("none", "all"):
            return None
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return click.FLOAT.convert(value, param, ctx)


def cost_or_auto(instance, attribute, value) -> None:
    """--max_cost is ``auto`` or a finite number of 0 or more."""
    if value == "auto":
        return
    if isinstance(value, str):
        raise UsageError(f"--max_cost takes a number of USD or auto, not {value!r}.")
    at_least(0)(instance, attribute, value)


def split_list(value: Optional[str], option: str = "the option") -> tuple:
    """``"a, b,c"`` or the JSON list ``'["a", "b", "c"]'`` -> ``("a", "b", "c")``; UsageError for other JSON."""
    if not value:
        return ()
    if value.lstrip().startswith(("[", '"')):
        try:
            items = json.loads(value)
        except ValueError:
            items = None
        if not isinstance(items, list) or not all(isinstance(item, str) and item.strip() for item in items):
            raise UsageError(
                f"{option} takes names separated by commas or a JSON list of names, not {value!r}; "
                'write a,b or \'["a", "b"]\'.'
            )
        return tuple(item.strip() for item in items)
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _names(option: str) -> Callable[[Optional[str]], tuple]:
    return lambda value: split_list(value, option)


def _key_values(option: str) -> Callable[[tuple], dict]:
    return lambda items: parse_key_values(items, option)


# Request fields a run sets itself: --extra_body may not send them (the options for them say what they mean).
OWN_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "stream", "max_tokens", "temperature",
                        "top_p", "top_k", "frequency_penalty", "presence_penalty", "n", "logprobs", "top_logprobs"})


def check_extra_body(fields: dict) -> None:
    """--extra_body may add any field but those the run sends itself."""
    taken = sorted(set(fields) & OWN_FIELDS)
    if taken:
        named = [name for name in taken if name in SAMPLING_SETTINGS or name == "max_tokens"]
        fix = f"pass {', '.join(f'--{name}' for name in named)} instead" if named else "leave it out"
        raise UsageError(f"--extra_body cannot set {', '.join(taken)}, which the run sends itself; {fix}.")


def _tool_options(items: tuple) -> dict:
    from ..contract.toolsets import parse_tool_options  # toolsets imports the interfaces; config stays light

    return parse_tool_options(items)


@attrs.frozen
class RunConfig:
    """Every option of ``hermes-batch run``: its default, help and validation.

    ``api_key`` and ``ephemeral_system_prompt`` are never written anywhere.

    The command's click options are made from these fields (``hermes_batch.run.options``),
    and docs/options.md is checked against them.
    """

    # required, but a resume takes them from run.json (cli/run.py checks them)
    dataset_file: Path = option(
        help="JSONL file of prompts.",
        cli=Cli(type=click.Path(path_type=Path, dir_okay=True), required=False, default_text=RESUME_TAKES))
    batch_size: int = option(
        help="Prompts per batch file and checkpoint unit.", validator=at_least(1),
        cli=Cli(required=False, default_text=RESUME_TAKES))
    run_name: str = option(help="Name of the run folder and checkpoint identity.")
    distribution: str = option("default", help="Toolset distribution to sample from.")
    tasks: Optional[Path] = option(
        None, help="A folder of Harbor task folders (or one task), run instead of --dataset_file (docs/tasks.md).",
        cli=Cli(type=click.Path(path_type=Path, file_okay=False)))
    distribution_file: Optional[Path] = option(
        None, help="TOML or JSON file of more distributions.",
        cli=Cli(type=click.Path(path_type=Path, dir_okay=False), eager=True),
    )
    model: str = option(DEFAULT_MODEL, help="Model name sent to the endpoint.")
    base_url: str = option(DEFAULT_BASE_URL, help="API base URL.")
    api_key: Optional[str] = option(
        None, repr=False, help="API key.",
        cli=Cli(default_text="ANTHROPIC_API_KEY for Anthropic, else OPENROUTER_API_KEY or OPENAI_API_KEY"),
    )
    max_turns: int = option(MAX_TURNS, help="Most model calls per prompt.", validator=at_least(1))
    num_workers: int = option(4, help="Prompts processed at the same time.", validator=at_least(1))
    resume: bool = option(False, help="Continue the run from its outputs.")
    overwrite: bool = option(False, help="Delete the run folder's outputs and start afresh.")
    allow_changed_settings: bool = option(
        False, help="Let --resume change options that change what the data means (model, endpoint, toolsets, "
        "sandbox, filters, ...); run.json keeps each session's settings.")
    verbose: bool = option(False, help="Log each prompt's turns and tool calls.")
    max_samples: Optional[int] = option(None, help="Only the first N samples: the first N prompts of the dataset, or N sessions in row order with --samples_per_prompt.", validator=at_least(1))
    max_tokens: Optional[int] = option(None, help="Most tokens per model response.", validator=at_least(1))
    providers_allowed: tuple = option(
        (), help="OpenRouter providers to allow, comma-separated.",
        cli=Cli(type=str, convert=_names("--providers_allowed")))
    providers_ignored: tuple = option(
        (), help="OpenRouter providers to ignore, comma-separated.",
        cli=Cli(type=str, convert=_names("--providers_ignored")))
    providers_order: tuple = option(
        (), help="OpenRouter providers to try in order, comma-separated.",
        cli=Cli(type=str, convert=_names("--providers_order")))
    provider_sort: Optional[str] = option(None, help="Sort OpenRouter providers by this.", validator=one_of(PROVIDER_SORTS))
    routing: str = option(
        "auto", validator=one_of(ROUTINGS),
        help="Where OpenRouter's routing fields (provider lists, the provider guard's exclusions) are sent: auto "
        "(OpenRouter's own URLs), openrouter (any --base_url: a gateway or server that speaks them), none.")
    provider_guard: bool = option(
        True, help="Turn the provider guard off: never exclude a provider whose answers fail significantly more "
        "often than the others' (docs/options.md, the provider guard).",
        cli=Cli(decls=("--no_provider_guard", "--no-provider-guard"), convert=lambda off: not off))
    reasoning_effort: Optional[str] = option(None, help="Reasoning effort.", validator=one_of(REASONING_EFFORTS))
    reasoning_disabled: bool = option(False, help="Turn reasoning/thinking off entirely.")
    # sampling: sent only when given, so the endpoint's own defaults hold otherwise
    temperature: Optional[float] = option(
        None, validator=at_least(0), cli=Cli(default_text="the endpoint's"), help="Sampling temperature.")
    top_p: Optional[float] = option(
        None, validator=[positive, at_most(1)], cli=Cli(default_text="the endpoint's"),
        help="Nucleus sampling: the smallest set of tokens whose probabilities add up to this (0 to 1).")
    top_k: Optional[int] = option(
        None, validator=at_least(1), cli=Cli(default_text="the endpoint's"),
        help="Sample among the K most likely tokens only.")
    frequency_penalty: Optional[float] = option(
        None, validator=finite, cli=Cli(default_text="the endpoint's"),
        help="Penalty on tokens by how often they appeared so far (OpenAI-compatible endpoints).")
    presence_penalty: Optional[float] = option(
        None, validator=finite, cli=Cli(default_text="the endpoint's"),
        help="Penalty on tokens that appeared at all so far (OpenAI-compatible endpoints).")
    extra_body: dict = option(
        factory=dict, validator=lambda _i, _a, value: check_extra_body(value),
        help="Any other field of the request body, sent as given (repeatable), e.g. --extra_body min_p=0.05; "
             "values are JSON when they parse as JSON.",
        cli=Cli(decls=("--extra_body", "--extra-body"), multiple=True, metavar="KEY=VALUE",
                convert=_key_values("--extra_body")),
    )
    logprobs: bool = option(
        False, help="Keep each assistant turn's token ids and logprobs beside the record (batch_N.tokens.jsonl), "
        "from endpoints that return them (vLLM, SGLang, llama.cpp's server); see docs/training-data.md.")
    top_logprobs: int = option(
        0, validator=[at_least(0), at_most(20)],
        help="With each sampled token, keep this many likeliest alternatives and their logprobs (implies --logprobs).")
    ephemeral_system_prompt: Optional[str] = option(None, help="System prompt used while running, never saved.")
    log_prefix_chars: int = option(
        LOG_PREFIX_CHARS, help="Characters of tool calls/results shown in logs.", validator=at_least(0))
    prefill_messages_file: Optional[Path] = option(
        None, help="JSON list of {role, content} few-shot messages.",
        cli=Cli(type=click.Path(path_type=Path, dir_okay=False)),
    )
    skip_invalid: bool = option(False, help="Skip invalid dataset lines instead of stopping.")
    sandbox: str = option("local", help="Sandbox backend.")
    sandbox_options: dict = option(
        factory=dict, help="Sandbox backend option (repeatable).",
        cli=Cli(decls=("-S", "--sandbox_option", "--sandbox-option"), multiple=True, metavar="KEY=VALUE",
                convert=_key_values("-S/--sandbox_option")),
    )
    filters: Optional[tuple] = option(
        None, help="Quality filter, in order (repeatable).",
        cli=Cli(decls=("--filter",), multiple=True, metavar="NAME", convert=lambda names: tuple(names) or None,
                default_text="no-reasoning, hallucinated-tools, empty-answer"),
    )  # None: the default filters; (): none (--no_filters)
    writers: tuple = option(
        ("jsonl",), help="Output writer (repeatable).",
        cli=Cli(decls=("--writer",), multiple=True, metavar="NAME", convert=lambda names: tuple(names) or ("jsonl",),
                default_text="jsonl"),
    )
    model_client: Optional[str] = option(None, help="Model client.", cli=Cli(default_text="chosen from --base_url"))
    executor: str = option("local", help="Executor.")
    executor_options: dict = option(
        factory=dict, help="Executor option (repeatable).",
        cli=Cli(decls=("-E", "--executor_option", "--executor-option"), multiple=True, metavar="KEY=VALUE",
                convert=_key_values("-E/--executor_option")),
    )
    tool_options: dict = option(
        factory=dict,
        help="Toolset option (repeatable), e.g. -T web.provider=searxng; secrets by environment variable name "
             "only (-T web.api_key_env=BRAVE_API_KEY).",
        cli=Cli(decls=("-T", "--tool_option", "--tool-option"), multiple=True, metavar="TOOLSET.KEY=VALUE",
                convert=_tool_options),
    )  # toolset -> {key: value}
    seed: Optional[int] = option(
        None, help="Seed for toolset sampling.", cli=Cli(default_text="random, recorded in run.json"))
    output_dir: Path = option(
        Path("data"), help="Parent folder of the run folder.", cli=Cli(type=click.Path(path_type=Path, file_okay=False)))
    command_timeout: float = option(COMMAND_TIMEOUT, validator=positive, help="Longest a tool command may run, in seconds.")
    max_retries: int = option(
        MAX_RETRIES, validator=at_least(0),
        help="Retries of a failing model call (429, 5xx, timeouts, dropped connections) before its prompt fails.",
    )
    progress: Optional[bool] = option(
        None, help="Live progress display.",
        cli=Cli(decls=("--progress/--no-progress",), default_text="when stderr is a terminal"),
    )
    request_timeout: float = option(
        REQUEST_TIMEOUT, validator=positive,
        help="Longest one model request may take, in seconds, before it is retried.",
    )
    prompt_timeout: Optional[float] = option(
        None, validator=positive, cli=Cli(default_text="none"),
        help="Wall-clock limit of one prompt's whole session, in seconds; a prompt cut by it is saved as partial.",
    )
    max_tool_calls_per_turn: int = option(
        MAX_TOOL_CALLS_PER_TURN, validator=at_least(1),
        help="Tool calls of one model reply that are run; the rest are answered with an error result.",
    )
    max_concurrent_requests: Optional[int] = option(
        None, validator=at_least(1), cli=Cli(default_text="--num_workers"),
        help="Model calls in flight at the start; shrinks on 429 and grows back.",
    )
    max_requests_per_minute: Optional[float] = option(
        None, validator=positive, cli=Cli(default_text="none"), help="Budget of model requests per minute.")
    max_tokens_per_minute: Optional[float] = option(
        None, validator=positive, cli=Cli(default_text="none"), help="Budget of prompt + completion tokens per minute.")
    max_cost: Optional[float | str] = option(
        None, validator=cost_or_auto, cli=Cli(type=CostOrAuto(), default_text="none"),
        help="Stop starting new prompts once the run's reported cost (USD, across resumes) reaches this; auto: the "
        "upper end of the 90% interval of the cost a --pilot forecast (forecast.json).",
    )
    preflight: bool = option(
        True, help="Skip the one minimal request that checks endpoint, key and model before the run.",
        cli=Cli(decls=("--no_preflight", "--no-preflight"), convert=lambda skip: not skip),
    )
    http_backend: str = option(
        "aiohttp", validator=one_of(HTTP_BACKENDS),
        help="How model calls are sent: aiohttp, or the SDKs' post() on httpx for a SOCKS proxy "
        "or a proxy/TLS setup aiohttp does not handle.",
    )
    verifiers: tuple = option(
        (), help="Verifier that rewards each sample after its session, in its sandbox (repeatable): command, "
        "answer, judge; see docs/verification.md.",
        cli=Cli(decls=("--verifier",), multiple=True, metavar="NAME[:OPTIONS]", convert=tuple),
    )
    samples_per_prompt: int = option(
        1, validator=at_least(1),
        help="Sessions per row, each with its own sandbox; they share the row's toolset sample.")
    toolsets_per_sample: bool = option(
        False, help="With --samples_per_prompt: draw each sample's toolsets on its own instead of the row's "
        "(its samples are then offered different tools, and pairs of them compare less).")
    stop_on_success: bool = option(
        False, help="Sample a row no further once one of its samples passed (--min_reward).")
    allocation: str = option(
        "fixed", validator=one_of(ALLOCATIONS),
        help="With --samples_per_prompt: fixed runs every row's K samples; adaptive gives samples first to the rows "
        "whose pass rate is least certain and stops a row at --target_passes passes or --max_failures failures in a row.")
    target_passes: int = option(
        1, validator=at_least(1), help="With --allocation adaptive: a row gets no more samples once this many passed.")
    max_failures: Optional[int] = option(
        None, validator=at_least(1), cli=Cli(default_text="none"),
        help="With --allocation adaptive: a row gets no more samples after this many failed in a row.")
    pilot: Optional[float] = option(
        None, validator=[positive, at_most(1)], cli=Cli(default_text="none"),
        help="Run this fraction of the rows (stratified), stop, and forecast the whole run into forecast.json; "
        "--resume goes on from the pilot's samples.")
    pilot_by: Optional[str] = option(
        None, cli=Cli(default_text="none"),
        help="With --pilot: a dataset field whose values are strata too (besides toolsets, image and task).")
    min_reward: float = option(
        1.0, validator=finite, help="The reward a verified sample needs to pass.")
    branch_at: Optional[int] = option(
        None, validator=at_least(1), cli=Cli(metavar="TURN"),
        help="Run each row's session to this many model calls once (the shared prefix), then continue --branches "
        "sessions from there, each in a copy of its sandbox (docs/training-data.md#branches-from-a-shared-prefix).")
    branches: Optional[int] = option(
        None, validator=at_least(1), cli=Cli(metavar="K"),
        help="With --branch_at: the sessions that continue each row's prefix; they are the row's samples.")
    batch_api: bool = option(
        False, help="Send the model calls as provider batches (OpenAI Batch API, Anthropic Message Batches) at "
        "batch prices; sessions wait for their batch (docs/batch-api.md).")
    batch_api_max_requests: int = option(
        MAX_BATCH_REQUESTS, validator=at_least(1), help="With --batch_api: a batch is submitted once it holds this many requests.")
    batch_api_max_wait: float = option(
        MAX_BATCH_WAIT_S, validator=positive,
        help="With --batch_api: a batch is submitted this many seconds after its first request, however full (at once "
        "when every session that may still send a request waits on one).")
    batch_api_poll_interval: float = option(
        BATCH_POLL_INTERVAL_S, validator=positive, help="With --batch_api: seconds between checks of a batch in flight.")

    response_cache: Optional[Path] = option(
        None, cli=Cli(type=click.Path(path_type=Path, file_okay=False), default_text="off"),
        help="Folder of model answers kept across runs: a request sent before, exactly, is answered from it "
        "without a call (identical requests get identical answers, whatever the temperature).",
    )

    def __attrs_post_init__(self):
        for field in attrs.fields(RunConfig):
            # bytes that are not UTF-8 in argv arrive as lone surrogates, which no request or file can carry
            value = getattr(self, field.name)
            texts = value if isinstance(value, tuple) else (value,)
            if any(isinstance(text, str) and has_lone_surrogate(text) for text in texts):
                raise UsageError(f"--{field.name} holds bytes that are not UTF-8 text; pass it as UTF-8.")
        if self.resume and self.overwrite:
            raise UsageError("--resume and --overwrite contradict each other; pass one of them.")
        if not self.resume:  # a resume takes the run's --verifier from run.json first: checked in make_plan
            self.check_verifier_needs()
        self.check_branches()
        self.check_allocation()
        if self.pilot is not None and self.max_cost == "auto":
            raise UsageError("--max_cost auto takes its budget from a pilot's forecast, which --pilot is about to "
                             "make; run the pilot first, then --resume with --max_cost auto.")
        if self.pilot_by is not None and self.pilot is None:
            raise UsageError("--pilot_by names the strata of a pilot; add --pilot FRACTION.")

    def check_branches(self) -> None:
        """--branch_at and --branches: together, below --max_turns, as the row's samples, in the driver's process."""
        if (self.branch_at is None) != (self.branches is None):
            raise UsageError("--branch_at and --branches go together; pass both, or neither.")
        if self.branch_at is None:
            return
        if self.branch_at >= self.max_turns:
            raise UsageError(f"--branch_at must be below --max_turns ({self.max_turns}), got {self.branch_at}; "
                             "the branches need turns of their own.")
        if self.samples_per_prompt != 1:
            raise UsageError("--branches K makes each row's K samples; leave --samples_per_prompt out.")
        if self.batch_api:
            raise UsageError("--branch_at cannot wait on provider batches; leave --batch_api out.")
        if self.executor != "local":
            raise UsageError(f"--branch_at runs a row's branches beside its prefix, which the {self.executor} "
                             "executor cannot; use --executor local.")

    @property
    def per_row(self) -> int:
        """The sessions of each row: its --branches, else its --samples_per_prompt."""
        return self.branches or self.samples_per_prompt

    def check_allocation(self) -> None:
        """--allocation adaptive needs several samples a row and a verifier; it replaces --stop_on_success."""
        if self.allocation != "adaptive":
            return
        if self.samples_per_prompt < 2:
            raise UsageError("--allocation adaptive shares out several samples a row; add --samples_per_prompt K "
                             "(2 or more).")
        if self.stop_on_success:
            raise UsageError("--allocation adaptive and --stop_on_success both decide when a row stops; use "
                             "--target_passes 1 instead of --stop_on_success.")
        if self.target_passes > self.samples_per_prompt:
            raise UsageError(f"--target_passes {self.target_passes} is more than the {self.samples_per_prompt} samples "
                             "a row has (--samples_per_prompt); lower it or raise --samples_per_prompt.")

    def check_verifier_needs(self) -> None:
        """Options that mean nothing without a --verifier: --stop_on_success, and --filter verified (it would
        discard every sample)."""
        if self.verifiers:
            return
        if self.allocation == "adaptive":
            raise UsageError("--allocation adaptive needs a verifier to say what passes; add --verifier NAME.")
        if self.stop_on_success:
            raise UsageError("--stop_on_success needs a verifier to say what passes; add --verifier NAME.")
        if any(str(spec).split(":", 1)[0].strip() == "verified" for spec in self.filters or ()):
            raise UsageError(
                "--filter verified keeps only samples a verifier passed, and no --verifier is given, so it would "
                "discard every sample; add --verifier NAME (see docs/verification.md) or leave the filter out."
            )

    @property
    def max_rows(self) -> Optional[int]:
        """The dataset rows the run reads: --max_samples counts samples, --samples_per_prompt of them a row."""
        if self.max_samples is None or self.per_row == 1:
            return self.max_samples
        return -(-self.max_samples // self.per_row)

    def public(self) -> dict:
        """The configuration as saved in run.json: no API key, no ephemeral prompt, no credentials in URLs or options."""
        from ..formats.redaction import display_url, public_options

        never = ("api_key", "ephemeral_system_prompt")
        data = attrs.asdict(self, filter=lambda a, _v: a.name not in never, recurse=False)
        data["base_url"] = display_url(self.base_url)
        return {
            k: (str(v) if isinstance(v, Path) else public_options(v) if isinstance(v, dict) else v)
            for k, v in data.items()
        }


def model_settings(config: RunConfig, concurrency: int) -> ModelSettings:
    """How the run reaches and drives the model; the call limit starts at --max_concurrent_requests or ``concurrency``."""
    return ModelSettings(
        model=config.model, base_url=config.base_url, api_key=config.api_key, max_tokens=config.max_tokens,
        temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
        frequency_penalty=config.frequency_penalty, presence_penalty=config.presence_penalty,
        extra_body=dict(config.extra_body),
        reasoning_effort=config.reasoning_effort, reasoning_disabled=config.reasoning_disabled,
        providers_allowed=config.providers_allowed, providers_ignored=config.providers_ignored,
        providers_order=config.providers_order, provider_sort=config.provider_sort, routing=config.routing,
        max_retries=config.max_retries,
        request_timeout=config.request_timeout,
        max_concurrent_requests=config.max_concurrent_requests or concurrency,
        max_requests_per_minute=config.max_requests_per_minute, max_tokens_per_minute=config.max_tokens_per_minute,
        http_backend=config.http_backend,
        logprobs=config.logprobs or config.top_logprobs > 0, top_logprobs=config.top_logprobs,
    )


def agent_settings(config: RunConfig, prefill: tuple) -> AgentSettings:
    """How the run's sessions go; ``prefill``: the messages of --prefill_messages_file."""
    return AgentSettings(
        max_turns=config.max_turns, system_prompt=DEFAULT_SYSTEM_PROMPT,
        ephemeral_system_prompt=config.ephemeral_system_prompt, prefill=prefill,
        command_timeout=config.command_timeout, log_prefix_chars=config.log_prefix_chars,
        prompt_timeout=config.prompt_timeout, max_tool_calls_per_turn=config.max_tool_calls_per_turn,
    )


def resolve_api_key(
    explicit: Optional[str], base_url: str, environ=os.environ, model_client: Optional[str] = None
) -> Optional[str]:
    """``--api_key``, else ANTHROPIC_API_KEY for Anthropic, OPENROUTER_API_KEY for OpenRouter URLs, else OPENAI_API_KEY."""
    if explicit:
        return explicit
    if model_client == "anthropic" or "api.anthropic.com" in base_url:
        return environ.get("ANTHROPIC_API_KEY") or None
    if "openrouter.ai" in base_url and environ.get("OPENROUTER_API_KEY"):
        return environ["OPENROUTER_API_KEY"]
    return environ.get("OPENAI_API_KEY") or None


# Hosted APIs that refuse every request without a key: their host -> the variable the key is read from.
_KEYED_HOSTS = {"openrouter.ai": "OPENROUTER_API_KEY", "api.openai.com": "OPENAI_API_KEY", "api.anthropic.com": "ANTHROPIC_API_KEY"}


def require_api_key(api_key: Optional[str], base_url: str, model_client: Optional[str] = None) -> None:
    """Raise UsageError at once when ``base_url`` is a hosted API that needs a key and none was found."""
    if api_key:
        return
    try:
        host = urlsplit(base_url).hostname or ""
    except ValueError:
        return
    variable = next((v for h, v in _KEYED_HOSTS.items() if host == h or host.endswith("." + h)), None)
    if variable is None:
        return  # a local or self-hosted endpoint may need no key
    if model_client == "anthropic":
        variable = "ANTHROPIC_API_KEY"
    raise UsageError(f"No API key for {base_url}: set {variable} or pass --api_key.")
