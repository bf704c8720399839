"""The container's command runner (-S runner=agent, the default): commands without engine calls, same results."""

from __future__ import annotations

import asyncio

import pytest

from hermes_batch import ConfigError, structure_config
from hermes_batch_docker import DockerBackend, DockerConfig
from hermes_batch_docker.agent import encode_arg, request_line
from hermes_batch_docker.sandbox import AGENT_DIED_NOTICE

from docker_rig import IMAGE_A, make_backend, spec


class EngineCalls:
    """Counts the exec calls a backend makes to the engine."""

    def __init__(self, backend: DockerBackend, monkeypatch):
        self.count = 0
        original = backend.api.exec_create

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(backend.api, "exec_create", counted)


def test_the_runner_option_takes_agent_or_exec():
    assert DockerConfig().runner == "agent"
    what = "options for the docker sandbox (-S)"
    assert structure_config({"runner": "exec"}, DockerConfig, what).runner == "exec"
    with pytest.raises(ConfigError, match="runner"):
        structure_config({"runner": "ssh"}, DockerConfig, what)


def test_request_lines_carry_any_argument_and_refuse_what_they_cannot():
    assert encode_arg("") == "x"
    assert encode_arg("a b\n'é") == "xa\\0040b\\0012\\0047\\0303\\0251"
    assert request_line("n", "X", ["a"] * 8) is None  # more arguments than the runner reads
    assert request_line("n", "X", ["nul\0byte"]) is None
    assert request_line("n", "X", ["y" * 70_000]) is None  # too long for one line: an exec runs it


async def test_commands_and_files_cost_no_exec_once_the_container_runs(backend, run_name, monkeypatch):
    sandbox = await backend.open(spec(run_name))
    try:
        calls = EngineCalls(backend, monkeypatch)
        archives = []
        monkeypatch.setattr(backend, "put_archive", lambda *args: archives.append(args))
        assert (await sandbox.exec("echo hi; echo err >&2; exit 4", 10)).output == "hi\nerr\n"
        await sandbox.write_file("d/f.bin", bytes(range(256)))
        assert await sandbox.read_file("d/f.bin") == bytes(range(256))
        with pytest.raises(FileNotFoundError):
            await sandbox.read_file("missing")
        with pytest.raises(IsADirectoryError):
            await sandbox.write_file("d", b"not over a folder")
        await sandbox.exec("chmod 755 d/f.bin", 10)
        await sandbox.write_file("d/f.bin", b"#!/bin/sh\necho run\n")  # in place: its mode is kept
        assert (await sandbox.exec("./d/f.bin", 10)).output == "run\n"
        assert calls.count == 0 and archives == []
    finally:
        await sandbox.close()


async def test_stop_processes_ends_the_runner_too_and_later_commands_are_execs(backend, run_name, monkeypatch):
    # what runs after it (a verifier's checks) must not go through a process the session's commands could reach
    sandbox = await backend.open(spec(run_name))
    try:
        await sandbox.exec("sleep 300 >/dev/null 2>&1 &", 10)
        assert "hermes-batch-runner" in (await sandbox.exec("ps -o args", 10)).output
        assert await sandbox.stop_processes()
        calls = EngineCalls(backend, monkeypatch)
        listing = (await sandbox.exec("ps -o args", 10)).output
        assert "sleep 300" not in listing and "hermes-batch-runner" not in listing
        assert calls.count == 1  # that command's exec
    finally:
        await sandbox.close()


async def test_arguments_reach_the_command_byte_for_byte(backend, run_name):
    sandbox = await backend.open(spec(run_name))
    try:
        command = "printf '%s|' 'a  b' \"tab\there\" '\\\\0101' 'é' '$HOME' \"x\ny\"; printf '\\n'"
        assert (await sandbox.exec(command, 10)).output == "a  b|tab\there|\\\\0101|é|$HOME|x\ny|\n"
        assert (await sandbox.exec("printf 'no newline at the end'", 10)).output == "no newline at the end"
        long = "echo " + "z" * 20_000
        assert (await sandbox.exec(long, 10)).output == "z" * 20_000 + "\n"
    finally:
        await sandbox.close()


async def test_a_command_that_kills_every_process_loses_its_runner_and_the_next_command_gets_a_new_one(
    backend, run_name, monkeypatch
):
    sandbox = await backend.open(spec(run_name))
    try:
        assert await sandbox._free_agent() is sandbox._agent is not None  # the runner answers
        result = await sandbox.exec("echo ran >> runs; kill -9 -1; sleep 1; echo after", 20)
        assert result.output.endswith(AGENT_DIED_NOTICE) and "after" not in result.output
        assert result.exit_code == 137
        calls = EngineCalls(backend, monkeypatch)
        assert await sandbox.read_file("runs") == b"ran\n"  # never run again, even when its pid line was lost
        assert (await sandbox.exec("echo again", 10)).output == "again\n"
        assert calls.count == 1  # the new runner's exec
        assert (await sandbox.exec("echo and again", 10)).output == "and again\n"
        assert calls.count == 1
    finally:
        await sandbox.close()


async def test_commands_that_come_while_the_runner_is_busy_run_as_execs(backend, run_name, monkeypatch):
    sandbox = await backend.open(spec(run_name))
    try:
        calls = EngineCalls(backend, monkeypatch)
        results = await asyncio.gather(*(sandbox.exec(f"sleep 0.5; echo {i}", 10) for i in range(3)))
        assert [r.output for r in results] == ["0\n", "1\n", "2\n"]
        assert calls.count == 2
    finally:
        await sandbox.close()


async def test_a_pooled_containers_runner_takes_the_prompts_environment_and_odd_names_use_execs(
    tmp_path, run_name, docker_api
):
    backend = make_backend(tmp_path, run_name, pool=2)
    await backend.start()
    try:
        await backend.prepare_image(IMAGE_A)
        env = {f"V{i}": f"value {i}\n'\"$" for i in range(9)}
        first = await backend.open(spec(run_name, 0, env=env))
        printed = await first.exec("for i in 0 1 2 3 4 5 6 7 8; do eval \"printf '%s;' \\\"\\$V$i\\\"\"; done", 10)
        assert printed.output == "".join(f"value {i}\n'\"$;" for i in range(9))
        # A name the runner's shell cannot export: the prompt's commands run as execs, which take it.
        odd = await backend.open(spec(run_name, 1, env={"odd-name": "kept", "PLAIN": "yes"}))
        assert odd._agent is None
        assert (await odd.exec("echo $PLAIN", 10)).output == "yes\n"
        assert "V0" not in (await odd.exec("env", 10)).output
        await first.close()
        await odd.close()
    finally:
        await backend.shutdown()


async def test_the_exec_runner_starts_no_runner(tmp_path, run_name, docker_api):
    backend = make_backend(tmp_path, run_name, runner="exec")
    await backend.start()
    try:
        sandbox = await backend.open(spec(run_name))
        listing = (await sandbox.exec("ps -o args", 10)).output
        assert "hermes-batch-runner" not in listing
        await sandbox.close()
    finally:
        await backend.shutdown()
