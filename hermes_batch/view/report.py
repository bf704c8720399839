"""report.html: one self-contained file (styles inlined, charts as SVG, no script, no network)."""

from __future__ import annotations

import datetime
from html import escape
from pathlib import Path

from ..folder.durable import atomic_write_text
from .index import DISCARDED, FAILED, KEPT, STATUSES, RunIndex, prompt_of, unwrap
from .render import page, record_html, summary_html
from .summary import summarize

REPORT_NAME = "report.html"
SAMPLES_PER_STATUS = 5
SAMPLE_MAX_BYTES = 256 * 1024  # a sample this long is passed over, so one huge record cannot bloat the report


def _samples(index: RunIndex, per_status: int) -> str:
    cols = index.columns
    sections = []
    for status in (KEPT, DISCARDED, FAILED):
        name = STATUSES[status]
        total = index.tallies.status[status]
        chosen = index.spread(status, per_status, SAMPLE_MAX_BYTES)
        if not chosen:
            continue
        records = []
        for i in chosen:
            try:
                data = index.read(i)
                html = record_html(name, data)
            except (OSError, ValueError, RecursionError):  # unreadable or absurdly nested: show another one
                continue
            title = f"#{cols.prompt[i]}"
            records.append(f'<details class="sample"><summary>{escape(title)}: {escape(_preview(index, i, data))}'
                           f"</summary>{html}</details>")
        sections.append(f'<h3 id="samples-{name}">{escape(name.capitalize())}: {len(records)} of {total:,}</h3>'
                        + "".join(records))
    return '<section class="samples"><h2>Samples</h2>' + "".join(sections) + "</section>"


def _preview(index: RunIndex, i: int, data: dict) -> str:
    status = index.columns.status[i]
    rec = unwrap(status, data)
    text = str(rec.get("prompt", "")) if status == FAILED else prompt_of(rec)
    return text[:120]


def render_report(index: RunIndex, samples: int = SAMPLES_PER_STATUS) -> str:
    """The report's HTML for the run ``index`` covers."""
    summary = summarize(index)
    generated = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    header = (f'<header class="top"><h1>{escape(summary["run_name"])}</h1>'
              f'<span class="sub">hermes-batch report · {len(index):,} records · generated {escape(generated)}</span></header>')
    body = f"{header}<main>{summary_html(summary)}{_samples(index, samples)}</main>"
    return page(f"{summary['run_name']}: hermes-batch report", body)


def write_report(run_dir, index: RunIndex | None = None, samples: int = SAMPLES_PER_STATUS, progress=None) -> Path:
    """Write ``RUN_DIR/report.html`` atomically and return its path; ``progress`` as for :meth:`RunIndex.refresh`."""
    run_dir = Path(run_dir)
    own = index is None
    if own:
        index = RunIndex(run_dir)
    try:
        index.refresh(progress)
        index.save()
        html = render_report(index, samples)
    finally:
        if own:
            index.close()
    target = run_dir / REPORT_NAME
    atomic_write_text(target, html)
    return target
