"""HTML shared by report.html and the viewer: the summary with its charts, and one record as a conversation."""

from __future__ import annotations

import json
import math
from html import escape
from importlib import resources
from typing import Optional

from ..formats import hermes_format
from . import charts
from .fields import VERDICTS, verdict_of, verifiers_of

LONG_LINES = 30  # tool output longer than this is folded
LONG_CHARS = 3000


def static_text(name: str) -> str:
    """A file of the package's ``static/`` folder (the page's CSS and script), to inline."""
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def page(title: str, body: str, script: str = "") -> str:
    """A whole HTML page with the stylesheet (and ``script``) inlined: nothing is fetched from anywhere."""
    script_html = f"<script>{script}</script>" if script else ""
    # no network, ever: a report opened from a mail attachment must not call anywhere, and a page
    # without a script of its own (the report) runs none, whatever a record holds
    scripts = "'unsafe-inline'; connect-src 'self'" if script else "'none'"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
        f"img-src data:; script-src {scripts}\">"
        f"<title>{escape(title)}</title><style>{static_text('style.css')}</style></head>"
        f"<body>{body}{script_html}</body></html>\n"
    )


# -- the summary ----------------------------------------------------------------------------


def _fmt_int(value) -> str:
    try:
        return f"{int(value or 0):,}"
    except (TypeError, ValueError, OverflowError):  # an old statistics.json may hold NaN or Infinity
        return "?"


def _fmt_duration(seconds: float) -> str:
    try:
        seconds = float(seconds or 0)
    except (TypeError, ValueError, OverflowError):
        return "?"
    if not math.isfinite(seconds):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def _table(headers, rows, cls: str = "") -> str:
    head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _fmt_cost(cost) -> str:
    if isinstance(cost, (int, float)) and not isinstance(cost, bool) and math.isfinite(cost) and cost >= 0:
        return f"${cost:.4f}"
    return "not reported"


def summary_cards(s: dict) -> str:
    counts = s["counts"]
    tokens = s["tokens"]
    cards = [
        ("kept", "Kept", _fmt_int(counts["kept"])),
        ("discarded", "Discarded", _fmt_int(counts["discarded"])),
        ("failed", "Failed", _fmt_int(counts["failed"])),
        ("skipped", "Skipped (invalid rows)", _fmt_int(counts["skipped_invalid"])),
        ("calls", "Model calls", _fmt_int(s["model_calls"])),
        ("tokens", "Tokens (prompt / completion)", f"{_fmt_int(tokens['prompt'])} / {_fmt_int(tokens['completion'])}"),
        ("cost", "Cost", _fmt_cost(s["cost"])),
        ("duration", "Duration", f"{_fmt_duration(s['duration_total_s'])} in {len(s['sessions'])} session(s)"),
        ("ratelimited", "Rate-limited calls", _fmt_int(s["rate_limited"])),
    ]
    rewards = s.get("rewards")
    if rewards:
        cards.insert(3, ("passed", "Samples passed (of verified)",
                         f"{_fmt_int(rewards['samples_passed'])} / {_fmt_int(rewards['samples_scored'])}"))
    audit = s.get("audit")
    if audit:
        cards.insert(4 if rewards else 3, ("shortcuts", "Samples with shortcut findings (of audited)",
                                           f"{_fmt_int(audit['samples_with_findings'])} / "
                                           f"{_fmt_int(audit['samples_audited'])}"))
    return '<div class="cards">' + "".join(
        f'<div class="card" data-count="{key}"><div class="num">{escape(value)}</div><div class="what">{escape(label)}</div></div>'
        for key, label, value in cards
    ) + "</div>"


