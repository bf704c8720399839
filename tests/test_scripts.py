"""The setup scripts of the README's test command: quiet when all is well, everything shown when not."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

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


# --- scripts/test.sh stops what it started, and only that --------------------------------------------

FAKE_DOCKER = r"""#!/usr/bin/env bash
# A stand-in for the docker client: the engine answers while the fake dockerd runs (or when FOUND_ENGINE=1),
# containers are files in $STATE; every call is logged.
echo "docker $*" >> "$STATE/log"
engine() { [ "${FOUND_ENGINE:-}" = 1 ] || { [ -s "$STATE/dockerd.pid" ] && kill -0 "$(cat "$STATE/dockerd.pid")" 2>/dev/null; }; }
engine || exit 1
case "$1" in
    info|import) exit 0 ;;
    image) exit 0 ;;
    inspect) [ -f "$STATE/container-${@: -1}" ] && cat "$STATE/container-${@: -1}" || exit 1 ;;
    rm) rm -f "$STATE/container-${@: -1}" ;;
    run) while [ "$1" != --name ]; do shift; done; echo "true 6" > "$STATE/container-$2" ;;
    exec) case "$*" in *--version*) echo "apptainer version 1.4.5" ;; esac ;;
esac
"""

FAKE_DOCKERD = r"""#!/usr/bin/env bash
while [ $# -gt 0 ]; do [ "$1" = --pidfile ] && pidfile=$2; shift; done
echo $$ > "$pidfile"
echo "dockerd started" >> "$STATE/log"
trap 'echo "dockerd stopped" >> "$STATE/log"; rm -f "$pidfile"; exit 0' TERM
while :; do sleep 0.1; done
"""

FAKE_PYTHON = r"""#!/usr/bin/env bash
[ "$1" = -c ] && exit 0
echo "pytest $* (fd 9 $( [ -e /proc/$$/fd/9 ] && echo inherited || echo closed))" >> "$STATE/log"
# the Nth pytest run exits with the Nth of FAKE_PYTEST_STATUSES (else FAKE_PYTEST_STATUS)
statuses=(${FAKE_PYTEST_STATUSES:-})
runs=$(grep -c '^pytest ' "$STATE/log")
exit "${statuses[$((runs - 1))]:-${FAKE_PYTEST_STATUS:-0}}"
"""


@pytest.fixture(autouse=True)
def _no_stand_in_left(tmp_path):
    yield
    # the fake dockerds a test left running (on purpose, or by failing): those whose command names this test's folder
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"{tmp_path}/".encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def run_test_sh(tmp_path, env=None, args=("--all", "-q")) -> tuple[subprocess.CompletedProcess, str]:
    """scripts/test.sh with stand-ins for docker, dockerd, apt-get, pip and python (nothing real is started or stopped)."""
    state, bin_dir, venv = tmp_path / "state", tmp_path / "bin", tmp_path / "venv"
    for folder in (state, bin_dir, venv / "bin"):
        folder.mkdir(parents=True, exist_ok=True)
    for path, text in [(bin_dir / "docker", FAKE_DOCKER), (bin_dir / "dockerd", FAKE_DOCKERD),
                       (bin_dir / "sudo", '#!/bin/sh\nexec "$@"\n'),
                       (bin_dir / "apt-get", '#!/bin/sh\necho "apt-get $*" >> "$STATE/log"\nexit 1\n'),
                       (venv / "bin" / "python", FAKE_PYTHON),
                       (venv / "bin" / "pip", '#!/bin/sh\necho "pip $*" >> "$STATE/log"\nexit 0\n')]:
        path.write_text(text)
        path.chmod(0o755)
    base = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path), "STATE": str(state),
        "HERMES_BATCH_VENV": str(venv), "HERMES_DOCKERD_PIDFILE": str(state / "dockerd.pid"),
        "HERMES_DOCKERD_LOG": str(state / "dockerd.log"), "HERMES_APPTAINER_HOME": str(tmp_path / "apptainer"),
        "HERMES_APPTAINER_CONTAINER": "test-rig", "HERMES_BATCH_SERVICES_LOCK": str(tmp_path / "services.lock"),
        "HERMES_CHROMIUM": "/bin/true",
    }
    done = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=120)
    return done, (state / "log").read_text()


def test_test_sh_stops_the_engine_and_container_it_started(tmp_path):
    done, log = run_test_sh(tmp_path, {"FAKE_PYTEST_STATUS": "3"})
    assert done.returncode == 3, done.stderr  # pytest's status
    assert "dockerd started" in log and "pytest -m pytest -n auto --dist loadgroup -m not (perf or modal or browser) -q (fd 9 closed)" in log
    [run] = [line for line in log.splitlines() if line.startswith("docker run ")]
    assert "--cap-drop ALL" in run and "--cap-add SYS_ADMIN" in run
    for privilege in ("--privileged", "seccomp=unconfined", "--cap-add ALL", "--restart"):
        assert privilege not in run
    after = log.split("pytest -m pytest", 1)[1]
    assert "docker rm -f test-rig" in after and "dockerd stopped" in after
    assert after.index("docker rm -f test-rig") < after.index("dockerd stopped")  # the container, then its engine
    assert "removing the container test-rig it started" in done.stderr
    assert "stopping the dockerd it started" in done.stderr


def test_test_sh_leaves_what_it_found_running(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "container-test-rig").write_text("true 5")  # an older rig that works, in use
    done, log = run_test_sh(tmp_path, {"FOUND_ENGINE": "1"})
    assert done.returncode == 0, done.stderr
    assert "dockerd started" not in log and "docker run" not in log and "docker rm" not in log
    assert "stopp" not in done.stderr and "removing" not in done.stderr


def test_test_sh_keeps_what_it_started_when_asked_or_in_use(tmp_path):
    done, log = run_test_sh(tmp_path / "kept", {"HERMES_BATCH_KEEP_SERVICES": "1"})
    assert done.returncode == 0, done.stderr
    assert "docker rm -f test-rig" not in log.split("pytest -m pytest", 1)[1] and "dockerd stopped" not in log
    assert "left running as HERMES_BATCH_KEEP_SERVICES=1 asks: the container test-rig dockerd (pid" in done.stderr

    lock = tmp_path / "shared" / "services.lock"
    lock.parent.mkdir()
    other = subprocess.Popen(["flock", "-s", str(lock), "sleep", "60"])  # another test run using them
    try:
        time.sleep(0.5)
        done, log = run_test_sh(tmp_path / "shared", {"HERMES_BATCH_SERVICES_LOCK": str(lock)})
    finally:
        other.kill()
        other.wait()
    assert done.returncode == 0, done.stderr
    assert "another scripts/test.sh is using what this one started; left running" in done.stderr
    assert "dockerd stopped" not in log


# --- scripts/test.sh alone: the fast tests in parallel, nothing installed or started; --all: everything ---------

FAST = "-n auto --dist loadgroup -m not (docker or apptainer or modal or ray or browser or slow or perf)"


def pytest_runs(log: str) -> list[str]:
    return [line.removeprefix("pytest -m pytest ") for line in log.splitlines() if line.startswith("pytest ")]


def test_test_sh_alone_runs_the_fast_tests_in_parallel_and_starts_nothing(tmp_path):
    done, log = run_test_sh(tmp_path, {"FAKE_PYTEST_STATUS": "3"}, args=("-q", "tests/test_x.py"))
    assert done.returncode == 3, done.stderr  # pytest's status
    assert pytest_runs(log) == [f"{FAST} -q tests/test_x.py (fd 9 closed)"]  # the caller's arguments come last
    assert not [line for line in log.splitlines() if line.startswith(("docker", "apt-get"))], log
    # it says what it does, step by step (the first run's pip took a minute in silence), and starts nothing
    said = done.stderr.splitlines()
    assert [line.split(":", 1)[0] for line in said] == ["test.sh"] * 3, said
    assert said[0].startswith("test.sh: installing into") and said[2].startswith("test.sh: running the tests")
    assert "docker.sh" not in done.stderr and "apt-get" not in done.stderr


def test_test_sh_all_runs_the_perf_tests_alone_after_the_others(tmp_path):
    done, log = run_test_sh(tmp_path, {"FOUND_ENGINE": "1"}, args=("--all", "-x"))
    assert done.returncode == 0, done.stderr
    assert pytest_runs(log) == ["-n auto --dist loadgroup -m not (perf or modal or browser) -x (fd 9 closed)", "-n 0 -m (perf or modal or browser) -x (fd 9 closed)"]
    assert "docker info" in log  # it made sure of the engine first


def test_test_sh_all_narrows_both_runs_by_the_callers_marker_expression(tmp_path):
    done, log = run_test_sh(tmp_path, {"FOUND_ENGINE": "1"}, args=("--all", "-m", "docker or ray", "-q", "-mslow"))
    assert done.returncode == 0, done.stderr
    assert pytest_runs(log) == ["-n auto --dist loadgroup -m (slow) and not (perf or modal or browser) -q (fd 9 closed)",
                                 "-n 0 -m (slow) and (perf or modal or browser) -q (fd 9 closed)"]


@pytest.mark.parametrize("statuses, status", [
    ("0 0", 0), ("1 0", 1), ("0 1", 1), ("2 1", 2),
    ("5 0", 0), ("0 5", 0), ("5 1", 1), ("5 5", 5),  # 5: the arguments selected no test of that run
])
def test_test_sh_all_fails_when_either_run_fails(tmp_path, statuses, status):
    done, log = run_test_sh(tmp_path, {"FOUND_ENGINE": "1", "FAKE_PYTEST_STATUSES": statuses})
    assert done.returncode == status, done.stderr
    assert len(pytest_runs(log)) == 2  # the perf tests run even when the others failed


def test_pip_runs_again_only_when_what_it_installs_changed(tmp_path):
    pip_calls = lambda log: [line for line in log.splitlines() if line.startswith("pip ")]  # noqa: E731
    _, log = run_test_sh(tmp_path, args=())
    first, plugins = pip_calls(log)
    assert "install --disable-pip-version-check -e .[test]" in first and "-e plugins/hermes_batch_filters" in first
    # the default run's tests use neither ray nor playwright: their plugins come without their dependencies
    assert "ray" not in first and "playwright" not in first and "duckdb" not in first
    assert plugins.endswith("--no-deps -e plugins/hermes_batch_toolbox -e plugins/hermes_batch_ray")
    _, log = run_test_sh(tmp_path, args=())
    assert len(pip_calls(log)) == 2, "the second run does not run pip"
    stamp = tmp_path / "venv" / ".hermes-batch-test-install"
    stamp.write_text("another set of pyproject.toml files\n")
    _, log = run_test_sh(tmp_path, args=())
    assert len(pip_calls(log)) == 3
    assert stamp.read_text() != "another set of pyproject.toml files\n"


def test_test_sh_all_installs_what_the_marked_tests_need_too(tmp_path):
    done, log = run_test_sh(tmp_path, {"FOUND_ENGINE": "1"}, args=("--all", "-q"))
    assert done.returncode == 0, done.stderr
    pips = [line for line in log.splitlines() if line.startswith("pip ")]
    assert len(pips) == 3 and pips[2].endswith(
        "-e plugins/hermes_batch_toolbox -e plugins/hermes_batch_ray playwright>=1.49 duckdb>=1.1")
    assert "--no-deps" not in pips[2]  # with ray and the toolbox's playwright


def test_the_default_install_lists_the_toolboxs_dependencies_but_playwright():
    import re
    import tomllib

    script = (ROOT / "scripts" / "test.sh").read_text()
    block = script[script.index("PACKAGES=(") : script.index("\n)\n", script.index("PACKAGES=("))]
    block = "\n".join(line for line in block.splitlines() if not line.strip().startswith("#"))
    listed = set(re.findall(r"'([^']+)'|\b(lxml_html_clean)\b", block))
    listed = {a or b for a, b in listed} - {".[test]"}
    toolbox = tomllib.loads((ROOT / "plugins" / "hermes_batch_toolbox" / "pyproject.toml").read_text())
    wanted = {dep for dep in toolbox["project"]["dependencies"] if not dep.startswith(("hermes-batch", "playwright"))}
    assert listed == wanted


def test_demo_sh_runs_pip_only_the_first_time(tmp_path):
    """A second demo ran pip again (9.8 s); the first said nothing for a minute."""
    venv, state = tmp_path / "venv", tmp_path / "state"
    (venv / "bin").mkdir(parents=True)
    state.mkdir()
    for path, text in [(venv / "bin" / "python", '#!/bin/sh\n[ "$1" = -c ] && exit 0\n'),
                       (venv / "bin" / "pip", '#!/bin/sh\necho "pip $*" >> "$STATE/log"\necho "Collecting attrs>=23"\n'),
                       (venv / "bin" / "hermes-batch", '#!/bin/sh\necho "hermes-batch $*" >> "$STATE/log"\n')]:
        path.write_text(text)
        path.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path), "STATE": str(state),
           "HERMES_BATCH_VENV": str(venv), "OPENROUTER_API_KEY": "sk-test"}
    said = []
    for _ in range(2):
        done = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        said.append(done.stderr)
    log = (state / "log").read_text().splitlines()
    assert [line for line in log if line.startswith("pip ")] == ["pip install --disable-pip-version-check -e .[testing]"]
    assert len([line for line in log if line.startswith("hermes-batch run")]) == 2
    assert "demo.sh: installing into" in said[0] and "  pip: collecting attrs" in said[0]
    assert said[1] == ""
