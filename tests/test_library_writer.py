"""LibraryWriter: a writer whose file a library writes by path, committed whole by the base (issue 30 item 5)."""

from __future__ import annotations

import json
import sqlite3

import pytest

import hermes_batch
from hermes_batch import LibraryWriter
from hermes_batch.testing import Reply, make_trajectory, write_dataset


class SQLiteWriter(LibraryWriter):
    name = "sqlite"
    description = "Trajectories in an SQLite table."
    filename = "trajectories.sqlite"
    suffix = ".sqlite"
    skips = "trajectories without an answer"

    def begin(self, path):
        db = sqlite3.connect(path)
        db.execute("CREATE TABLE trajectories (prompt_index INTEGER, conversations TEXT)")
        return db

    def add(self, db, trajectory):
        if trajectory.final_answer is None:
            return False
        turns = [{"from": turn.from_, "value": turn.value} for turn in trajectory.conversations]
        db.execute("INSERT INTO trajectories VALUES (?, ?)", (trajectory.prompt_index, json.dumps(turns)))
        return True

    def end(self, db):
        db.commit()
        db.close()


class Plugin:
    @hermes_batch.hookimpl
    def register_writers(self, register):
        register(SQLiteWriter)


def _rows(path):
    with sqlite3.connect(path) as db:
        return db.execute("SELECT prompt_index FROM trajectories ORDER BY prompt_index").fetchall()


def test_a_run_and_an_export_write_the_library_file_whole(tmp_path, runner, model_server):
    runner.plugins = (Plugin(),)
    dataset = write_dataset(tmp_path / "prompts.jsonl", [{"prompt": f"task {i}"} for i in range(3)])
    result = runner.invoke(dataset, "--writer", "sqlite", "--no_filters", server=model_server(lambda r: Reply("Done.")))
    assert result.exit_code == 0, result.output
    assert _rows(runner.folder() / "trajectories.sqlite") == [(0,), (1,), (2,)]
    assert [p.name for p in runner.folder().iterdir() if p.name.endswith(".tmp")] == []
    out = tmp_path / "export.sqlite"
    result = runner.cli("export", str(runner.folder()), "--format", "sqlite", "--output", str(out))
    assert result.exit_code == 0, result.output
    assert _rows(out) == [(0,), (1,), (2,)]


def test_the_base_counts_skips_and_an_error_leaves_the_old_file(tmp_path):
    path = tmp_path / "out.sqlite"
    with SQLiteWriter().open(path) as sink:
        sink.add(make_trajectory(prompt_index=1))
        sink.add(make_trajectory(prompt_index=2, completed=False))  # no answer: the format leaves it out
    assert (sink.count, sink.skipped) == (1, 1) and _rows(path) == [(1,)]
    with pytest.raises(RuntimeError):
        with SQLiteWriter().open(path) as sink:
            sink.add(make_trajectory(prompt_index=7))
            raise RuntimeError("interrupted")
    assert _rows(path) == [(1,)] and sorted(p.name for p in tmp_path.iterdir()) == ["out.sqlite"]