def summary_charts(s: dict) -> str:
    out = []
    if s["tools"]:
        rows = [(name, (row[1], row[2])) for name, row in s["tools"]]
        out.append(charts.figure("tools", "Tool calls by tool (all finished samples)",
                                 charts.bars(rows, ("success", "failure"))))
    else:
        out.append(charts.empty("tools", "Tool calls by tool", "No tool was called."))
    if s["toolsets"] or s["expected"]:
        finished = max(s["finished"], 1)
        names = [name for name, _c in s["toolsets"]] + [n for n in s["expected"] if n not in dict(s["toolsets"])]
        observed = dict(s["toolsets"])
        rows = [(name, (observed.get(name, 0) / finished,)) for name in names]
        markers = [s["expected"].get(name) for name in names]
        out.append(charts.figure(
            "toolsets", "Toolsets sampled: share of prompts against the distribution",
            charts.bars(rows, ("sampled",), markers=markers if any(m is not None for m in markers) else None,
                        percent=True, scale_max=1.0),
            "Each bar is the share of finished prompts that got the toolset; the tick is what the distribution's "
            "probabilities predict (the most likely toolset also gets the prompts where no coin came up).",
        ))
    r = s["reasoning"]
    rows = [(label, (r[key][0], r[key][1])) for key, label in (("finished", "all finished"), ("kept", "kept"))]
    out.append(charts.figure("reasoning", "Reasoning coverage (assistant turns)",
                             charts.bars(rows, ("with reasoning", "without")),
                             f"Samples without any reasoning: {r['finished'][2]:,} of all finished, {r['kept'][2]:,} kept."))
    bins = charts.int_bins(s["turns"])
    out.append(charts.figure("turns", "Model calls per prompt", charts.columns(bins)) if bins
               else charts.empty("turns", "Model calls per prompt"))
    bins = charts.log_bins(s["duration"], unit=" s")
    out.append(charts.figure("duration", "Prompt duration (log scale)", charts.columns(bins)) if bins
               else charts.empty("duration", "Prompt duration"))
    bins = charts.log_bins({k / 1000: v for k, v in s["latency_ms"].items()}, unit=" s")
    out.append(charts.figure("latency", "Model call latency (log scale)", charts.columns(bins, unit="calls")) if bins
               else charts.empty("latency", "Model call latency"))
    if s["end_reasons"]:
        out.append(charts.figure("end", "End reasons (finished prompts)", charts.bars([(k, (v,)) for k, v in s["end_reasons"]])))
    if s["failures_by_kind"]:
        out.append(charts.figure("failures", "Failed prompts by kind",
                                 charts.bars([(k, (v,)) for k, v in s["failures_by_kind"]])))
    else:
        out.append(charts.empty("failures", "Failed prompts by kind", "No prompt failed."))
    if s["discards_by_filter"]:
        reasons = _table(("filter", "reason", "samples"), [(f, r, f"{c:,}") for (f, r), c in s["discard_reasons"]],
                         "reasons")
        out.append(charts.figure("discards", "Discarded samples by filter",
                                 charts.bars([(k, (v,)) for k, v in s["discards_by_filter"]])).replace(
            "</figure>", f"{reasons}</figure>"))
    else:
        out.append(charts.empty("discards", "Discarded samples by filter", "No sample was discarded."))
    if s.get("audit"):
        out.append(audit_chart(s["audit"]))
    if s.get("rewards"):
        out[:0] = reward_charts(s["rewards"])
    return '<div class="charts">' + "".join(out) + "</div>"


