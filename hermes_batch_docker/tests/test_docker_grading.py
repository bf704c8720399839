"""A verifier's tests in a prompt's container, apart from the agent (Sandbox.run_tests, issue 43): the real engine.

Each test runs in both modes, a container per prompt (strict) and a view of a reused container (-S reuse=namespace),
and, where it matters, with the image's root as the agent and with an agent of its own (-S user=).
"""

from __future__ import annotations

import time

import pytest

from hermes_batch_docker.grading import GRADE_PREFIX, REWARD_OWNER

from docker_rig import make_backend, spec

MODES = {
    "strict": {},
    "reuse": {"reuse": "namespace", "pool": 1},
    "strict-user": {"user": "1000:1000"},
    "reuse-user": {"reuse": "namespace", "pool": 1, "user": "1000:1000"},
}


@pytest.fixture(params=list(MODES))
async def opened(request, tmp_path, run_name, docker_api):
    """(the mode, a sandbox of a started backend in that mode), the session's processes stopped as a verifier does
    before the tests run; closed and shut down after the test."""
    backend = make_backend(tmp_path, run_name, **MODES[request.param])
    await backend.start()
    sandbox = await backend.open(spec(run_name, 0, env={"FROM_THE_ROW": "row-value"}))
    try:
        yield request.param, sandbox
    finally:
        await sandbox.close()
        await backend.shutdown()


async def stopped(sandbox, *commands):
    for command in commands:
        result = await sandbox.exec(command, 30)
        assert result.exit_code == 0, result
    assert await sandbox.stop_processes() is True


# What the agent's code tries when the tests run it: its identity, its capabilities, every place it must not write
# ($1: the tests' folder, $2: the reward file, $3: GRADE/bin, given by the tests).
PROBE = (
    'echo "uid=$(id -u)"; grep CapEff /proc/self/status; echo "home=$HOME row=$FROM_THE_ROW"; '
    'echo x > /forged && echo WROTE-ROOT; echo x > "$1/forged" && echo WROTE-TESTS; '
    'echo 1 > "$2" && echo WROTE-REWARD; echo x > "$3/new" && echo WROTE-BIN; echo x > /tmp/agent-tmp && echo WROTE-TMP; '
    'echo x > probe-by-agent && echo WROTE-WORKDIR; kill -9 -1; echo survived'
)
RUN_PROBE = (f'"$HERMES_RUN_UNTRUSTED" sh -c \'{PROBE}\' sh "$HERMES_TESTS_DIR" "$HERMES_REWARD_FILE" '
             '"$(dirname "$HERMES_RUN_UNTRUSTED")"')


async def test_the_tests_run_as_root_and_the_agent_s_code_as_the_agent_walled_in(opened):
    mode, sandbox = opened
    # the agent leaves a working folder the tests could not write as the agent's user
    await stopped(sandbox, "echo 'exit 0' > rev.sh; chmod 555 .")
    script = ('echo "tests uid=$(id -u) home=$HOME row=${FROM_THE_ROW-unset}"; grep CapEff /proc/self/status; '
              'touch written-by-tests && echo TESTS-WROTE; cat "$HERMES_TESTS_DIR/hidden.txt"; echo; '
              f'{RUN_PROBE}; echo "untrusted status=$?"; echo 0.5 > "$HERMES_REWARD_FILE"')
    run = await sandbox.run_tests(script, (("hidden.txt", "secret"),), 60)
    out = run.result.output
    assert run.result.exit_code == 0 and not run.result.timed_out, out
    assert (run.reward, run.problem) == (b"0.5\n", ""), run
    lines = out.splitlines()
    mask = sandbox._backend.config.prompt_capability_mask
    # the tests: the container's root with the container's capabilities, in a HOME of their own
    assert lines[0].startswith(f"tests uid=0 home={GRADE_PREFIX}") and lines[0].endswith("/home row=unset"), out
    assert lines[1] == f"CapEff:\t{mask:016x}", out
    assert lines[2:4] == ["TESTS-WROTE", "secret"], out
    agent_uid = "1000" if mode.endswith("user") else "0"
    home = "/" if mode.endswith("user") else "/root"  # the image knows no user 1000: Docker gives HOME=/
    assert lines[4:7] == [f"uid={agent_uid}", "CapEff:\t0000000000000000", f"home={home} row=row-value"], out
    assert "WROTE-TMP" in lines
    for forbidden in ("WROTE-ROOT", "WROTE-TESTS", "WROTE-REWARD", "WROTE-BIN", "WROTE-WORKDIR"):
        assert forbidden not in lines, out
    assert lines[-2:] == ["survived", "untrusted status=0"], out  # kill -9 -1 reached none of the tests' processes
    listed = await sandbox.exec("ls -d written-by-tests probe-by-agent /forged 2>&1", 30)
    assert "written-by-tests\n" in listed.output and "probe-by-agent:" in listed.output and "/forged:" in listed.output


