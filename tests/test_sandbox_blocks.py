"""The public building blocks of sandbox backends, by themselves (the local sandbox is built from them)."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import stat
import time
from pathlib import Path

import pytest

import hermes_batch
from hermes_batch import ChildProcess, SandboxFolder, require_regular_file, run_command


def test_the_blocks_are_public():
    for name in ("SandboxFolder", "require_regular_file", "run_command", "ChildProcess", "WarmPool", "remove_tree", "command_runner",
                 "container_views"):
        assert name in hermes_batch.__all__


# --- SandboxFolder: link-safe paths ------------------------------------------------------------


@pytest.fixture
def folder(tmp_path: Path):
    root = tmp_path / "box"
    (root / "work").mkdir(parents=True)
    (tmp_path / "secret").write_bytes(b"runner's secret")
    opened = SandboxFolder(str(root), str(root / "work"))
    yield opened
    opened.close()


def test_folder_writes_and_reads_relative_to_cwd(folder, tmp_path):
    folder.write("a/b/c.bin", b"\x00\xff" * 10)
    assert (tmp_path / "box/work/a/b/c.bin").read_bytes() == b"\x00\xff" * 10
    assert folder.read("a/b/c.bin", 3) == b"\x00\xff\x00"
    assert folder.read(str(tmp_path / "box/work/a/b/c.bin")) == b"\x00\xff" * 10


@pytest.mark.parametrize("path", ["../../secret", "/etc/passwd"])
def test_folder_refuses_paths_out_of_it(folder, path):
    with pytest.raises(PermissionError, match="outside this prompt's sandbox folder"):
        folder.read(path)


def test_folder_follows_links_inside_and_refuses_links_out(folder, tmp_path):
    work = tmp_path / "box/work"
    (work / "real").write_bytes(b"inside")
    os.symlink("real", work / "inner")
    os.symlink(str(tmp_path / "secret"), work / "out")
    os.symlink("../..", work / "up")
    assert folder.read("inner") == b"inside"
    for path in ("out", "up/secret"):
        with pytest.raises(PermissionError):
            folder.read(path)
    with pytest.raises(PermissionError):
        folder.write("out", b"overwritten")
    assert (tmp_path / "secret").read_bytes() == b"runner's secret"


def test_folder_refuses_fifos_and_devices_without_blocking(folder, tmp_path):
    os.mkfifo(tmp_path / "box/work/fifo")
    os.symlink("/dev/zero", tmp_path / "box/work/zero")  # outside anyway; a device made inside needs root
    started = time.monotonic()
    for call in (lambda: folder.read("fifo"), lambda: folder.write("fifo", b"x")):
        with pytest.raises(OSError) as caught:
            call()
        assert caught.value.errno == errno.EINVAL and "FIFO" in str(caught.value)
    assert time.monotonic() - started < 5


def test_require_regular_file_names_what_it_refuses(tmp_path):
    require_regular_file(stat.S_IFREG | 0o644, "f")
    with pytest.raises(IsADirectoryError):
        require_regular_file(os.stat(tmp_path).st_mode, str(tmp_path))
    for mode, kind in ((os.stat("/dev/null").st_mode, "device"), (stat.S_IFIFO, "FIFO"), (stat.S_IFSOCK, "socket")):
        with pytest.raises(OSError, match=kind) as caught:
            require_regular_file(mode, "x")
        assert caught.value.errno == errno.EINVAL


# --- run_command: timeout, bounded output, the process group killed ------------------------------


async def test_run_command_merges_output_and_reports_the_exit_status(tmp_path):
    result = await run_command(["/bin/sh", "-c", "echo out; echo err >&2; exit 3"], 10, cwd=str(tmp_path))
    assert (result.output, result.exit_code, result.timed_out) == ("out\nerr\n", 3, False)
    killed = await run_command(["/bin/sh", "-c", "kill -9 $$"], 10)
    assert killed.exit_code == 128 + 9


async def test_run_command_kills_the_whole_process_group_at_the_timeout(tmp_path):
    started = time.monotonic()
    result = await run_command(["/bin/sh", "-c", "echo before; sleep 30 & echo $! > background; sleep 30"], 1,
                               cwd=str(tmp_path))
    assert result.timed_out and result.exit_code is None and result.output == "before\n"
    assert time.monotonic() - started < 5
    background = int((tmp_path / "background").read_text())
    for _ in range(100):
        if not _alive(background):
            break
        await asyncio.sleep(0.05)
    assert not _alive(background)  # the background job in its group died with it


async def test_run_command_returns_when_the_command_ends_though_a_child_holds_its_output(tmp_path):
    started = time.monotonic()
    result = await run_command(["/bin/sh", "-c", "sleep 30 & echo $! > background; echo started"], 20, cwd=str(tmp_path))
    assert time.monotonic() - started < 2
    assert (result.output, result.exit_code, result.timed_out) == ("started\n", 0, False)
    background = int((tmp_path / "background").read_text())
    try:
        await asyncio.sleep(0.2)
        assert _alive(background)  # not killed: background processes live on
    finally:
        os.kill(background, signal.SIGKILL)


async def test_run_command_bounds_its_output():
    result = await run_command(["/bin/sh", "-c", "echo FIRST; yes filler | head -c 5000000; echo LAST"], 60,
                               max_output_bytes=4096)
    assert result.output.startswith("FIRST\n") and result.output.endswith("LAST\n")
    assert "bytes of output omitted" in result.output and len(result.output) < 4200


async def test_cancelling_run_command_kills_the_command(tmp_path):
    task = asyncio.ensure_future(run_command(["/bin/sh", "-c", "echo $$ > pid; exec sleep 60"], 60, cwd=str(tmp_path)))
    for _ in range(200):
        await asyncio.sleep(0.05)
        if (tmp_path / "pid").exists() and (tmp_path / "pid").read_text().strip():
            break
    pid = int((tmp_path / "pid").read_text())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if not _alive(pid):
            break
        await asyncio.sleep(0.05)
    assert not _alive(pid)


async def test_run_command_can_leave_the_child_unreaped_for_a_later_kill(tmp_path):
    held = []
    await run_command(["/bin/sh", "-c", "sleep 60 > /dev/null 2>&1 & echo $! > bg"], 10, cwd=str(tmp_path),
                      settle=held.append)
    (child,) = held
    background = int((tmp_path / "bg").read_text())
    assert _alive(background)
    child.kill_group()  # the leader unreaped, its group is still its own: the background job is in it
    for _ in range(100):
        if not _alive(background):
            break
        await asyncio.sleep(0.05)
    assert not _alive(background)
    child.reap()
    child.kill_group()  # once reaped, a no-op: the number may be someone else's now


async def test_child_process_leads_its_own_session():
    child = await ChildProcess.start(["sleep", "60"])
    try:
        assert os.getsid(child.pid) == child.pid and os.getpgid(child.pid) == child.pid
    finally:
        child.kill_group()
        await child.exited
        child.reap()
    assert child.returncode == -9


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


# --- WarmPool: sandboxes started ahead of need ---------------------------------------------------


class Made:
    """A stand-in for containers: ``create`` returns the next number (after ``gate`` opens), ``discard`` records."""

    def __init__(self, fail: bool = False):
        self.count = 0
        self.discarded: list[int] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail = fail

    async def create(self) -> int:
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("no engine")
        self.count += 1
        return self.count

    def discard(self, made: int) -> None:
        self.discarded.append(made)


async def settled() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_warm_pool_keeps_size_ready_and_replaces_one_only_when_it_is_released():
    made = Made()
    pool = hermes_batch.WarmPool("image", "/work", 2, made.create, made.discard, what="container")
    pool.fill()
    await settled()
    assert (pool.ready, made.count) == (2, 2)
    assert await pool.take() == 1
    await settled()
    assert (pool.ready, made.count) == (1, 2)  # no replacement while the prompt that took it works
    pool.release()
    await settled()
    assert (pool.ready, made.count) == (2, 3)
    pool.close()
    assert sorted(made.discarded) == [2, 3] and pool.ready == 0  # the idle ones, never the taken one


async def test_what_is_given_back_serves_the_next_prompt_and_is_discarded_once_the_pool_is_closed():
    made = Made()
    pool = hermes_batch.WarmPool("image", "/work", 1, made.create, made.discard)
    pool.fill()
    await settled()
    first = await pool.take()
    made.gate.clear()
    waiting = asyncio.ensure_future(pool.take())  # finds the pool empty: one is being made for it
    await settled()
    pool.give_back(first)
    assert await waiting == first  # the one given back goes to the prompt that waits
    made.gate.set()
    await settled()
    assert (pool.ready, made.count) == (1, 2)  # the one made for it waits for the next prompt
    pool.give_back(first)
    assert pool.ready == 2 and made.count == 2  # given back, not replaced
    pool.close()
    pool.give_back(first)
    assert sorted(made.discarded) == [1, 1, 2]


async def test_a_prompt_waits_for_one_expected_back_instead_of_making_more():
    made = Made()
    pool = hermes_batch.WarmPool("image", "/work", 1, made.create, made.discard)
    pool.fill()
    await settled()
    first = await pool.take()
    pool.expect_back()  # its prompt ended; its next view is being made
    waiting = asyncio.ensure_future(pool.take())
    await settled()
    assert made.count == 1 and not waiting.done()  # no second container for a prompt that can wait for the first
    pool.give_back(first)
    assert await waiting == first
    pool.expect_back()
    pool.not_back()  # it could not serve again: discarded, so its replacement is made
    await settled()
    assert (pool.ready, made.count) == (1, 2)
    pool.close()


async def test_a_prompt_that_finds_the_pool_empty_gets_the_next_one_made():
    made = Made()
    made.gate.clear()
    pool = hermes_batch.WarmPool("image", "/work", 1, made.create, made.discard)
    pool.fill()
    takers = [asyncio.ensure_future(pool.take()) for _ in range(3)]
    await settled()
    made.gate.set()
    assert sorted(await asyncio.gather(*takers)) == [1, 2, 3]  # the pool's first, then one made for each waiting
    await settled()
    assert (pool.ready, made.count) == (0, 3)  # nothing more until they are released
    pool.close()


async def test_a_pool_of_none_ahead_makes_one_for_each_prompt_that_asks_right_after_the_last_was_handed_out():
    made = Made()
    pool = hermes_batch.WarmPool("image", "/work", 0, made.create, made.discard)  # as -S reuse=namespace's
    first = await pool.take()
    async with asyncio.timeout(5):  # asked at once (in this task), before the task that made the first ended
        second = await pool.take()
    assert (first, second, pool.ready) == (1, 2, 0)
    pool.close()


async def test_a_pool_whose_creation_fails_says_so_once_and_lets_each_prompt_make_its_own(caplog):
    made = Made(fail=True)
    made.gate.clear()
    pool = hermes_batch.WarmPool("image", "/work", 2, made.create, made.discard, what="container")
    pool.fill()
    waiting = asyncio.ensure_future(pool.take())
    await settled()
    made.gate.set()
    with caplog.at_level("WARNING", logger="hermes_batch.sandbox"):
        assert await waiting is None
        assert await pool.take() is None
    assert isinstance(pool.broken, RuntimeError)
    assert [r.getMessage() for r in caplog.records].count(
        "Could not start a container ahead of need for the image image (no engine); each prompt starts its own "
        "instead.") == 1
    pool.close()


async def test_a_pool_that_worked_goes_on_after_one_creation_fails():
    made = Made()
    pool = hermes_batch.WarmPool("image", "/work", 1, made.create, made.discard)
    pool.fill()
    await settled()
    assert await pool.take() == 1
    made.fail, made.gate = True, asyncio.Event()
    waiting = asyncio.ensure_future(pool.take())  # finds the pool empty: one is being made for it
    await settled()
    made.gate.set()
    assert await waiting is None and pool.broken is None  # that prompt makes its own; the pool is not given up
    made.fail = False
    pool.release()
    await settled()
    assert (pool.ready, await pool.take()) == (1, 2)
    pool.close()


async def test_a_pool_that_must_not_give_up_survives_even_a_first_creation_that_fails():
    made = Made(fail=True)
    pool = hermes_batch.WarmPool("image", "/work", 0, made.create, made.discard, give_up=False)
    assert await pool.take() is None and pool.broken is None  # that prompt makes its own
    made.fail = False
    assert await pool.take() == 1
    pool.close()


async def test_closing_a_pool_fails_the_prompts_waiting_for_one_and_discards_what_comes_late():
    made = Made()
    made.gate.clear()
    pool = hermes_batch.WarmPool("image", "/work", 1, made.create, made.discard, backend="docker")
    waiting = asyncio.ensure_future(pool.take())
    await settled()
    pool.close()
    with pytest.raises(hermes_batch.SandboxError, match="The docker sandbox backend is shutting down"):
        await waiting
    made.gate.set()
    await settled()
    assert made.count == 0  # its creations were cancelled
    assert await pool.take() is None


async def test_a_runner_request_takes_its_output_up_to_its_own_end_marker_however_the_bytes_are_cut():
    runner = hermes_batch.command_runner
    nonce = runner.new_nonce()
    stream = b"4242\nout \x1eother 0\n" + b"\x1e" + nonce.encode() + b" 3\nnext request"
    for cut in range(1, len(stream)):  # every way of cutting it in two chunks
        output = hermes_batch.BoundedOutput(1000)
        request = runner.Request(asyncio.get_running_loop(), nonce, output)
        rest = request.feed(stream[:cut])
        rest = request.feed(stream[cut:]) if rest is None else rest + stream[cut:]
        await asyncio.sleep(0)
        assert (request.pid, output.value(), request.done.result(), rest) == (
            4242, b"out \x1eother 0\n", 3, b"next request"
        ), cut


async def test_a_runner_request_whose_runner_died_keeps_what_came_and_has_no_status():
    runner = hermes_batch.command_runner
    output = hermes_batch.BoundedOutput(1000)
    request = runner.Request(asyncio.get_running_loop(), "n1", output)
    assert request.feed(b"77\npartial \x1en") is None
    request.lost()
    await asyncio.sleep(0)
    assert (request.pid, output.value(), request.done.result()) == (77, b"partial \x1en", None)


def test_a_runners_first_line_is_its_pid_however_the_bytes_are_cut_and_anything_else_says_it_did_not_start():
    held = bytearray()
    assert hermes_batch.command_runner.first_line(held, b"12") is None
    assert hermes_batch.command_runner.first_line(held, b"34\nout") == (1234, b"out") and held == b""
    for printed in (b"sh: setsid: not found\n", b"9" * 40):
        with pytest.raises(ValueError, match="did not start"):
            hermes_batch.command_runner.first_line(bytearray(), printed)


def test_runner_request_lines_escape_every_unsafe_byte_and_refuse_what_cannot_be_one_line():
    runner = hermes_batch.command_runner
    assert runner.request_line("n", "X", ["a b", "é\n"]) == b"n X xa\\0040b x\\0303\\0251\\0012\n"
    assert runner.request_line("n", "X", ["x"] * (runner.MAX_ARGS + 1)) is None
    assert runner.request_line("n", "X", ["nul\0"]) is None
    assert runner.request_line("n", "X", ["y" * runner.MAX_LINE]) is None


def test_the_runner_exports_any_shell_name_but_its_own():
    exportable = hermes_batch.command_runner.exportable
    assert all(exportable(name) for name in ("w", "s", "n", "PATH", "_x", "f1"))
    assert not any(exportable(name) for name in ("_hbr_w", "1x", "A-B", "A B", ""))


def test_a_views_command_lines_carry_what_each_backend_gives():
    View = hermes_batch.container_views.View
    docker_like = View("/h", "/t/1", "/work", 100, mask=0x3, user=(7, 8, "/home/u"), own_network=True)
    assert docker_like.open_argv(["sh"]) == ["/h", "-O", "100", "-T", "/t/1", "-n", "-k", "3", "-i", "7:8", "-w", "/work", "--", "sh"]
    assert docker_like.env == {"HOME": "/home/u"}
    apptainer_like = View("/h", "/t/2", "/work", 100, lower="/img")
    assert apptainer_like.open_argv(["sh"]) == ["/h", "-O", "100", "-T", "/t/2", "-L", "/img", "-k", "0", "-w", "/work", "--", "sh"]
    assert apptainer_like.join_argv(["ls"], "/elsewhere") == ["/h", "-J", "/t/2", "-k", "0", "-w", "/elsewhere", "--", "ls"]
    assert apptainer_like.stop_argv() == ["/h", "-J", "/t/2", "-X"] and apptainer_like.env == {}
