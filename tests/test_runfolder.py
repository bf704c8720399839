import asyncio
import errno
import json
import logging
import os

import pytest

from hermes_batch.folder import runfolder
from hermes_batch.errors import RunFolderWriteError, UsageError
from hermes_batch.formats.records import Failure
from hermes_batch.folder.durable import AppendLog, atomic_write_lines, atomic_write_text
from hermes_batch.folder.runfolder import RunFolder, read_records, validate_run_name
from hermes_batch.formats.serialization import to_json_line


def failure(index: int, message: str = "boom") -> Failure:
    return Failure(index, f"key{index}", 0, "OSError", "sandbox", message, "2026-01-01T00:00:00")


# --- run names and paths -------------------------------------------------------


@pytest.mark.parametrize("name", ["run1", "my.run-2_x", "R", "a" * 128, "2026-01-15.v2"])
def test_valid_run_names_are_accepted(name):
    assert validate_run_name(name) == name


@pytest.mark.parametrize("name", ["", "../x", "..", ".hidden", "a/b", "a\\b", "a b", "run\n", "ü", "a" * 129, "/abs"])
def test_invalid_run_names_are_refused_with_one_sentence(name):
    with pytest.raises(UsageError) as info:
        validate_run_name(name)
    message = str(info.value)
    assert message.endswith(".") and "\n" not in message


def test_run_folder_refuses_an_escaping_name(tmp_path):
    with pytest.raises(UsageError, match="run name"):
        RunFolder(tmp_path, "../x")


def test_run_folder_paths(tmp_path):
    folder = RunFolder(tmp_path / "data", "demo")
    assert folder.dir == tmp_path / "data" / "demo"
    assert folder.batch_path(7) == folder.dir / "batch_7.jsonl"
    names = [folder.trajectories, folder.discarded, folder.failed, folder.checkpoint, folder.statistics,
             folder.run_json, folder.scratch]
    assert [p.name for p in names] == ["trajectories.jsonl", "discarded.jsonl", "failed.jsonl", "checkpoint.json",
                                       "statistics.json", "run.json", "scratch"]


def test_has_outputs_and_batch_file_order(tmp_path):
    folder = RunFolder(tmp_path, "demo")
    assert not folder.has_outputs()
    assert list(folder.iter_batch_files()) == []
    folder.create()
    folder.scratch.mkdir()
    (folder.dir / "notes.txt").write_text("x")
    (folder.dir / "batch_x.jsonl").write_text("")
    (folder.dir / ".batch_1.jsonl.tmp").write_text("")
    assert not folder.has_outputs()
    for n in (10, 2, 0):
        folder.batch_path(n).write_text("")
    assert folder.has_outputs()
    assert [n for n, _ in folder.iter_batch_files()] == [0, 2, 10]
    assert [p.name for _, p in folder.iter_batch_files()] == ["batch_0.jsonl", "batch_2.jsonl", "batch_10.jsonl"]


def test_has_outputs_sees_failed_file_alone(tmp_path):
    folder = RunFolder(tmp_path, "demo")
    folder.create()
    folder.failed.write_text("")
    assert folder.has_outputs()


# --- durable appends ---------------------------------------------------------------


def test_torn_tail_is_repaired_before_append(tmp_path, caplog):
    path = tmp_path / "batch_0.jsonl"
    good = to_json_line(failure(0))
    torn = to_json_line(failure(1))[:25]
    path.write_text(good + torn)
    log = AppendLog(path)
    with caplog.at_level(logging.WARNING):
        assert log.open() == len(torn.encode())
    assert "torn" in caplog.text
    log.append_sync(to_json_line(failure(2)))
    log.close()
    assert path.read_text() == good + to_json_line(failure(2))
    assert [r.prompt_index for _, r in read_records(path, Failure)] == [0, 2]


def test_lazy_open_repairs_a_file_without_any_newline(tmp_path):
    path = tmp_path / "failed.jsonl"
    path.write_bytes(b'{"prompt_index": 3, "conte')
    log = AppendLog(path)
    log.append_sync(to_json_line(failure(4)))
    log.close()
    assert log.dropped_bytes == 26
    assert path.read_text() == to_json_line(failure(4))


def test_torn_tail_longer_than_one_read_chunk(tmp_path):
    path = tmp_path / "discarded.jsonl"
    good = to_json_line(failure(0))
    path.write_text(good + "x" * 200_000)
    assert AppendLog(path).open() == 200_000
    assert path.read_text() == good


def test_each_record_is_one_write_of_the_whole_line(tmp_path, monkeypatch):
    writes = []
    real_write = os.write

    def recording_write(fd, data):
        writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(runfolder.os, "write", recording_write)
    log = AppendLog(tmp_path / "batch_0.jsonl")
    lines = [to_json_line(failure(i, "ü" * i)) for i in range(3)]
    for line in lines:
        log.append_sync(line)
    log.close()
    assert writes == [line.encode() for line in lines]


