"""Screenshots of report.html and `hermes-batch view` for the README, taken in Debian's Chromium.

Makes the demo run of hermes_batch.testing.demo_run against the scripted
model server in a temporary folder, then writes docs/images/report.png and
docs/images/view.png:

    .venv/bin/python docs/screenshots.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import expect, sync_playwright

from hermes_batch.testing.demo_run import make_demo_run

IMAGES = Path(__file__).resolve().parent / "images"
CHROMIUM = os.environ.get("HERMES_CHROMIUM", "/usr/bin/chromium")
VIEWPORT = {"width": 1280, "height": 800}


def main() -> None:
    IMAGES.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = make_demo_run(Path(tmp) / "data")
        viewer = subprocess.Popen([sys.executable, "-m", "hermes_batch", "view", str(run_dir), "--port", "0"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            url = re.search(r"at (http://\S+/) ", viewer.stdout.readline()).group(1)
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport=VIEWPORT)
                page.goto(run_dir.joinpath("report.html").as_uri())
                page.screenshot(path=IMAGES / "report.png")
                page.goto(url)
                page.locator("#list .row", has_text="Compute 6 times 7").click()
                expect(page.locator("#detail .tool-call").first).to_be_visible()
                page.locator("#detail details.reasoning summary").first.click()
                page.screenshot(path=IMAGES / "view.png")
                browser.close()
        finally:
            viewer.terminate()
            viewer.wait()
    for name in ("report.png", "view.png"):
        print(f"{IMAGES / name}: {(IMAGES / name).stat().st_size // 1024} kB")


if __name__ == "__main__":
    main()
