"""Charts as inline SVG, drawn in Python: no charting library to ship, and they work with scripts off.

Every bar is a ``<rect class="bar ...">`` with a ``<title>`` (the tooltip), so
the charts read the same in ``report.html``, in the viewer and in a test.
"""

from __future__ import annotations

import math
from html import escape
from typing import Optional, Sequence

ROW_HEIGHT = 22
LABEL_WIDTH = 160
BAR_WIDTH = 300
VALUE_WIDTH = 130


def _fmt(value: float) -> str:
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.3g}" if value < 100 else f"{value:,.0f}"
    return f"{int(value):,}"


def _clip_label(label: str, limit: int = 28) -> str:
    return label if len(label) <= limit else label[: limit - 1] + "…"


def figure(chart_id: str, title: str, svg: str, note: str = "") -> str:
    """A chart with its caption, as an HTML ``<figure>``."""
    note_html = f'<p class="note">{escape(note)}</p>' if note else ""
    return f'<figure class="chart" id="chart-{escape(chart_id)}"><figcaption>{escape(title)}</figcaption>{svg}{note_html}</figure>'


def empty(chart_id: str, title: str, message: str = "Nothing to show yet.") -> str:
    return f'<figure class="chart empty" id="chart-{escape(chart_id)}"><figcaption>{escape(title)}</figcaption><p class="note">{escape(message)}</p></figure>'


def bars(
    rows: Sequence[tuple[str, Sequence[float]]],
    series: Sequence[str] = ("count",),
    *,
    markers: Optional[Sequence[Optional[float]]] = None,
    scale_max: Optional[float] = None,
    percent: bool = False,
) -> str:
    """Horizontal bars, one row per label; a row with several values is stacked (one segment per series).

    ``markers`` draws a tick per row at that value (an expected share beside the observed one).
    """
    total_max = scale_max or max((sum(values) for _label, values in rows), default=0) or 1
    if markers:
        total_max = max(total_max, max((m for m in markers if m is not None), default=0))
    legend = len(series) > 1 or markers
    top = 20 if legend else 4
    height = top + ROW_HEIGHT * len(rows) + 4
    width = LABEL_WIDTH + BAR_WIDTH + VALUE_WIDTH
    out = [f'<svg class="bars" role="img" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'xmlns="http://www.w3.org/2000/svg">']
    if legend:
        x = LABEL_WIDTH
        for k, name in enumerate(series):
            out.append(f'<rect class="legend s{k}" x="{x}" y="4" width="10" height="10"/>'
                       f'<text x="{x + 14}" y="13" class="legend-text">{escape(name)}</text>')
            x += 24 + 7 * len(name)
        if markers:
            out.append(f'<line class="marker" x1="{x + 5}" x2="{x + 5}" y1="2" y2="16"/>'
                       f'<text x="{x + 10}" y="13" class="legend-text">expected</text>')
    for r, (label, values) in enumerate(rows):
        y = top + r * ROW_HEIGHT
        out.append(f'<text class="label" x="{LABEL_WIDTH - 6}" y="{y + 15}" text-anchor="end">'
                   f'<title>{escape(label)}</title>{escape(_clip_label(label))}</text>')
        x = float(LABEL_WIDTH)
        for k, value in enumerate(values):
            w = BAR_WIDTH * value / total_max
            shown = f"{value:.1%}" if percent else _fmt(value)
            name = f"{series[k]}: " if len(series) > 1 else ""
            out.append(f'<rect class="bar s{k}" x="{x:.1f}" y="{y + 3}" width="{max(w, 0):.1f}" height="{ROW_HEIGHT - 6}">'
                       f'<title>{escape(label)}: {escape(name)}{shown}</title></rect>')
            x += w
        total = sum(values)
        text = f"{total:.1%}" if percent else " / ".join(_fmt(v) for v in values) if len(values) > 1 else _fmt(total)
        if markers and markers[r] is not None:
            mx = LABEL_WIDTH + BAR_WIDTH * markers[r] / total_max
            out.append(f'<line class="marker" x1="{mx:.1f}" x2="{mx:.1f}" y1="{y + 1}" y2="{y + ROW_HEIGHT - 1}">'
                       f'<title>expected {markers[r]:.1%}</title></line>')
            text += f" (exp. {markers[r]:.0%})"
        out.append(f'<text class="value" x="{LABEL_WIDTH + BAR_WIDTH + 6}" y="{y + 15}">{escape(text)}</text>')
    out.append("</svg>")
    return "".join(out)


def columns(bins: Sequence[tuple[str, int]], *, unit: str = "prompts") -> str:
    """A histogram: one vertical bar per bin, labels under every few bars."""
    n = len(bins)
    width = LABEL_WIDTH + BAR_WIDTH + VALUE_WIDTH
    plot_w, plot_h, left, top = width - 60, 150, 50, 10
    peak = max((c for _l, c in bins), default=0) or 1
    step = plot_w / max(n, 1)
    out = [f'<svg class="columns" role="img" viewBox="0 0 {width} {plot_h + 50}" width="{width}" height="{plot_h + 50}" '
           f'xmlns="http://www.w3.org/2000/svg">',
           f'<line class="axis" x1="{left}" x2="{left + plot_w}" y1="{top + plot_h}" y2="{top + plot_h}"/>',
           f'<text class="value" x="{left - 4}" y="{top + 8}" text-anchor="end">{_fmt(peak)}</text>',
           f'<text class="value" x="{left - 4}" y="{top + plot_h}" text-anchor="end">0</text>']
    every = max(1, math.ceil(n / 10))
    for i, (label, count) in enumerate(bins):
        h = plot_h * count / peak
        x = left + i * step
        out.append(f'<rect class="bar s0" x="{x + 1:.1f}" y="{top + plot_h - h:.1f}" width="{max(step - 2, 1):.1f}" '
                   f'height="{h:.1f}"><title>{escape(label)}: {count:,} {escape(unit)}</title></rect>')
        if i % every == 0:
            out.append(f'<text class="tick" x="{x + step / 2:.1f}" y="{top + plot_h + 14}" text-anchor="middle">'
                       f'{escape(label)}</text>')
    out.append("</svg>")
    return "".join(out)


def log_bins(values_counter: dict, *, unit: str, bins: int = 16) -> list[tuple[str, int]]:
    """Bin a histogram ``{value: count}`` of positive durations on a log scale (they span orders of magnitude)."""
    positive = {v: c for v, c in values_counter.items() if c}
    if not positive:
        return []
    lo = max(min(positive), 1e-3)
    hi = max(max(positive), lo * 1.0001)
    edges = [lo * (hi / lo) ** (k / bins) for k in range(bins + 1)]
    counts = [0] * bins
    for value, count in positive.items():
        k = 0 if value <= lo else min(bins - 1, int(bins * math.log(value / lo) / math.log(hi / lo)))
        counts[k] += count
    return [(f"{_short(edges[k])}{unit}", counts[k]) for k in range(bins)]


def _short(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}".rstrip("0").rstrip(".")
    return f"{value:.2g}"


def int_bins(counter: dict, *, max_bins: int = 30) -> list[tuple[str, int]]:
    """Bins of a histogram of small integers (turns per prompt): one per value, grouped when there are many."""
    if not counter:
        return []
    lo, hi = min(counter), max(counter)
    width = max(1, math.ceil((hi - lo + 1) / max_bins))
    out = []
    for start in range(lo, hi + 1, width):
        count = sum(counter.get(v, 0) for v in range(start, start + width))
        label = str(start) if width == 1 else f"{start}–{start + width - 1}"
        out.append((label, count))
    return out
