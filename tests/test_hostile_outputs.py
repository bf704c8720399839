"""What reads a finished run for the user, under hostile files: ``export``'s output checks and the viewer's lines.

An ``--output`` that is a plain file is a mistake in the command (exit 2), not a disk error; the viewer
reads its record files as untrusted (a line nested too deep to decode, longer than any record, a FIFO in
place of a batch file) and answers every request with a page or a 404, never a 500.
"""

from __future__ import annotations

import json
import os

import pytest
from aiohttp.test_utils import TestClient, TestServer

from hermes_batch.testing import ToolLoopScript, run_cli as hb, write_dataset
from hermes_batch.view.index import RunIndex
from hermes_batch.view.server import Viewer
from view_rig import demo_run_dir, run_copy  # noqa: F401 (fixtures)


@pytest.fixture
def small_run(tmp_path, runner, model_server):
    data = write_dataset(tmp_path / "data.jsonl", [{"prompt": f"task {k}: look"} for k in range(2)])
    result = runner.invoke(data, "--distribution", "terminal_only", server=model_server(ToolLoopScript(tool_calls=1)))
    assert result.exit_code == 0, result.output
    return runner.folder()


@pytest.mark.parametrize("where", ["the file", "under the file"])
def test_an_export_output_that_is_a_plain_file_is_a_usage_error_not_a_disk_error(small_run, tmp_path, where):
    notes = tmp_path / "notes.txt"
    notes.write_text("the user's notes\n")
    output = notes if where == "the file" else notes / "exports"
    result = hb("export", small_run, "--format", "sharegpt", "--output", output, ok=False)
    assert result.exit_code == 2, result.output
    message = result.output.strip().splitlines()[-1]
    assert message.startswith(f"Error: --output {output} ") and "not a folder; pass a folder" in message
    assert message.endswith("or a file name ending in .jsonl.")
    assert notes.read_text() == "the user's notes\n"


def deep_line(record_line: str, depth: int) -> bytes:
    return (record_line[:-1] + ', "extra": ' + "[" * depth + "]" * depth + "}\n").encode()


async def test_the_viewer_answers_a_record_nested_too_deep_with_a_page_not_a_500(run_copy):
    first = (run_copy / "batch_0.jsonl").read_text().splitlines()[0]
    offsets = []
    with open(run_copy / "batch_0.jsonl", "ab") as handle:
        for depth in (2_000, 200_000):
            offsets.append(handle.tell())
            handle.write(deep_line(first, depth))
    viewer = Viewer(run_copy, RunIndex(run_copy, persist=False))
    async with TestClient(TestServer(viewer.app())) as client:
        for offset in offsets:
            answer = await client.get("/api/record", params={"ref": f"batch_0.jsonl:{offset}"})
            assert answer.status == 404, await answer.text()
            assert "is no record" in await answer.text()
        answer = await client.get("/api/record", params={"ref": "batch_0.jsonl:0"})
        assert answer.status == 200
        listed = await client.get("/api/records")
        assert listed.status == 200


def test_a_line_longer_than_any_record_is_skipped_and_counted_not_held(run_copy, monkeypatch):
    from hermes_batch.view import index as index_module

    monkeypatch.setattr(index_module, "MAX_LINE_BYTES", 100_000)
    monkeypatch.setattr(index_module, "_CHUNK", 4096)
    first = (run_copy / "batch_0.jsonl").read_text().splitlines()[0]
    record = json.loads(first)
    record["prompt_index"] = 77
    with open(run_copy / "batch_0.jsonl", "a") as handle:
        handle.write(first[:-1] + ', "padding": "' + "p" * 300_000 + '"}\n')
        handle.write(json.dumps(record) + "\n")
    before = RunIndex(run_copy, cache_dir=run_copy / "a", persist=False)
    before.refresh()
    assert 77 in list(before.columns.prompt)  # the record after the long line is indexed where it is
    assert before.tallies.unreadable == 1
    status, data = before.read_ref(f"batch_0.jsonl:{before.columns.offset[list(before.columns.prompt).index(77)]}")
    assert data["prompt_index"] == 77


def test_a_record_file_that_is_a_fifo_is_not_read(run_copy):
    (run_copy / "batch_9.jsonl").unlink(missing_ok=True)
    os.mkfifo(run_copy / "batch_9.jsonl")
    index = RunIndex(run_copy, persist=False)
    index.refresh()  # returns: the FIFO is left out
    assert len(index) > 0 and "batch_9.jsonl" not in index.files
