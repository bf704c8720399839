"""The run folder under stress: starved thread pools, full disks, two runs at once, the user's own files.

Every test drives a real run (in-process through the CLI or the Run API, or as a
subprocess when a signal, an rlimit or a kill is needed) against the scripted
model server, with the local sandbox, inside pytest's tmp_path only.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

import hermes_batch
from hermes_batch.folder import durable
from hermes_batch.run import resume_scan
from hermes_batch.run.cleanup import is_sandbox_folder
from hermes_batch.run.config import RunConfig
from hermes_batch.errors import RunFolderError, RunFolderWriteError
from hermes_batch.folder.journal import CallJournal
from hermes_batch.folder.lock import LOCK_NAME, RunFolderLock
from hermes_batch.contract.plugins import get_plugin_manager
from hermes_batch.formats.records import Failure, content_key
from hermes_batch.folder.durable import AppendLog
from hermes_batch.folder.runfolder import RunFolder, read_records
from hermes_batch.run.runner import RunEngine
from hermes_batch.formats.serialization import to_json_line
from hermes_batch.testing import TEST_API_KEY as API_KEY
from hermes_batch.testing import ToolLoopScript, ended, wait_for, write_dataset

BASE = ("--distribution", "terminal_only", "--seed", "7", "--no_filters")
FAST = ToolLoopScript(tool_calls=1)


def prompts(n: int, tag: str = "task") -> list[dict]:
    return [{"prompt": f"{tag} {i}"} for i in range(n)]


def merged_prompts(runner) -> Counter:
    return Counter(t["conversations"][1]["value"] for t in runner.records("trajectories.jsonl"))


def assert_whole_lines(folder: Path) -> None:
    for path in folder.glob("*.jsonl"):
        data = path.read_bytes()
        assert not data or data.endswith(b"\n"), f"{path.name} ends in a torn line"
        for line in data.splitlines():
            json.loads(line)


def temp_files(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if durable.is_temp_file(p.name)]


def last_line(output: str) -> str:
    return output.strip().splitlines()[-1]


# --- item 1: the run folder's writes have threads of their own ------------------------------------


class PoolHog:
    """Takes every thread of the run's shared pool at start, as tools stuck on FIFOs would."""

    def __init__(self):
        self.release = threading.Event()
        self.taken = threading.Semaphore(0)
        self.size = 0

    @hermes_batch.hookimpl
    def run_started(self, run):
        self.size = run.thread_pool._max_workers
        for _ in range(self.size):
            run.thread_pool.submit(self._block)
        for _ in range(self.size):
            assert self.taken.acquire(timeout=10)

    def _block(self):
        self.taken.release()
        self.release.wait()


def test_records_are_written_and_the_run_ends_while_tools_hold_every_pool_thread(tmp_path, model_server):
    server = model_server(FAST)
    hog = PoolHog()
    config = RunConfig(
        dataset_file=write_dataset(tmp_path / "d.jsonl", prompts(12)), batch_size=5, run_name="run",
        base_url=server.base_url, model="m", api_key=API_KEY, output_dir=tmp_path / "out",
        distribution="terminal_only", progress=False, num_workers=3, filters=(),
        sandbox_options={"keep": True},  # closing a sandbox would itself need the hogged pool
    )
    run = RunEngine(config, get_plugin_manager(extra_plugins=[hog]))
    run.prepare()
    outcome = {}
    ended = threading.Event()

    async def main():
        outcome["result"] = await run.execute()
        ended.set()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    try:
        assert ended.wait(60), "the run did not end while the shared pool was taken"
        assert hog.size >= 3
        result = outcome["result"]
        assert result.exit_code == 0, result.message
        folder = tmp_path / "out" / "run"
        merged = [json.loads(line) for line in (folder / "trajectories.jsonl").read_text().splitlines()]
        assert sorted(t["prompt_index"] for t in merged) == list(range(12))
        assert (folder / "statistics.json").exists()
    finally:
        hog.release.set()
        thread.join(30)


# --- item 4: write errors ------------------------------------------------------------------------


