from collections import Counter

import pytest

from hermes_batch.formats.records import Discarded, Failure, Metadata, PromptRow, Trajectory, Turn, content_key
from hermes_batch.folder.resume import plan_resume, scan_finished
from hermes_batch.folder.runfolder import AppendLog, RunFolder
from hermes_batch.formats.serialization import to_json_line


def key(prompt: str) -> str:
    return content_key(prompt, None, None)


def traj(index: int, prompt: str) -> Trajectory:
    meta = Metadata(index // 10, "2026-01-01T00:00:00", "m", key(prompt))
    conv = (Turn("human", prompt), Turn("gpt", "<think>x</think>done"))
    return Trajectory(index, conv, meta, True, False, 1, (), {}, {})


def rows(*prompts: str) -> list[PromptRow]:
    return [PromptRow(i, p, i + 1) for i, p in enumerate(prompts)]


@pytest.fixture
def folder(tmp_path) -> RunFolder:
    folder = RunFolder(tmp_path, "run")
    folder.create()
    return folder


def write(path, *records) -> None:
    log = AppendLog(path)
    for record in records:
        log.append_sync(to_json_line(record))
    log.close()


def test_scan_counts_duplicates_discarded_and_not_failed(folder):
    write(folder.batch_path(0), traj(0, "a"), traj(2, "a"), traj(1, "b"))
    write(folder.batch_path(1), traj(10, "a"))
    write(folder.discarded, Discarded(traj(3, "c"), ("no-reasoning",), ("no reasoning",)))
    write(folder.failed, Failure(4, key("d"), 0, "OSError", "sandbox", "died", "2026-01-01T00:00:00"))
    assert scan_finished(folder) == Counter({key("a"): 3, key("b"): 1, key("c"): 1})


def test_scan_of_an_empty_folder(tmp_path):
    assert scan_finished(RunFolder(tmp_path, "never-ran")) == Counter()


def test_scan_ignores_a_torn_last_line(folder):
    write(folder.batch_path(0), traj(0, "a"))
    with open(folder.batch_path(0), "a") as fh:
        fh.write(to_json_line(traj(1, "b"))[:-1])  # the crash came before the newline
    assert scan_finished(folder) == Counter({key("a"): 1})


def test_duplicated_rows_run_as_often_as_they_appear(folder):
    write(folder.batch_path(0), traj(0, "a"), traj(2, "a"))
    plan = plan_resume(rows("a", "b", "a", "a", "c"), scan_finished(folder))
    todo = list(plan)
    assert [(r.prompt_index, r.prompt) for r in todo] == [(1, "b"), (3, "a"), (4, "c")]
    assert (plan.skipped, plan.to_run, plan.unmatched) == (2, 3, 0)


def test_reordered_dataset_resumes_by_content(folder):
    # first run over [a, b, c]: a finished, c discarded, b failed
    write(folder.batch_path(0), traj(0, "a"))
    write(folder.discarded, Discarded(traj(2, "c"), ("hallucinated-tools",), ("called ghost",)))
    write(folder.failed, Failure(1, key("b"), 0, "ModelEndpointError", "model_endpoint", "503", "2026-01-01T00:00:00"))
    plan = plan_resume(rows("c", "new", "b", "a"), scan_finished(folder))
    assert [r.prompt for r in plan] == ["new", "b"]
    assert plan.skipped == 2


def test_finished_prompts_missing_from_the_dataset_are_reported(folder):
    write(folder.batch_path(0), traj(0, "gone"), traj(1, "a"))
    plan = plan_resume(rows("a", "b"), scan_finished(folder))
    assert [r.prompt for r in plan] == ["b"]
    assert plan.unmatched == 1


def test_plan_does_not_consume_the_callers_counter(folder):
    finished = Counter({key("a"): 1})
    list(plan_resume(rows("a"), finished))
    assert finished == Counter({key("a"): 1})


def test_rows_with_other_image_or_cwd_are_other_prompts(folder):
    write(folder.batch_path(0), traj(0, "a"))
    dataset = [PromptRow(0, "a", 1, image="python:3.12"), PromptRow(1, "a", 2, cwd="/src"), PromptRow(2, "a", 3)]
    assert [r.prompt_index for r in plan_resume(dataset, scan_finished(folder))] == [0, 1]
