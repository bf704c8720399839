"""``hermes-batch import`` of a seed folder that came from elsewhere: every file of it is untrusted.

A planted ``.import/`` must not move a file from outside the folder or have its run.json adopted; batch
files that are links to files elsewhere are refused, not copied; a line too long for any record is skipped
without being held; batch_runner.py's checkpoint.json of any shape is read without a traceback.
"""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest

from hermes_batch.testing import write_dataset

from test_seed_import import lines, make_seed_run, seed_record

PROMPTS = [f"task {i}: list the files" for i in range(6)]


@pytest.fixture
def seed(tmp_path):
    folder = tmp_path / "out" / "seedrun"
    make_seed_run(folder, PROMPTS)
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in PROMPTS])
    return folder, data


def victim(tmp_path):
    path = tmp_path / "victim_file.txt"
    path.write_text("the user's own file\n")
    return path


@pytest.mark.parametrize("marker", [
    {"originals": ["../../victim_file.txt"]},
    {"originals": ["../../victim_file.txt"], "staging": "IDENTITY"},  # the right identity, a path out
    {"originals": ["batch_0.jsonl"]},  # a .import/ that came with the folder: no identity of this one
    {"originals": ["batch_0.jsonl"], "staging": [1, 2]},
    {"originals": "batch_0.jsonl", "staging": "IDENTITY"},
])
def test_a_planted_import_folder_moves_nothing_and_is_not_adopted(tmp_path, runner, seed, marker):
    folder, data = seed
    precious = victim(tmp_path)
    staging = folder / ".import"
    staging.mkdir()
    st = os.stat(staging)
    marker = {k: ([st.st_dev, st.st_ino] if v == "IDENTITY" else v) for k, v in marker.items()}
    (staging / "COMPLETE").write_text(json.dumps(marker))
    (staging / "run.json").write_text(json.dumps({"config": {"base_url": "http://attacker.example/v1"},
                                                  "imported": {"from": "batch_runner.py"}}))
    before = sorted(p.name for p in folder.iterdir())
    result = runner.cli("import", str(folder), "--dataset_file", str(data))
    assert result.exit_code == 2, result.output
    assert f"{staging} was not left by an interrupted 'hermes-batch import' of this folder" in result.output
    assert "remove it, then run the import again." in result.output and "Finished" not in result.output
    assert precious.read_text() == "the user's own file\n"  # not moved
    assert not (folder / "run.json").exists() and sorted(p.name for p in folder.iterdir()) == before


def test_a_planted_run_json_with_settings_an_import_never_writes_is_refused(tmp_path, runner, seed):
    folder, data = seed
    staging = folder / ".import"
    staging.mkdir()
    st = os.stat(staging)
    (staging / "COMPLETE").write_text(json.dumps({"originals": ["batch_0.jsonl"], "staging": [st.st_dev, st.st_ino]}))
    (staging / "run.json").write_text(json.dumps({"config": {"base_url": "http://attacker.example/v1"},
                                                  "imported": {"from": "batch_runner.py"}}))
    result = runner.cli("import", str(folder), "--dataset_file", str(data))
    assert result.exit_code == 2, result.output
    assert "its run.json is not one an import writes" in result.output
    assert not (folder / "run.json").exists() and (folder / "batch_0.jsonl").exists()


def test_an_import_cut_off_in_its_switch_is_still_finished_by_the_next(tmp_path, runner, seed, monkeypatch):
    from hermes_batch.offline import seed_import

    folder, data = seed
    real = os.replace
    moved = []

    def cut_off(src, dst):  # the switch stops after its first move (os is every module's os)
        if (folder / ".import" / "COMPLETE").exists():
            if moved:
                raise OSError(errno.EIO, "Input/output error")
            moved.append(src)
        real(src, dst)

    monkeypatch.setattr(seed_import.os, "replace", cut_off)
    assert runner.cli("import", str(folder), "--dataset_file", str(data)).exit_code == 74
    monkeypatch.setattr(seed_import.os, "replace", real)
    assert (folder / ".import" / "COMPLETE").exists() and not (folder / "run.json").exists()
    result = runner.cli("import", str(folder), "--dataset_file", str(data))
    assert result.exit_code == 0, result.output
    assert "Finished the interrupted import" in result.output
    assert json.loads((folder / "run.json").read_text())["imported"]["from"] == "batch_runner.py"
    assert sorted(p.name for p in (folder / "batch_runner").iterdir()) == [
        "batch_0.jsonl", "batch_1.jsonl", "batch_2.jsonl", "checkpoint.json", "statistics.json", "trajectories.jsonl"]