async def test_a_link_to_the_root_left_for_home_gives_the_agent_s_code_no_way_out(tmp_path, run_name, docker_api):
    """A root agent swaps its HOME for a link to /: run-untrusted gives Landlock no rule there (grading.h), so its
    code still writes only its own folders."""
    backend = make_backend(tmp_path, run_name)
    await backend.start()
    sandbox = await backend.open(spec(run_name, 0))
    try:
        await stopped(sandbox, "rm -rf /root && ln -s / /root && echo linked")
        run = await sandbox.run_tests(f'echo ran; {RUN_PROBE}; echo "status=$?"', (), 60)
        assert run.result.output.splitlines()[0] == "ran", run
        assert run.result.output.splitlines()[-1] == "status=0", run
        assert "survived" in run.result.output.splitlines(), run
        assert not {"WROTE-ROOT", "WROTE-TESTS", "WROTE-REWARD", "WROTE-BIN"} & set(run.result.output.splitlines()), run
    finally:
        await sandbox.close()
        await backend.shutdown()


async def test_the_tests_environment_is_clean_and_the_agent_s_code_gets_its_own(opened):
    _mode, sandbox = opened
    await stopped(sandbox)
    run = await sandbox.run_tests(
        'env | sort; echo ---; "$HERMES_RUN_UNTRUSTED" env | sort', (), 60)
    tests, agent = run.result.output.split("---\n")
    tests_env = dict(line.split("=", 1) for line in tests.splitlines())
    assert tests_env["PATH"] == "/bin"  # the image's
    assert tests_env["HOME"].startswith(GRADE_PREFIX) and tests_env["TMPDIR"] == tests_env["HOME"][:-5] + "/tmp"
    assert tests_env["PYTHONNOUSERSITE"] == "1" and "FROM_THE_ROW" not in tests_env, tests
    agent_env = dict(line.split("=", 1) for line in agent.splitlines())
    assert agent_env["FROM_THE_ROW"] == "row-value" and not any(key.startswith("HERMES_") for key in agent_env), agent
    assert agent_env["HOME"] in ("/", "/root"), agent


async def test_the_report_is_read_from_the_supervisor_alone(opened):
    _mode, sandbox = opened
    await stopped(sandbox)
    forged = "hermes-batch-reward 66310a"  # "f" and "1\n": what a reward file of 1 reports
    run = await sandbox.run_tests(f"echo '{forged}'; echo '{forged}' >&2", (), 60)
    assert run.result.output == f"{forged}\n{forged}\n"
    assert (run.reward, run.problem) == (None, ""), run  # no reward file was written


async def test_a_long_script_reaches_the_tests_through_a_file(opened):
    _mode, sandbox = opened
    await stopped(sandbox)
    big = "x" * (200 * 1024)  # more than one argument may hold
    run = await sandbox.run_tests('wc -c < "$HERMES_TESTS_DIR/big.txt"; echo 1 > "$HERMES_REWARD_FILE"',
                                  (("big.txt", big),), 60)
    assert run.result.output.split() == [str(len(big))], run.result
    assert run.reward == b"1\n"


async def test_tests_that_run_past_their_timeout_are_killed(opened):
    _mode, sandbox = opened
    await stopped(sandbox)
    started = time.monotonic()
    run = await sandbox.run_tests("echo begun; sleep 600", (), 1)
    assert run.result.timed_out and run.result.exit_code is None and run.reward is None, run
    assert run.result.output == "begun\n"
    assert time.monotonic() - started < 20
    left = await sandbox.exec("ps -o args | grep -c 'sleep 60[0]'", 30)
    assert left.output.strip() == "0", left


async def test_the_reward_s_folder_belongs_to_no_user_of_the_agent(opened):
    _mode, sandbox = opened
    await stopped(sandbox)
    run = await sandbox.run_tests('stat -c "%u:%g %a" "$(dirname "$HERMES_REWARD_FILE")"', (), 60)
    assert run.result.output == f"{REWARD_OWNER} 700\n", run


async def test_a_strict_backend_without_the_helper_says_why_the_tests_cannot_run_apart(
        tmp_path, run_name, docker_api, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    backend = make_backend(tmp_path, run_name)
    await backend.start()  # a run without a command verifier goes on
    try:
        assert "no C compiler was found" in backend.tests_apart_missing
        assert "install gcc and libc6-dev" in backend.tests_apart_missing
    finally:
        await backend.shutdown()


@pytest.mark.parametrize("lost", [1, 3])
async def test_an_identity_exec_whose_output_the_engine_lost_is_asked_again(tmp_path, run_name, docker_api, lost):
    # Under load the engine once returned exit status 0 and no output for the quick identity exec before the tests:
    # the sample's verifier failed with an internal error (1 prompt of 60 in bench_tasks.py).
    from hermes_batch import SandboxError
    from hermes_batch_docker.sandbox import IDENTITY_ATTEMPTS

    backend = make_backend(tmp_path, run_name)
    await backend.start()
    sandbox = await backend.open(spec(run_name, 0))
    try:
        real, calls = sandbox._exec_sync, []

        def losing(argv, *args, **kwargs):
            calls.append(argv)
            return (0, b"", b"") if len(calls) <= lost else real(argv, *args, **kwargs)

        sandbox._exec_sync = losing
        if lost < IDENTITY_ATTEMPTS:
            uid, _gid, _home = await sandbox._agent_identity()
            assert uid == 0 and len(calls) == lost + 1
        else:  # never an answer: said, not taken for an identity
            with pytest.raises(SandboxError, match="could not be found"):
                await sandbox._agent_identity()
            assert len(calls) == IDENTITY_ATTEMPTS
    finally:
        await sandbox.close()
        await backend.shutdown()
