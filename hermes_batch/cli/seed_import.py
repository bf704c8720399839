"""``hermes-batch import``: a run folder of Hermes Agent's batch_runner.py becomes a hermes-batch run folder."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("import")
@click.argument("seed_run_dir", type=click.Path(path_type=Path, file_okay=False))
@click.option("--dataset_file", "--dataset-file", "dataset_file", required=True,
              type=click.Path(path_type=Path, dir_okay=False),
              help="The dataset the run was made from: its records are matched to its rows by prompt.")
@click.option("--batch_size", "--batch-size", "batch_size", type=click.IntRange(min=1), default=None,
              help="Prompts per batch file.  [default: the batch size of batch_runner.py's statistics.json]")
@click.option("--filter", "filter_", multiple=True, metavar="NAME[:OPTIONS]",
              help="A filter to judge each record by (repeatable).  [default: no-reasoning, hallucinated-tools, as "
                   "batch_runner.py did]")
@click.option("--no_filters", "--no-filters", "no_filters", is_flag=True, help="Keep every record.")
@click.option("--skip_invalid", "--skip-invalid", "skip_invalid", is_flag=True,
              help="Skip invalid dataset lines instead of stopping.")
def import_command(seed_run_dir, dataset_file, batch_size, filter_, no_filters, skip_invalid):
    """Make a run folder of batch_runner.py a hermes-batch run folder, so --resume pays for no finished prompt again."""
    from ..run import selection
    from ..errors import RunFolderError, UsageError
    from ..offline.folder_info import rebuild_statistics
    from ..folder.merge import merge_run
    from ..contract.plugins import collect
    from ..offline.refilter import locked
    from ..folder.runfolder import RunFolder
    from ..offline.seed_import import MAX_LINE_BYTES, SEED_FOLDER, import_run
    from . import plugin_manager
    from .run import _setup_logging

    _setup_logging(False)
    if filter_ and no_filters:
        raise click.UsageError("--no_filters and --filter contradict each other; pass one of them.")
    if not seed_run_dir.is_dir():
        raise RunFolderError(f"{seed_run_dir} is not a folder; pass the run folder batch_runner.py wrote (data/<run_name>).")
    path = seed_run_dir.resolve()
    try:
        folder = RunFolder(path.parent, path.name)
    except UsageError:
        raise RunFolderError(
            f"{seed_run_dir} is named {path.name!r}, which is not a run name (letters, digits, '.', '_', '-'); "
            "rename the folder, then import it."
        ) from None
    registry = collect(plugin_manager())
    specs = () if no_filters else (tuple(filter_) or selection.SEED_FILTERS)
    with locked(folder, "hermes-batch import"):
        result = import_run(folder, dataset_file, batch_size, registry, specs, skip_invalid=skip_invalid)
        merge_run(folder, selection.writers(registry, ("jsonl",)))
        rebuild_statistics(folder)
    if result.finished_interrupted:
        click.echo(f"Finished the interrupted import of {folder.dir}.")
        return
    click.echo(
        f"Imported {result.records} record(s) of batch_runner.py into {folder.dir}: {result.kept} kept, "
        f"{result.discarded} discarded by the filters, {result.unmatched} whose prompt the dataset does not hold and "
        f"{result.unreadable} unreadable set aside in unmatched.jsonl; batch_runner.py's files are in "
        f"{folder.dir / SEED_FOLDER}."
    )
    if result.too_long:
        click.echo(f"{result.too_long} line(s) of its batch files were longer than any record may be "
                   f"({MAX_LINE_BYTES >> 20} MiB) and were skipped, not imported.")
    if result.checkpoint_only:
        click.echo(f"Its checkpoint.json calls {result.checkpoint_only} more prompt(s) completed that have no record "
                   "(batch_runner.py matches by record too): they run again.")
    size = json.loads(folder.run_json.read_text(encoding="utf-8"))["config"]["batch_size"]
    click.echo(f"Continue it with: hermes-batch run --dataset_file {dataset_file} --batch_size {size} "
               f"--run_name {folder.run_name} --output_dir {folder.dir.parent} --resume")