def _pass(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def reward_charts(rewards: dict) -> list[str]:
    """The verifiers' part of the summary (only for runs with --verifier): pass@k, per toolsets, rewards."""
    ks = list(rewards["pass_at_k"])
    rows = [(f"pass@{k}", (rewards["pass_at_k"][k] or 0.0,)) for k in ks]
    scopes = [("all", rewards)] + (list(rewards["by_toolsets"].items()) if len(rewards["by_toolsets"]) > 1 else [])
    table = _table(("toolsets", "samples", "passed", "rows", "never passed", *(f"pass@{k}" for k in ks)), [
        (name, f"{scope.get('samples', scope.get('samples_scored', 0)):,}",
         f"{scope.get('passed', scope.get('samples_passed', 0)):,}", f"{scope['rows']:,}",
         f"{scope['rows_never_passed']:,} ({_pass(scope['share_rows_never_passed'])})",
         *(_pass(scope["pass_at_k"].get(k)) for k in ks))
        for name, scope in scopes], "passk")
    never = rewards["rows_never_passed"]
    out = [charts.figure(
        "passk", "pass@k (rows of the dataset)", charts.bars(rows, ("pass@k",), percent=True, scale_max=1.0),
        f"{never:,} of {rewards['rows']:,} rows never passed ({_pass(rewards['share_rows_never_passed'])}).",
    ).replace("</figure>", f"{table}</figure>")]
    mean = rewards["reward_mean"]
    out.append(charts.figure(
        "rewards", "Reward distribution (verified samples)",
        charts.columns(list(rewards["reward_histogram"].items()), unit="samples"),
        f"Mean reward {'-' if mean is None else f'{mean:.3f}'}; {rewards['samples_unverified']:,} sample(s) whose "
        "verifier failed (reward 0, not passed) are not in it. Bucket 0.9 holds rewards from 0.9 to 1.0.",
    ))
    return out


def audit_chart(audit: dict) -> str:
    """The shortcut audit's part of the summary: samples with a finding of each kind, passing or not."""
    rows = [(kind, (row["samples"] - row["passed"], row["passed"])) for kind, row in audit["by_kind"].items()
            if row["samples"]]
    title = "Shortcut audit: samples with findings, by kind"
    if not rows:
        return charts.empty("audit", title, f"None of the {audit['samples_audited']:,} audited samples did anything "
                                            "the shortcut audit looks for.")
    return charts.figure(
        "audit", title, charts.bars(rows, ("not passed", "passed")),
        f"{audit['samples_with_findings']:,} of {audit['samples_audited']:,} audited samples have findings; "
        f"{audit['passed_with_findings']:,} of the {audit['samples_passed']:,} passing ones, "
        f"{audit['kept_with_findings']:,} kept. --filter no-shortcuts discards them (docs/verification.md).",
    )


def summary_tables(s: dict) -> str:
    parts = []
    if s["requests"]:
        rows = []
        for name, row in s["requests"].items():
            median = row.get("median_latency_s")
            rows.append((name, f"{row.get('requests', 0):,}", f"{row.get('errors', 0):,}",
                         f"{row.get('rate_limited', 0):,}", "-" if median is None else f"{median:.3f} s"))
        parts.append("<h3>Providers</h3>" + _table(("provider", "requests", "errors", "rate-limited", "median latency"),
                                                    rows, "providers"))
    if s["sessions"]:
        rows = [(k + 1, x.get("started_at", ""), _fmt_duration(x.get("duration_s", 0)), x.get("prompts_run", 0),
                 "yes" if x.get("interrupted") else "no", x.get("rate_limited_calls", 0))
                for k, x in enumerate(s["sessions"])]
        parts.append("<h3>Sessions</h3>" + _table(("#", "started", "duration", "prompts run", "interrupted",
                                                    "rate-limited calls"), rows, "sessions"))
    tokens = s["tokens"]
    parts.append("<h3>Tokens</h3>" + _table(("prompt", "completion", "reasoning", "cached"),
                                            [tuple(_fmt_int(tokens.get(k)) for k in ("prompt", "completion", "reasoning", "cached"))],
                                            "tokens"))
    return '<div class="tables">' + "".join(parts) + "</div>"


def summary_html(s: dict) -> str:
    """The summary section: counts, tables and charts."""
    facts = [f"model {s['model']}" if s["model"] else "", f"distribution {s['distribution']}" if s["distribution"] else "",
             f"{s['total_prompts']:,} prompts in the dataset" if s["total_prompts"] is not None else "",
             f"{s['partial']:,} partial samples" if s["partial"] else "",
             f"{s['unreadable']:,} lines of the record files left out as no record" if s["unreadable"] else ""]
    facts_html = " · ".join(escape(f) for f in facts if f)
    return (f'<section class="summary" id="summary"><p class="facts">{facts_html}</p>{summary_cards(s)}'
            f"{summary_charts(s)}{summary_tables(s)}</section>")


# -- one record -----------------------------------------------------------------------------


def _pretty(value) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, indent=2, ensure_ascii=False)


