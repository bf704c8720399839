"""The sample and verification fields of a record (issue 31): defaults, old records, one JSON type each."""

from __future__ import annotations

import io
import json

import pytest

from hermes_batch.formats.records import Metadata, VerifierResult
from hermes_batch.formats.serialization import to_json_line, trajectory_from_dict, trajectory_to_dict
from hermes_batch.testing.records import make_trajectory

FIELDS = ("sample_index", "reward", "verified", "passed", "verifiers")


def verified_record(**metadata):
    results = (
        VerifierResult("command", 1.0, "exit status 0", output="2 passed\n", duration_s=0.25),
        VerifierResult("answer", 0.5, "number within 0.1", duration_s=0.001),
    )
    fields = dict(sample_index=2, reward=0.5, verified=True, passed=False, verifiers=results)
    fields.update(metadata)
    return make_trajectory(metadata=fields)


def test_a_record_without_verification_says_so_with_defaults():
    meta = json.loads(to_json_line(make_trajectory()))["metadata"]
    assert {name: meta[name] for name in FIELDS} == {
        "sample_index": 0, "reward": 0.0, "verified": False, "passed": False, "verifiers": "[]"}
    # appended: older readers keep their columns
    assert list(meta)[-9:] == [*FIELDS, "audit", "branch_of", "branch_turn", "token_check"]


def test_the_fields_read_back_as_written():
    record = verified_record()
    line = to_json_line(record)
    data = json.loads(line)
    # JSON text, like invalid_tool_calls: "[]" and a list of objects are one Arrow type
    assert json.loads(data["metadata"]["verifiers"])[0] == {
        "name": "command", "reward": 1.0, "reason": "exit status 0", "error": "", "output": "2 passed\n",
        "duration_s": 0.25}
    assert trajectory_from_dict(data) == record
    assert json.loads(to_json_line(trajectory_from_dict(data))) == data


def test_a_record_written_before_the_fields_reads_as_their_defaults():
    data = trajectory_to_dict(verified_record())
    for name in FIELDS:
        del data["metadata"][name]
    meta = trajectory_from_dict(data).metadata
    assert (meta.sample_index, meta.reward, meta.verified, meta.passed, meta.verifiers) == (0, 0.0, False, False, ())


def test_numbers_are_written_as_floats_and_bad_values_read_as_defaults():
    # a plugin that builds a record with an int reward, or NaN, still writes one JSON type per field
    record = verified_record(reward=1, verifiers=(VerifierResult("x", 1, duration_s=2),
                                                  VerifierResult("y", float("nan"), error="boom")))
    meta = json.loads(to_json_line(record))["metadata"]
    assert isinstance(meta["reward"], float) and meta["reward"] == 1.0
    verifiers = json.loads(meta["verifiers"])
    assert [type(v["reward"]) for v in verifiers] == [float, float]
    assert verifiers[1]["reward"] == 0.0 and isinstance(verifiers[0]["duration_s"], float)
    meta.update(sample_index=-1, reward="1", verified="true", passed=1, verifiers=[{"name": 3}, "x"])
    back = trajectory_from_dict({**trajectory_to_dict(record), "metadata": meta}).metadata
    assert (back.sample_index, back.reward, back.verified, back.passed) == (0, 0.0, False, False)
    assert back.verifiers == (VerifierResult(""),)
    # a list of objects (not text) reads too
    meta["verifiers"] = [{"name": "command", "reward": 1.0}]
    back = trajectory_from_dict({**trajectory_to_dict(record), "metadata": meta}).metadata
    assert back.verifiers == (VerifierResult("command", 1.0),)


def test_metadata_defaults_need_no_arguments():
    meta = Metadata(batch_num=0, timestamp="t", model="m", content_key="k")
    assert (meta.sample_index, meta.reward, meta.verified, meta.passed, meta.verifiers) == (0, 0.0, False, False, ())


def test_pyarrow_reads_verified_and_unverified_records_with_one_schema():
    """A run without verifiers read with one that has them (in small blocks, unverified first) is one schema."""
    pa_json = pytest.importorskip("pyarrow.json")
    lines = [to_json_line(make_trajectory()) for _ in range(3)] + [to_json_line(verified_record(sample_index=i)) for i in range(3)]
    data = "".join(lines).encode()
    options = pa_json.ReadOptions(block_size=max(map(len, lines)) + 10)
    schema = pa_json.read_json(io.BytesIO(data), read_options=options).schema
    assert schema == pa_json.read_json(io.BytesIO(data), read_options=pa_json.ReadOptions(block_size=1 << 20)).schema
    meta = schema.field("metadata").type
    assert str(meta.field("verifiers").type) == "string"
    assert str(meta.field("reward").type) == "double" and str(meta.field("sample_index").type) == "int64"
    assert str(meta.field("verified").type) == str(meta.field("passed").type) == "bool"
