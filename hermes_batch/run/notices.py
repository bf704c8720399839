"""What a run says once before its first prompt: options or rows it will not use, lines it skips."""

from __future__ import annotations

import json
import logging

import attrs

from ..formats import dataset
from ..model.model_http import sends_routing
from ..formats.jsonguard import scrub_text
from ..folder.runfolder import RunFolder
from ..folder.durable import atomic_write_lines

log = logging.getLogger("hermes_batch.run")
# The start banner: said on every run (the command line sets it to INFO), not only under --verbose.
banner_log = logging.getLogger("hermes_batch.run.start")

SKIPPED_LINES = "skipped_lines.txt"  # every line --skip_invalid skipped, as FILE:LINE: reason
SKIPPED_SHOWN = 10  # of them in the log
ROUTING_OPTIONS = ("providers_allowed", "providers_ignored", "providers_order", "provider_sort")


def start_banner(plan, installed_toolsets, to_run: int, finished: int, concurrency: int, sandbox) -> None:
    """What the run is about to do, said once before its first prompt: the prompts, the model, the toolsets it
    offers (and those of its distribution it cannot), the filters in force, the sandbox.

    Toolsets the distribution names and this machine cannot offer are warned about only when the user asked for
    them by name (a distribution other than ``default``, or a ``-T`` option); the ``default`` distribution names
    every toolset, so on most machines some are missing, and the banner's toolset line says which.
    """
    from ..formats.redaction import display_url
    from .config import RunConfig
    from .distributions import unavailable_toolsets, unavailable_warning, where_to_get
    from .selection import DEFAULT_FILTERS

    config = plan.config
    done = f" ({finished} finished before)" if finished else ""
    banner_log.info(
        "Run %s: %d prompt(s) to run%s, %d at once; model %s at %s (%s client)",
        config.run_name, to_run, done, concurrency, config.model, display_url(config.base_url), plan.model_client,
    )
    missing = unavailable_toolsets(plan.distribution, installed_toolsets)
    offered = [name for name, _p in plan.distribution.probabilities if name in plan.toolsets]
    line = f"Toolsets of distribution {plan.distribution.name}: {', '.join(offered)}"
    if missing:
        line += f"; not installed: {', '.join(missing)} ({where_to_get(missing)})"
    if plan.unconfigured:
        line += (f"; not configured here: {', '.join(plan.unconfigured)} (--verbose says what each needs, "
                 "docs/sandboxes.md how to give it)")
    banner_log.info("%s", line)
    banner_log.info("Filters: %s", _filters_line(config.filters, plan.filters, DEFAULT_FILTERS))
    sampling = plan.model.sampling()
    if sampling:
        banner_log.info("Sampling: %s", ", ".join(f"{k} {json.dumps(v)}" for k, v in sampling.items()))
    if plan.verifiers:
        banner_log.info("Verifiers: %s; %d sample(s) a row", ", ".join(plan.verifiers), config.per_row)
    banner_log.info("Sandbox: %s (isolation %s); executor %s", sandbox.name, sandbox.isolation or "unknown",
                    plan.executor)

    named = set(config.tool_options)  # toolsets the user configured by name
    chosen = config.distribution != attrs.fields(RunConfig).distribution.default  # a distribution chosen by name
    if chosen:
        warning = unavailable_warning(plan.distribution, installed_toolsets)
        if warning:
            log.warning("%s", warning)
    for name, reason in plan.unconfigured.items():
        if chosen or name in named:
            log.warning("Toolset %s is left out of sampling: %s", name, reason)
        else:
            log.info("Toolset %s is left out of sampling: %s", name, reason)
    if not chosen and missing:
        log.info("%s", unavailable_warning(plan.distribution, installed_toolsets))


def _filters_line(given, specs, defaults) -> str:
    if given is None:
        return f"{', '.join(specs)} (the defaults; a --filter replaces them, see docs/options.md)"
    if not specs:
        return "none (--no_filters)"
    off = [name for name in defaults if name not in {spec.split(":", 1)[0] for spec in specs}]
    if not off:
        return ", ".join(specs)
    which = f"filters {', '.join(off)} are" if len(off) > 1 else f"filter {off[0]} is"
    return (f"{', '.join(specs)}; the default {which} off, as --filter replaces the defaults "
            f"(add {' '.join(f'--filter {name}' for name in off)} to keep {'them' if len(off) > 1 else 'it'})")


