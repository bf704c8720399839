"""A verifier's tests apart from the agent (Sandbox.run_tests, issue 43) against the Modal stand-in (fake_modal:
Modal's cloud cannot run here), whose sandboxes are Docker containers: root with Docker's default capabilities,
Docker's seccomp profile (no namespaces) and this machine's Landlock.  The run-level corpus is in
test_modal_verification.py."""

from __future__ import annotations

import time

import pytest

from hermes_batch import RunContext, SandboxSpec
from hermes_batch_modal import ModalBackend, ModalConfig
from hermes_batch_modal import backend as modal_backend

from modal_rig import IMAGE_A

# The agent's leftovers: a folder and a file nobody may write, a file nobody may read, a daemon.
LEFTOVERS = (
    "echo mine > kept.txt; chmod 000 kept.txt; mkdir -p locked; chmod 555 locked . ; "
    "setsid sh -c 'while :; do sleep 0.1; done' > /dev/null 2>&1 & echo left"
)
# What the tests see, each line a fact "name=value"; the agent's code reports its user, whether it may read or write
# the reward, and its capabilities.
PROBE = (
    'echo 0.25 > "$HERMES_REWARD_FILE"; echo "user=$(id -u)"; echo "grade=${HERMES_TESTS_DIR%/tests}"; '
    'echo "hidden=$(cat "$HERMES_TESTS_DIR/sub/hidden.txt")"; echo "kept=$(cat kept.txt)"; '
    'echo "write=$(echo x > locked/new && echo yes)"; '
    'echo "untrusted=$("$HERMES_RUN_UNTRUSTED" sh -c \'id -u; cat "$0" 2>/dev/null || echo no-reward; '
    '{ echo 1 > "$0"; } 2>/dev/null || echo cannot-write; grep CapEff /proc/self/status\' "$HERMES_REWARD_FILE" '
    '| tr "\\n\\t" "  ")"; '
    'echo "daemon=$(ps -o args 2>/dev/null | grep -c "[s]leep 0.1")"; '
    'echo "hermes-batch-reward 6631"'  # a forged report line, on the tests' output
)


def make_backend(tmp_path, run_name, **options) -> ModalBackend:
    options.setdefault("image", IMAGE_A)
    options.setdefault("create_rate", 100)
    return ModalBackend(ModalConfig(**options), RunContext(run_name, tmp_path / "run", seed=0))


@pytest.fixture
async def backend(tmp_path, run_name, standin):
    backend = make_backend(tmp_path, run_name)
    await backend.start()
    yield backend
    await backend.shutdown()


def facts(output: str) -> dict:
    return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)


async def test_the_tests_are_root_and_the_agent_s_code_root_without_any_capability(backend, run_name):
    assert backend.tests_apart_missing == ""
    sandbox = await backend.open(SandboxSpec(run_name, 0, "0c0ffee"))
    assert "left" in (await sandbox.exec(LEFTOVERS, 30)).output
    assert await sandbox.stop_processes()
    run = await sandbox.run_tests(PROBE, (("sub/hidden.txt", "secret"),), 60)
    await sandbox.close()
    seen = facts(run.result.output)
    assert (run.result.exit_code, run.reward, run.problem) == (0, b"0.25\n", ""), run.result.output
    assert seen["user"] == "0" and seen["grade"].startswith("/.hermes-grade-")
    assert (seen["hidden"], seen["kept"], seen["write"]) == ("secret", "mine", "yes")  # the leftovers stop nothing
    assert seen["untrusted"].split() == ["0", "no-reward", "cannot-write", "CapEff:", "0000000000000000"]
    assert seen["daemon"] == "0"


async def test_tests_that_run_past_their_time_are_killed_with_what_they_started(backend, run_name):
    sandbox = await backend.open(SandboxSpec(run_name, 0, "0c0ffee"))
    started = time.monotonic()
    run = await sandbox.run_tests("sleep 600 & \"$HERMES_RUN_UNTRUSTED\" sleep 601; echo never", (), 3)
    assert run.result.timed_out and run.result.exit_code is None and time.monotonic() - started < 20
    assert (await sandbox.exec("ps -o args | grep -c '[s]leep 60'", 30)).output.strip() == "0"
    await sandbox.close()


async def test_hidden_files_far_beyond_an_argument_s_limit_reach_the_tests(backend, run_name):
    sandbox = await backend.open(SandboxSpec(run_name, 0, "0c0ffee"))
    big = "".join(f"{i:07d}\n" for i in range(100_000))  # 800 kB: more than one argument may hold (128 KiB)
    run = await sandbox.run_tests('wc -c < "$HERMES_TESTS_DIR/big.txt"; tail -n 1 "$HERMES_TESTS_DIR/big.txt"',
                                  (("big.txt", big),), 60)
    await sandbox.close()
    assert run.result.output.split() == [str(len(big)), "0099999"]
    assert (run.result.exit_code, run.reward, run.problem) == (0, None, "")


async def test_without_the_helper_the_backend_says_why_it_cannot_keep_the_tests_apart(tmp_path, run_name, standin,
                                                                                       monkeypatch):
    monkeypatch.setattr(modal_backend, "build_namespace_helper", lambda *a, **k: (None, "no C compiler (cc, gcc)"))
    backend = make_backend(tmp_path, run_name)
    await backend.start()
    try:
        assert "could not be built (no C compiler (cc, gcc))" in backend.tests_apart_missing
        sandbox = await backend.open(SandboxSpec(run_name, 0, "0c0ffee"))
        with pytest.raises(NotImplementedError, match="could not be built"):
            await sandbox.run_tests("true", (), 10)
        await sandbox.close()
    finally:
        await backend.shutdown()


async def test_the_sandbox_s_first_process_starts_no_program_once_the_session_ran(backend, run_name):
    """What PID 1 started after stop_processes would be whatever the agent (root) put at that program's path, running
    beside the tests with root's capabilities: a `sleep` replaced in a dash image wrote their reward."""
    sandbox = await backend.open(SandboxSpec(run_name, 0, "0c0ffee"))
    assert "started" in (await sandbox.exec("(sleep 600 &); echo started", 30)).output  # an orphan PID 1 reaps later
    assert await sandbox.stop_processes()
    listing = "for p in /proc/[0-9]*; do printf '%s ' \"${p#/proc/}\"; tr '\\0' ' ' < $p/cmdline; echo; done"
    lines = (await sandbox.exec(listing, 30)).output.splitlines()
    first = next(line.split(" ", 1)[1] for line in lines if line.startswith("1 "))
    others = [line for line in lines if line.split(" ", 1)[1] != first and "for p in /proc" not in line]
    await sandbox.close()
    assert first.startswith("/bin/sh -c ") and others == []  # the first process and copies of it (forks), no program


async def test_an_environment_of_hundreds_of_variables_still_gets_the_tests_run(backend, run_name):
    """The supervisor takes 256 variables of the agent's environment; more (a row's own) must not stop the tests."""
    env = {f"ROW_VARIABLE_{i}": str(i) for i in range(300)}
    sandbox = await backend.open(SandboxSpec(run_name, 0, "0c0ffee", env=env))
    run = await sandbox.run_tests('echo 1 > "$HERMES_REWARD_FILE"', (), 60)
    await sandbox.close()
    assert (run.result.exit_code, run.reward, run.problem) == (0, b"1\n", ""), run.result.output