def _records(value) -> list:
    """The dicts of a list field, which schema 2 may store as JSON text; anything else is dropped."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return []
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def cost_of(usage: dict):
    """The reported cost, or None when the endpoint reported none (schema 2 writes 0.0 then)."""
    usage = _dict(usage)
    if usage.get("cost_reported") is False:
        return None
    return usage.get("cost")


def _block(text: str, cls: str) -> str:
    """Text in a ``<pre>``, folded when long."""
    lines = text.count("\n") + 1
    body = f'<pre class="{cls}">{escape(text)}</pre>'
    if lines > LONG_LINES or len(text) > LONG_CHARS:
        return f'<details class="long"><summary>{lines:,} lines, {len(text):,} characters</summary>{body}</details>'
    return body


def _tool_results(value: str) -> str:
    blocks = hermes_format.response_texts(value)
    if not blocks:
        return _block(value, "text")
    out = []
    for raw in blocks:
        try:
            payload = json.loads(raw)
        except ValueError:
            out.append(_block(raw, "text"))
            continue
        payload = _dict(payload)
        content = payload.get("content")
        if isinstance(content, dict) and set(content) >= {"output"}:
            extra = {k: v for k, v in content.items() if k != "output"}
            body = _block(str(content.get("output", "")), "output") + _block(_pretty(extra), "json")
        else:
            body = _block(_pretty(content), "json")
        out.append(f'<div class="tool-result"><div class="tool-name">{escape(str(payload.get("name", "")))}'
                   f' <span class="call-id">{escape(str(payload.get("tool_call_id", "")))}</span></div>{body}</div>')
    return "".join(out)


def _assistant(turn: dict) -> str:
    value = str(turn.get("value", ""))
    out = []
    reasoning, value = hermes_format.split_reasoning(value)
    if reasoning is not None:
        out.append(f'<details class="reasoning"><summary>Reasoning</summary>{_block(reasoning, "text")}</details>')
    calls = _records(turn.get("tool_calls"))
    if calls:
        value = hermes_format.without_call_blocks(value)
    if value.strip():
        out.append(_block(value.strip(), "text"))
    for call in calls:
        out.append(f'<div class="tool-call"><div class="tool-name">{escape(str(call.get("name", "")))}'
                   f' <span class="call-id">{escape(str(call.get("id", "")))}</span></div>'
                   f'{_block(_pretty(call.get("arguments")), "json")}</div>')
    return "".join(out)


_ROLE_NAMES = {"system": "system", "human": "user", "gpt": "assistant", "tool": "tool results"}


def conversation_html(conversations) -> str:
    out = []
    for turn in _records(conversations):
        role = str(turn.get("from", ""))
        value = str(turn.get("value", ""))
        if role == "system":
            body = f'<details class="system"><summary>System prompt and tool definitions</summary>{_block(value, "text")}</details>'
        elif role == "gpt":
            body = _assistant(turn)
        elif role == "tool":
            body = _tool_results(value)
        else:
            body = _block(value, "text")
        out.append(f'<div class="turn turn-{escape(role)}"><div class="role">{escape(_ROLE_NAMES.get(role, role))}</div>'
                   f"{body}</div>")
    return '<div class="conversation">' + "".join(out) + "</div>"


def _meta_rows(status: str, record: dict) -> list[tuple[str, str]]:
    if status == "failed":
        usage = _dict(record.get("usage"))
        return [("prompt index", record.get("prompt_index")), ("batch", record.get("batch_num")),
                ("error kind", record.get("error_kind")), ("error class", record.get("error_class")),
                ("model calls", record.get("api_calls")), ("cost", cost_of(usage)),
                ("timestamp", record.get("timestamp"))]
    meta = _dict(record.get("metadata"))
    usage = _dict(meta.get("usage"))
    providers = sorted({str(c.get("provider") or "unknown") for c in _records(meta.get("calls"))})
    verified = []
    if verifiers_of(meta):
        verdict = VERDICTS[verdict_of(meta)]
        verified = [("reward", f"{meta.get('reward')} ({verdict})"), ("sample", meta.get("sample_index"))]
    return verified + [
        ("prompt index", record.get("prompt_index")), ("id", meta.get("id")), ("batch", meta.get("batch_num")),
        ("end reason", meta.get("end_reason")), ("completed", record.get("completed")),
        ("partial", record.get("partial")), ("model calls", record.get("api_calls")),
        ("duration", f"{meta.get('duration_s', 0)} s"),
        ("tokens", f"{usage.get('prompt_tokens', 0)} prompt / {usage.get('completion_tokens', 0)} completion"),
        ("cost", cost_of(usage)), ("model", meta.get("model")), ("providers", ", ".join(providers)),
        ("toolsets", ", ".join(map(str, record.get("toolsets_used") or ()))),
        ("tools offered", ", ".join(map(str, meta.get("tools_offered") or ()))), ("sandbox", meta.get("sandbox")),
        ("seed", meta.get("seed")), ("timestamp", meta.get("timestamp")),
    ]


def record_html(status: str, data: dict, link: Optional[str] = None) -> str:
    """One record: its metadata alongside its conversation (or its error, for a failure)."""
    data = _dict(data)
    record = _dict(data.get("trajectory")) if status == "discarded" else data
    rows = [(k, v) for k, v in _meta_rows(status, record) if v not in (None, "", ())]
    meta = "".join(f"<dt>{escape(k)}</dt><dd>{escape(str(v))}</dd>" for k, v in rows)
    notes = ""
    if status == "discarded":
        notes = "".join(f'<div class="why"><b>{escape(str(f))}</b>: {escape(str(r))}</div>'
                        for f, r in zip(data.get("filters") or (), data.get("reasons") or ()))
    for v in verifiers_of(_dict(record.get("metadata"))):
        said = v.get("error") or v.get("reason") or ""
        notes += (f'<div class="why verifier"><b>verifier {escape(str(v.get("name", "")))}: '
                  f'{escape(str(v.get("reward", "")))}</b> {escape(str(said))}</div>')
    for f in _records(_dict(record.get("metadata")).get("audit")):
        notes += (f'<div class="why audit"><b>shortcut {escape(str(f.get("kind", "")))}</b> '
                  f'(turn {escape(str(f.get("turn", "")))}, {escape(str(f.get("tool", "")))}): '
                  f'{escape(str(f.get("target", "")))}</div>')
    invalid = _records(_dict(record.get("metadata")).get("invalid_tool_calls"))
    notes += "".join(f'<div class="why"><b>invalid call {escape(str(c.get("name", "")))}</b>: '
                     f'{escape(str(c.get("reason", "")))}</div>' for c in invalid)
    if status == "failed":
        body = (f'<div class="why"><b>{escape(str(record.get("error_kind", "")))}</b>: '
                f'{escape(str(record.get("message", "")))}</div>'
                f'<div class="turn turn-human"><div class="role">user</div>{_block(str(record.get("prompt", "")), "text")}</div>')
    else:
        body = conversation_html(record.get("conversations"))
    link_html = f'<a class="permalink" href="{escape(link)}">link to this prompt</a>' if link else ""
    tools = _dict(record.get("tool_stats"))
    used = [f"{name} {_dict(s).get('success', 0)}✓ {_dict(s).get('failure', 0)}✗"
            for name, s in tools.items() if _dict(s).get("count")]
    tools_html = f'<div class="tools-used">{escape(" · ".join(used))}</div>' if used else ""
    return (f'<article class="record status-{escape(status)}"><aside class="meta"><div class="badge {escape(status)}">'
            f"{escape(status)}</div>{link_html}<dl>{meta}</dl>{tools_html}</aside>"
            f'<div class="body">{notes}{body}</div></article>')
