"""What a resume takes from run.json, and which changed options it refuses.

Every option of ``hermes-batch run`` is in exactly one class (a test checks it):

* ``MEANING``: options that change what the data means (the model, its
  endpoint and settings, the toolsets offered and how, the sandbox, the
  filters, the turn limits, the prompts around the row).  A resume that gives
  another value than the run's is refused, naming both, unless
  ``--allow_changed_settings`` is given; run.json then keeps each session's
  settings (``settings_history``).
* ``RUN``: options that change only how the run goes (workers, batches, limits,
  timeouts, budgets, the executor, logging).  They may change on any resume.
* ``COMMAND``: what says which run folder and what to do with it.  Never taken
  from run.json.

On a resume every ``MEANING`` and ``RUN`` option not given on the command line
is taken from run.json (``inherit``), so ``--resume`` alone continues the run
as it was started.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
import typing
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import attrs

from .config import RunConfig
from ..errors import UsageError
from ..formats.redaction import REDACTED
from ..folder.runfolder import RunFolder

log = logging.getLogger("hermes_batch.run")

MEANING = frozenset({
    "distribution", "distribution_file", "model", "base_url", "model_client", "max_turns",
    "max_tool_calls_per_turn", "max_tokens", "reasoning_effort", "reasoning_disabled", "ephemeral_system_prompt",
    "prefill_messages_file", "sandbox", "sandbox_options", "filters", "tool_options", "seed",
    "verifiers", "min_reward",
    # sampling: what a sample is drawn from (pass@k, DPO pairs)
    "temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty", "extra_body",
    "toolsets_per_sample",
    "branch_at", "branches",  # a branch continues its row's prefix: another turn or count is another dataset
})
RUN = frozenset({
    "dataset_file", "batch_size", "num_workers", "verbose", "max_samples", "providers_allowed",
    "providers_ignored", "providers_order", "provider_sort", "log_prefix_chars", "skip_invalid", "writers",
    "executor", "executor_options", "command_timeout", "max_retries", "progress", "request_timeout",
    "prompt_timeout", "max_concurrent_requests", "max_requests_per_minute", "max_tokens_per_minute", "max_cost",
    "preflight", "http_backend", "samples_per_prompt", "stop_on_success", "response_cache",
    "routing", "provider_guard",
    "logprobs", "top_logprobs",  # what is kept beside the records, not what a sample is
    "allocation", "target_passes", "max_failures",
})
# how the model calls travel (docs/batch-api.md), not what they ask
RUN |= {"batch_api", "batch_api_max_requests", "batch_api_max_wait", "batch_api_poll_interval"}
# --pilot is one session's: the --resume after it runs the rest of the rows; --tasks makes the dataset_file
# that run.json keeps
COMMAND = frozenset({"run_name", "output_dir", "resume", "overwrite", "allow_changed_settings", "api_key",
                     "pilot", "pilot_by", "tasks"})
NEVER_SAVED = frozenset({"api_key", "ephemeral_system_prompt"})  # run.json keeps a digest of the prompt only

HISTORY = "settings_history"
# Options whose default is not what the versions before them did: a run folder of such a version resumes as it ran.
BEFORE_THE_OPTION = {"toolsets_per_sample": True}  # each sample drew its toolsets from its own key


def read_run_json(folder: RunFolder) -> dict:
    """run.json as a dict ({} when missing or unreadable); a committed refilter's, when one awaits its switch."""
    from ..folder.unfinished import PLAN, STAGING

    path = folder.run_json
    staged = folder.dir / STAGING / "run.json"
    if (folder.dir / STAGING / PLAN).exists() and staged.exists():
        path = staged  # the next start finishes that refilter before anything reads the records
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# --- the run folder a resume continues --------------------------------------------------------------


def require_run_folder(config: RunConfig) -> None:
    """A resume needs its run folder: without one it would run, and pay for, every prompt again.

    Raises UsageError naming the closest run folders of --output_dir (a misspelled --run_name).
    """
    folder = RunFolder(config.output_dir, config.run_name)
    if folder.dir.is_dir():
        return
    runs = _run_folders(Path(config.output_dir))
    close = difflib.get_close_matches(config.run_name, runs, n=3, cutoff=0.6)
    if close:
        hint = f"the closest run folders there are {', '.join(close)}"
    elif runs:
        shown = ", ".join(runs[:5]) + (", ..." if len(runs) > 5 else "")
        hint = f"the run folders there are {shown}"
    else:
        hint = f"{config.output_dir} holds no run folder"
    raise UsageError(
        f"There is no run folder {folder.dir} to resume, so --resume would pay for every prompt again; {hint}. "
        "Check --run_name and --output_dir, or leave out --resume to start a new run."
    )


def _run_folders(output_dir: Path) -> list:
    """The names of the folders of ``output_dir`` that hold a run (its run.json or checkpoint.json)."""
    try:
        entries = sorted(os.scandir(output_dir), key=lambda entry: entry.name)
    except OSError:
        return []
    names = []
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False) and any(
                    os.path.isfile(os.path.join(entry.path, name)) for name in ("run.json", "checkpoint.json")):
                names.append(entry.name)
        except OSError:
            continue
    return names


