"""What a run says once before its first prompt: options or rows it will not use, lines it skips."""

from __future__ import annotations

import logging

from . import dataset
from .default_plugins.openai_client import is_openrouter
from .jsonguard import scrub_text
from .runfolder import RunFolder, atomic_write_lines

log = logging.getLogger("hermes_batch.run")

SKIPPED_LINES = "skipped_lines.txt"  # every line --skip_invalid skipped, as FILE:LINE: reason
SKIPPED_SHOWN = 10  # of them in the log
ROUTING_OPTIONS = ("providers_allowed", "providers_ignored", "providers_order", "provider_sort")


def routing_elsewhere(config) -> None:
    """OpenRouter's provider routing given for another endpoint: it is not sent, say so."""
    given = [f"--{name}" for name in ROUTING_OPTIONS if getattr(config, name)]
    if given and not is_openrouter(config.base_url):
        log.warning(
            "%s route requests between OpenRouter's providers; %s is not OpenRouter, so they are not sent.",
            ", ".join(given), config.base_url,
        )


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
