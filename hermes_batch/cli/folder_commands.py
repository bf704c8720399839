"""``hermes-batch export``, ``refilter`` and ``stats``: commands over a run folder that never call a model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import attrs
import click

from ..run import selection
from ..errors import UsageError
from ..contract.run_filters import INCLUDE
from ..contract.plugins import collect
from ..contract.writers import FileWriter

_RUN_DIR = click.Path(path_type=Path, file_okay=False)


def _registry():
    from . import plugin_manager  # the command's own (the one a test passes, without -p no:NAME's plugins)

    return collect(plugin_manager())


def _logging() -> None:
    from .run import _setup_logging

    _setup_logging(False)


@click.command("export")
@click.argument("run_dirs", metavar="RUN_DIR [RUN_DIR ...]", nargs=-1, required=True, type=_RUN_DIR)
@click.option("--format", "format_", required=True, metavar="NAME[:OPTIONS]",
              help="sharegpt, openai (openai:reasoning=drop), parquet (hermes-batch-parquet), dpo or rollouts "
                   "(samples of a row together, with --verifier), or any file writer.")
@click.option("--output", type=click.Path(path_type=Path), default=None,
              help="A file ending in the format's suffix, or a folder of <split> files [default: RUN_DIR/exports/<format>/; "
                   "needed for several runs].")
@click.option("--force", is_flag=True,
              help="Replace existing files at the output that hermes-batch export did not write.")
@click.option("--include", type=click.Choice(INCLUDE), default=None,
              help="Kept trajectories, discarded ones, or all [default: kept; all for dpo and rollouts].")
@click.option("--split", "split", multiple=True, metavar="NAME=SHARE",
              help="A split taking SHARE of the prompts by a hash of their content (repeatable), e.g. validation=0.05; the rest is train.")
@click.option("--filter", "filter_", multiple=True, metavar="NAME[:OPTIONS]",
              help="Leave out what this filter rejects (repeatable); also whole-run filters such as near-duplicates.")
@click.option("--seed", type=int, default=None,
              help="The seed of the formats that choose at random (dpo pairs; same as dpo:seed=N) [default: 0].")
@click.option("--keep_verifier_fields", "--keep-verifier-fields", "keep_verifier_fields", is_flag=True,
              help="Keep the rows' verifier-only fields (tests, test_files, answer, rubric) in metadata.row; "
                   "without it no export carries them.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def export_command(run_dirs, format_, output, include, split, filter_, force, seed, keep_verifier_fields, as_json):
    """Write the trajectories of one run, or several merged, as training files (splits stable across re-exports)."""
    from ..offline.export import as_json as result_json
    from ..offline.export import describe, export, parse_splits
    from ..offline.folder_info import open_run_folder

    _logging()
    folders = [open_run_folder(run_dir) for run_dir in run_dirs]
    registry = _registry()
    writer = selection.plugin(registry, "writers", format_, "--format")
    if not isinstance(writer, FileWriter):
        raise UsageError(f"The writer {writer.name!r} writes only into a run folder, so it cannot export; choose a file format.")
    if seed is not None:
        if not (attrs.has(type(writer.config)) and "seed" in attrs.fields_dict(type(writer.config))):
            raise UsageError(f"The {writer.name} format chooses nothing at random, so --seed does not apply; leave it out.")
        writer.config = attrs.evolve(writer.config, seed=seed)
    filters = selection.filters(registry, tuple(filter_), whole_run=True)
    _refuse_verified_without_verifiers(folders, filters)
    result = export(folders, writer, output=output, include=include, splits=parse_splits(split), filters=filters,
                    force=force, keep_verifier_fields=keep_verifier_fields)
    click.echo(result_json(result) if as_json else describe(result))


def _refuse_verified_without_verifiers(folders, filters) -> None:
    """--filter verified over a run that ran no --verifier would discard every record: refuse it, naming the run."""
    from ..offline.folder_info import read_run_json

    if not any(f.name == "verified" for f in filters):
        return
    for folder in folders:
        run_json = read_run_json(folder)
        if not isinstance(run_json.get("config"), dict):
            continue  # no run.json (a run killed at its start): nothing says what it ran
        history = run_json.get("settings_history")
        sessions = [run_json["config"]]
        if isinstance(history, list):  # an earlier session may have run the verifiers
            sessions += [entry.get("settings") for entry in history if isinstance(entry, dict)]
        if not any(isinstance(s, dict) and s.get("verifiers") for s in sessions):
            raise UsageError(
                f"--filter verified keeps only samples a verifier passed, and the run in {folder.dir} ran no "
                "--verifier, so it would discard every record; leave the filter out, or run with --verifier NAME "
                "(see docs/verification.md)."
            )


@click.command("refilter")
@click.argument("run_dir", type=_RUN_DIR)
@click.option("--filter", "filter_", multiple=True, metavar="NAME[:OPTIONS]",
              help="A filter to judge every finished record by (repeatable, in order).")
@click.option("--no_filters", "--no-filters", "no_filters", is_flag=True, help="Keep every finished record (brings all discarded ones back).")
@click.option("--dry_run", "--dry-run", "dry_run", is_flag=True, help="Say what would move; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def refilter_command(run_dir, filter_, no_filters, dry_run, as_json):
    """Apply filters again to a run's kept and discarded records, without any model call (audited)."""
    from ..offline.folder_info import open_run_folder, read_run_json
    from ..offline.refilter import locked, refilter

    _logging()
    if not filter_ and not no_filters:
        raise click.UsageError("Give the filters to apply with --filter NAME (repeatable), or --no_filters to keep everything.")
    if filter_ and no_filters:
        raise click.UsageError("--no_filters and --filter contradict each other; pass one of them.")
    folder = open_run_folder(run_dir)
    registry = _registry()
    filters = selection.filters(registry, tuple(filter_), whole_run=True)
    _refuse_verified_without_verifiers([folder], filters)
    config = read_run_json(folder).get("config") or {}
    writer_specs = tuple(config.get("writers") or ("jsonl",))
    try:
        writers = selection.writers(registry, writer_specs)
    except UsageError as exc:
        raise UsageError(f"The run's writers cannot be rebuilt: {exc} Install the writer's plugin, then refilter.") from None
    with locked(folder, "hermes-batch refilter"):
        result = refilter(folder, filters, tuple(filter_), dry_run=dry_run, writers=writers)
    _print_refilter(result, as_json)