@pytest.mark.parametrize("name", ["batch_1.jsonl", "batch_7.jsonl", "statistics.json", "checkpoint.json"])
def test_a_seed_file_that_is_a_link_to_a_file_elsewhere_is_refused_not_copied(tmp_path, runner, seed, name):
    folder, data = seed
    outside = tmp_path / "outside.jsonl"
    outside.write_text(lines(seed_record(0, "a secret prompt from elsewhere", 0)) + "secret line\n")
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(outside)
    result = runner.cli("import", str(folder), "--dataset_file", str(data))
    assert result.exit_code == 2, result.output
    assert f"{folder / name} is a symbolic link" in result.output
    assert "the import reads only the files of the folder itself" in result.output
    assert not (folder / "unmatched.jsonl").exists() and not (folder / "run.json").exists()
    assert not any(b"secret" in p.read_bytes() for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def test_a_seed_file_that_is_a_fifo_is_refused_at_once(tmp_path, runner, seed):
    folder, data = seed
    (folder / "statistics.json").unlink()
    os.mkfifo(folder / "statistics.json")
    done = threading.Event()

    def watchdog():  # an import blocked on the FIFO for 20 s is let go (a writer comes and goes), and fails
        if not done.wait(20):
            waited.append(True)
            os.close(os.open(folder / "statistics.json", os.O_WRONLY | os.O_NONBLOCK))

    waited: list = []
    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    try:
        result = runner.cli("import", str(folder), "--dataset_file", str(data), "--batch_size", "2")
    finally:
        done.set()
        thread.join()
    assert not waited, "the import waited for a writer of the FIFO"
    assert result.exit_code == 2 and "is a named pipe (FIFO)" in result.output


@pytest.mark.parametrize("completed", [[[0], [1]], [{"a": 1}, None, "x", 2.5, 3], "all", 7])
def test_a_checkpoint_of_any_shape_is_read_without_a_traceback(runner, seed, completed):
    folder, data = seed
    (folder / "checkpoint.json").write_text(json.dumps({"run_name": "seedrun", "completed_prompts": completed}))
    result = runner.cli("import", str(folder), "--dataset_file", str(data))
    assert result.exit_code == 0, result.output
    assert "Imported 5 record(s)" in result.output


def test_a_line_longer_than_any_record_is_skipped_not_imported(runner, seed, monkeypatch):
    from hermes_batch.offline import seed_import

    monkeypatch.setattr(seed_import, "MAX_LINE_BYTES", 100_000)
    folder, data = seed
    huge = seed_record(4, PROMPTS[4], 2)
    huge["conversations"][2]["value"] = "o" * 200_000  # a tool output no record of a run holds
    with open(folder / "batch_2.jsonl", "r+") as handle:  # in place of the torn last line
        text = handle.read()
        handle.seek(0)
        handle.write(text[: text.rindex("\n") + 1] + lines(huge, seed_record(5, PROMPTS[5], 2)))
        handle.truncate()
    result = runner.cli("import", str(folder), "--dataset_file", str(data))
    assert result.exit_code == 0, result.output
    assert "1 line(s) of its batch files were longer than any record may be" in result.output
    imported = [json.loads(line) for p in folder.glob("batch_*.jsonl") for line in p.read_text().splitlines()]
    assert 4 not in [r["prompt_index"] for r in imported] and 5 in [r["prompt_index"] for r in imported]
    assert b"o" * 1000 not in (folder / "unmatched.jsonl").read_bytes()


@pytest.mark.parametrize("line", [
    "[" * 100_000 + "]" * 100_000,
    json.dumps({"conversations": [{"from": "human", "value": "task 0: list the files"}],
                "tool_stats": {"terminal": {"count": "many"}}, "prompt_index": 10**40, "toolsets_used": "terminal"}),
    json.dumps({"conversations": [{"from": "human", "value": "task 1: list the files"},
                                  {"from": "gpt", "value": "x", "tool_calls": [{"function": {"name": ["x"] * 3}}]}],
                "metadata": ["not", "an", "object"]}),
    json.dumps({"conversations": [{"from": "human", "value": "task 2: list the files"}],
                "completed": "yes", "api_calls": -5, "toolsets_used": [["terminal"]]}),
])
def test_records_of_any_shape_are_imported_or_set_aside_never_a_crash(tmp_path, runner, line):
    folder = tmp_path / "out" / "seedrun"
    folder.mkdir(parents=True)
    (folder / "batch_0.jsonl").write_text(line + "\n" + lines(seed_record(3, PROMPTS[3], 0)))
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": p} for p in PROMPTS])
    result = runner.cli("import", str(folder), "--dataset_file", str(data), "--batch_size", "2", "--no_filters")
    assert result.exit_code == 0, result.output
    assert "Imported 2 record(s)" in result.output