def routing_elsewhere(config) -> None:
    """OpenRouter's provider routing given for another endpoint: it is not sent, say so."""
    given = [f"--{name}" for name in ROUTING_OPTIONS if getattr(config, name)]
    if given and not sends_routing(config):
        why = ("--routing none keeps them back" if config.routing == "none" else
               f"{config.base_url} is not OpenRouter (pass --routing openrouter if it speaks OpenRouter's routing)")
        log.warning("%s route requests between OpenRouter's providers; %s, so they are not sent.", ", ".join(given), why)


def ignored_images(report, backend_cls, dataset_file) -> None:
    """Rows name container images but the sandbox backend runs none."""
    if report.images and backend_cls.ignores_images:
        shown = ", ".join(report.images[:3]) + (", ..." if len(report.images) > 3 else "")
        log.warning(
            "Rows of %s name container images (%s), which the %s sandbox ignores: every prompt runs on this "
            "machine; pass --sandbox docker (or another container backend) to run each in its image.",
            dataset_file, shown, backend_cls.name,
        )


def skipped_lines(report, folder: RunFolder, dataset_file, max_samples) -> None:
    """--skip_invalid: the first skipped lines in the log, every one in skipped_lines.txt of the run folder."""
    if not report.invalid:
        return
    if len(report.problems) == report.invalid:
        problems = report.problems
    else:  # the report keeps the first ones only
        problems = dataset.iter_problems(dataset_file, max_samples=max_samples)
    path = folder.dir / SKIPPED_LINES
    # scrubbed: a dataset file name that is not UTF-8 holds lone surrogates, which no UTF-8 file can
    atomic_write_lines(path, (scrub_text(f"{problem}\n") for problem in problems))
    shown = report.problems[:SKIPPED_SHOWN]
    more = f"\n  ... and {report.invalid - len(shown)} more" if report.invalid > len(shown) else ""
    log.warning(
        "Skipped %d invalid line(s) of %s (--skip_invalid); all are listed in %s:\n  %s%s",
        report.invalid, dataset_file, path, "\n  ".join(shown), more,
    )


def discarding_everything(config, filter_names) -> None:
    """Reasoning turned off while the no-reasoning filter is on: it will discard every sample, say so first."""
    off = ("--reasoning_disabled" if config.reasoning_disabled
           else "--reasoning_effort none" if config.reasoning_effort == "none" else None)
    if off and "no-reasoning" in filter_names:
        others = [name for name in filter_names if name != "no-reasoning"]
        keep = " ".join(f"--filter {name}" for name in others) if others else "--no_filters"
        log.warning(
            "%s turns reasoning off, so the no-reasoning filter will discard every sample without reasoning in its "
            "text, which is every sample of most models; pass the filters without it (%s) to keep them.", off, keep,
        )


MOSTLY = 0.5  # a filter that discards more than this share of the finished samples is worth a word


def mostly_discarded(statistics: dict, filter_names, run_dir) -> None:
    """At the end: one filter discarded most of the finished samples (a run can exit 0 having kept nothing)."""
    finished = statistics["prompts"]["finished"]
    if not finished:
        return
    for name, count in statistics["discarded_by_filter"].items():
        if name == "verified" and count < finished:
            continue  # rejection sampling: the failing samples are meant to go (dpo and rollouts still read them)
        if count > finished * MOSTLY:
            hint = ""
            if name == "verified":
                hint = " no sample passed its verifiers (see the reasons in discarded.jsonl and the pass@k table);"
            if name == "no-reasoning":
                hint = (" the model gave no reasoning (it may not be a reasoning model, or reasoning is off: "
                        "--reasoning_disabled, --reasoning_effort none);")
            others = [n for n in filter_names if n != name]
            keep = " ".join(f"--filter {n}" for n in others) if others else "--no_filters"
            log.warning(
                "The %s filter discarded %d of the %d finished samples (%.0f%%, see discarded.jsonl);%s to keep "
                "them, run `hermes-batch refilter %s %s` (no model call; later resumes keep those filters).",
                name, count, finished, 100 * count / finished, hint, run_dir, keep,
            )