def test_short_writes_are_completed(tmp_path, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(runfolder.os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
    path = tmp_path / "batch_0.jsonl"
    log = AppendLog(path)
    log.append_sync(to_json_line(failure(0)))
    log.append_sync(to_json_line(failure(1)).rstrip("\n"))  # the newline is added when missing
    log.close()
    assert path.read_text() == to_json_line(failure(0)) + to_json_line(failure(1))


def test_a_record_spanning_lines_is_refused(tmp_path):
    log = AppendLog(tmp_path / "x.jsonl")
    with pytest.raises(ValueError):
        log.append_sync('{"a": 1}\n{"b": 2}\n')


async def test_concurrent_async_appends_give_whole_lines(tmp_path):
    path = tmp_path / "batch_3.jsonl"
    log = AppendLog(path)
    big = "y" * 50_000  # large lines would interleave if appends were not serialised
    await asyncio.gather(*(log.append(to_json_line(failure(i, big))) for i in range(100)))
    log.close()
    records = [r for _, r in read_records(path, Failure)]
    assert sorted(r.prompt_index for r in records) == list(range(100))
    assert path.read_text().count("\n") == 100


async def test_appends_made_during_a_write_share_the_next_write_and_fsync(tmp_path, monkeypatch):
    fsyncs, real_fsync = [], os.fsync
    monkeypatch.setattr(runfolder.os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd)))
    path = tmp_path / "batch_0.jsonl"
    log = AppendLog(path)
    await asyncio.gather(*(log.append(to_json_line(failure(i))) for i in range(200)))
    log.close()
    assert sorted(r.prompt_index for _, r in read_records(path, Failure)) == list(range(200))
    assert len(fsyncs) <= 3  # the first record alone (and the new file's folder), then all the others


async def test_a_failed_write_fails_every_record_it_carried_and_leaves_whole_lines(tmp_path, monkeypatch):
    path = tmp_path / "batch_0.jsonl"
    log = AppendLog(path)
    await log.append(to_json_line(failure(0)))
    real_write = os.write
    full = {"on": True}

    def write(fd, data):
        if full["on"] and fd == log._fd:
            real_write(fd, bytes(data[:10]))  # part of it lands, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(runfolder.os, "write", write)
    results = await asyncio.gather(*(log.append(to_json_line(failure(i))) for i in range(1, 6)),
                                   return_exceptions=True)
    assert all(isinstance(r, RunFolderWriteError) for r in results) and "ENOSPC" in str(results[0])
    full["on"] = False
    await log.append(to_json_line(failure(6)))
    log.close()
    assert [r.prompt_index for _, r in read_records(path, Failure)] == [0, 6]
    assert path.read_text().count("\n") == 2


async def test_a_cancelled_append_is_written_all_the_same(tmp_path):
    path = tmp_path / "batch_0.jsonl"
    log = AppendLog(path)
    tasks = [asyncio.ensure_future(log.append(to_json_line(failure(i)))) for i in range(3)]
    await asyncio.sleep(0)
    tasks[1].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await log.append(to_json_line(failure(3)))
    log.close()
    assert sorted(r.prompt_index for _, r in read_records(path, Failure)) == [0, 1, 2, 3]


async def test_closed_log_reopens_on_next_append(tmp_path):
    path = tmp_path / "batch_0.jsonl"
    log = AppendLog(path)
    await log.append(to_json_line(failure(0)))
    assert log.is_open
    log.close()
    log.close()
    assert not log.is_open
    await log.append(to_json_line(failure(1)))
    log.close()
    assert [r.prompt_index for _, r in read_records(path, Failure)] == [0, 1]


# --- atomic replacement ------------------------------------------------------------


def test_atomic_write_replaces_content(tmp_path):
    path = tmp_path / "statistics.json"
    atomic_write_text(path, "old\n")
    atomic_write_text(path, "new\n")
    assert path.read_text() == "new\n"
    assert os.listdir(tmp_path) == ["statistics.json"]


def test_failure_mid_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "trajectories.jsonl"
    path.write_text("old line\n")

    def lines():
        yield "new line 1\n"
        yield "new line 2\n"
        raise RuntimeError("crash while merging")

    with pytest.raises(RuntimeError):
        atomic_write_lines(path, lines())
    assert path.read_text() == "old line\n"
    assert os.listdir(tmp_path) == ["trajectories.jsonl"]


def test_failure_at_rename_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.json"
    path.write_text('{"old": true}')

    def failing_replace(src, dst):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(runfolder.os, "replace", failing_replace)
    with pytest.raises(RunFolderWriteError, match=r"checkpoint.json failed: Input/output error \(EIO\)"):
        atomic_write_text(path, '{"new": true}')
    assert json.loads(path.read_text()) == {"old": True}
    assert os.listdir(tmp_path) == ["checkpoint.json"]


def test_atomic_write_lines_counts_lines(tmp_path):
    path = tmp_path / "out.jsonl"
    assert atomic_write_lines(path, (f"{i}\n" for i in range(5))) == 5
    assert path.read_text().splitlines() == ["0", "1", "2", "3", "4"]


# --- tolerant reading ----------------------------------------------------------------


def test_read_records_skips_corrupt_lines(tmp_path, caplog):
    path = tmp_path / "failed.jsonl"
    path.write_text(
        to_json_line(failure(0))
        + "{not json\n"
        + "\n"
        + json.dumps({"prompt_index": "x"}) + "\n"
        + to_json_line(failure(4))
        + to_json_line(failure(5))[:-1]  # complete JSON but no newline: a torn write, never counted
    )
    with caplog.at_level(logging.WARNING):
        got = list(read_records(path, Failure))
    assert [(line, r.prompt_index) for line, r in got] == [(1, 0), (5, 4)]
    assert "failed.jsonl:2" in caplog.text
    assert "failed.jsonl:4" in caplog.text
    assert "failed.jsonl:6" in caplog.text


def test_read_records_of_missing_file_yields_nothing(tmp_path):
    assert list(read_records(tmp_path / "nope.jsonl", Failure)) == []
