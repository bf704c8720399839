"""A verifier's tests apart from the agent (Sandbox.run_tests, issue 43) in real instances: as root, in a reused
instance's view, as an ordinary user; the run-level corpus is in test_singularity_verification.py."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from hermes_batch import RunContext, SandboxSpec, grading
from hermes_batch_singularity import SingularityBackend, SingularityConfig
from hermes_batch_singularity import grading as tests_apart

# The agent's leftovers: a folder and a file nobody may write, a file nobody may read, a daemon, a forged reward.
LEFTOVERS = (
    "echo mine > kept.txt; chmod 000 kept.txt; mkdir -p locked; chmod 555 locked . ; "
    "setsid sh -c 'while :; do sleep 0.1; done' > /dev/null 2>&1 & echo left"
)
# What the tests check, each line a fact "name=value" they print; an ordinary user's tests own the agent's files,
# so they may change modes the agent left (root's need not).
PROBE = (
    'echo 0.25 > "$HERMES_REWARD_FILE"; echo "user=$(id -u)"; echo "grade=${HERMES_TESTS_DIR%/tests}"; '
    'echo "home=$HOME"; echo "hidden=$(cat "$HERMES_TESTS_DIR/sub/hidden.txt")"; '
    'echo "kept=$(cat kept.txt 2>/dev/null || { chmod u+r kept.txt && cat kept.txt; })"; '
    'echo "write=$(echo x > locked/new 2>/dev/null || { chmod u+w locked && echo x > locked/new; } && echo yes)"; '
    'echo "untrusted=$("$HERMES_RUN_UNTRUSTED" sh -c \'id -u; cat "$0" 2>/dev/null || echo no-reward; '
    'echo 1 > "$0" 2>/dev/null || echo cannot-write\' "$HERMES_REWARD_FILE" | tr "\\n" " ")"; '
    'echo "daemon=$(ps -o args 2>/dev/null | grep -c "[s]leep 0.1")"; '
    'echo "hermes-batch-reward 6631"'  # a forged report line, on the tests' output
)


def make_backend(tmp_path, run_name, **options) -> SingularityBackend:
    options.setdefault("cache_dir", str(tmp_path / "cache"))
    return SingularityBackend(SingularityConfig(**options), RunContext(run_name, tmp_path / "run", seed=0))


def facts(output: str) -> dict:
    return dict(line.split("=", 1) for line in output.splitlines() if "=" in line and not line.startswith(" "))


async def graded_after_leftovers(backend, run_name) -> tuple:
    sandbox = await backend.open(SandboxSpec(run_name, 0, "0c0ffee", env={"GREETING": "hi"}))
    try:
        assert "left" in (await sandbox.exec(LEFTOVERS, 30)).output
        assert await sandbox.stop_processes()
        run = await sandbox.run_tests(PROBE, (("sub/hidden.txt", "secret"),), 60)
        return run, facts(run.result.output)
    finally:
        await sandbox.close()


@pytest.mark.parametrize("reuse", ["none", "namespace"])
async def test_as_root_the_tests_are_root_with_their_capabilities_and_the_agent_s_code_is_not(tmp_path, run_name,
                                                                                             images, reuse):
    backend = make_backend(tmp_path, run_name, image=images.sif_a, reuse=reuse)
    await backend.start()
    try:
        assert backend.tests_apart_missing == ""
        run, seen = await graded_after_leftovers(backend, run_name)
    finally:
        await backend.shutdown()
    assert (run.result.exit_code, run.reward, run.problem) == (0, b"0.25\n", ""), run.result.output
    assert seen["user"] == "0" and seen["grade"].startswith("/.hermes-grade-") and seen["home"] == seen["grade"] + "/home"
    assert (seen["hidden"], seen["kept"], seen["write"]) == ("secret", "mine", "yes")  # the leftovers stop nothing
    # the agent's code: root without capabilities, the reward folder neither readable nor writable
    assert seen["untrusted"].split() == ["0", "no-reward", "cannot-write"]
    assert seen["daemon"] == "0"  # stop_processes ended it before the tests


async def test_as_an_ordinary_user_the_tests_are_that_user_and_the_agent_s_code_is_kept_apart(
        tmp_path, run_name, images, user_apptainer_bin):
    shared = Path(tempfile.mkdtemp(prefix="unprivileged-", dir=Path(user_apptainer_bin).parent))
    try:
        shared.chmod(0o755)
        sif = shared / "a.sif"
        shutil.copyfile(images.sif_a, sif)
        sif.chmod(0o644)
        backend = make_backend(tmp_path, run_name, image=str(sif), binary=f"{user_apptainer_bin}/apptainer",
                               no_privs=False)
        await backend.start()
        try:
            assert backend.tests_apart_missing == ""
            run, seen = await graded_after_leftovers(backend, run_name)
        finally:
            await backend.shutdown()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert (run.result.exit_code, run.reward, run.problem) == (0, b"0.25\n", ""), run.result.output
    assert seen["user"] not in ("", "0") and seen["grade"].startswith("/.hermes-grade-")
    assert (seen["hidden"], seen["kept"], seen["write"]) == ("secret", "mine", "yes")  # the owner may change modes
    # run-untrusted's own namespaces: the same user, the reward's folder hidden
    assert seen["untrusted"].split() == [seen["user"], "no-reward", "cannot-write"]


async def test_tests_that_run_past_their_time_are_killed_with_what_they_started(tmp_path, run_name, images):
    backend = make_backend(tmp_path, run_name, image=images.sif_a)
    await backend.start()
    try:
        sandbox = await backend.open(SandboxSpec(run_name, 0, "0c0ffee"))
        assert await sandbox.stop_processes()
        started = time.monotonic()
        run = await sandbox.run_tests("sleep 600 & \"$HERMES_RUN_UNTRUSTED\" sleep 601; echo never", (), 3)
        assert run.result.timed_out and run.result.exit_code is None and time.monotonic() - started < 20
        left = await sandbox.exec("ps -o args | grep -c '[s]leep 60'", 30)
        assert left.output.strip() == "0"
        await sandbox.close()
    finally:
        await backend.shutdown()


async def test_hidden_files_far_beyond_an_argument_s_limit_reach_the_tests(tmp_path, run_name, images):
    backend = make_backend(tmp_path, run_name, image=images.sif_a)
    await backend.start()
    try:
        sandbox = await backend.open(SandboxSpec(run_name, 0, "0c0ffee"))
        big = "".join(f"{i:07d}\n" for i in range(100_000))  # 800 kB: more than one argument may hold (128 KiB)
        run = await sandbox.run_tests('wc -c < "$HERMES_TESTS_DIR/big.txt"; tail -n 1 "$HERMES_TESTS_DIR/big.txt"',
                                      (("big.txt", big),), 60)
        assert run.result.output.split() == [str(len(big)), "0099999"]
        assert (run.result.exit_code, run.reward, run.problem) == (0, None, "")
        await sandbox.close()
    finally:
        await backend.shutdown()


def test_without_landlock_root_s_instances_cannot_keep_the_tests_apart(monkeypatch):
    monkeypatch.setattr(grading, "landlock_abi", lambda: 6)
    assert tests_apart.missing(None, as_root=True) == ""
    monkeypatch.setattr(grading, "landlock_abi", lambda: 0)
    assert tests_apart.missing(None, as_root=True) == tests_apart.NO_LANDLOCK
    monkeypatch.setattr(tests_apart, "user_namespaces", lambda: True)
    assert tests_apart.missing(None, as_root=False) == ""  # an ordinary user's run-untrusted has namespaces
    monkeypatch.setattr(tests_apart, "user_namespaces", lambda: False)
    assert tests_apart.missing(None, as_root=False) == tests_apart.NEITHER
    assert "could not be built (no C compiler)" in tests_apart.missing("no C compiler", as_root=False)


async def test_a_working_folder_swapped_for_a_link_to_the_root_by_the_agent_s_code_opens_nothing(tmp_path, run_name,
                                                                                                 images):
    """Root's run-untrusted has Landlock alone: the folders it may write are those the supervisor resolved, never
    what an earlier untrusted command put at their path since (a link to /, to write the tests' own files)."""
    backend = make_backend(tmp_path, run_name, image=images.sif_a)
    await backend.start()
    try:
        sandbox = await backend.open(SandboxSpec(run_name, 0, "0c0ffee", cwd="/tmp/project"))
        assert await sandbox.stop_processes()
        swap = "\"$HERMES_RUN_UNTRUSTED\" sh -c 'mv /tmp/project /tmp/moved && ln -s / /tmp/project && echo swapped'"
        forge = ("\"$HERMES_RUN_UNTRUSTED\" sh -c '{ echo \"exit 0\" > \"$0\"; } 2>/dev/null && echo forged || echo denied' "
                 "\"$HERMES_TESTS_DIR/check.sh\"")
        run = await sandbox.run_tests(f"{swap}; {forge}; sh \"$HERMES_TESTS_DIR/check.sh\"", (("check.sh", "exit 3\n"),), 60)
        assert run.result.output.split() == ["swapped", "denied"] and run.result.exit_code == 3, run.result.output
        await sandbox.close()
    finally:
        await backend.shutdown()
