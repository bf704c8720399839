"""``--samples_per_prompt`` of absurd size: memory goes with the rows and the finished records, not the samples.

A billion samples over ten rows took 20 GB in 30 s (a list of every sample index, made up front) before
the kernel killed the run; the samples a session runs are now ranges, made as they are read, and a resume
claims the finished ones in a pass over the rows per sample index, stopping once every record is claimed.
"""

from __future__ import annotations

import array
import json

import attrs

from hermes_batch.folder.rowkeys import RowKeys
from hermes_batch.formats.records import Usage, sample_digest
from hermes_batch.run import samples
from hermes_batch.testing import ToolLoopScript, write_dataset


def test_samples_left_are_a_range_with_the_finished_ones_left_out():
    left = samples.SamplesLeft(10, (0, 3, 4, 9))
    assert list(left) == [1, 2, 5, 6, 7, 8] and len(left) == 6
    assert [left[k] for k in range(6)] == [1, 2, 5, 6, 7, 8] and left[-1] == 8
    assert list(left[1:]) == [2, 5, 6, 7, 8] and left[:1] == (1,) and list(left[5:]) == [8] and list(left[6:]) == []
    huge = samples.SamplesLeft(10**9, (0, 1, 5))
    assert len(huge) == 10**9 - 3 and huge[3] == 6 and huge[-1] == 10**9 - 1
    assert len(huge[1:]) == 10**9 - 4 and huge[1:][0] == 3


def keys_of(n: int) -> RowKeys:
    keys = RowKeys()
    for index in range(n):
        keys.digests.append(1000 + index)
        keys.indexes.append(index)
    return keys


def test_a_resume_over_a_billion_samples_a_row_matches_in_a_few_passes():
    keys = keys_of(10)
    finished = array.array("Q", [sample_digest(1000 + row, i) for row in range(10) for i in range(3)])
    finished.append(sample_digest(1003, 7))  # a row's sample that ran after some that failed
    found = samples.match(keys, finished, 10**9, None)
    assert found.total == 10 * 10**9 and found.skipped == 31 and found.finished == 31
    assert list(found.left) == list(range(10))
    assert found.of(3, 10**9, None)[:5] == (3, 4, 5, 6, 8)
    assert found.of(0, 10**9, None)[0] == 3 and len(found.of(0, 10**9, None)) == 10**9 - 3


def test_duplicated_rows_and_passed_rows_are_matched_as_before():
    keys = RowKeys(array.array("Q", [7, 7, 8]), array.array("Q", [0, 1, 2]))
    finished = array.array("Q", [sample_digest(7, 0), sample_digest(7, 0), sample_digest(7, 1), sample_digest(8, 0)])
    found = samples.match(keys, finished, 3, None, passed={sample_digest(8, 0)})
    assert list(found.left) == [0, 1]  # row 2 passed: it runs no more
    assert list(found.of(0, 3, None)) == [2] and list(found.of(1, 3, None)) == [1, 2]
    assert found.skipped == 3 + 3 and found.to_run == 3


def limited_memory():
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # today's code asks for 36 GB at the first row


def test_a_billion_samples_a_row_run_and_resume_in_little_memory(tmp_path, runner, model_server, procs):
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {k}: look"} for k in range(10)])
    loop = ToolLoopScript(tool_calls=1)
    server = model_server(lambda request: attrs.evolve(loop(request), usage=Usage(10, 10, cost=0.01)))
    options = ("--distribution", "terminal_only", "--samples_per_prompt", "1000000000", "--num_workers", "2")
    for budget in ("0.05", "0.1"):  # the first run, then a resume: each stops at its --max_cost
        proc = runner.spawn(data, *options, "--max_cost", budget, *(("--resume",) if budget == "0.1" else ()),
                            server=server, preexec_fn=limited_memory)
        procs.append(proc)
        _out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert "--max_cost" in err
    kept = [json.loads(line) for path in runner.folder().glob("batch_*.jsonl") for line in path.read_text().splitlines()]
    assert len(kept) >= 5 and len(set((r["prompt_index"], r["metadata"]["sample_index"]) for r in kept)) == len(kept)
