"""Run folders of hand-written records with rewards (the 31 record shape), for the tests of what reads them."""

from __future__ import annotations

import json

import pytest

from hermes_batch.folder.durable import AppendLog
from hermes_batch.folder.runfolder import RunFolder
from hermes_batch.formats import hermes_format
from hermes_batch.formats.records import Discarded, Trajectory, Turn, content_key, sample_key
from hermes_batch.formats.serialization import from_json, to_json_line
from hermes_batch.testing import make_trajectory

TERMINAL = {"type": "function", "function": {"name": "terminal", "description": "Run a command.",
                                              "parameters": {"type": "object", "properties": {}}}}


def sample(index: int, prompt: str, sample_index: int, reward=None, *, passed=None, error="", toolsets=("terminal",),
           system="You are a helpful assistant.", answer=None) -> Trajectory:
    """A sample of row ``index`` as the 31 record shape has it: ``reward`` None means no verifier ran."""
    row = content_key(prompt, None, None)
    # as the run keys them: the row's key for sample 0, a key of its own for each other sample
    meta = {"content_key": sample_key(row, sample_index) if sample_index else row, "sample_index": sample_index,
            "batch_num": index // 10,
            "id": f"row-{index}"}
    traj = make_trajectory(prompt_index=index, toolsets_used=tuple(toolsets),
                           answer=answer or f"answer {index}.{sample_index}")
    convs = list(traj.conversations)
    convs[0], convs[1] = Turn("system", hermes_format.system_text(system, [TERMINAL])), Turn("human", prompt)
    data = json.loads(to_json_line(traj))
    data["conversations"] = [{"from": t.from_, "value": t.value} for t in convs[:2]] + data["conversations"][2:]
    data["metadata"].update(meta)
    if reward is not None:
        verified = not error
        data["metadata"].update(
            reward=0.0 if error else float(reward), verified=verified,
            passed=verified and (reward >= 1.0 if passed is None else passed),
            verifiers=json.dumps([{"name": "command", "reward": 0.0 if error else float(reward), "reason": "tests ran",
                                   "error": error, "output": "", "duration_s": 0.5}]),  # JSON text, as records hold it
        )
    return from_json(data, Trajectory)


def write(path, *records) -> None:
    log = AppendLog(path)
    for record in records:
        log.append_sync(to_json_line(record))
    log.close()


# row 0: samples pass, fail, pass, fail; row 1: all fail; row 2: all pass (one reward above the bar);
# row 3: partial credit 0.5 twice and one verifier error
ROWS = {
    0: [1.0, 0.0, 1.0, 0.0],
    1: [0.0, 0.0, 0.0, 0.0],
    2: [1.0, 1.0],
    3: [0.5, 0.5, "error"],
}


def rewarded_samples():
    out = []
    for index, rewards in ROWS.items():
        for s, reward in enumerate(rewards):
            if reward == "error":
                out.append(sample(index, f"task {index}", s, 0.0, error="timed out after 60 s"))
            else:
                out.append(sample(index, f"task {index}", s, reward, toolsets=("terminal",) if s % 2 == 0 else ("file",)))
    return out


@pytest.fixture
def rewarded(tmp_path) -> RunFolder:
    """A run whose failing samples the verified filter discarded (so a row's samples lie in two files)."""
    folder = RunFolder(tmp_path / "out", "rewarded")
    folder.create()
    kept, discarded = [], []
    for traj in rewarded_samples():
        if traj.metadata.passed:
            kept.append(traj)
        else:
            discarded.append(Discarded(traj, ("verified",), ("reward below the run's --min_reward",)))
    write(folder.batch_path(0), *kept)
    write(folder.discarded, *discarded)
    return folder
