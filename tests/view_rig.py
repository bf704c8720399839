"""Fixtures of the report and viewer tests: the demo run, a running viewer, Debian's Chromium through Playwright."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_batch.testing.demo_run import make_demo_run

CHROMIUM = os.environ.get("HERMES_CHROMIUM", "/usr/bin/chromium")
needs_chromium = pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason="needs Debian's chromium (scripts/chromium.sh)")
CHROMIUM_FLAGS = ("--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-dev-shm-usage")


_DEMO: dict = {}  # one demo run for all modules: each module that imports the fixture gets its own copy of it


@pytest.fixture(scope="session")
def demo_run_dir(tmp_path_factory) -> Path:
    """One demo run for the whole session, made by the first pytest-xdist worker that needs it (about 10 s of
    waiting on the model server and the sandboxes, which each worker need not repeat); tests that change a run
    copy it first (``run_copy``)."""
    if "run" not in _DEMO:
        if os.environ.get("PYTEST_XDIST_WORKER"):
            shared = tmp_path_factory.getbasetemp().parent  # this session's, shared by its workers
            with open(shared / "demo-run.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not (shared / "demo-run.done").exists():
                    make_demo_run(shared / "demo-run" / "out")
                    (shared / "demo-run.done").write_text("")
            _DEMO["run"] = shared / "demo-run" / "out" / "demo"
        else:
            _DEMO["run"] = make_demo_run(tmp_path_factory.mktemp("view") / "out")
    return _DEMO["run"]


@pytest.fixture
def run_copy(demo_run_dir, tmp_path) -> Path:
    """A copy of the demo run this test may change (its view index cache left out)."""
    target = tmp_path / "out" / "demo"
    shutil.copytree(demo_run_dir, target, ignore=shutil.ignore_patterns(".hermes-batch-view"))
    return target


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class ViewerProcess:
    """``hermes-batch view RUN_DIR --port 0`` as a child process; ``url`` (with its token) once it said where it listens."""

    def __init__(self, run_dir: Path, *extra: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hermes_batch", "view", str(run_dir), "--port", "0", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.announcement = self.proc.stdout.readline()
        match = re.search(r"at (http://\S+/)\?token=(\S+) ", self.announcement)
        if not match:
            self.stop()
            raise AssertionError(f"the viewer did not start: {self.announcement!r} {self.proc.stderr.read()[-2000:]}")
        self.base, self.token = match.group(1), match.group(2)  # http://127.0.0.1:PORT/ and this start's token
        self.url = f"{self.base}?token={self.token}"  # what it printed: opening it lets the page in

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def viewer():
    """Factory: ``viewer(run_dir)`` starts the viewer, stopped after the test."""
    started = []

    def start(run_dir, *extra):
        v = ViewerProcess(run_dir, *extra)
        started.append(v)
        return v

    yield start
    for v in started:
        v.stop()


@pytest.fixture(scope="module")
def shared_viewer(demo_run_dir, tmp_path_factory):
    """One viewer over a copy of the demo run, for the tests of a module that only read."""
    target = tmp_path_factory.mktemp("shared") / "demo"
    shutil.copytree(demo_run_dir, target, ignore=shutil.ignore_patterns(".hermes-batch-view"))
    v = ViewerProcess(target)
    yield v
    v.stop()


def expect(*args, **kwargs):
    """Playwright's ``expect``, imported when a browser test calls it: the everyday run, which leaves those tests
    out, does without Playwright (scripts/test.sh --all installs it)."""
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(*args, **kwargs)


@pytest.fixture(scope="module")
def browser():
    """Chromium for one module: Playwright's sync API keeps an event loop running while it is open, which the
    async tests of the modules after this one must not find."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=list(CHROMIUM_FLAGS))
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    p = context.new_page()
    p.set_default_timeout(15_000)
    yield p
    context.close()


@pytest.fixture
def small_disk(tmpfs):
    """A real 1 MiB tmpfs mounted inside tmp_path (we are root), to fill up; unmounted afterwards."""
    return tmpfs("1m")


def fill_up(folder: Path) -> Path:
    """Fill the disk ``folder`` is on to its last byte; returns the filler file (delete it to free the space)."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:  # ENOSPC: the last write filled what was left
            pass
    return filler
