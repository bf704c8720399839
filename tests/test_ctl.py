"""hermes-batch ctl: a running run steered through the unix socket in its run folder."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import time

from hermes_batch.errors import EXIT_INTERRUPTED
from hermes_batch.folder.control_socket import send
from hermes_batch.run.control import ControlServer, RunControl
from hermes_batch.testing import ToolLoopScript, wait_for, write_dataset


def _ctl(runner, folder, *args):
    result = runner.cli("ctl", str(folder), *args)
    return result.exit_code, result.output


def test_ctl_steers_a_running_run_and_stop_resumes(model_server, runner, tmp_path):
    server = model_server(ToolLoopScript(tool_calls=1), latency=0.1)
    rows = 60
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"p{i}"} for i in range(rows)])
    proc = runner.spawn(dataset, "--num_workers", "4", "--no_filters", server=server)
    folder = runner.folder()
    sock = folder / "control" / "socket"
    try:
        wait_for(lambda: sock.exists() and server.request_count > 4, 60, "the run's control socket", proc)
        assert stat.S_IMODE(sock.lstat().st_mode) == 0o600 and stat.S_IMODE(sock.parent.lstat().st_mode) == 0o700
        code, out = _ctl(runner, folder, "status")
        status = json.loads(out)
        assert code == 0 and status["workers"] == 4 and status["paused"] is False and status["prompts_to_run"] == rows

        assert _ctl(runner, folder, "pause")[0] == 0
        time.sleep(0.6)  # the calls in flight end (0.1 s each)
        before = server.request_count
        time.sleep(1.0)
        assert server.request_count == before, "a model call went out while paused"
        assert json.loads(_ctl(runner, folder, "status")[1])["paused"] is True
        assert _ctl(runner, folder, "resume")[0] == 0
        wait_for(lambda: server.request_count > before, 10, "calls after resume", proc)

        code, out = _ctl(runner, folder, "workers", "1")
        assert code == 0 and json.loads(out)["workers"] == 1
        wait_for(lambda: json.loads(_ctl(runner, folder, "status")[1])["running"] <= 1, 10, "one prompt at a time")
        for _ in range(5):
            assert json.loads(_ctl(runner, folder, "status")[1])["running"] <= 1
            time.sleep(0.1)
        code, out = _ctl(runner, folder, "workers", "99")
        assert code != 0 and "from 1 to 4" in out
        code, out = _ctl(runner, folder, "max_cost", "12.5")
        assert code == 0 and json.loads(out)["max_cost"] == 12.5

        assert _ctl(runner, folder, "stop")[0] == 0
        proc.wait(60)
        assert proc.returncode == EXIT_INTERRUPTED, proc.stderr.read()
        assert "Stopped by hermes-batch ctl" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not sock.exists()
    code, out = _ctl(runner, folder, "status")
    assert code != 0 and "No run is listening" in out
    done = len(runner.records("trajectories.jsonl"))
    assert 0 < done < rows
    result = runner.invoke(dataset, "--resume", "--num_workers", "8", server=server)
    assert result.exit_code == 0, result.output
    assert len(runner.records("trajectories.jsonl")) == rows


def test_a_stale_socket_says_no_run_listens_and_the_next_run_replaces_it(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "control").mkdir(parents=True, mode=0o700)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(run_dir / "control" / "socket"))
    stale.close()  # as a killed run leaves it
    try:
        send(run_dir, {"command": "status"})
    except Exception as exc:
        assert "No run is listening" in str(exc) and "ended" in str(exc)
    else:
        raise AssertionError("a stale socket answered")

    async def serve():
        server = ControlServer(run_dir, RunControl(3))
        await server.start()
        try:
            return await asyncio.to_thread(send, run_dir, {"command": "workers", "value": 2})
        finally:
            await server.close()

    assert asyncio.run(serve())["status"]["workers"] == 2
    assert not (run_dir / "control").exists()


def test_a_long_run_folder_path_is_reached_through_the_folder_descriptor(tmp_path):
    run_dir = tmp_path / ("d" * 120) / ("e" * 120)  # far past the 107 bytes of a socket path
    run_dir.mkdir(parents=True)

    async def serve():
        server = ControlServer(run_dir, RunControl(2))
        await server.start()
        try:
            return await asyncio.to_thread(send, run_dir, {"command": "status"})
        finally:
            await server.close()

    assert asyncio.run(serve())["status"]["workers"] == 2


def test_requests_are_untrusted_and_bounded(tmp_path):
    control = RunControl(4)
    for hostile in (None, [], {"command": "rm"}, {"command": "workers", "value": True},
                    {"command": "workers", "value": 0}, {"command": "max_cost", "value": float("nan")},
                    {"command": "max_cost", "value": -1}, {"command": "max_cost", "value": "5"}):
        answer = control.handle(hostile)
        assert answer["ok"] is False and answer["error"].endswith("."), hostile
    assert control.workers == 4

    async def serve():
        server = ControlServer(tmp_path, control)
        await server.start()
        try:
            def raw(data: bytes) -> bytes:
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.connect(str(tmp_path / "control" / "socket"))
                    sock.sendall(data)
                    sock.shutdown(socket.SHUT_WR)
                    return sock.recv(65536)
            return await asyncio.to_thread(raw, b"x" * 100_000), await asyncio.to_thread(raw, b"\xff\n")
        finally:
            await server.close()

    too_long, not_json = asyncio.run(serve())
    assert too_long == b""  # cut off, never read whole
    assert json.loads(not_json)["error"] == "The request is not one line of JSON."


def test_a_folder_others_can_enter_is_closed_and_a_link_refused(tmp_path):
    (tmp_path / "a" / "control").mkdir(parents=True, mode=0o755)
    os.chmod(tmp_path / "a" / "control", 0o755)

    async def serve(run_dir):
        server = ControlServer(run_dir, RunControl(1))
        await server.start()
        mode = stat.S_IMODE((run_dir / "control").stat().st_mode)
        await server.close()
        return mode

    assert asyncio.run(serve(tmp_path / "a")) == 0o700
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "control").symlink_to(tmp_path / "a")
    try:
        asyncio.run(serve(tmp_path / "b"))
    except Exception as exc:
        assert "is not a folder the run made" in str(exc)
    else:
        raise AssertionError("a linked control folder was used")
