"""The shortcut audit in report.html and the viewer (issue 43): the samples with findings by kind, and a record's
findings beside its conversation; nothing of it for runs older than the audit."""

from __future__ import annotations

import pytest

from hermes_batch.folder.runfolder import RunFolder
from hermes_batch.formats.records import AuditFinding, Discarded
from hermes_batch.testing import make_trajectory
from hermes_batch.view.report import write_report
from reward_rig import rewarded, write  # noqa: F401 (fixture)
from view_rig import browser, expect, needs_chromium, page, viewer  # noqa: F401 (fixtures)

READS_TESTS = AuditFinding("tests-read", 2, "terminal", "tests/check_count.sh", "cat tests/check_count.sh")
REFLOG = AuditFinding("git-history", 2, "terminal", "git reflog", "git reflog")


def sample(index: int, *findings: AuditFinding, passed: bool = True):
    return make_trajectory(prompt_index=index, metadata={"audit": findings, "passed": passed, "verified": True,
                                                         "reward": 1.0 if passed else 0.0, "id": f"row-{index}",
                                                         "content_key": f"{index:032x}"})


@pytest.fixture
def audited(tmp_path) -> RunFolder:
    """Four audited samples: one kept that read the tests and passed, one that read the git history and failed,
    one clean, and one no-shortcuts discarded."""
    folder = RunFolder(tmp_path / "out", "audited")
    folder.create()
    write(folder.batch_path(0), sample(0, READS_TESTS), sample(1, REFLOG, passed=False), sample(2))
    write(folder.discarded, Discarded(sample(3, READS_TESTS, REFLOG), ("no-shortcuts",), ("tests-read: ...",)))
    return folder


def test_the_report_counts_the_samples_with_findings_by_kind(audited):
    html = write_report(audited.dir).read_text()
    assert 'data-count="shortcuts"' in html and "3 / 4" in html
    assert 'id="chart-audit"' in html
    assert "3 of 4 audited samples have findings; 2 of the 3 passing ones, 2 kept." in html
    assert "tests-read: not passed: 0" in html and "tests-read: passed: 2" in html  # the bars' titles
    assert "git-history: not passed: 1" in html and "permissions" not in html.split('id="chart-audit"')[1][:2000]
    assert "shortcut tests-read" in html  # a sample's findings, in the records shown


def test_a_run_older_than_the_audit_shows_nothing_of_it(rewarded):
    html = write_report(rewarded.dir).read_text()
    assert 'data-count="shortcuts"' not in html and "chart-audit" not in html


def test_a_run_without_findings_says_so(tmp_path):
    folder = RunFolder(tmp_path / "out", "clean")
    folder.create()
    write(folder.batch_path(0), sample(0), sample(1))
    html = write_report(folder.dir).read_text()
    assert "0 / 2" in html and "None of the 2 audited samples did anything the shortcut audit looks for." in html


@needs_chromium
def test_the_viewer_shows_the_audit_and_a_record_s_findings(audited, viewer, page):
    v = viewer(audited.dir)
    page.goto(v.url)
    page.click("#tab-summary")
    expect(page.locator('#pane-summary .card[data-count="shortcuts"] .num')).to_have_text("3 / 4")
    expect(page.locator("#pane-summary #chart-audit rect.bar")).to_have_count(4)  # two kinds, two series each
    page.goto(v.url + "#/batch_0.jsonl:0")  # the first record (a byte offset)
    expect(page.locator("#detail .why.audit")).to_contain_text("shortcut tests-read (turn 2, terminal): "
                                                               "tests/check_count.sh")
