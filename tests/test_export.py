"""hermes-batch export: each format read by its real consumer, stable splits, what is included, bad input."""

import json
import os
import shutil
import subprocess
import sys
import time

import datasets
import pytest

from hermes_batch.offline.export import parse_splits, split_of
from hermes_batch.testing.openai_finetune import check_line
from hermes_batch.testing import SHAPES, ShapeScript, answer_for, run_shapes, shape_rows
from hermes_batch.testing import read_jsonl as lines
from hermes_batch.testing import run_cli as hb


@pytest.fixture
def run_dir(shapes_run_dir):
    """A copy of the module's finished run of every shape (conftest), which the test may change."""
    return shapes_run_dir


def test_sharegpt_export_is_the_merged_records_and_loads_in_datasets(run_dir, tmp_path):
    hb("export", run_dir, "--format", "sharegpt")
    out = run_dir / "exports" / "sharegpt" / "train.jsonl"
    assert out.read_text() == (run_dir / "trajectories.jsonl").read_text()
    ds = datasets.load_dataset("json", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf"))
    assert len(ds) == len(lines(run_dir / "trajectories.jsonl"))
    assert ds[0]["conversations"][0]["from"] == "system"


def test_include_discarded_and_all_in_prompt_index_order(run_dir, tmp_path):
    kept = [r["prompt_index"] for r in lines(run_dir / "trajectories.jsonl")]
    discarded = sorted(r["trajectory"]["prompt_index"] for r in lines(run_dir / "discarded.jsonl"))
    assert kept and discarded
    hb("export", run_dir, "--format", "sharegpt", "--include", "discarded", "--output", tmp_path / "d.jsonl")
    hb("export", run_dir, "--format", "sharegpt", "--include", "all", "--output", tmp_path / "a.jsonl")
    assert [r["prompt_index"] for r in lines(tmp_path / "d.jsonl")] == discarded
    every = [r["prompt_index"] for r in lines(tmp_path / "a.jsonl")]
    assert every == sorted(kept + discarded)
    # kept and discarded records of one export share one schema (tool columns with zeros), so datasets loads it
    ds = datasets.load_dataset("json", data_files=str(tmp_path / "a.jsonl"), split="train", cache_dir=str(tmp_path / "hf"))
    assert len(ds) == len(every)
    assert len({tuple(sorted(r["tool_stats"])) for r in lines(tmp_path / "a.jsonl")}) == 1


def test_openai_lines_follow_the_fine_tuning_rules(run_dir, tmp_path):
    result = hb("export", run_dir, "--format", "openai", "--include", "all", "--output", tmp_path / "o.jsonl")
    rows = lines(tmp_path / "o.jsonl")
    for row in rows:
        assert check_line(row) == []
    # the hallucinated-tool samples cannot be valid lines: left out and said so
    unknown = sum(1 for r in lines(run_dir / "discarded.jsonl") if r["trajectory"]["conversations"][1]["value"].startswith("[unknown]"))
    assert unknown == 3
    assert "left out as the format cannot hold them: 3" in result.output
    by_prompt = {r["messages"][1]["content"]: r for r in rows}
    ok = by_prompt["[ok] task 0"]
    assert [m["role"] for m in ok["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert ok["messages"][-1]["content"] == "<think>\nThinking about step 2.\n</think>\n" + answer_for("[ok] task 0")
    assert {t["function"]["name"] for t in ok["tools"]} >= {"terminal", "read_file"}
    assert "<tools>" not in ok["messages"][0]["content"]
    call = ok["messages"][2]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"])["command"].startswith("echo ")
    assert ok["messages"][3]["tool_call_id"] == call["id"]
    ds = datasets.load_dataset("json", data_files=str(tmp_path / "o.jsonl"), split="train", cache_dir=str(tmp_path / "hf"))
    assert len(ds) == len(rows)


def test_openai_reasoning_dropped_by_option(run_dir, tmp_path):
    hb("export", run_dir, "--format", "openai:reasoning=drop", "--output", tmp_path / "o.jsonl")
    rows = lines(tmp_path / "o.jsonl")
    assert rows and all(check_line(r) == [] for r in rows)
    texts = [m.get("content") or "" for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert not any("<think>" in t for t in texts)
    assert answer_for("[ok] task 1") in texts


def test_openai_checker_catches_broken_lines():
    good = {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
        {"role": "assistant", "content": "done"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    assert check_line(good) == []
    bad_args = json.loads(json.dumps(good))
    bad_args["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    assert any("not valid JSON" in p for p in check_line(bad_args))
    bad_id = json.loads(json.dumps(good))
    bad_id["messages"][2]["tool_call_id"] = "c2"
    assert any("answers no call" in p for p in check_line(bad_id))
    unanswered = json.loads(json.dumps(good))
    del unanswered["messages"][2]
    assert any("never answered" in p for p in check_line(unanswered))
    undefined = json.loads(json.dumps(good))
    undefined["tools"][0]["function"]["name"] = "g"
    assert any("does not define" in p for p in check_line(undefined))
    assert any("unknown role" in p for p in check_line({"messages": [{"role": "bot", "content": "x"}]}))


def test_splits_are_stable_and_keep_copies_of_a_prompt_together(run_dir, tmp_path):
    hb("export", run_dir, "--format", "sharegpt", "--split", "validation=0.3", "--split", "test=0.2",
       "--output", tmp_path / "first")
    hb("export", run_dir, "--format", "sharegpt", "--split", "test=0.2", "--split", "validation=0.3",
       "--output", tmp_path / "second")
    for name in ("train", "validation", "test"):
        assert (tmp_path / "first" / f"{name}.jsonl").read_bytes() == (tmp_path / "second" / f"{name}.jsonl").read_bytes()
    splits = {name: lines(tmp_path / "first" / f"{name}.jsonl") for name in ("train", "validation", "test")}
    assert sum(map(len, splits.values())) == len(lines(run_dir / "trajectories.jsonl"))
    where = {}
    for name, rows in splits.items():
        for row in rows:
            assert where.setdefault(row["metadata"]["content_key"], name) == name
    ds = datasets.load_dataset("json", data_dir=str(tmp_path / "first"), cache_dir=str(tmp_path / "hf"))
    assert set(ds) == {"train", "validation", "test"}


def test_split_shares_hold_over_many_keys():
    splits = parse_splits(["validation=0.05"])
    names = [split_of(f"{i:032x}", splits) for i in range(20000)]
    assert 0.04 < names.count("validation") / len(names) < 0.06


def test_file_output_with_splits_names_each_file(run_dir, tmp_path):
    result = hb("export", run_dir, "--format", "openai", "--split", "validation=0.5", "--output", tmp_path / "data.jsonl")
    assert (tmp_path / "data.train.jsonl").exists() and (tmp_path / "data.validation.jsonl").exists()
    assert "validation:" in result.output


def test_an_empty_split_is_said_since_datasets_refuses_it(run_dir, tmp_path):
    result = hb("export", run_dir, "--format", "sharegpt", "--split", "validation=0.0001", "--output", tmp_path / "s")
    assert (tmp_path / "s" / "validation.jsonl").read_text() == ""
    assert "warning: validation got no trajectories, and datasets.load_dataset refuses" in result.output
    with pytest.raises(ValueError, match="corresponds to no data"):  # what the warning saves a user from meeting later
        datasets.load_dataset("json", data_dir=str(tmp_path / "s"), cache_dir=str(tmp_path / "hf"))
    assert "warning" not in hb("export", run_dir, "--format", "sharegpt", "--output", tmp_path / "t").output


@pytest.mark.parametrize("args, message", [
    (["--format", "nope"], "Unknown --format 'nope'"),
    (["--format", "openai:reasoning=maybe"], "reasoning"),
    (["--format", "sharegpt:x=1"], "takes no options"),
    (["--format", "sharegpt", "--split", "validation=1.5"], "between 0 and 1"),
    (["--format", "sharegpt", "--split", "a=0.6", "--split", "b=0.5"], "nothing for train"),
    (["--format", "sharegpt", "--split", "train=0.1"], "train is what the other splits leave"),
    (["--format", "sharegpt", "--filter", "nope"], "Unknown --filter 'nope'"),
])
def test_bad_export_options_are_one_sentence(run_dir, args, message):
    result = hb("export", run_dir, *args, ok=False)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_a_folder_that_is_no_run_is_refused(tmp_path):
    result = hb("export", tmp_path, "--format", "sharegpt", ok=False)
    assert result.exit_code == 2 and "holds no run" in result.output


def test_writer_formats_also_run_as_writers(tmp_path, model_server):
    server = model_server(script=ShapeScript())
    folder = run_shapes(tmp_path, server, shape_rows(["ok", "fail"], 2),
                        extra=["--writer", "jsonl", "--writer", "openai:reasoning=drop", "--writer", "sharegpt"])
    openai_lines = lines(folder / "trajectories.openai.jsonl")
    assert len(openai_lines) == len(lines(folder / "trajectories.jsonl")) == 4
    assert all(check_line(r) == [] for r in openai_lines)
    assert (folder / "trajectories.sharegpt.jsonl").read_text() == (folder / "trajectories.jsonl").read_text()


def test_an_interrupted_export_leaves_the_previous_file(run_dir, tmp_path, monkeypatch):
    out = tmp_path / "o.jsonl"
    hb("export", run_dir, "--format", "sharegpt", "--output", out)
    before = out.read_bytes()
    from hermes_batch.default_plugins import jsonl_writer

    def boom(_traj):
        raise KeyboardInterrupt

    monkeypatch.setattr(jsonl_writer, "to_json_line", boom)
    result = hb("export", run_dir, "--format", "sharegpt", "--output", out, ok=False)
    assert result.exit_code == 1 and "Aborted" in result.output  # click's answer to Ctrl-C
    assert out.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def plant_lone_surrogate(run_dir, prompt):
    """Give ``prompt``'s kept record an escaped lone surrogate after its answer, as versions before the repair wrote."""
    answer = answer_for(prompt)
    for path in sorted(run_dir.glob("batch_*.jsonl")):
        text = path.read_text(encoding="utf-8")
        if answer in text:
            path.write_text(text.replace(answer, answer + "\\ud800", 1), encoding="utf-8")
            return answer
    raise AssertionError(f"no batch file holds the answer of {prompt!r}")


def test_an_old_record_with_a_lone_surrogate_is_repaired_as_the_run_does(run_dir, tmp_path):
    answer = plant_lone_surrogate(run_dir, "[ok] task 1")
    result = hb("export", run_dir, "--format", "openai", "--output", tmp_path / "o.jsonl")
    assert "repaired: 1" in result.output  # text that is not Unicode, written with U+FFFD as the run writes it
    rows = lines(tmp_path / "o.jsonl")
    assert len(rows) == len(lines(run_dir / "trajectories.jsonl"))
    row = next(r for r in rows if r["messages"][1]["content"] == "[ok] task 1")
    assert row["messages"][-1]["content"].endswith(answer + "\ufffd")
    hb("export", run_dir, "--format", "sharegpt", "--output", tmp_path / "s.jsonl")
    assert answer + "\ufffd" in (tmp_path / "s.jsonl").read_text(encoding="utf-8")



# --- what an export may write, and what it owns (27.3, 28.4) --------------------------------------------------


def file_bytes(folder) -> dict:
    """name -> bytes of every visible file of ``folder``."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")}


def temporary(folder) -> list:
    """Temporary files and exchange folders an export left in or beside ``folder``."""
    return sorted(p.name for place in (folder, folder.parent) for p in place.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.parametrize("where", ["batch", "discarded.jsonl", "failed.jsonl", "checkpoint.json", "run folder",
                                   "other run's batch", "other run's scratch"])
def test_export_never_writes_a_run_folders_records(run_dir, tmp_path, where):
    other = run_dir.parent / "other"
    shutil.copytree(run_dir, other)
    (other / "failed.jsonl").write_text("")
    batch = sorted(run_dir.glob("batch_*.jsonl"))[0].name
    output = {"batch": run_dir / batch, "discarded.jsonl": run_dir / "discarded.jsonl",
              "failed.jsonl": other / "failed.jsonl", "checkpoint.json": run_dir / "checkpoint.json",
              "run folder": run_dir, "other run's batch": other / batch,
              "other run's scratch": other / "scratch"}[where]
    before = {folder: file_bytes(folder) for folder in (run_dir, other)}
    result = hb("export", run_dir, "--format", "sharegpt", "--output", output, ok=False)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "inside the run folder" in result.output and "whose files are the run's own records" in result.output
    assert {folder: file_bytes(folder) for folder in (run_dir, other)} == before
    # its exports/ folder is the export's: any run's
    hb("export", run_dir, "--format", "sharegpt", "--output", other / "exports" / "mine")
    assert (other / "exports" / "mine" / "train.jsonl").exists()


def test_an_existing_file_the_export_did_not_write_is_refused_unless_force(run_dir, tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text("the user's own data\n")
    result = hb("export", run_dir, "--format", "sharegpt", "--output", out, ok=False)
    assert result.exit_code == 2
    assert f"{out} exists and was not written by hermes-batch export; pass --force" in result.output
    assert out.read_text() == "the user's own data\n"
    hb("export", run_dir, "--format", "sharegpt", "--output", out, "--force")
    assert out.read_text() == (run_dir / "trajectories.jsonl").read_text()
    hb("export", run_dir, "--format", "sharegpt", "--output", out, "--include", "all")  # its own now: no --force
    assert len(lines(out)) > len(lines(run_dir / "trajectories.jsonl"))
    # a file the export wrote and the user changed since is theirs again
    out.write_text("edited\n")
    result = hb("export", run_dir, "--format", "sharegpt", "--output", out, ok=False)
    assert result.exit_code == 2 and "was changed since the export wrote it; pass --force" in result.output
    assert out.read_text() == "edited\n"
    # a split file among the user's files is refused the same way
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "validation.jsonl").write_text("mine\n")
    result = hb("export", run_dir, "--format", "openai", "--split", "validation=0.5", "--output", tmp_path / "folder",
                ok=False)
    assert result.exit_code == 2 and "validation.jsonl exists and was not written" in result.output
    assert sorted(p.name for p in (tmp_path / "folder").iterdir()) == ["validation.jsonl"]


def test_a_second_export_replaces_the_whole_set_of_the_first(run_dir, tmp_path):
    folder = run_dir / "exports" / "sharegpt"
    hb("export", run_dir, "--format", "sharegpt", "--split", "validation=0.5")
    assert sorted(file_bytes(folder)) == ["train.jsonl", "validation.jsonl"]
    result = hb("export", run_dir, "--format", "sharegpt")
    assert "removed from the previous export here: validation.jsonl" in result.output
    assert sorted(file_bytes(folder)) == ["train.jsonl"]
    ds = datasets.load_dataset("json", data_dir=str(folder), cache_dir=str(tmp_path / "hf"))
    assert set(ds) == {"train"} and len(ds["train"]) == len(lines(run_dir / "trajectories.jsonl"))
    # named files with splits, then without: the split files go, the user's files stay
    (tmp_path / "notes.txt").write_text("mine\n")
    hb("export", run_dir, "--format", "openai", "--split", "validation=0.5", "--output", tmp_path / "d.jsonl")
    assert {"d.train.jsonl", "d.validation.jsonl"} <= set(file_bytes(tmp_path))
    hb("export", run_dir, "--format", "openai", "--output", tmp_path / "d.jsonl")
    assert sorted(p for p in file_bytes(tmp_path) if p.startswith("d.")) == ["d.jsonl"]
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    # a folder holding the user's files too: the export's set is replaced there, the rest left alone
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "README.md").write_text("my dataset card\n")
    hb("export", run_dir, "--format", "sharegpt", "--split", "test=0.5", "--output", shared)
    result = hb("export", run_dir, "--format", "parquet" if _has_parquet() else "openai", "--output", shared)
    assert "removed from the previous export here: test.jsonl" in result.output
    left = sorted(file_bytes(shared))
    assert "README.md" in left and "test.jsonl" not in left and len(left) == 2
    assert temporary(shared) == []


def _has_parquet() -> bool:
    try:
        import hermes_batch_parquet  # noqa: F401
    except ImportError:
        return False
    return True


KILLER = r"""
import os, signal, sys, time
from pathlib import Path
from hermes_batch.contract.writers import LineSink
try:
    import hermes_batch.offline.export_files as export_files
except ImportError:  # versions before export_files.py: so that this test shows what they did
    export_files = None

point, flag = sys.argv[1], Path(sys.argv[2])

def stop_here():
    flag.write_text("here")
    if point.startswith("sigint"):
        os.kill(os.getpid(), signal.SIGINT)  # held off while files are switched
        return
    time.sleep(60)  # the test kills the process now

if point == "writing":
    add = LineSink.add
    def slow_add(self, trajectory):
        add(self, trajectory)
        if self.count == 2:
            self.file.flush()
            stop_here()
    LineSink.add = slow_add
elif point in ("before exchange", "after exchange"):
    exchange = export_files._exchange
    def stopping_exchange(new, old):
        if point == "before exchange":
            stop_here()
        done = exchange(new, old)
        if point == "after exchange":
            stop_here()
        return done
    export_files._exchange = stopping_exchange
elif point.endswith("between renames"):
    if point.startswith("no exchange"):
        export_files._exchange = lambda new, old: False  # a file system without RENAME_EXCHANGE
    replace, count = os.replace, [0]
    def stopping_replace(src, dst):
        replace(src, dst)
        dst = Path(dst)
        if dst.suffix == ".jsonl" and not dst.name.endswith(".tmp") and not dst.parent.name.endswith(".tmp"):
            count[0] += 1
            if count[0] == 1:
                stop_here()
    os.replace = stopping_replace

from hermes_batch.cli import main
main(sys.argv[3:])
"""


def killed_export(tmp_path, point, *args, sigkill=True):
    """``hermes-batch export ARGS`` in a child process, SIGKILLed at ``point``; returns its exit status."""
    flag = tmp_path / f"flag-{point.replace(' ', '-')}"
    flag.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", KILLER, point, str(flag), "export", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not sigkill:
        out, err = proc.communicate(timeout=120)
        assert flag.exists(), err
        return proc.returncode, err
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.kill()
    proc.communicate()
    return proc.returncode, ""


@pytest.mark.parametrize("point", ["writing", "before exchange", "after exchange"])
def test_a_killed_export_leaves_the_old_set_or_the_new_and_the_next_cleans_up(run_dir, tmp_path, point):
    folder = tmp_path / "splits"
    hb("export", run_dir, "--format", "sharegpt", "--include", "all", "--split", "validation=0.4", "--output", folder)
    old = file_bytes(folder)
    hb("export", run_dir, "--format", "sharegpt", "--split", "test=0.4", "--output", tmp_path / "fresh")
    new = file_bytes(tmp_path / "fresh")
    killed_export(tmp_path, point, run_dir, "--format", "sharegpt", "--split", "test=0.4", "--output", folder)
    assert file_bytes(folder) == (new if point == "after exchange" else old)  # one set or the other, whole
    assert temporary(folder) != []  # what the killed export left ...
    hb("export", run_dir, "--format", "sharegpt", "--split", "test=0.4", "--output", folder)
    assert file_bytes(folder) == new
    assert temporary(folder) == []  # ... is removed by the next export


@pytest.mark.parametrize("point", ["between renames", "no exchange between renames"])
def test_a_switch_killed_between_renames_is_finished_by_the_next_export(run_dir, tmp_path, point):
    # named split files among the user's own, or a file system without RENAME_EXCHANGE: the files are switched
    # one by one after the manifest names the new set (the commit point)
    place = tmp_path / "place"
    place.mkdir()
    if point == "between renames":
        (place / "notes.txt").write_text("mine\n")
        out, fresh, own = place / "d.jsonl", tmp_path / "fresh" / "d.jsonl", lambda name: name.startswith("d.")
    else:
        out, fresh, own = place, tmp_path / "fresh", lambda name: True
    hb("export", run_dir, "--format", "sharegpt", "--include", "all", "--split", "validation=0.4", "--output", out)
    hb("export", run_dir, "--format", "sharegpt", "--split", "test=0.4", "--output", fresh)
    new = file_bytes(fresh.parent if fresh.suffix else fresh)
    killed_export(tmp_path, point, run_dir, "--format", "sharegpt", "--split", "test=0.4", "--output", out)
    manifests = [json.loads(p.read_text()) for p in place.glob(".*hermes-batch-export.json")]
    assert [sorted(m["switching"]) for m in manifests] == [sorted(new)]  # killed inside the switch
    # the next export into the same place, whatever it is asked, first finishes the switch the manifest names
    hb("export", run_dir, "--format", "sharegpt", "--split", "test=0.4", "--output", out)
    assert {k: v for k, v in file_bytes(place).items() if own(k)} == new
    assert temporary(place) == []
    if point == "between renames":
        assert (place / "notes.txt").read_text() == "mine\n"


def test_ctrl_c_waits_for_the_switch_of_the_files(run_dir, tmp_path):
    out = tmp_path / "d.jsonl"
    (tmp_path / "notes.txt").write_text("mine\n")
    hb("export", run_dir, "--format", "sharegpt", "--include", "all", "--split", "validation=0.4", "--output", out)
    hb("export", run_dir, "--format", "sharegpt", "--split", "test=0.4", "--output", tmp_path / "fresh" / "d.jsonl")
    status, err = killed_export(tmp_path, "sigint between renames", run_dir, "--format", "sharegpt",
                                "--split", "test=0.4", "--output", out, sigkill=False)
    assert status == 1 and "Aborted" in err and "Traceback" not in err  # click's Ctrl-C, after the switch
    assert {k: v for k, v in file_bytes(tmp_path).items() if k.startswith("d.")} == file_bytes(tmp_path / "fresh")


@pytest.fixture
def small_disk(tmpfs):
    """A real 400 KiB tmpfs mounted inside tmp_path (we are root); unmounted afterwards."""
    return tmpfs("400k")


@pytest.mark.parametrize("fmt", ["sharegpt", "openai", "parquet"])
def test_a_full_disk_is_one_sentence_with_status_74_and_leaves_no_half_file(run_dir, small_disk, fmt):
    if fmt == "parquet" and not _has_parquet():
        pytest.skip("hermes-batch-parquet is not installed")
    folder = small_disk / "export"
    hb("export", run_dir, "--format", fmt, "--output", folder)
    old = file_bytes(folder)
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    (small_disk / "filler").write_bytes(b"x" * max(0, free - 8192))
    result = hb("export", run_dir, "--format", fmt, "--include", "all", "--split", "validation=0.5",
                "--output", folder, ok=False)
    assert result.exit_code == 74, result.output
    message = result.output.strip().splitlines()[-1]
    assert message.startswith(f"Error: Writing {folder}/") and "No space left on device (ENOSPC)" in message
    assert message.endswith("free some space on that disk.") and "Traceback" not in result.output
    assert file_bytes(folder) == old and temporary(folder) == []


# --- several runs, one dataset (28.5) -------------------------------------------------------------------------


def test_several_runs_export_as_one_dataset_with_one_schema(tmp_path, model_server):
    (tmp_path / "dists.toml").write_text('[terminal_alone]\ntoolsets = { terminal = 100 }\n'
                                         '[with_files]\ntoolsets = { terminal = 100, file = 100 }\n')
    server = model_server(script=ShapeScript())
    rows = shape_rows(["ok", "notool"], 4)

    def run(name, distribution):
        return run_shapes(tmp_path, server, rows, run_name=name,
                          extra=["--distribution_file", tmp_path / "dists.toml", "--distribution", distribution])

    a, b, same_as_a = run("a", "terminal_alone"), run("b", "with_files"), run("c", "terminal_alone")
    tools = {name: json.loads((folder / "run.json").read_text())["tools"] for name, folder in
             (("a", a), ("b", b), ("c", same_as_a))}
    # every record lists every installed tool, whatever its run offered (docs/training-data.md)
    assert tools["a"] == tools["b"] == tools["c"] and "terminal" in tools["a"] and "write_file" in tools["a"]
    raw = lambda *folders: datasets.load_dataset(  # noqa: E731
        "json", data_files=[str(f / "trajectories.jsonl") for f in folders], split="train", cache_dir=str(tmp_path / "hf"))
    # the runs' own files load together
    assert len(raw(a, same_as_a)) == 2 * len(lines(a / "trajectories.jsonl"))
    assert len(raw(a, b)) == len(lines(a / "trajectories.jsonl")) + len(lines(b / "trajectories.jsonl"))

    result = hb("export", a, b, "--format", "sharegpt", "--split", "validation=0.5", "--output", tmp_path / "merged")
    kept = lines(a / "trajectories.jsonl") + lines(b / "trajectories.jsonl")
    ds = datasets.load_dataset("json", data_dir=str(tmp_path / "merged"), cache_dir=str(tmp_path / "hf"))
    assert set(ds) == {"train", "validation"} and len(ds["train"]) + len(ds["validation"]) == len(kept)
    merged = lines(tmp_path / "merged" / "train.jsonl") + lines(tmp_path / "merged" / "validation.jsonl")
    assert {tuple(sorted(r["tool_stats"])) for r in merged} == {tuple(tools["b"])}  # every line lists every tool
    assert {r["metadata"]["content_key"] for r in merged} == {r["metadata"]["content_key"] for r in kept}
    assert "train:" in result.output

    hb("export", a, b, "--format", "openai", "--output", tmp_path / "merged.openai.jsonl")
    openai_rows = lines(tmp_path / "merged.openai.jsonl")
    assert len(openai_rows) == len(kept) and all(check_line(r) == [] for r in openai_rows)
    assert len(datasets.load_dataset("json", data_files=str(tmp_path / "merged.openai.jsonl"), split="train",
                                     cache_dir=str(tmp_path / "hf"))) == len(kept)

    # whole-run filters compare across the runs: b answered the same prompts as a
    result = hb("export", a, b, "--format", "sharegpt", "--filter", "near-duplicates", "--output", tmp_path / "d.jsonl")
    answered = [r for r in lines(b / "trajectories.jsonl") if r["completed"] and answer_for(r["conversations"][1]["value"])]
    assert answered and f"left out by near-duplicates: {len(answered)}" in result.output

    result = hb("export", a, b, "--format", "sharegpt", ok=False)
    assert result.exit_code == 2 and "Exporting several runs needs --output" in result.output
    result = hb("export", a, a, "--format", "sharegpt", "--output", tmp_path / "twice", ok=False)
    assert result.exit_code == 2 and "is given twice" in result.output


def test_no_export_carries_the_rows_verifier_only_fields_unless_asked(tmp_path, model_server):
    from hermes_batch.testing import Reply, Runner, write_dataset

    runner = Runner(tmp_path, server=model_server(lambda request: Reply(content="42", reasoning="Easy.")))
    secret = {"tests": "SECRET-TESTS pytest -q", "test_files": {"t.py": "SECRET-FILES"}, "answer": "SECRET-ANSWER",
              "rubric": "SECRET-RUBRIC", "solution": "SECRET-SOLUTION"}
    data = write_dataset(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "topic": "math", **secret} for i in range(3)])
    result = runner.invoke(data, "--distribution", "terminal_only", "--verifier", "answer:field=solution",
                           "--samples_per_prompt", "2")
    assert result.exit_code == 0, result.output
    assert "SECRET-TESTS" in (runner.folder() / "trajectories.jsonl").read_text()  # the run's own records keep them

    for format_ in ("sharegpt", "openai", "rollouts", "dpo"):
        out = tmp_path / f"out.{format_}.jsonl"
        hb("export", runner.folder(), "--format", format_, "--output", out)
        assert out.exists() and "SECRET" not in out.read_text(), format_
    rows = [json.loads(r["metadata"]["row"]) for r in lines(tmp_path / "out.sharegpt.jsonl")]
    assert len(rows) == 6 and all(row == {"topic": "math"} for row in rows)  # answer:field=solution's field too

    hb("export", runner.folder(), "--format", "sharegpt", "--output", tmp_path / "all.jsonl", "--keep_verifier_fields")
    [row] = {r["metadata"]["row"] for r in lines(tmp_path / "all.jsonl")}
    assert json.loads(row) == {"topic": "math", **secret}
