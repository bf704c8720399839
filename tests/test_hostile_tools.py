"""A hostile model's tool calls against the whole run: nothing blocks, nothing keeps the process from exiting."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hermes_batch.testing import write_dataset

from hermes_batch.local_sandbox import launchers
from hermes_batch.local_sandbox.backend import LocalSandboxBackend, LocalSandboxConfig
from hermes_batch.errors import ConfigError
from hermes_batch.contract.run_context import RunContext
from hermes_batch.testing import Reply


def fifo_script(request):
    if request.turn == 0:
        return Reply(reasoning="Make a pipe.", tool_calls=[("terminal", {"command": "mkfifo pipe && ln -s pipe link"})])
    if request.turn == 1:
        calls = [
            ("read_file", {"path": "pipe"}),
            ("write_file", {"path": "pipe", "content": "x"}),
            ("patch", {"path": "link", "old_string": "a", "new_string": "b"}),
            ("search_files", {"pattern": "x", "path": "pipe"}),
            ("read_file", {"path": "/dev/zero"}),
        ]
        return Reply(reasoning="Read the pipe.", tool_calls=calls)
    return Reply(content="The pipe was refused.", reasoning="Done.")


def test_file_tools_on_a_fifo_end_at_once_and_the_run_exits(model_server, runner, tmp_path):
    # Before, read_file on a FIFO blocked a pool thread for ever: the prompt was abandoned after the
    # grace period, and the process never exited, not even on SIGINT.
    runner.server = model_server(fifo_script)
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": "Play with a pipe."}])
    started = time.monotonic()
    proc = runner.spawn(dataset, "--no_filters", "--command_timeout", "20")
    try:
        _out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert time.monotonic() - started < 60
    (trajectory,) = runner.records("trajectories.jsonl")
    tool_turn = [turn for turn in trajectory["conversations"] if turn["from"] == "tool"][1]
    results = [json.loads(block.split("\n</tool_response>")[0])["content"]
               for block in tool_turn["value"].split("<tool_response>\n")[1:]]
    assert [("FIFO" in r["error"] or "outside" in r["error"]) for r in results] == [True] * 5, results


BLOCKED_FOREVER = textwrap.dedent(
    """
    import asyncio, threading, time
    from hermes_batch.session.threads import in_daemon_thread

    async def main():
        try:
            await asyncio.wait_for(in_daemon_thread(threading.Event().wait), 0.5)
        except asyncio.TimeoutError:
            print("abandoned", flush=True)

    asyncio.run(main())
    """
)


def test_an_abandoned_blocked_call_does_not_keep_the_process_from_exiting():
    done = subprocess.run([sys.executable, "-c", BLOCKED_FOREVER], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "abandoned\n"


def _refuse():
    raise OSError("refused")


async def test_daemon_threads_are_reused_but_a_blocked_one_never_takes_a_call():
    from hermes_batch.session.threads import in_daemon_thread

    first = await in_daemon_thread(threading.get_ident)
    assert [await in_daemon_thread(threading.get_ident) for _ in range(5)] == [first] * 5  # the idle one, again
    with pytest.raises(OSError, match="refused"):
        await in_daemon_thread(_refuse)
    assert await in_daemon_thread(threading.get_ident) == first  # and after a call that raised
    stuck, where = threading.Event(), []

    def block():
        where.append(threading.get_ident())
        stuck.wait()

    blocked = asyncio.ensure_future(in_daemon_thread(block))
    while not where:
        await asyncio.sleep(0.01)
    others = await asyncio.gather(*(in_daemon_thread(threading.get_ident) for _ in range(3)))
    assert where == [first] and first not in others  # the blocked thread was never handed another call
    assert all(t.daemon for t in threading.enumerate() if t.ident in {first, *others})
    stuck.set()
    await blocked


def test_the_same_call_in_the_default_executor_would_hang_the_exit():
    # What in_daemon_thread avoids: asyncio.run joins the default executor's threads.
    script = BLOCKED_FOREVER.replace(
        "in_daemon_thread(threading.Event().wait)",
        "asyncio.get_running_loop().run_in_executor(None, threading.Event().wait)",
    )
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=5)


@pytest.fixture
def no_namespaces(monkeypatch):
    """A machine without unshare and nsenter, and without a C compiler for the compiled helper."""
    real_which = launchers.shutil.which
    monkeypatch.setattr(launchers.shutil, "which", lambda name: None if name in ("unshare", "nsenter") else real_which(name))
    monkeypatch.setattr(launchers.namespace_init, "build", lambda: (None, "no C compiler was found"))
    monkeypatch.setattr(launchers, "_launchers", {})


async def test_isolation_namespace_where_it_cannot_work_is_a_config_error(no_namespaces, tmp_path):
    backend = LocalSandboxBackend(LocalSandboxConfig(isolation="namespace"), RunContext("r", tmp_path, seed=0))
    with pytest.raises(ConfigError, match="-S isolation=namespace cannot work on this machine .*unshare and nsenter"
                       ".*; the compiled helper: no C compiler was found"):
        await backend.check()


async def test_auto_isolation_falls_back_to_processes(no_namespaces, tmp_path):
    backend = LocalSandboxBackend(LocalSandboxConfig(), RunContext("r", tmp_path, seed=0))
    await backend.start()
    try:
        assert not backend.launcher.namespace
        from hermes_batch.formats.records import SandboxSpec

        sandbox = await backend.open(SandboxSpec("r", 0, "0123456789abcdef"))
        assert (await sandbox.exec("echo $HERMES_BATCH_SANDBOX", 10)).output.strip() != ""
        await sandbox.close()
    finally:
        await backend.shutdown()