def test_a_failed_append_leaves_no_half_record_and_says_what_happened(tmp_path, monkeypatch):
    path = tmp_path / "batch_0.jsonl"
    log = AppendLog(path)
    log.append_sync(to_json_line(Failure(0, "k0", 0, "E", "sandbox", "first", "t")))
    real_write = os.write
    calls = []

    def disk_fills_up(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:10]))  # part of the record lands, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(durable.os, "write", disk_fills_up)
    with pytest.raises(RunFolderWriteError) as info:
        log.append_sync(to_json_line(Failure(1, "k1", 0, "E", "sandbox", "second", "t")))
    monkeypatch.undo()
    message = str(info.value)
    assert message.startswith(f"Writing {path} failed: No space left on device (ENOSPC); ")
    assert message.endswith("run the same command with --resume to continue.") and message.count(".") >= 1
    assert info.value.exit_code == 74
    log.append_sync(to_json_line(Failure(2, "k2", 0, "E", "sandbox", "third", "t")))
    log.close()
    assert [r.prompt_index for _, r in read_records(path, Failure)] == [0, 2]
    assert path.read_bytes().count(b"\n") == 2


def test_a_failed_atomic_replace_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "statistics.json"
    path.write_text("old\n")
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(durable.os, "fsync", full)
    with pytest.raises(RunFolderWriteError, match=r"Disk quota exceeded \(EDQUOT\); .*raise your disk quota"):
        durable.atomic_write_text(path, "new\n")
    monkeypatch.setattr(durable.os, "fsync", real_fsync)
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["statistics.json"]


@pytest.fixture
def small_disk(tmpfs):
    """A real 600 KiB tmpfs mounted inside tmp_path (we are root); unmounted afterwards."""
    return tmpfs("600k")


