"""Open files and threads: a run asks for what its concurrency needs before any model call, and fits in what it gets."""

from __future__ import annotations

import re
import resource
import subprocess
import sys

import pytest

from hermes_batch.run import limits
from hermes_batch.errors import UsageError
from hermes_batch.testing import ToolLoopScript

from hermes_batch.testing import write_dataset

BASE = ("--distribution", "terminal_only", "--seed", "3", "--no_filters", "--batch_size", "100")


def spawn_with_open_files(runner, data, server, soft: int, hard: int, *extra) -> tuple[int, str]:
    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    args = runner.args(data, *BASE, *extra, server=server)
    proc = subprocess.run([sys.executable, "-m", "hermes_batch", *args], capture_output=True, text=True,
                          preexec_fn=low_limit, timeout=600)
    return proc.returncode, proc.stderr


@pytest.fixture
def slow_server(model_server):
    # every prompt holds its connection and its command's pipe for a while, so 300 prompts overlap
    return model_server(ToolLoopScript(tool_calls=1, command="sleep 0.3; echo {prompt_hash}"), latency=0.3,
                        record=False)


def test_a_low_hard_limit_runs_fewer_prompts_at_once_instead_of_failing_them(runner, tmp_path, slow_server):
    data = write_dataset(tmp_path / "d.jsonl", [{"prompt": f"task {i}"} for i in range(300)])
    status, err = spawn_with_open_files(runner, data, slow_server, 256, 256, "--num_workers", "1000")
    assert status == 0, err[-3000:]
    assert not (runner.folder() / "failed.jsonl").exists()
    assert "Too many open files" not in err
    warning = next(line for line in err.splitlines() if "--num_workers 1000 needs more" in line)
    assert "open files (limit 256)" in warning and re.search(r"run 'ulimit -n \d+' before hermes-batch", warning)
    assert len(runner.records("trajectories.jsonl")) == 300


def test_the_soft_limit_is_raised_to_the_hard_limit_at_start(runner, tmp_path, slow_server):
    data = write_dataset(tmp_path / "d.jsonl", [{"prompt": f"task {i}"} for i in range(300)])
    status, err = spawn_with_open_files(runner, data, slow_server, 256, 16384, "--num_workers", "1000")
    assert status == 0, err[-3000:]
    assert "needs more" not in err and not (runner.folder() / "failed.jsonl").exists()
    assert len(runner.records("trajectories.jsonl")) == 300


def test_a_limit_that_fits_not_even_one_prompt_stops_before_any_model_call(runner, tmp_path, model_server):
    server = model_server()
    data = write_dataset(tmp_path / "d.jsonl", [{"prompt": "x"}])
    status, err = spawn_with_open_files(runner, data, server, 40, 40)
    assert status == 2, err
    assert err.strip().splitlines()[-1].startswith("Error: This process may not have enough open files (limit 40)")
    assert re.search(r"run 'ulimit -n \d+' first\.$", err.strip()) and server.request_count == 0


def fake_limits(files=(1024, 1024), tasks=(resource.RLIM_INFINITY, resource.RLIM_INFINITY)):
    values = {resource.RLIMIT_NOFILE: files, resource.RLIMIT_NPROC: tasks}
    return lambda which: values[which]


def test_the_estimate_counts_files_and_tasks_per_prompt():
    fit = limits.fit_concurrency(80, raise_limit=fake_limits(), files_open=lambda: 20, euid=1000)
    assert fit == limits.Fit(80)
    fit = limits.fit_concurrency(1000, raise_limit=fake_limits(), files_open=lambda: 20, euid=1000)
    assert fit.concurrency == (1024 - 20 - limits.FILES_BASE) // limits.FILES_PER_PROMPT
    assert fit.reasons == (("open files", 1024, "ulimit -n 13312"),)  # (20 + 96 + 10 * 1000) * 1.25, rounded up to 1024s


def test_descriptors_a_toolset_holds_whatever_the_prompts_are_counted_once():
    fit = limits.fit_concurrency(1000, files_reserved=528, raise_limit=fake_limits(), files_open=lambda: 20, euid=1000)
    assert fit.concurrency == (1024 - 20 - limits.FILES_BASE - 528) // limits.FILES_PER_PROMPT
    assert fit.reasons == (("open files", 1024, "ulimit -n 13312"),)  # (20 + 96 + 528 + 10 * 1000) * 1.25
    with pytest.raises(UsageError, match="open files \\(limit 1024\\)"):
        limits.fit_concurrency(1, files_reserved=1000, raise_limit=fake_limits(), files_open=lambda: 20, euid=1000)


def test_threads_and_processes_limit_the_concurrency_of_a_user_but_not_of_root():
    tasks = fake_limits(files=(65536, 65536), tasks=(4096, 4096))
    fit = limits.fit_concurrency(2000, raise_limit=tasks, files_open=lambda: 20, tasks_in_use=lambda uid: 1000,
                                 euid=1000)
    assert fit.concurrency == (4096 - 1000 - limits.TASKS_BASE) // limits.TASKS_PER_PROMPT
    assert fit.reasons == (("threads and processes", 4096, "ulimit -u 12288"),)  # (1000 + 64 + 4 * 2000) * 1.25
    assert "ulimit -u 12288" in limits.describe(2000, fit)
    assert limits.fit_concurrency(2000, raise_limit=tasks, files_open=lambda: 20, euid=0) == limits.Fit(2000)
    with pytest.raises(UsageError, match="threads and processes \\(limit 4096\\)"):
        limits.fit_concurrency(10, raise_limit=tasks, files_open=lambda: 20, tasks_in_use=lambda uid: 4090, euid=1)


def test_raising_the_soft_limit_in_this_process():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(512, hard), hard))
        assert limits.raise_soft_limit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_disk_needed_is_the_records_so_far_per_prompt_times_the_prompts_at_once(tmp_path):
    from hermes_batch.folder.durable import RECORD_BYTES
    from hermes_batch.folder.runfolder import RunFolder

    folder = RunFolder(tmp_path, "run")
    # nothing written yet: a record is guessed at RECORD_BYTES, for the prompts that run at once
    assert limits.space_needed(folder, finished=0, concurrency=8, to_run=100) == 8 * RECORD_BYTES
    assert limits.space_needed(folder, finished=0, concurrency=8, to_run=3) == 3 * RECORD_BYTES
    folder.dir.mkdir(parents=True)
    (folder.dir / "batch_0.jsonl").write_bytes(b"x" * 3000)
    (folder.dir / "batch_1.jsonl").write_bytes(b"x" * 1000)
    folder.discarded.write_bytes(b"x" * 2000)  # discarded records count: they are written too
    assert limits.space_needed(folder, finished=6, concurrency=4, to_run=100) == 4 * 1000
