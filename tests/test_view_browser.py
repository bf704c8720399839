"""`hermes-batch view` in Debian's Chromium: search, filters, a trajectory, and a record that lands while the page is open."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from view_rig import expect
from view_rig import (  # noqa: F401 (fixtures)
    browser, demo_run_dir, needs_chromium, page, read_jsonl, run_copy, shared_viewer, viewer,
)

pytestmark = needs_chromium


def _rows(page):
    return page.locator("#list .row")


def test_viewer_binds_to_localhost_and_says_so(shared_viewer):
    v = shared_viewer
    assert v.url.startswith("http://127.0.0.1:")
    assert "only this machine can connect" in v.announcement


def test_viewer_refuses_a_port_in_use_in_one_sentence(run_copy):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "hermes_batch", "view", str(run_copy), "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"Error: Cannot listen on 127.0.0.1:{port}" in proc.stderr and "--port" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_search_filter_and_a_trajectory(shared_viewer, page):
    v = shared_viewer
    page.goto(v.url)
    expect(_rows(page)).to_have_count(11)
    expect(page.locator("#total")).to_contain_text("of 11")

    # a search finds the one prompt that says it
    page.fill("#q", "6 TIMES 7")
    expect(_rows(page)).to_have_count(1)
    expect(_rows(page).first).to_contain_text("Compute 6 times 7 with the shell.")

    # its trajectory: the tool call with its arguments, then the result
    _rows(page).first.click()
    call = page.locator("#detail .tool-call").first
    expect(call.locator(".tool-name")).to_contain_text("terminal")
    expect(call.locator("pre.json")).to_contain_text('"command": "echo step-0-')
    result = page.locator("#detail .tool-result").first
    expect(result.locator("pre.output")).to_contain_text("step-0-")
    expect(page.locator("#detail details.reasoning").first).not_to_have_attribute("open", "")
    assert page.url.endswith("#/batch_0.jsonl:" + page.locator("#detail .permalink").get_attribute("href").split(":")[-1])

    # filters narrow the list
    page.fill("#q", "")
    expect(_rows(page)).to_have_count(11)
    page.select_option("#status", "discarded")
    expect(_rows(page)).to_have_count(2)
    for i in range(2):
        assert _rows(page).nth(i).get_attribute("data-status") == "discarded"
    page.select_option("#filter", "hallucinated-tools")
    expect(_rows(page)).to_have_count(1)
    expect(_rows(page).first).to_contain_text("teleport")
    page.select_option("#status", "")
    page.select_option("#filter", "")
    page.select_option("#end", "max_turns")
    expect(_rows(page)).to_have_count(1)
    expect(_rows(page).first).to_contain_text("Keep listing files forever.")

    # sorting by model calls, most first
    page.select_option("#end", "")
    page.select_option("#sort", "turns")
    page.check("#desc")
    expect(_rows(page).first).to_contain_text("4 calls")


def test_a_link_opens_its_prompt(shared_viewer, page):
    v = shared_viewer
    failed_ref = "failed.jsonl:0"
    page.goto(v.url + "#/" + failed_ref)
    expect(page.locator("#detail .badge")).to_have_text("failed")
    expect(page.locator("#detail")).to_contain_text("The model endpoint answered 503")
    expect(page.locator("#detail")).to_contain_text("This prompt always meets a broken provider.")


def test_summary_tab_shows_the_counts_and_charts(demo_run_dir, shared_viewer, page):
    stats = json.loads((demo_run_dir / "statistics.json").read_text())
    v = shared_viewer
    page.goto(v.url)
    page.click("#tab-summary")
    expect(page.locator('#pane-summary .card[data-count="kept"] .num')).to_have_text(str(stats["prompts"]["kept"]))
    expect(page.locator('#pane-summary .card[data-count="discarded"] .num')).to_have_text(str(stats["prompts"]["discarded"]))
    expect(page.locator("#pane-summary #chart-discards rect.bar")).to_have_count(2)


def test_live_view_picks_up_a_record_appended_after_the_page_opened(run_copy, viewer, page):
    v = viewer(run_copy)
    page.goto(v.url)
    expect(_rows(page)).to_have_count(11)
    expect(page.locator("#live")).to_contain_text("8 kept")

    record = read_jsonl(run_copy / "batch_0.jsonl")[0]
    record["prompt_index"] = 11
    for turn in record["conversations"]:
        if turn["from"] == "human":
            turn["value"] = "A prompt that landed while the page was open."
    line = (json.dumps(record) + "\n").encode()
    batch = run_copy / "batch_3.jsonl"  # a new batch file, as the run opens one
    with open(batch, "ab") as fh:
        fh.write(line[:40])  # written in two parts, as a large record may be: only the whole line counts
        fh.flush()
        fh.write(line[40:])
    expect(_rows(page)).to_have_count(12, timeout=20_000)
    expect(_rows(page).last).to_contain_text("A prompt that landed while the page was open.")
    expect(page.locator("#live")).to_contain_text("9 kept")
    page.fill("#q", "landed while")
    expect(_rows(page)).to_have_count(1)


@pytest.mark.parametrize("ref", ["../run.json:0", "batch_0.jsonl:3", "statistics.json:0"])
def test_viewer_serves_only_records_of_the_run(shared_viewer, page, ref):
    v = shared_viewer
    page.goto(v.url)  # the page's cookie lets its own requests in
    assert page.request.get(v.base + "api/record?ref=batch_0.jsonl:0").status == 200
    response = page.request.get(v.base + "api/record?ref=" + ref)
    assert response.status == 404