def test_disk_full_stops_the_run_with_its_own_status_and_resume_finishes(tmp_path, runner, model_server, small_disk):
    # 30 prompts with 30 KB answers cannot fit in 600 KiB; the dataset lives outside the small disk
    server = model_server(ToolLoopScript(tool_calls=1, final="x" * 30_000 + " {prompt}"))
    data = write_dataset(tmp_path / "d.jsonl", prompts(30))
    args = runner.args(data, *BASE, "--num_workers", "4", server=server)
    out = small_disk / "out"
    args[args.index("--output_dir") + 1] = str(out)
    from click.testing import CliRunner

    from hermes_batch.cli import cli

    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    folder = out / "run"
    assert result.exit_code == 74, result.output
    message = last_line(result.output)
    assert message.startswith(f"Error: Writing {folder}/") and "No space left on device (ENOSPC)" in message
    assert message.endswith("then run the same command with --resume to continue.")
    assert "internal error" not in result.output and "Traceback" not in result.output
    assert_whole_lines(folder)
    assert temp_files(folder) == []
    saved = sum(1 for p in folder.glob("batch_*.jsonl") for _ in p.read_text().splitlines())
    assert 0 < saved < 30

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    second = model_server(ToolLoopScript(tool_calls=1, final="x" * 30_000 + " {prompt}"))
    args[args.index("--base_url") + 1] = second.base_url  # another scripted server: another port, same model
    result = CliRunner().invoke(cli, args + ["--resume", "--allow_changed_settings"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    merged = Counter(json.loads(line)["conversations"][1]["value"] for line in
                     (folder / "trajectories.jsonl").read_text().splitlines())
    assert merged == Counter(f"task {i}" for i in range(30))
    assert len({r.prompt for r in second.requests if not r.preflight}) == 30 - saved  # none paid twice
    assert_whole_lines(folder)


def test_a_resume_on_a_disk_still_full_stops_before_paying_for_anything(tmp_path, runner, model_server, small_disk):
    # a resume on a still-full disk paid a dozen requests (some 40 in the report) before its first record failed
    server = model_server(ToolLoopScript(tool_calls=1, final="x" * 30_000 + " {prompt}"))
    data = write_dataset(tmp_path / "d.jsonl", prompts(30))
    args = runner.args(data, *BASE, "--num_workers", "8", server=server)
    args[args.index("--output_dir") + 1] = str(small_disk / "out")
    from click.testing import CliRunner

    from hermes_batch.cli import cli

    assert CliRunner().invoke(cli, args, catch_exceptions=False).exit_code == 74
    folder = small_disk / "out" / "run"
    paid = server.request_count
    result = CliRunner().invoke(cli, args + ["--resume"], catch_exceptions=False)
    assert result.exit_code == 74, result.output
    assert server.request_count == paid, server.request_count - paid  # not even the preflight
    message = last_line(result.output)
    # the check of the free space, or, when the first run left too little for the resume to bring its indexes up
    # to date (a few kB), that write: one sentence either way, before anything is sent
    if message.startswith(f"Error: Writing {folder / 'index'}/"):
        assert "No space left on device (ENOSPC); finished prompts are saved, so free some space" in message, message
    else:
        assert message.startswith(f"Error: The disk of {folder} has only ") and " free, " in message, message
        assert message.endswith("free some space on it or choose another --output_dir, then run the same command again.")
    assert "Traceback" not in result.output
    assert_whole_lines(folder)


@pytest.mark.parametrize("executor", [(), ("--executor", "processes", "-E", "workers=2")], ids=["local", "processes"])
def test_no_model_request_goes_out_after_the_first_failed_write(executor, tmp_path, runner, model_server, monkeypatch):
    # eight sessions at once, the first to end fills the disk with its record: the other seven send nothing more
    arrivals = []

    def latency(request):  # called as each request arrives
        arrivals.append(time.monotonic())
        return 0.05 if request.prompt == "task 0" else 0.2

    server = model_server(ToolLoopScript(tool_calls=3), latency=latency)
    data = write_dataset(tmp_path / "d.jsonl", prompts(40))
    real_write = os.write
    failed_at = []

    def disk_fills_with_the_first_record(fd, chunk):
        if Path(os.readlink(f"/proc/self/fd/{fd}")).name.startswith("batch_"):
            failed_at.append(time.monotonic())
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, chunk)

    monkeypatch.setattr(os, "write", disk_fills_with_the_first_record)
    result = runner.invoke(data, *BASE, "--num_workers", "8", *executor, server=server)
    monkeypatch.undo()
    assert result.exit_code == 74, result.output
    assert failed_at and "No space left on device (ENOSPC)" in last_line(result.output)
    # a request already on its way when the write failed arrives within milliseconds; none is sent after it
    assert [round(t - failed_at[0], 3) for t in arrivals if t > failed_at[0] + 0.1] == []


def test_a_failed_append_stops_the_call_journal_at_once(tmp_path, monkeypatch):
    # told in the writing thread, before the error reaches the event loop: no request slips out in between
    journal = CallJournal(tmp_path / "calls.jsonl", 0)
    log = AppendLog(tmp_path / "batch_0.jsonl", on_error=journal.stop)
    journal.sent()

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(durable.os, "write", full)
    with pytest.raises(RunFolderWriteError):
        log.append_sync(to_json_line(Failure(0, "k0", 0, "E", "sandbox", "first", "t")))
    monkeypatch.undo()
    with pytest.raises(RunFolderWriteError, match=r"batch_0.jsonl failed: No space left on device \(ENOSPC\)"):
        journal.sent()
    journal.close()
    assert (tmp_path / "calls.jsonl").read_text().count('"event":"sent"') == 1


def test_a_file_size_limit_is_reported_as_a_write_error_and_resume_finishes(tmp_path, runner, model_server):
    server = model_server(ToolLoopScript(tool_calls=1, final="y" * 20_000 + " {prompt}"))
    data = write_dataset(tmp_path / "d.jsonl", prompts(12))

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    proc = runner.spawn(data, *BASE, "--batch_size", "100", server=server, preexec_fn=small_files)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 74, err
    assert "File too large (EFBIG)" in err and "ulimit -f" in err and "Traceback" not in err
    assert_whole_lines(runner.folder())

    second = model_server(ToolLoopScript(tool_calls=1, final="y" * 20_000 + " {prompt}"))
    result = runner.invoke(data, *BASE, "--batch_size", "100", "--resume", server=second)
    assert result.exit_code == 0, result.output
    assert merged_prompts(runner) == Counter(f"task {i}" for i in range(12))


def test_a_reindex_that_cannot_write_is_a_write_error_and_the_old_files_stay(tmp_path, runner, model_server):
    # a resume over a changed dataset renumbers the records (reindex.py): its writes fail like any other
    server = model_server(ToolLoopScript(tool_calls=1, final="z" * 20_000 + " {prompt}"))
    data = write_dataset(tmp_path / "d.jsonl", prompts(4))
    assert runner.invoke(data, *BASE, "--batch_size", "100", server=server).exit_code == 0
    before = {p.name: p.read_bytes() for p in runner.folder().glob("batch_*.jsonl")}
    write_dataset(data, [{"prompt": "new first"}] + prompts(4))  # every record moves down one row

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, 30_000))

    proc = runner.spawn(data, *BASE, "--batch_size", "100", "--resume", server=server, preexec_fn=small_files)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 74, err
    assert f"Error: Re-indexing {runner.folder()}/.reindex/batch_0.jsonl failed: File too large (EFBIG)" in err
    assert "Traceback" not in err and "internal error" not in err
    assert {p.name: p.read_bytes() for p in runner.folder().glob("batch_*.jsonl")} == before

    second = model_server(ToolLoopScript(tool_calls=1, final="z" * 20_000 + " {prompt}"))
    result = runner.invoke(data, *BASE, "--batch_size", "100", "--resume", server=second)
    assert result.exit_code == 0, result.output
    assert merged_prompts(runner) == Counter(["new first"] + [f"task {i}" for i in range(4)])
    assert {r.prompt for r in second.requests if not r.preflight} == {"new first"}
    assert not (runner.folder() / ".reindex").exists()


