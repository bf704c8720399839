"""The setup scripts of the README's test command: quiet when all is well, everything shown when not."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

NOISY = """#!/bin/sh
echo "Reading package lists... Done"
echo "debconf: delaying package configuration, since apt-utils is not installed" >&2
echo "WARNING: Location '/opt/nowhere' is ignored: it is either a non-existing path or lacks a specific scheme." >&2
exit ${FAKE_STATUS:-0}
"""


def bash(tmp_path, script: str, status: int = 0) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("apt-get", "pip"):
        fake = bin_dir / tool
        fake.write_text(NOISY)
        fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_STATUS": str(status), "TMPDIR": str(tmp_path), "HOME": str(tmp_path)}
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_apt_installs_print_nothing_when_they_succeed(tmp_path):
    done = bash(tmp_path, '. scripts/docker.sh; _hb_as_root() { "$@"; }; _hb_apt_install busybox-static && echo OK')
    assert done.stdout == "OK\n" and done.stderr == ""


def test_a_failing_apt_install_shows_all_it_said(tmp_path):
    done = bash(tmp_path, '. scripts/docker.sh; _hb_as_root() { "$@"; }; _hb_apt_install busybox-static || echo FAILED', 100)
    assert done.stdout.endswith("FAILED\n")
    assert "debconf: delaying" in done.stderr and "exit status 100" in done.stderr


def test_pip_notes_are_hidden_on_success_and_shown_on_failure(tmp_path):
    ok = bash(tmp_path, ". scripts/python.sh; quietly pip install -e . && echo OK")
    assert ok.stdout == "OK\n" and ok.stderr == ""
    failed = bash(tmp_path, ". scripts/python.sh; quietly pip install -e . || echo FAILED", 1)
    assert failed.stdout.endswith("FAILED\n") and "is ignored" in failed.stderr
    assert not list(tmp_path.glob("hermes-batch-setup.*")), "the kept-aside output is removed"


def test_build_folders_are_ignored_by_git():
    for path in ("build/lib/x.py", "hermes_batch_docker/build/lib/x.py", "plugins/hermes_batch_example/build/x"):
        assert subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT).returncode == 0, path
