"""report.html: written at the end of every run and by `hermes-batch report`, read in a real browser offline."""

from __future__ import annotations

import errno
import json
import re
import shutil
import subprocess
import sys
from collections import Counter

from click.testing import CliRunner

from hermes_batch.cli import cli
from hermes_batch.testing.demo_run import FAILING, KEPT_PROMPTS
from view_rig import (  # noqa: F401 (fixtures)
    browser, demo_run_dir, fill_up, needs_chromium, page, read_jsonl, run_copy, small_disk, viewer,
)


def _finished(run_dir) -> list[dict]:
    kept = [r for p in sorted(run_dir.glob("batch_*.jsonl")) for r in read_jsonl(p)]
    return kept + [r["trajectory"] for r in read_jsonl(run_dir / "discarded.jsonl")]


def test_every_run_ends_with_a_report(demo_run_dir):
    html = (demo_run_dir / "report.html").read_text()
    # the samples are spread over the kept records in file order, which is the order prompts finished in:
    # the first one is always among them
    first_kept = read_jsonl(demo_run_dir / "batch_0.jsonl")[0]
    assert f"#{first_kept['prompt_index']}: {first_kept['conversations'][1]['value'][:40]}" in html
    # self-contained: nothing is loaded from anywhere
    for needle in ("<script src", "<link", "@import", "url(http", 'src="http'):
        assert needle not in html


def test_report_command_writes_and_says_where(run_copy):
    (run_copy / "report.html").unlink()
    result = CliRunner().invoke(cli, ["report", str(run_copy)])
    assert result.exit_code == 0, result.output
    assert f"Wrote {run_copy / 'report.html'}" in result.output
    assert (run_copy / "report.html").stat().st_size > 10_000