def test_a_journal_that_cannot_be_written_stops_the_run_as_a_write_error(tmp_path, runner, model_server, monkeypatch):
    # calls.jsonl is written on the event loop before each request: a failure there is the run folder's, not
    # the prompt's ("internal error"), and must not leave half a line in the journal
    server = model_server(FAST)
    data = write_dataset(tmp_path / "d.jsonl", prompts(6))
    journal = runner.folder() / "calls.jsonl"
    real_write = os.write
    lines = []

    def journal_fills_the_disk(fd, chunk):
        if os.readlink(f"/proc/self/fd/{fd}") == str(journal):
            lines.append(len(chunk))
            if len(lines) > 6:
                real_write(fd, bytes(chunk[:7]))
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, chunk)

    monkeypatch.setattr(os, "write", journal_fills_the_disk)
    result = runner.invoke(data, *BASE, "--num_workers", "1", server=server)
    monkeypatch.undo()
    assert result.exit_code == 74, result.output
    assert last_line(result.output).startswith(f"Error: Writing {journal} failed: No space left on device (ENOSPC)")
    assert "internal error" not in result.output and "Traceback" not in result.output
    assert not (runner.folder() / "failed.jsonl").exists() or not runner.records("failed.jsonl")
    assert_whole_lines(runner.folder())

    second = model_server(FAST)
    result = runner.invoke(data, *BASE, "--resume", server=second)
    assert result.exit_code == 0, result.output
    assert merged_prompts(runner) == Counter(f"task {i}" for i in range(6))


def test_a_tools_model_call_that_cannot_be_journaled_stops_the_run(tmp_path, model_server, monkeypatch):
    # the usage a tool reports is journaled inside its call: the error must stop the run, not reach the model
    from test_tool_options import NotesPlugin, run_api

    server = model_server(ToolLoopScript(tool_calls=1, tool="note", command="hello"))
    real_write = os.write

    def usage_lines_fail(fd, chunk):
        if bytes(chunk).startswith(b'{"event":"usage"'):
            raise OSError(errno.EFBIG, "File too large")
        return real_write(fd, chunk)

    monkeypatch.setattr(os, "write", usage_lines_fail)
    _run, result = run_api(tmp_path, server, [{"prompt": "p"}], NotesPlugin(), distribution="notes_only")
    monkeypatch.undo()
    assert result.exit_code == 74, result.message
    assert result.message.startswith(f"Writing {tmp_path / 'out' / 'notes' / 'calls.jsonl'} failed: File too large")


# --- item 4: files the run reads ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["folder", "fifo", "not utf-8", "lone surrogate", "deep"])
def test_a_prefill_file_that_cannot_be_used_gets_one_sentence(tmp_path, runner, model_server, kind):
    server = runner.server = model_server()
    prefill = tmp_path / "prefill.json"
    expected = {
        "folder": "is a directory.",  # click's own check of the option
        "fifo": "is not a regular file (a pipe, socket or device); pass a file to --prefill_messages_file.",
        "not utf-8": "is not valid UTF-8 (byte 0xe9 at offset 33); save it as UTF-8.",
        "lone surrogate": "cannot be sent: $[0].content: holds a lone surrogate (\\ud800)",
        "deep": "cannot be sent: $[0].content",
    }[kind]
    if kind == "folder":
        prefill.mkdir()
    elif kind == "fifo":
        os.mkfifo(prefill)  # opening it to read would wait for a writer for ever
    elif kind == "not utf-8":
        prefill.write_bytes(b'[{"role": "user", "content": "caf\xe9"}]')
    elif kind == "lone surrogate":
        prefill.write_text('[{"role": "user", "content": "x\\ud800"}]')
    else:
        prefill.write_text('[{"role": "user", "content": ' + "[" * 200 + "]" * 200 + "}]")
    data = write_dataset(tmp_path / "d.jsonl", prompts(1))
    result = runner.invoke(data, "--prefill_messages_file", str(prefill))
    assert result.exit_code == 2, result.output
    message = last_line(result.output)
    assert message.startswith("Error: ") and message.endswith(".") and expected in message, message
    assert "Traceback" not in result.output and server.request_count == 0
    if kind != "folder":
        assert message.startswith(f"Error: The prefill messages file {prefill} ")


