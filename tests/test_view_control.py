"""The viewer's run controls in Debian's Chromium: the same as hermes-batch ctl, against a running run."""

from __future__ import annotations

import time

from view_rig import expect
from view_rig import browser, needs_chromium, page, viewer  # noqa: F401 (fixtures)

from hermes_batch.errors import EXIT_INTERRUPTED
from hermes_batch.testing import ToolLoopScript, wait_for, write_dataset

pytestmark = needs_chromium


def test_the_viewer_pauses_resumes_sets_workers_and_stops_a_running_run(model_server, runner, tmp_path, viewer, page):
    server = model_server(ToolLoopScript(tool_calls=1), latency=0.1)
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(80)])
    proc = runner.spawn(dataset, "--num_workers", "4", "--no_filters", server=server)
    folder = runner.folder()
    try:
        wait_for(lambda: (folder / "control" / "socket").exists() and server.request_count > 4, 60,
                 "the run's control socket", proc)
        v = viewer(folder)
        page.goto(v.url)
        state = page.locator("#control-state")
        expect(state).to_contain_text("running")

        page.click("#ctl-pause")
        expect(state).to_contain_text("paused")
        time.sleep(0.6)  # the calls in flight end
        before = server.request_count
        time.sleep(1.0)
        assert server.request_count == before, "a model call went out while paused"
        page.click("#ctl-resume")
        expect(state).to_contain_text("running")
        wait_for(lambda: server.request_count > before, 10, "calls after resume", proc)

        page.fill("#ctl-workers", "2")
        page.click("#ctl-set-workers")
        expect(state).to_contain_text("of 2 workers")
        page.fill("#ctl-workers", "9")
        page.click("#ctl-set-workers")
        expect(state).to_contain_text("from 1 to 4")

        page.click("#ctl-stop")
        proc.wait(60)
        assert proc.returncode == EXIT_INTERRUPTED
        expect(state).to_contain_text("no run listening")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
