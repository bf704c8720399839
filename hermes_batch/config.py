"""The configuration of one run, as given on the command line."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

import attrs

from .errors import UsageError
from .jsonguard import has_lone_surrogate

DEFAULT_MODEL = "anthropic/claude-sonnet-4.6"
DEFAULT_BASE_URL = "https://openrouter.ai/api/v1"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
PROVIDER_SORTS = ("price", "throughput", "latency")
HTTP_BACKENDS = ("aiohttp", "httpx")


@attrs.frozen
class RunConfig:
    """Every option of ``hermes-batch run``; ``api_key`` and ``ephemeral_system_prompt`` are never written anywhere."""

    dataset_file: Path
    batch_size: int
    run_name: str
    distribution: str = "default"
    distribution_file: Optional[Path] = None
    model: str = DEFAULT_MODEL
    base_url: str = DEFAULT_BASE_URL
    api_key: Optional[str] = attrs.field(default=None, repr=False)
    max_turns: int = 10
    num_workers: int = 4
    resume: bool = False
    overwrite: bool = False
    verbose: bool = False
    max_samples: Optional[int] = None
    max_tokens: Optional[int] = None
    providers_allowed: tuple = ()
    providers_ignored: tuple = ()
    providers_order: tuple = ()
    provider_sort: Optional[str] = None
    reasoning_effort: Optional[str] = None
    reasoning_disabled: bool = False
    ephemeral_system_prompt: Optional[str] = None
    log_prefix_chars: int = 100
    prefill_messages_file: Optional[Path] = None
    skip_invalid: bool = False
    sandbox: str = "local"
    sandbox_options: dict = attrs.field(factory=dict)
    filters: Optional[tuple] = None  # None: the default filters
    writers: tuple = ("jsonl",)
    model_client: Optional[str] = None  # None: chosen from base_url
    executor: str = "local"
    executor_options: dict = attrs.field(factory=dict)
    tool_options: dict = attrs.field(factory=dict)  # toolset -> {key: value}; secrets only as variable names
    seed: Optional[int] = None
    output_dir: Path = Path("data")
    command_timeout: float = 180.0
    max_retries: int = 6  # retries of one failing model call before its prompt fails
    progress: Optional[bool] = None  # None: live display when stderr is a terminal
    request_timeout: float = 600.0  # longest one model request may take
    prompt_timeout: Optional[float] = None  # wall-clock limit of one prompt's session
    max_tool_calls_per_turn: int = 20  # tool calls of one model reply that are run; the rest get an error result
    max_concurrent_requests: Optional[int] = None  # None: --num_workers
    max_requests_per_minute: Optional[float] = None
    max_tokens_per_minute: Optional[float] = None
    max_cost: Optional[float] = None  # USD; stop starting prompts once the run's reported cost reaches it
    preflight: bool = True
    http_backend: str = "aiohttp"  # the model SDKs' HTTP transport (HTTP_BACKENDS)

    def __attrs_post_init__(self):
        for field in attrs.fields(RunConfig):
            value = getattr(self, field.name)
            # NaN passes every comparison below and inf is no limit at all: refused for every float option
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(f"--{field.name} must be a finite number, got {value}.")
            # bytes that are not UTF-8 in argv arrive as lone surrogates, which no request or file can carry
            texts = value if isinstance(value, tuple) else (value,)
            if any(isinstance(text, str) and has_lone_surrogate(text) for text in texts):
                raise UsageError(f"--{field.name} holds bytes that are not UTF-8 text; pass it as UTF-8.")
        for name in ("batch_size", "max_turns", "num_workers", "max_tool_calls_per_turn"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name} must be at least 1, got {getattr(self, name)}.")
        if self.max_samples is not None and self.max_samples < 1:
            raise UsageError(f"--max_samples must be at least 1, got {self.max_samples}.")
        if self.max_retries < 0:
            raise UsageError(f"--max_retries must be 0 or more, got {self.max_retries}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UsageError(f"--max_tokens must be at least 1, got {self.max_tokens}.")
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise UsageError(f"--reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}.")
        if self.provider_sort is not None and self.provider_sort not in PROVIDER_SORTS:
            raise UsageError(f"--provider_sort must be one of {', '.join(PROVIDER_SORTS)}.")
        if self.http_backend not in HTTP_BACKENDS:
            raise UsageError(f"--http_backend must be one of {', '.join(HTTP_BACKENDS)}.")
        if self.resume and self.overwrite:
            raise UsageError("--resume and --overwrite contradict each other; pass one of them.")
        for name in (
            "command_timeout", "request_timeout", "prompt_timeout", "max_requests_per_minute", "max_tokens_per_minute",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UsageError(f"--{name} must be more than 0, got {value:g}.")
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise UsageError(f"--max_concurrent_requests must be at least 1, got {self.max_concurrent_requests}.")
        if self.max_cost is not None and self.max_cost < 0:
            raise UsageError(f"--max_cost must be 0 or more, got {self.max_cost:g}.")

    def public(self) -> dict:
        """The configuration as saved in run.json: no API key, no ephemeral prompt, no credentials in URLs or options."""
        from .redaction import display_url, public_options

        never = ("api_key", "ephemeral_system_prompt")
        data = attrs.asdict(self, filter=lambda a, _v: a.name not in never, recurse=False)
        data["base_url"] = display_url(self.base_url)
        return {
            k: (str(v) if isinstance(v, Path) else public_options(v) if isinstance(v, dict) else v)
            for k, v in data.items()
        }


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


def split_list(value: Optional[str]) -> tuple:
    """``"a, b,c"`` -> ``("a", "b", "c")``."""
    if not value:
        return ()
    return tuple(item.strip() for item in value.split(",") if item.strip())