def test_the_prefill_file_is_checked_the_same_through_the_api(tmp_path):
    from hermes_batch.errors import UsageError
    from hermes_batch.run.inputfiles import load_prefill

    with pytest.raises(UsageError, match="is a folder; pass a file to --prefill_messages_file.$"):
        load_prefill(tmp_path)


def test_a_dataset_that_is_a_pipe_is_refused_at_once(tmp_path, runner):
    fifo = tmp_path / "d.jsonl"
    os.mkfifo(fifo)
    result = runner.invoke(fifo)
    assert result.exit_code == 2
    assert last_line(result.output) == (
        f"Error: The dataset {fifo} is not a regular file (a pipe, socket or device); pass a JSONL file."
    )


@pytest.mark.parametrize("content", [b"\xff\xfe", b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}", b'{"x": NaN}'])
def test_a_distribution_file_that_cannot_be_used_gets_one_sentence(tmp_path, runner, content):
    path = tmp_path / "dists.json"
    path.write_bytes(content)
    result = runner.invoke(write_dataset(tmp_path / "d.jsonl", prompts(1)), "--distribution_file", str(path))
    assert result.exit_code == 2, result.output
    assert last_line(result.output).startswith(("Error: The distribution file", f"Error: {path}:"))
    assert "Traceback" not in result.output


# --- item 7: only ever delete what the run wrote --------------------------------------------------


def users_files(folder: Path, data_rows) -> dict:
    """The user's own files inside the run folder: notes, a subfolder, and the dataset itself."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("my notes")
    (folder / "mine").mkdir()
    (folder / "mine" / "keep.md").write_text("keep me")
    (folder / ".notes.tmp").write_text("mine too")
    write_dataset(folder / "dataset.jsonl", data_rows)
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def assert_users_files_intact(folder: Path, before: dict) -> None:
    for relative, data in before.items():
        assert (folder / relative).read_bytes() == data, relative


def test_a_fatal_error_early_in_a_run_deletes_only_what_the_run_wrote(tmp_path, runner, model_server):
    server = model_server(api_key="the-right-key")
    folder = runner.folder()
    before = users_files(folder, prompts(3))
    result = runner.invoke(folder / "dataset.jsonl", *BASE, "--no_preflight", server=server)
    assert result.exit_code == 2, result.output  # the key is refused at the first prompt: the whole run stops
    assert_users_files_intact(folder, before)
    left = {p.relative_to(folder) for p in folder.rglob("*")}
    assert left == set(before) | {Path("mine")}


def test_overwrite_replaces_the_outputs_and_keeps_the_users_files(tmp_path, runner, model_server):
    runner.server = model_server(FAST)
    folder = runner.folder()
    before = users_files(folder, prompts(7, "old"))
    data = folder / "dataset.jsonl"
    assert runner.invoke(data, *BASE, "-S", "keep=true").exit_code == 0
    assert (folder / "batch_1.jsonl").exists() and list((folder / "scratch").iterdir())

    # what a resume over a changed dataset and --skip_invalid leave, and a re-index a crash cut short
    (folder / "unmatched.jsonl").write_text((folder / "batch_0.jsonl").read_text())
    (folder / "skipped_lines.txt").write_text("d.jsonl:3: not JSON\n")
    (folder / ".reindex").mkdir()
    (folder / ".reindex" / "batch_0.jsonl").write_text("{}\n")
    old_requests = json.loads((folder / "statistics.json").read_text())["model_requests"]["requests"]
    assert old_requests >= 7

    write_dataset(data, prompts(3, "new"))
    before[Path("dataset.jsonl")] = data.read_bytes()
    result = runner.invoke(data, *BASE, "--overwrite")
    assert result.exit_code == 0, result.output
    assert merged_prompts(runner) == Counter(f"new {i}" for i in range(3))
    assert not (folder / "batch_1.jsonl").exists()  # the old run's batch, which the new one never wrote
    assert not (folder / "scratch").exists()
    for name in ("unmatched.jsonl", "skipped_lines.txt", ".reindex"):
        assert not (folder / name).exists(), name
    # the journal is the new run's alone: the old run's calls are not counted again
    requests = json.loads((folder / "statistics.json").read_text())["model_requests"]["requests"]
    assert requests == sum('"event":"sent"' in line for line in (folder / "calls.jsonl").read_text().splitlines())
    assert 3 <= requests < old_requests
    assert_users_files_intact(folder, before)


def test_overwrite_refuses_to_delete_the_dataset_it_is_about_to_read(tmp_path, runner, model_server):
    runner.server = model_server(FAST)
    assert runner.invoke(write_dataset(tmp_path / "d.jsonl", prompts(3)), *BASE).exit_code == 0
    data = write_dataset(runner.folder() / "batch_9.jsonl", prompts(2, "next"))  # named like a batch file
    result = runner.invoke(data, *BASE, "--overwrite")
    assert result.exit_code == 2, result.output
    assert last_line(result.output) == (
        f"Error: The dataset {data} is an output of the run in {runner.folder()}, which --overwrite would "
        "delete; copy it out of the run folder first."
    )
    assert data.exists() and (runner.folder() / "batch_0.jsonl").exists()


def test_overwrite_never_follows_a_link_out_of_the_folder(tmp_path, runner, model_server):
    runner.server = model_server(FAST)
    data = write_dataset(tmp_path / "d.jsonl", prompts(2))
    assert runner.invoke(data, *BASE).exit_code == 0
    precious = tmp_path / "precious.jsonl"
    precious.write_text("do not touch\n")
    batch = runner.folder() / "batch_9.jsonl"
    batch.symlink_to(precious)
    (runner.folder() / "scratch").mkdir()
    (runner.folder() / "scratch" / "p1-0123abcd-abcdefgh").symlink_to(tmp_path, target_is_directory=True)
    assert runner.invoke(data, *BASE, "--overwrite").exit_code == 0
    assert precious.read_text() == "do not touch\n" and not batch.exists()
    assert (tmp_path / "d.jsonl").exists()


def test_leftovers_of_a_killed_session_are_removed_at_the_next_start_and_nothing_else(tmp_path, runner, model_server):
    runner.server = model_server(FAST)
    data = write_dataset(tmp_path / "d.jsonl", prompts(2))
    assert runner.invoke(data, *BASE).exit_code == 0
    folder = runner.folder()
    scratch = folder / "scratch"
    scratch.mkdir()
    leftovers = [folder / ".trajectories.jsonl.hermes-batch-0123456789abcdef.tmp",
                 folder / ".statistics.json.hermes-batch-fedcba9876543210.tmp"]
    for path in leftovers:
        path.write_text("half a merge")
    (scratch / "p0-0123abcd-x1y2z3_w").mkdir()
    (scratch / "p0-0123abcd-x1y2z3_w" / "file").write_text("a killed prompt's work")
    kept = scratch / "kept-p1-0123abcd-abcdefgh"
    kept.mkdir()
    users = [folder / ".trajectories.jsonl.tmp", folder / ".x.hermes-batch-short.tmp", scratch / "mine"]
    for path in users:
        path.write_text("the user's")
    result = runner.invoke(data, *BASE, "--resume")
    assert result.exit_code == 0, result.output
    assert not any(p.exists() for p in leftovers) and not (scratch / "p0-0123abcd-x1y2z3_w").exists()
    assert kept.is_dir() and all(p.read_text() == "the user's" for p in users)


async def test_the_local_sandbox_makes_folders_cleanup_recognises_and_renames_kept_ones(tmp_path):
    from hermes_batch.local_sandbox.backend import LocalSandboxBackend, LocalSandboxConfig
    from hermes_batch.formats.records import SandboxSpec
    from hermes_batch.contract.run_context import RunContext

    backend = LocalSandboxBackend(LocalSandboxConfig(keep=True), RunContext("r", tmp_path, 1))
    await backend.start()
    sandbox = await backend.open(SandboxSpec("r", 123, content_key("p", None, None)))
    assert is_sandbox_folder(sandbox.root.name, kept=False)
    await sandbox.close()
    await backend.shutdown()
    assert sandbox.root.name.startswith("kept-p123-") and sandbox.root.is_dir()
    assert is_sandbox_folder(sandbox.root.name) and not is_sandbox_folder(sandbox.root.name, kept=False)


# --- item 8: one run per folder ------------------------------------------------------------------


def test_a_second_run_on_the_same_folder_refuses_at_once_naming_the_first(
    tmp_path, runner, model_server, procs
):
    first_server = model_server(ToolLoopScript(tool_calls=1), latency=0.3)
    data = write_dataset(tmp_path / "d.jsonl", prompts(8))
    first = runner.spawn(data, *BASE, "--num_workers", "2", server=first_server)
    procs.append(first)
    wait_for(lambda: first_server.request_count > 2, 60, "the first run to be under way", first)

    second_server = model_server(FAST)
    started = time.monotonic()
    result = runner.invoke(data, *BASE, "--resume", server=second_server)
    assert time.monotonic() - started < 10
    assert result.exit_code == 2, result.output
    assert last_line(result.output) == (
        f"Error: The run folder {runner.folder()} is in use by another run (pid {first.pid} on host "
        f"{socket.gethostname()}, since {json.loads((runner.folder() / LOCK_NAME).read_text())['started_at']} UTC); "
        "wait for it to end or stop it, then run the command again."
    )
    assert second_server.request_count == 0  # not even the preflight

    _out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert merged_prompts(runner) == Counter(f"task {i}" for i in range(8))
    assert not (runner.folder() / LOCK_NAME).exists()


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path, runner, model_server, procs):
    server = model_server(ToolLoopScript(tool_calls=1, command="sleep 30"))
    data = write_dataset(tmp_path / "d.jsonl", prompts(4))
    first = runner.spawn(data, *BASE, server=server)
    procs.append(first)
    wait_for(lambda: (runner.folder() / LOCK_NAME).exists() and server.request_count > 1, 60, "the run", first)
    first.kill()
    ended(first)
    assert json.loads((runner.folder() / LOCK_NAME).read_text())["pid"] == first.pid  # left behind

    result = runner.invoke(data, *BASE, "--resume", server=model_server(FAST))
    assert result.exit_code == 0, result.output
    assert merged_prompts(runner) == Counter(f"task {i}" for i in range(4))


def test_the_lock_refuses_a_second_holder_in_the_same_process_and_is_released(tmp_path):
    folder = tmp_path / "run"
    with RunFolderLock(folder) as lock:
        assert lock.held and (folder / LOCK_NAME).exists()
        with pytest.raises(RunFolderError, match=f"pid {os.getpid()} on host"):
            RunFolderLock(folder).acquire()
    assert not folder.exists()  # the lock made the folder and leaves it as it found it
    folder.mkdir()
    (folder / "notes.txt").write_text("x")
    with RunFolderLock(folder):
        pass
    assert os.listdir(folder) == ["notes.txt"]


def test_the_lock_falls_back_to_the_recorded_pid_where_flock_is_missing(tmp_path, monkeypatch):
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LOCK_NAME).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    with pytest.raises(RunFolderError, match="in use by another run"):
        RunFolderLock(folder).acquire()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (folder / LOCK_NAME).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    with RunFolderLock(folder) as lock:
        assert json.loads((folder / LOCK_NAME).read_text())["pid"] == os.getpid() and lock.held


# --- item 14: file modes -------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_every_file_of_the_run_folder_gets_the_users_umask(tmp_path, runner, model_server, umask):
    runner.server = model_server(FAST)
    data = write_dataset(tmp_path / "d.jsonl", prompts(3) + ["{broken"])
    old = os.umask(umask)
    try:
        result = runner.invoke(data, *BASE, "--skip_invalid")
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in runner.folder().iterdir() if p.is_file()}
    assert {"batch_0.jsonl", "trajectories.jsonl", "statistics.json", "checkpoint.json", "run.json", "calls.jsonl",
            "skipped_lines.txt"} <= set(modes)
    assert set(modes.values()) == {0o666 & ~umask}, modes


# --- also: the merge -----------------------------------------------------------------------------


def big_finished_run(runner, tmp_path, count: int) -> Path:
    """A run folder whose batch file already holds ``count`` finished prompts, and the dataset that matches."""
    folder = runner.folder()
    folder.mkdir(parents=True)
    data = write_dataset(tmp_path / "d.jsonl", prompts(count))
    template = {
        "prompt_index": 0, "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": ""},
                                             {"from": "gpt", "value": "<think>\nok\n</think>\n" + "z" * 400}],
        "metadata": {"batch_num": 0, "timestamp": "2026-01-01T00:00:00.000", "model": "m", "content_key": ""},
        "completed": True, "partial": False, "api_calls": 1, "toolsets_used": ["terminal"],
        "tool_stats": {"terminal": {"count": 0, "success": 0, "failure": 0}}, "tool_error_counts": {"terminal": 0},
    }
    with open(folder / "batch_0.jsonl", "w") as handle:
        for i in range(count):
            template["prompt_index"] = i
            template["conversations"][1]["value"] = f"task {i}"
            template["metadata"]["content_key"] = content_key(f"task {i}", None, None)
            handle.write(json.dumps(template) + "\n")
    return data


def test_ctrl_c_during_the_merge_stops_it_at_once_and_leaves_consistent_files(
    tmp_path, runner, model_server, procs
):
    data = big_finished_run(runner, tmp_path, 30_000)
    folder = runner.folder()
    proc = runner.spawn(data, *BASE, "--batch_size", "100000", "--resume", server=model_server(FAST))
    procs.append(proc)
    merging = lambda: [name for name in temp_files(folder) if name.startswith(".trajectories.jsonl.")]  # noqa: E731
    wait_for(merging, 300, "the merge to start writing", proc)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Interrupted while merging" in err and "Traceback" not in err
    # the merge stopped where it was (on the event loop it ran to the end before the signal was even seen)
    assert not (folder / "trajectories.jsonl").exists()
    assert temp_files(folder) == []
    json.loads((folder / "checkpoint.json").read_text())

    result = runner.invoke(data, *BASE, "--batch_size", "100000", "--resume", server=model_server(FAST))
    assert result.exit_code == 0, result.output
    assert sum(1 for _ in open(folder / "trajectories.jsonl")) == 30_000


def test_ctrl_c_while_a_resume_reads_the_run_folder_is_heard_at_once(tmp_path, runner, model_server, monkeypatch):
    from hermes_batch.folder.statistics import iter_finished

    data = big_finished_run(runner, tmp_path, 30_000)
    folder = RunFolder(runner.folder().parent, "run")
    started = time.perf_counter()
    sum(1 for _ in iter_finished(folder))  # reading every record, as a resume without an index does
    whole_scan = time.perf_counter() - started

    scanning = threading.Event()
    scan_started = []
    real_read = resume_scan.read_run_folder

    def read(*args):  # the folder built by copying has no index yet: the resume reads every record
        scan_started.append(time.perf_counter())
        scanning.set()
        return real_read(*args)

    monkeypatch.setattr(resume_scan, "read_run_folder", read)
    config = RunConfig(
        dataset_file=data, batch_size=100_000, run_name="run", output_dir=runner.folder().parent, resume=True,
        base_url=model_server(FAST).base_url, model="scripted-model", api_key=API_KEY, distribution="terminal_only",
        progress=False,
    )
    run = RunEngine(config, get_plugin_manager())
    run.prepare()

    async def interrupt():
        task = asyncio.create_task(run.execute())
        while not scanning.is_set():  # a scan on the event loop would keep this loop waiting until it ended
            await asyncio.sleep(0.005)
        task.cancel()
        return await task, time.perf_counter() - scan_started[0]

    result, waited = asyncio.run(interrupt())
    assert result.exit_code == 130 and result.message == "Interrupted before any prompt ran."
    assert waited < whole_scan / 3, (waited, whole_scan)
    assert not (folder.dir / "trajectories.jsonl").exists() and not os.path.exists(folder.dir / LOCK_NAME)


def test_a_run_folder_file_that_is_a_folder_is_one_sentence_and_the_lock_is_released(tmp_path, runner, model_server):
    runner.server = model_server(FAST)
    data = write_dataset(tmp_path / "d.jsonl", prompts(2))
    assert runner.invoke(data, *BASE).exit_code == 0
    checkpoint = runner.folder() / "checkpoint.json"
    checkpoint.unlink()
    checkpoint.mkdir()
    result = runner.invoke(data, *BASE, "--resume")
    assert result.exit_code == 2, result.output
    assert last_line(result.output) == (
        f"Error: {checkpoint} cannot be read (Is a directory); it must be a file a run wrote, so move it away."
    )
    assert not (runner.folder() / LOCK_NAME).exists()


def test_an_output_folder_that_cannot_be_created_is_one_sentence(tmp_path, runner, model_server):
    server = runner.server = model_server()
    (tmp_path / "out").write_text("a file where the output folder should be")
    out = tmp_path / "out" / "below"
    result = runner.invoke(write_dataset(tmp_path / "d.jsonl", prompts(1)), *BASE, "--output_dir", str(out))
    assert result.exit_code == 74, result.output
    assert last_line(result.output) == f"Error: Writing {out / 'run'} failed: Not a directory (ENOTDIR); fix the cause."
    assert server.request_count == 0


def test_a_run_folder_that_cannot_be_repaired_or_read_is_one_sentence(tmp_path, monkeypatch):
    from hermes_batch.errors import UsageError
    from hermes_batch.run.inputfiles import read_text_file

    torn = tmp_path / "batch_0.jsonl"
    torn.write_bytes(b'{"whole": 1}\n{"torn')
    real_open = os.open

    def read_only(path, flags, *args):
        if flags & os.O_RDWR or flags & os.O_WRONLY:
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(RunFolderWriteError, match=r"Read-only file system \(EROFS\); .*remount it writable"):
        durable.repair_torn_tail(torn)

    def no_permission(path, flags, *args):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "open", no_permission)
    with pytest.raises(UsageError) as info:
        read_text_file(tmp_path / "p.json", "prefill messages file", "--prefill_messages_file", UsageError)
    assert str(info.value) == (
        f"The prefill messages file {tmp_path / 'p.json'} cannot be read (Permission denied); check its permissions."
    )