def _print_refilter(result, as_json: bool) -> None:
    if as_json:
        data = {
            "dry_run": result.dry_run, "filters": list(result.filters), "moved_to_discarded": result.to_discarded,
            "moved_to_kept": result.to_kept, "reasons_changed": result.reasons_changed, "kept": result.kept,
            "discarded": result.discarded, "by_filter": result.by_filter,
            "moves": [{"prompt_index": m.prompt_index, "to": m.to,
                       "filters": list(m.verdict.filters) if m.verdict else [],
                       "reasons": list(m.verdict.reasons) if m.verdict else []} for m in result.moves],
        }
        click.echo(json.dumps(data, indent=2))
        return
    verb = "would move" if result.dry_run else "moved"
    click.echo(f"{verb} {result.to_discarded} kept -> discarded and {result.to_kept} discarded -> kept; "
               f"now {result.kept} kept and {result.discarded} discarded.")
    for name, count in result.by_filter.items():
        click.echo(f"  {name}: rejects {count}")
    for move in result.moves[:20]:
        why = "; ".join(f"{n}: {r}" for n, r in zip(move.verdict.filters, move.verdict.reasons)) if move.verdict else "passes every filter"
        click.echo(f"  prompt {move.prompt_index}: -> {move.to} ({why})")
    if len(result.moves) > 20:
        click.echo(f"  ... and {len(result.moves) - 20} more" + ("" if result.dry_run else " (see refilter_audit.jsonl)"))


@click.command("stats")
@click.argument("run_dir", type=_RUN_DIR)
@click.option("--json", "as_json", is_flag=True, help="Print statistics.json instead of the tables.")
def stats_command(run_dir, as_json):
    """Print the statistics of a run folder again (rebuilt from its records when statistics.json is older)."""
    from rich.console import Console

    from ..offline.folder_info import current_statistics, open_run_folder
    from ..folder.statistics import render_statistics

    _logging()
    folder = open_run_folder(run_dir)
    stats, rebuilt = current_statistics(folder)
    if as_json:
        click.echo(json.dumps(stats, indent=2))
        return
    render_statistics(stats, Console(file=sys.stdout))
    if rebuilt:
        click.echo("(rebuilt from the run folder's records: statistics.json is missing or older than them)")


COMMANDS = (export_command, refilter_command, stats_command)