def test_report_and_view_refuse_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for command in (["report", str(tmp_path)], ["view", str(tmp_path)], ["report", str(tmp_path / "missing")]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 2
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: ") and "run folder" in lines[0], result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_report_is_written_for_a_run_still_going(run_copy):
    """`hermes-batch report` on a folder with records but no statistics.json (the run has not ended)."""
    (run_copy / "statistics.json").unlink()
    (run_copy / "report.html").unlink()
    result = CliRunner().invoke(cli, ["report", str(run_copy)])
    assert result.exit_code == 0, result.output
    # the one failed prompt is always among the samples; which kept ones are depends on the order they ended in
    assert FAILING in (run_copy / "report.html").read_text()


@needs_chromium
def test_report_in_a_browser_with_the_network_blocked(demo_run_dir, page):
    stats = json.loads((demo_run_dir / "statistics.json").read_text())
    finished = _finished(demo_run_dir)
    blocked = []

    def block(route):
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    page.route("**/*", block)
    page.goto((demo_run_dir / "report.html").as_uri())

    def card(name):
        return page.locator(f'.card[data-count="{name}"] .num').inner_text()

    assert card("kept") == str(stats["prompts"]["kept"]) == "8"
    assert card("discarded") == str(stats["prompts"]["discarded"]) == "2"
    assert card("failed") == str(stats["prompts"]["failed"]) == "1"
    assert card("calls") == str(stats["finished"]["model_calls"])

    # one bar per value of model calls per prompt, from the fewest to the most
    turns = Counter(r["api_calls"] for r in finished)
    bars = page.locator("#chart-turns rect.bar")
    assert bars.count() == max(turns) - min(turns) + 1
    titles = [bars.nth(i).locator("title").text_content() for i in range(bars.count())]
    assert titles[0] == f"{min(turns)}: {turns[min(turns)]} prompts"
    # one row per end reason, one per filter that discarded something
    assert page.locator("#chart-end rect.bar").count() == len({r["metadata"]["end_reason"] for r in finished})
    # a bar per filter that discarded something (the filters in force are all listed, empty-answer with 0)
    assert page.locator("#chart-discards rect.bar").count() == len(
        [n for n in stats["discarded_by_filter"].values() if n]) == 2
    assert "called tools that were not offered: teleport" in page.locator("#chart-discards table").inner_text()
    # the sampler check: terminal_only samples terminal (and file, its dependency) for every prompt
    assert page.locator("#chart-toolsets .marker").count() >= 1

    # a sample trajectory opens and shows its tool call and its result
    sample = page.locator("details.sample", has_text=re.compile("|".join(map(re.escape, KEPT_PROMPTS)))).first
    assert not sample.locator(".tool-call").first.is_visible()  # a sample may hold more than one call
    sample.locator("summary").first.click()
    assert sample.locator(".tool-call").first.is_visible()
    assert sample.locator(".tool-call .tool-name").first.inner_text().startswith("terminal")
    assert "step-0-" in sample.locator(".tool-result pre.output").first.inner_text()
    assert blocked == []


@needs_chromium
def test_markup_in_a_record_is_shown_as_text_never_run(run_copy, page):
    record = read_jsonl(run_copy / "batch_0.jsonl")[0]
    hostile = '<script>document.title="owned"</script><img src="http://198.51.100.1/x.png" onerror="alert(1)">'
    for turn in record["conversations"]:
        if turn["from"] == "human":
            turn["value"] = hostile
    record["prompt_index"] = 0
    (run_copy / "batch_0.jsonl").write_text(json.dumps(record) + "\n")  # the only kept record: it is sampled
    assert CliRunner().invoke(cli, ["report", str(run_copy)]).exit_code == 0
    requests, dialogs = [], []
    page.on("request", lambda request: requests.append(request.url))
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.goto((run_copy / "report.html").as_uri())
    sample = page.locator("details.sample", has_text="#0:")
    sample.locator("summary").first.click()
    assert hostile in sample.locator(".turn-human pre").inner_text()
    assert page.title() != "owned" and dialogs == []
    assert [url for url in requests if not url.startswith("file://")] == []


def test_overwrite_removes_the_old_report_with_the_other_outputs(run_copy):
    from hermes_batch.run.cleanup import remove_outputs
    from hermes_batch.folder.runfolder import RunFolder

    (run_copy / "notes.txt").write_text("mine")
    remove_outputs(RunFolder(run_copy.parent, run_copy.name))
    assert not (run_copy / "report.html").exists()
    assert (run_copy / "notes.txt").read_text() == "mine"


def _no_record_lines(run_dir) -> None:
    """What an old run folder or a hand edit may hold: lines that are no record, numbers that are no number."""
    with open(run_dir / "discarded.jsonl", "ab") as fh:
        fh.write(b"[1,2,3]\n")
    record = read_jsonl(run_dir / "batch_0.jsonl")[0]
    record["prompt_index"], record["api_calls"] = 30, "API_CALLS"
    record["metadata"]["usage"]["cost"] = "COST"
    line = json.dumps(record).replace('"API_CALLS"', "1e999").replace('"COST"', "NaN")
    with open(run_dir / "batch_1.jsonl", "a") as fh:
        fh.write(line + "\n")
    stats = json.loads((run_dir / "statistics.json").read_text())
    stats["cost"], stats["tokens"]["prompt"] = float("inf"), float("nan")  # written by an older version
    stats["duration"]["sessions"][0]["duration_s"] = float("inf")
    (run_dir / "statistics.json").write_text(json.dumps(stats))


def test_report_leaves_out_lines_that_are_no_record_and_counts_them(run_copy):
    _no_record_lines(run_copy)
    result = CliRunner().invoke(cli, ["report", str(run_copy)])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert "Left out 1 line(s) of the record files that are no record" in result.output
    html = (run_copy / "report.html").read_text()
    assert "1 lines of the record files left out as no record" in html
    assert re.search(r'data-count="kept"><div class="num">9<', html)  # the record of odd numbers is listed
    assert re.search(r'data-count="cost"><div class="num">not reported<', html)


def test_view_serves_a_run_with_lines_that_are_no_record(run_copy, viewer):
    from test_view_guard import _get

    _no_record_lines(run_copy)
    v = viewer(run_copy)
    assert "Serving 12 records" in v.announcement
    status, _headers, body = _get(v, f"/api/summary?token={v.token}")
    assert status == 200 and "1 lines of the record files left out as no record" in body
    assert _get(v, f"/api/records?sort=turns&desc=1&token={v.token}")[0] == 200


def test_report_on_a_full_disk_says_so_in_one_sentence(demo_run_dir, small_disk):
    run_dir = small_disk / "demo"
    shutil.copytree(demo_run_dir, run_dir, ignore=shutil.ignore_patterns(".hermes-batch-view", "report.html"))
    filler = fill_up(small_disk)
    result = CliRunner().invoke(cli, ["report", str(run_dir)])
    assert result.exit_code == 74, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert lines[-1] == (f"Error: Writing {run_dir / 'report.html'} failed: No space left on device (ENOSPC); "
                         f"free some space on that disk, then run `hermes-batch report {run_dir}` again.")
    assert not (run_dir / "report.html").exists()
    filler.unlink()
    result = CliRunner().invoke(cli, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert (run_dir / "report.html").stat().st_size > 10_000


def test_view_on_a_full_disk_says_so_and_does_not_blame_the_port(demo_run_dir, small_disk):
    run_dir = small_disk / "demo"
    shutil.copytree(demo_run_dir, run_dir, ignore=shutil.ignore_patterns(".hermes-batch-view"))
    fill_up(small_disk)
    proc = subprocess.run([sys.executable, "-m", "hermes_batch", "view", str(run_dir), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 74, proc.stderr
    assert "Traceback" not in proc.stderr and "Cannot listen" not in proc.stderr and "--port" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"Error: Indexing {run_dir} failed: No space left on device (ENOSPC); free some space on that disk.")


def test_report_that_cannot_be_written_advises_the_report_command_not_a_resume(run_copy, monkeypatch):
    """Without a tmpfs: the report's own file cannot be written (its fsync says the quota is exceeded)."""
    from hermes_batch.folder import runfolder

    def quota(fd):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(runfolder.os, "fsync", quota)
    result = CliRunner().invoke(cli, ["report", str(run_copy)])
    assert result.exit_code == 74, result.output
    assert result.output.strip().splitlines()[-1] == (
        f"Error: Writing {run_copy / 'report.html'} failed: Disk quota exceeded (EDQUOT); "
        f"free some space or raise your disk quota, then run `hermes-batch report {run_copy}` again.")


def test_view_whose_index_cannot_be_written_says_so_in_one_sentence(run_copy, monkeypatch):
    """Without a tmpfs: the first pass over the run fails as on a full disk."""
    import threading

    from hermes_batch.view.index import RunIndex

    def full(self, progress=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RunIndex, "refresh", full)
    results = []
    # in a thread of its own: the Chromium of this module's browser tests keeps an event loop in this one
    thread = threading.Thread(target=lambda: results.append(CliRunner().invoke(cli, ["view", str(run_copy), "--port", "0"])))
    thread.start()
    thread.join(120)
    result = results[0]
    assert result.exit_code == 74, result.output
    assert "Cannot listen" not in result.output
    assert result.output.strip().splitlines()[-1] == (
        f"Error: Indexing {run_copy} failed: No space left on device (ENOSPC); free some space on that disk.")


def test_the_report_sums_what_statistics_json_counts(run_copy):
    """One aggregator: a line that no record class reads is listed by the viewer but counted by neither."""
    from hermes_batch.folder.runfolder import RunFolder
    from hermes_batch.folder.statistics import build_statistics
    from hermes_batch.view.index import RunIndex
    from hermes_batch.view.summary import summarize

    record = read_jsonl(run_copy / "batch_0.jsonl")[0]
    record["prompt_index"] = 77
    record["tool_stats"] = {"terminal": {"count": "many", "success": 0, "failure": 0}}  # no count: not a record
    with open(run_copy / "batch_0.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")
    (run_copy / "statistics.json").unlink()  # the report of a run still going: nothing taken from it
    saved = {path.name: path.read_bytes() for path in (run_copy / "index").iterdir()}
    index = RunIndex(run_copy)
    index.refresh()
    assert 77 in [index.columns.prompt[i] for i in range(len(index))]
    summary = summarize(index)
    stats = build_statistics(RunFolder(run_copy.parent, run_copy.name))
    finished = stats["finished"]
    reasoning = finished["reasoning"]
    assert summary["reasoning"]["finished"] == [reasoning["with_reasoning"], reasoning["without_reasoning"],
                                                reasoning["samples_without_reasoning"]]
    assert dict((name, row[0]) for name, row in summary["tools"]) == \
        {name: usage["count"] for name, usage in finished["tool_usage"].items() if usage["count"]}
    assert summary["partial"] == finished["partial"]
    assert summary["tokens"]["completion"] == stats["tokens"]["completion"]
    assert saved == {path.name: path.read_bytes() for path in (run_copy / "index").iterdir()}  # the run's, untouched


def test_view_takes_a_free_port_by_default_not_one_a_model_server_may_use(run_copy, monkeypatch):
    from hermes_batch.view import server

    asked = []

    async def serve(run_dir, host, port, announce, progress=None):
        asked.append((host, port))
        announce(f"http://{host}:40123/?token=t", 0)

    monkeypatch.setattr(server, "serve", serve)
    result = CliRunner().invoke(cli, ["view", str(run_copy)])
    assert result.exit_code == 0, result.output
    assert asked == [("127.0.0.1", 0)]  # 0: the system picks a free port, which the printed URL names
    assert "at http://127.0.0.1:40123/" in result.output
