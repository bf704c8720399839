import json

import attrs

import pluggy
import pytest

from hermes_batch import PROJECT_NAME
from hermes_batch.contract import hookspecs
from hermes_batch.default_plugins import jsonl_writer
from hermes_batch.default_plugins.jsonl_writer import JsonlWriter
from hermes_batch.contract.interfaces import Writer
from hermes_batch.folder.merge import merge_run
from hermes_batch.formats.records import Discarded, InvalidToolCall, Metadata, ToolCallRecord, ToolStat, Trajectory, Turn, Usage, content_key
from hermes_batch.folder.durable import AppendLog
from hermes_batch.folder.runfolder import RunFolder
from hermes_batch.formats.serialization import to_json_line

BATCH_SIZE = 10


def traj(index: int, tools: dict[str, ToolStat]) -> Trajectory:
    prompt = f"prompt {index}"
    calls = tuple(ToolCallRecord(f"call_{n}", n, {"command": "ls"}) for n in tools)
    conv = (
        Turn("system", "sys"),
        Turn("human", prompt),
        Turn("gpt", "<think>x</think>calling", calls),
        Turn("tool", "<tool_response>...</tool_response>"),
        Turn("gpt", "<think>y</think>done"),
    )
    usage = Usage(10, 5, cost=0.001) if index % 2 else None
    meta = Metadata(index // BATCH_SIZE, "2026-01-01T00:00:00", "m", content_key(prompt, None, None), usage=usage)
    errors = {name: stat.failure for name, stat in tools.items()}
    return Trajectory(index, conv, meta, True, False, 2, ("terminal",), tools, errors)


def append(path, *records) -> None:
    log = AppendLog(path)
    for record in records:
        log.append_sync(to_json_line(record))
    log.close()


@pytest.fixture
def folder(tmp_path) -> RunFolder:
    folder = RunFolder(tmp_path, "merge-run")
    folder.create()
    # appended in completion order, not prompt order; batch_10 sorts after batch_2 by number
    append(folder.batch_path(10), traj(101, {"web_search": ToolStat(2, 1, 1)}), traj(100, {}))
    append(folder.batch_path(0), traj(2, {"terminal": ToolStat(1, 1, 0)}), traj(0, {}),
           traj(1, {"read_file": ToolStat(3, 2, 1)}))
    append(folder.batch_path(2), traj(25, {"terminal": ToolStat(2, 2, 0)}), traj(21, {}))
    append(folder.discarded, Discarded(traj(3, {"ghost_tool": ToolStat(1, 0, 1)}), ("hallucinated-tools",), ("x",)))
    return folder


class ListWriter(Writer):
    name = "list"

    def __init__(self):
        self.got = []

    def write(self, run_dir, trajectories):
        self.got = list(trajectories)
        return None


def read_jsonl(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def test_merge_orders_by_prompt_index_across_batches(folder):
    result = merge_run(folder, [JsonlWriter()])
    lines = read_jsonl(folder.trajectories)
    assert [line["prompt_index"] for line in lines] == [0, 1, 2, 21, 25, 100, 101]
    assert result.trajectories == 7
    assert result.outputs == {"jsonl": "trajectories.jsonl"}


def test_every_line_lists_the_union_of_tools_with_zeros(folder):
    result = merge_run(folder, [JsonlWriter()])
    # a name only a discarded sample used (a hallucinated tool) does not become a column
    assert result.tool_names == ("read_file", "terminal", "web_search")
    lines = read_jsonl(folder.trajectories)
    for line in lines:
        assert list(line["tool_stats"]) == ["read_file", "terminal", "web_search"]
        assert list(line["tool_error_counts"]) == ["read_file", "terminal", "web_search"]
    by_index = {line["prompt_index"]: line for line in lines}
    assert by_index[0]["tool_stats"]["terminal"] == {"count": 0, "success": 0, "failure": 0}
    assert by_index[1]["tool_stats"]["read_file"] == {"count": 3, "success": 2, "failure": 1}
    assert by_index[101]["tool_error_counts"] == {"read_file": 0, "terminal": 0, "web_search": 1}


def test_tools_known_to_the_run_become_columns_even_unused(folder):
    result = merge_run(folder, [JsonlWriter()], tool_names=("write_file",))
    assert "write_file" in result.tool_names
    assert all(line["tool_stats"]["write_file"]["count"] == 0 for line in read_jsonl(folder.trajectories))


def test_every_writer_gets_the_same_ordered_stream(folder):
    first, second = ListWriter(), ListWriter()
    result = merge_run(folder, [first, JsonlWriter(), second])
    assert [t.prompt_index for t in first.got] == [t.prompt_index for t in second.got] == [0, 1, 2, 21, 25, 100, 101]
    assert result.outputs == {"list": None, "jsonl": "trajectories.jsonl"}


def test_merge_replaces_an_old_merge_and_handles_an_empty_run(tmp_path):
    folder = RunFolder(tmp_path, "empty")
    folder.create()
    folder.trajectories.write_text("stale\n")
    result = merge_run(folder, [JsonlWriter()])
    assert result.trajectories == 0
    assert folder.trajectories.read_text() == ""


def test_huggingface_datasets_loads_the_merged_file(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets

    merge_run(folder, [JsonlWriter()])
    ds = datasets.load_dataset("json", data_files=str(folder.trajectories), split="train",
                               cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == 7
    assert ds["prompt_index"] == [0, 1, 2, 21, 25, 100, 101]
    assert set(ds.features["tool_stats"]) == {"read_file", "terminal", "web_search"}
    assert ds[0]["tool_stats"]["web_search"] == {"count": 0, "success": 0, "failure": 0}
    assert ds[6]["conversations"][1]["from"] == "human"


def test_datasets_loads_a_big_file_whose_optional_fields_appear_late(tmp_path, monkeypatch):
    """datasets types each column from the file's first block: absent values must not be null there."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets

    path = tmp_path / "trajectories.jsonl"
    padding = "x" * 2000  # ~25 MB in all, well past the reader's first block
    with open(path, "w") as f:
        for i in range(12000):
            late = i >= 11000
            t = traj(i, {"terminal": ToolStat(1, 1, 0)})
            meta = attrs.evolve(
                t.metadata,
                id=f"row-{i}" if late else "",
                row={"topic": "late"} if late else {},
                image="img:1" if late else "",
                cwd="/app" if late else "",
                invalid_tool_calls=(InvalidToolCall("call_1", "teleport", "unknown tool"),) if late else (),
            )
            t = attrs.evolve(t, metadata=meta, conversations=t.conversations + (Turn("gpt", padding),))
            f.write(to_json_line(t))
    ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == 12000
    last = ds[11999]["metadata"]
    assert (last["id"], last["image"], last["cwd"]) == ("row-11999", "img:1", "/app")
    assert json.loads(last["row"]) == {"topic": "late"}
    assert json.loads(last["invalid_tool_calls"]) == [{"id": "call_1", "name": "teleport", "reason": "unknown tool"}]


def test_the_plugin_registers_the_jsonl_writer():
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(jsonl_writer)
    registered = []
    pm.hook.register_writers(register=registered.append)
    assert registered == [JsonlWriter, jsonl_writer.ShareGPTWriter]  # the same records under the format's name
    assert JsonlWriter.name == "jsonl"
