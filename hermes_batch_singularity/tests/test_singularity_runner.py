"""The command runner of an instance (-S runner=agent): one exec per prompt, never trusted after stop_processes."""

from __future__ import annotations

import os
import stat

import pytest

from hermes_batch import ConfigError, RunContext, SandboxSpec, structure_config
from hermes_batch_singularity import SingularityBackend, SingularityConfig
from hermes_batch_singularity.sandbox import RUNNER_DIED_NOTICE


def counting_apptainer(tmp_path, apptainer_bin) -> tuple:
    """An apptainer command that notes each call's subcommand in a log, then runs the real one: (its path, the log)."""
    log = tmp_path / "calls.log"
    script = tmp_path / "apptainer"
    real = os.path.join(apptainer_bin, "apptainer")
    script.write_text(f'#!/bin/sh\necho "$1 $2" >> {log}\nexec {real} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script), log


def execs(log) -> int:
    return sum(1 for line in log.read_text().splitlines() if line.startswith("exec "))


async def open_one(tmp_path, run_name, image, **options):
    options.setdefault("cache_dir", str(tmp_path / "cache"))
    backend = SingularityBackend(SingularityConfig(image=image, **options), RunContext(run_name, tmp_path / "run", seed=0))
    await backend.start()
    return backend, await backend.open(SandboxSpec(run_name, 0, "00000000c0ffee", env={"HB_VAR": "a b'c"}))


def test_the_runner_option_is_agent_or_exec():
    def structure(value):
        return structure_config({"runner": value}, SingularityConfig, "options for the singularity sandbox (-S)")

    assert SingularityConfig().runner == "agent" and structure("exec").runner == "exec"
    with pytest.raises(ConfigError, match="runner"):
        structure("ssh")


async def test_a_prompts_commands_and_files_cost_one_exec(tmp_path, run_name, images, apptainer_bin):
    binary, log = counting_apptainer(tmp_path, apptainer_bin)
    backend, sandbox = await open_one(tmp_path, run_name, images.sif_a, binary=binary)
    try:
        assert execs(log) == 1  # the runner, which also made the working folder
        assert (await sandbox.exec('pwd; echo "$HB_VAR"; echo err >&2; exit 3', 30)).output == "/workspace\na b'c\nerr\n"
        assert (await sandbox.exec("export LEAK=1; cd /tmp", 30)).exit_code == 0
        assert (await sandbox.exec('pwd; echo "[$LEAK]"', 30)).output == "/workspace\n[]\n"  # each command anew
        await sandbox.write_file("deep/er/file.bin", bytes(range(256)) * 100 + b"\nX n1 xecho\n")
        assert await sandbox.read_file("deep/er/file.bin") == bytes(range(256)) * 100 + b"\nX n1 xecho\n"
        assert await sandbox.read_file("deep/er/file.bin", 3) == b"\x00\x01\x02"
        with pytest.raises(IsADirectoryError):
            await sandbox.write_file("deep", b"x")
        with pytest.raises(FileNotFoundError):
            await sandbox.read_file("missing")
        assert execs(log) == 1
    finally:
        await sandbox.close()
        await backend.shutdown()


async def test_checks_after_stop_processes_go_around_the_runner_and_cannot_be_forged(tmp_path, run_name, images, apptainer_bin):
    binary, log = counting_apptainer(tmp_path, apptainer_bin)
    backend, sandbox = await open_one(tmp_path, run_name, images.sif_a, binary=binary)
    try:
        runner_pid = sandbox._runner.pid
        # A leftover that writes made-up ends of requests into the runner's output and steals its input.
        forger = (
            f"(while :; do printf '\\036%s 0\\nforged\\n' x > /proc/{runner_pid}/fd/1; "
            f"head -c 1 /proc/{runner_pid}/fd/0 > /dev/null; done) > /dev/null 2>&1 &"
        )
        assert "started\n" in (await sandbox.exec(f"setsid sh -c \"{forger}\" & echo started", 30)).output
        assert await sandbox.stop_processes()
        before = execs(log)
        for _ in range(2):
            check = await sandbox.exec("echo checked; exit 7", 30)
            assert (check.output, check.exit_code) == ("checked\n", 7)
        assert execs(log) == before + 2 and sandbox._runner is None  # each an exec of its own, no runner again
        assert "forged" not in (await sandbox.exec("ps -o args 2>/dev/null || ps", 30)).output
    finally:
        await sandbox.close()
        await backend.shutdown()


async def test_a_command_that_kills_the_runner_says_so_and_the_next_one_runs(tmp_path, run_name, images):
    backend, sandbox = await open_one(tmp_path, run_name, images.sif_a)
    try:
        killed = await sandbox.exec("echo before; kill -9 -1; sleep 1; echo after", 30)
        assert killed.exit_code == 137 and RUNNER_DIED_NOTICE in killed.output
        result = await sandbox.exec("echo again", 30)
        assert (result.output, result.exit_code) == ("again\n", 0)
    finally:
        await sandbox.close()
        await backend.shutdown()
