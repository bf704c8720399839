"""The report and the viewer of a run with verifiers: pass@k and rewards in the summary, the list filtered by reward."""

from __future__ import annotations

import pytest

from hermes_batch.view.index import RunIndex
from hermes_batch.view.query import Query, run_query
from hermes_batch.view.report import write_report
from reward_rig import rewarded  # noqa: F401 (fixture)
from view_rig import browser, demo_run_dir, needs_chromium, page, run_copy, viewer  # noqa: F401 (fixtures)
from view_rig import expect


@pytest.fixture
def index(rewarded):
    idx = RunIndex(rewarded.dir)
    idx.refresh()
    yield idx
    idx.close()


def prompts(page_: dict) -> list:
    return [(row["prompt_index"], row["verdict"], row["reward"]) for row in page_["rows"]]


def test_the_list_filters_by_verdict_and_minimum_reward(index):
    assert run_query(index, Query(verdict="passed"))["total"] == 4
    assert {r["status"] for r in run_query(index, Query(verdict="passed"))["rows"]} == {"kept"}
    assert run_query(index, Query(verdict="failed"))["total"] == 8  # verified below the mark: 6 at 0.0, 2 at 0.5
    assert prompts(run_query(index, Query(verdict="unverified"))) == [(3, "unverified", 0.0)]
    assert run_query(index, Query(min_reward=0.5))["total"] == 6
    assert run_query(index, Query(min_reward=0.0))["total"] == 12  # the unverified sample has no reward to compare
    assert run_query(index, Query(min_reward=0.5, status="discarded"))["total"] == 2
    best = run_query(index, Query(sort="reward", desc=True, limit=4))["rows"]
    assert [r["reward"] for r in best] == [1.0] * 4
    query = Query.from_params({"verdict": "passed", "min_reward": "0.7"})
    assert query.verdict == "passed" and query.min_reward == pytest.approx(0.7)
    assert Query.from_params({"min_reward": "much"}).min_reward is None


def test_a_reloaded_index_keeps_the_rewards(rewarded, index):
    index.save()
    again = RunIndex(rewarded.dir)
    try:
        again.refresh()
        assert run_query(again, Query(verdict="passed"))["total"] == 4
        assert run_query(again, Query(min_reward=0.5))["total"] == 6
    finally:
        again.close()


def test_the_report_shows_pass_at_k_and_the_rewards_only_for_runs_with_verifiers(rewarded, run_copy):
    html = write_report(rewarded.dir).read_text()
    assert 'id="chart-passk"' in html and 'id="chart-rewards"' in html
    assert 'data-count="passed"' in html and "4 / 13" in html
    assert "2 of 4 rows never passed (50.0%)" in html
    assert "<tr><td>file</td><td>6</td><td>1</td><td>4</td><td>3 (75.0%)</td>" in html  # per toolsets too
    assert "verifier command" in html  # a sample's verifiers, in the records shown
    plain = write_report(run_copy).read_text()
    assert "chart-passk" not in plain and "chart-rewards" not in plain and 'data-count="passed"' not in plain


@needs_chromium
def test_the_viewer_filters_by_reward(rewarded, viewer, page):
    v = viewer(rewarded.dir)
    page.goto(v.url)
    rows = page.locator("#list .row")
    expect(rows).to_have_count(13)
    expect(page.locator("#verdict")).to_be_visible()
    page.select_option("#verdict", "passed")
    expect(rows).to_have_count(4)
    expect(rows.first).to_contain_text("passed 1")
    page.select_option("#verdict", "")
    page.fill("#min_reward", "0.5")
    page.locator("#min_reward").dispatch_event("change")
    expect(rows).to_have_count(6)
    page.select_option("#verdict", "failed")
    expect(rows).to_have_count(2)
    expect(rows.first).to_contain_text("failed 0.5")


@needs_chromium
def test_a_run_without_verifiers_shows_no_reward_filter(run_copy, viewer, page):
    v = viewer(run_copy)
    page.goto(v.url)
    expect(page.locator("#list .row").first).to_be_visible()
    expect(page.locator("#verdict")).to_be_hidden()
    expect(page.locator("#min_reward")).to_be_hidden()
