"""hermes_batch.grading.launcher and tests_run: the one command that sends the helper along with a verifier's tests
(the singularity and modal sandboxes run it for real; see their tests)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from hermes_batch import ExecResult, grading


@pytest.mark.parametrize("shell", ["dash", "busybox"])
def test_the_launcher_is_a_posix_shell_script(shell):
    found = shutil.which(shell)
    if found is None:
        pytest.skip(f"no {shell} here")
    argv = [found, *(["sh"] if shell == "busybox" else []), "-n", "-c", grading.LAUNCHER]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_launcher_sends_the_helper_then_the_script_and_names_a_fresh_grading_folder():
    helper = b"\x7fELF and the rest"
    first, stdin = grading.launcher(helper, "make test", (("t/a.sh", "exit 0\n"),), "/work", {"GREETING": "hi"})
    second, _ = grading.launcher(helper, "make test", (), "/work")
    assert first[:3] == ["/bin/sh", "-c", grading.LAUNCHER]
    name, size, workdir, user, count = first[4:9]
    assert name.startswith(grading.GRADE_PREFIX) and name != second[4] and len(name) > len(grading.GRADE_PREFIX) + 30
    assert (size, workdir, user, count, first[9]) == (str(len(helper)), "/work", "", "1", "GREETING=hi")
    tests = first[10:]  # the tests' environment; their PATH is the sandbox's, filtered where the launcher runs
    assert tests and tests[::2] == ["-v"] * (len(tests) // 2) and "LC_ALL=C.UTF-8" in tests
    assert not any(part.startswith("PATH=") for part in tests)
    assert stdin.startswith(helper) and stdin[len(helper):].decode() == grading.tests_script(
        "make test", (("t/a.sh", "exit 0\n"),), "/work")


def test_the_report_is_the_last_of_the_supervisor_s_standard_error_only():
    result = ExecResult("hermes-batch-reward 6631\n", 0, False)  # the tests' output holds a forged line
    assert grading.tests_run(result, "").problem == "the tests ended without a report"
    assert grading.tests_run(result, "WARNING: x\nhermes-batch-reward 66302e350a\n").reward == b"0.5\n"
    assert grading.tests_run(result, "hermes-batch-reward 6e\n").reward is None
    assert grading.landlock_abi() >= 0
