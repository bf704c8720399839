"""1000 sessions under ``ulimit -n 1024`` with the browser in use: the run counts the browser's descriptors.

Each open browser context has a proxy in the run's process (its listening
socket, and per connection of Chromium's one onwards, at most 32), so the
browser's descriptors compete with the prompts' connections and pipes.  The
run counts them (``BrowserRuntime.files_needed``) with its per-prompt estimate
and runs as many prompts at once as fit, instead of failing prompts with
EMFILE after their model calls were paid.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import subprocess
import sys

import pytest

from hermes_batch.testing import Reply, write_dataset
from hermes_batch_toolbox.testing import LocalWebsite

pytestmark = [
    pytest.mark.skipif(not os.access("/usr/bin/chromium", os.X_OK), reason="needs Debian's chromium"),
    pytest.mark.timeout(1800),
]

PROMPTS = 1000


def browse_then_sleep(page: str):
    def script(request):
        browsing = "browser_navigate" in request.tools
        if request.turn == 0 and browsing:
            return Reply(tool_calls=[("browser_navigate", {"url": page})])
        if request.turn == (1 if browsing else 0):  # the prompt's command holds its pipes meanwhile
            return Reply(tool_calls=[("terminal", {"command": "sleep 0.2; echo slept"})])
        return Reply(content="done")

    return script


def test_a_thousand_sessions_under_1024_open_files_with_the_browser(runner, tmp_path, model_server, site):
    with contextlib.ExitStack() as stack:
        # seven sites, so that a page's 48 slow images hold Chromium's 32 connections to the proxy at once
        others = [stack.enter_context(LocalWebsite()) for _ in range(6)]
        page = f"{site.url}/many?n=48&delay=3&from={','.join(o.url for o in others)}"
        server = model_server(browse_then_sleep(page), latency=0.2, record=False)
        data = write_dataset(tmp_path / "d.jsonl", [{"prompt": f"task {i}"} for i in range(PROMPTS)])
        distributions = tmp_path / "distributions.json"
        distributions.write_text(json.dumps({"browse": {"description": "sometimes the browser",
                                                        "toolsets": {"browser": 20, "terminal": 100}}}))
        addresses = ",".join(s.address for s in (site, *others))

        def low_limit():
            resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

        args = runner.args(
            data, "--distribution_file", str(distributions), "--distribution", "browse", "--seed", "1",
            "--no_filters", "--batch_size", "100", "--num_workers", "1000",
            "-T", f"browser.allow_addresses={addresses}", "-T", "browser.timeout=60", "-T", "browser.slot_timeout=900",
            server=server,
        )
        proc = subprocess.run([sys.executable, "-m", "hermes_batch", *args], capture_output=True, text=True,
                              preexec_fn=low_limit, timeout=1700)
    err = proc.stderr
    assert proc.returncode == 0, err[-3000:]
    assert "Too many open files" not in err and "Traceback" not in err, err[-3000:]
    assert not (runner.folder() / "failed.jsonl").exists(), (runner.folder() / "failed.jsonl").read_text()[:3000]
    warning = next(line for line in err.splitlines() if "--num_workers 1000 needs more" in line)
    assert "open files (limit 1024)" in warning and re.search(r"run 'ulimit -n \d+' before hermes-batch", warning)
    trajectories = runner.records("trajectories.jsonl")
    assert len(trajectories) == PROMPTS
    browsed = [t for t in trajectories if "browser" in t["toolsets_used"]]
    assert len(browsed) > 100
    for trajectory in browsed:
        [result] = [turn["value"] for turn in trajectory["conversations"] if turn["from"] == "tool" and "Many" in turn["value"]]
        assert '\\"success\\": true' in result or '"success": true' in result, result
