"""The ``report`` and ``view`` commands."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import click

from ..errors import RunFolderWriteError, UsageError
from ..folder.durable import write_error
from .index import CACHE_DIR_NAME

_RUN_FILES = ("run.json", "checkpoint.json", "statistics.json", "discarded.jsonl", "failed.jsonl", "trajectories.jsonl")


def check_run_dir(run_dir: Path) -> Path:
    """``run_dir`` if it looks like a run folder, else a one-sentence UsageError."""
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a folder; pass the run folder `hermes-batch run` wrote (data/<run_name>).")
    names = {p.name for p in run_dir.iterdir()}
    if not names & set(_RUN_FILES) and not any(n.startswith("batch_") and n.endswith(".jsonl") for n in names):
        raise UsageError(f"{run_dir} holds no run outputs (no run.json, batch_*.jsonl or checkpoint.json); "
                         "pass the run folder `hermes-batch run` wrote (data/<run_name>).")
    return run_dir


def _progress():
    """A progress callback that says every few seconds how many records are indexed: a first pass takes minutes."""
    shown = [time.monotonic()]

    def progress(records: int) -> None:
        if time.monotonic() - shown[0] >= 5:
            shown[0] = time.monotonic()
            click.echo(f"  {records:,} records indexed ...", err=True)

    return progress


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


@click.command("report")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--samples", type=click.IntRange(0, 1000), default=5, show_default=True,
              help="Records of each kind (kept, discarded, failed) to include for reading.")
def report_command(run_dir, samples):
    """Write RUN_DIR/report.html: summary, charts and sample records in one self-contained file.

    The file needs no network (styles inlined, charts drawn as SVG, no script), so it
    opens from a cluster's scratch disk or as an e-mail attachment.  It is also
    written at the end of every run.
    """
    from .index import RunIndex
    from .report import REPORT_NAME, write_report

    check_run_dir(run_dir)
    started = time.perf_counter()
    try:
        index = RunIndex(run_dir)
        try:
            path = write_report(run_dir, index=index, samples=samples, progress=_progress())
            unreadable = index.tallies.unreadable
        finally:
            index.close()
    except (OSError, RunFolderWriteError) as exc:  # a full disk, a quota: one sentence, and the status a run gives it
        cause = exc if isinstance(exc, OSError) else exc.__cause__
        if not isinstance(cause, OSError):
            raise
        message = str(write_error(run_dir / REPORT_NAME, cause, started=False)).rstrip(".")
        raise RunFolderWriteError(f"{message}, then run `hermes-batch report {run_dir}` again.") from None
    click.echo(f"Wrote {path} ({_size(path.stat().st_size)}, {time.perf_counter() - started:.1f} s).")
    if unreadable:
        click.echo(f"Left out {unreadable:,} line(s) of the record files that are no record (not JSON, or not a "
                   "JSON object); the report counts them.", err=True)


@click.command("view")
@click.argument("run_dir", type=click.Path(path_type=Path))
# a free port by default: model servers (vLLM, llama.cpp, ...) take the usual fixed ones on the same machine
@click.option("--port", type=click.IntRange(0, 65535), default=0,
              help="Port to listen on; the URL printed says which.  [default: 0, any free port]")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but 127.0.0.1 lets other machines read your run.")
def view_command(run_dir, port, host):
    """Browse a run in a local web app: search, filter, sort and read every trajectory.

    Live while the run goes on: new records appear as they land.  The records are
    read from disk by offset; an index of where they are (a few dozen bytes per
    record) is cached in RUN_DIR/.hermes-batch-view/.
    """
    from .server import IndexingError, serve

    check_run_dir(run_dir)
    click.echo(f"Indexing {run_dir} ...", err=True)
    progress = _progress()

    def announce(url: str, records: int) -> None:
        where = "only this machine can connect" if host in ("127.0.0.1", "localhost", "::1") else \
            f"listening on {host}: other machines can read this run"
        click.echo(f"Serving {records:,} records of {run_dir} at {url} ({where}). Press Ctrl-C to stop.")

    try:
        asyncio.run(serve(run_dir, host, port, announce, progress))
    except IndexingError as exc:
        raise write_error(run_dir, exc.cause, started=False, doing="Indexing") from None
    except OSError as exc:
        raise UsageError(f"Cannot listen on {host}:{port} ({exc.strerror or exc}); pass another --port, or 0 for any free one.") from exc
    except KeyboardInterrupt:
        click.echo("Stopped.", err=True)


__all__ = ["CACHE_DIR_NAME", "check_run_dir", "report_command", "view_command"]