def require_dataset(config: RunConfig) -> None:
    """After ``inherit``: a resume whose run.json did not give --dataset_file and --batch_size asks for them."""
    missing = [f"--{name}" for name in ("dataset_file", "batch_size") if getattr(config, name) is None]
    if missing:
        raise UsageError(
            f"The run folder {RunFolder(config.output_dir, config.run_name).dir} has no run.json to take "
            f"{' and '.join(missing)} from (its first session stopped before writing one); pass "
            f"{' and '.join(missing)} with --resume."
        )


# --- taking the options not given from run.json ----------------------------------------------------


def _from_json(name: str, value: Any) -> Any:
    """A value as run.json holds it -> the field's Python value."""
    hint = typing.get_type_hints(RunConfig)[name]
    if value is None:
        return None
    if Path in (hint, *typing.get_args(hint)):
        return Path(value)
    if isinstance(value, list):
        return tuple(value)
    return value


def _holds_redacted(value: Any) -> bool:
    if isinstance(value, str):
        return REDACTED in value
    if isinstance(value, Mapping):
        return any(_holds_redacted(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_redacted(v) for v in value)
    return False


def inherit(config: RunConfig, given: Iterable[str]) -> RunConfig:
    """``config`` (a resume) with every option not in ``given`` taken from the run's run.json, where it has one."""
    run_json = read_run_json(RunFolder(config.output_dir, config.run_name))
    recorded = run_json.get("config")
    if not isinstance(recorded, dict):
        return config  # a folder of a run killed before it wrote run.json, or not a run folder at all
    given = set(given)
    names = {f.name for f in attrs.fields(RunConfig)}
    taken = {}
    for name in sorted((MEANING | RUN) - NEVER_SAVED - given):
        if name not in recorded and name in BEFORE_THE_OPTION:
            taken[name] = BEFORE_THE_OPTION[name]  # the run folder's version did what the option now asks for
            continue
        if name not in recorded or name not in names:
            continue  # an option newer than the run folder: its default
        value = recorded[name]
        if name == "filters" and value is None:
            # the defaults of the version that ran it (filters were added to them since): as run.json resolved them
            last = recorded_settings(run_json) or {}
            if isinstance(last.get("filters"), list) and all(isinstance(f, str) for f in last["filters"]):
                taken[name] = tuple(last["filters"])
                continue
        if _holds_redacted(value):
            raise UsageError(
                f"run.json does not keep the secret part of --{name} of this run; pass --{name} again with --resume."
            )
        taken[name] = _from_json(name, value)
    try:
        config = attrs.evolve(config, **taken)
    except UsageError as exc:
        raise UsageError(f"{exc} (taken from run.json; pass the option to override it)") from None
    if taken.get("max_samples") is not None:
        log.warning(
            "--max_samples %d is the run's (run.json): the resume runs the first %d prompts only; pass "
            "--max_samples all for the whole dataset.", config.max_samples, config.max_samples,
        )
    return config


# --- what a session's settings are, and how they compare -------------------------------------------


def digest(text: Optional[str]) -> Optional[str]:
    """A short hash of a text the run must not keep (the ephemeral system prompt), to notice that it changed."""
    if text is None:
        return None
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def settings(plan) -> dict:
    """The ``MEANING`` settings of a planned session, as run.json keeps them and a resume compares them.

    Defaults are resolved (the filters a run applies, the model client chosen
    from the URL), files are their content's digest, the distribution its
    probabilities, and the ephemeral system prompt its digest; ``toolsets`` are
    those of the distribution this machine can offer (installed and configured).
    """
    from ..formats.serialization import record_converter

    config = plan.config
    public = config.public()
    out = {name: public[name] for name in sorted(MEANING - NEVER_SAVED - {"distribution_file", "prefill_messages_file"})}
    out["seed"] = plan.seed
    out["filters"] = list(plan.filters)
    out["model_client"] = plan.model_client
    out["distribution_probabilities"] = dict(plan.distribution.probabilities)
    prefill = [record_converter.unstructure(m) for m in plan.agent.prefill]
    out["prefill_messages"] = digest(json.dumps(prefill, sort_keys=True)) if prefill else None
    out["ephemeral_system_prompt"] = digest(config.ephemeral_system_prompt)
    # what this machine can offer: a plugin installed, Chromium or a provider's key changes the prompts' tools
    out["toolsets"] = sorted(plan.toolsets)
    return _json(out)


# how each setting is named to the user
_OPTION = {
    "distribution_probabilities": "--distribution (its toolset probabilities)",
    "prefill_messages": "--prefill_messages_file (its messages)",
    "filters": "--filter",
    "verifiers": "--verifier",
    "sandbox_options": "-S/--sandbox_option",
    "tool_options": "-T/--tool_option",
    "toolsets": "the toolsets this machine can offer (installed plugins, Chromium, -T providers and keys)",
}
_SECRET_TEXT = ("ephemeral_system_prompt", "prefill_messages")  # shown as given or not, never as a digest


def _shown(name: str, value: Any) -> str:
    if name in _SECRET_TEXT:
        return "another text" if value else "not given"
    if value is None:
        return "not given"
    return json.dumps(value, ensure_ascii=False)


def changes(before: Mapping, now: Mapping) -> dict:
    """name -> (before, now) for every setting recorded ``before`` that differs ``now``."""
    return {name: (before[name], now.get(name)) for name in sorted(before) if name in now and before[name] != now[name]}


def describe(changed: Mapping) -> str:
    """``--model was "a", now "b"; ...``."""
    parts = []
    for name, (old, new) in changed.items():
        option = _OPTION.get(name, f"--{name}")
        if name in _SECRET_TEXT:
            parts.append(f"{option} was {'given' if old else 'not given'} and is {_shown(name, new)} now")
        else:
            parts.append(f"{option} was {_shown(name, old)} and is {_shown(name, new)} now")
    return "; ".join(parts)


def recorded_settings(run_json: Mapping) -> Optional[dict]:
    """The settings of the run's last session, as run.json recorded them (None: a run.json without them)."""
    history = run_json.get(HISTORY)
    if isinstance(history, list) and history and isinstance(history[-1], Mapping):
        recorded = history[-1].get("settings")
        if isinstance(recorded, Mapping):
            return dict(recorded)
    config = run_json.get("config")
    if not isinstance(config, Mapping):
        return None
    # a run.json of a version before the history: its configuration, and what it tells of the rest
    from .selection import filter_specs

    out = {name: config[name] for name in MEANING - NEVER_SAVED - {"distribution_file", "prefill_messages_file",
                                                                    "filters", "model_client"} if name in config}
    if "filters" in config:
        filters = config["filters"]
        out["filters"] = list(filter_specs(tuple(filters) if isinstance(filters, list) else None))
    distribution = run_json.get("distribution")
    if isinstance(distribution, Mapping) and isinstance(distribution.get("probabilities"), Mapping):
        out["distribution_probabilities"] = dict(distribution["probabilities"])
    if isinstance(run_json.get("model_client"), str):
        out["model_client"] = run_json["model_client"]
    return _json(out)


def check_resume(plan, folder: RunFolder, session: int) -> list:
    """The settings history run.json is to keep for this session; refuses changed ``MEANING`` settings.

    A resume whose settings differ from those of the run's last session raises
    UsageError naming each old and new value, unless --allow_changed_settings
    is given: then the history gains this session's settings.
    """
    now = settings(plan)
    run_json = read_run_json(folder) if plan.config.resume else {}
    history = run_json.get(HISTORY)
    history = [entry for entry in history if isinstance(entry, Mapping)] if isinstance(history, list) else []
    before = recorded_settings(run_json) if run_json else None
    if before is None:  # the first session, or a folder whose run.json is gone
        return [{"session": session, "settings": now}]
    if not history:  # a run.json of an earlier version: its settings open the history
        history = [{"session": 0, "settings": before}]
    changed = changes(before, now)
    if not changed:
        return history
    if not plan.config.allow_changed_settings:
        how = "leave those options out to continue the run as it was"
        if "toolsets" in changed:  # no option of this command changed them: the machine did
            how = "give this machine the toolsets the run had" + (" and leave the other options out"
                                                                   if len(changed) > 1 else "")
        raise UsageError(
            f"This resume changes settings that change what the run's data means: {describe(changed)}; {how}, "
            "or pass --allow_changed_settings to change them (run.json keeps each session's settings and every "
            "record names its model)."
        )
    log.warning(
        "Settings that change what the data means differ from the earlier sessions (%s); allowed by "
        "--allow_changed_settings: run.json keeps each session's settings.", describe(changed),
    )
    return history + [{"session": session, "settings": now}]


def distinct(history: Iterable[Mapping], name: str) -> list:
    """The distinct values of one setting over a settings history, in the order they first appear."""
    seen = []
    for entry in history:
        value = (entry.get("settings") or {}).get(name) if isinstance(entry, Mapping) else None
        if isinstance(value, str) and value not in seen:
            seen.append(value)
    return seen



def with_filters(data: dict, specs) -> dict:
    """run.json ``data`` saying the run's records are judged by ``specs`` (a refilter's per-sample filters)."""
    data = json.loads(json.dumps(data))
    specs = list(specs)
    if isinstance(data.get("config"), dict):
        data["config"]["filters"] = specs
    before = recorded_settings(data)
    if before is not None and before.get("filters") != specs:
        history = [entry for entry in data.get(HISTORY) or () if isinstance(entry, Mapping)] or [
            {"session": 0, "settings": before}]
        history.append({"session": None, "refilter": True, "settings": {**before, "filters": specs}})
        data[HISTORY] = history
    return data
