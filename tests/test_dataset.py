"""Dataset validation and row streaming (SPEC section 3)."""

from __future__ import annotations

import json
import os
import time
import tracemalloc

import pytest

from hermes_batch.formats.dataset import MAX_PROBLEMS, dataset_error, format_problems, iter_rows, validate_dataset
from hermes_batch.errors import DatasetError, UsageError


def write_lines(path, lines) -> str:
    """Write ``lines`` (str or bytes each) one per line and return the path as a string."""
    with open(path, "wb") as handle:
        for line in lines:
            handle.write(line if isinstance(line, bytes) else line.encode("utf-8"))
            handle.write(b"\n")
    return str(path)


def row(**fields) -> str:
    return json.dumps(fields)


BAD_LINES = [
    (b'{"prompt": "ok", ', "invalid JSON"),
    (b'{"prompt": "caf\xe9"}', "invalid UTF-8"),
    (b'["prompt", "x"]', "expected a JSON object, got array"),
    (b'"just a string"', "expected a JSON object, got string"),
    (b'{"text": "no prompt here"}', 'missing "prompt"'),
    (b'{"prompt": 42}', "$.prompt: expected a string, got int"),
    (b'{"prompt": null}', "$.prompt: expected a string, got null"),
    (b'{"prompt": ["a"]}', "$.prompt: expected a string, got array"),
    (b'{"prompt": ""}', "$.prompt: is empty"),
    (b'{"prompt": "  \\n\\t "}', "$.prompt: is empty"),
    (b'{"prompt": "x", "image": 3}', "$.image: expected a string, got int"),
    (b'{"prompt": "x", "docker_image": {"name": "a"}}', "$.docker_image: expected a string, got object"),
    (b'{"prompt": "x", "image": "a:1", "docker_image": "b:2"}', "differ"),
    (b'{"prompt": "x", "cwd": false}', "$.cwd: expected a string, got bool"),
    (b'{"prompt": "x", "image": ""}', "$.image: is empty"),
]


@pytest.mark.parametrize(("line", "reason"), BAD_LINES, ids=[reason for _, reason in BAD_LINES])
def test_each_kind_of_bad_line_is_reported_with_file_and_line_number(tmp_path, line, reason):
    path = write_lines(tmp_path / "data.jsonl", [row(prompt="first"), "", line, row(prompt="last")])

    report = validate_dataset(path)

    assert (report.valid, report.invalid, report.total) == (2, 1, 3)
    assert len(report.problems) == 1
    assert report.problems[0].startswith(f"{path}:3: ")
    assert reason in report.problems[0]
    assert [r.prompt for r in iter_rows(path)] == ["first", "last"]


def test_invalid_json_problem_includes_the_decoder_message(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", ['{"prompt": "x",}'])
    (problem,) = validate_dataset(path).problems
    assert problem.startswith(f"{path}:1: invalid JSON: ")
    assert "column" in problem


def test_file_name_is_shown_as_the_user_gave_it(tmp_path, monkeypatch):
    write_lines(tmp_path / "data.jsonl", ["{}"])
    monkeypatch.chdir(tmp_path)
    assert validate_dataset("data.jsonl").problems[0].startswith("data.jsonl:1: ")


def test_blank_lines_and_bad_rows_do_not_shift_prompt_indices(tmp_path):
    path = write_lines(
        tmp_path / "d.jsonl",
        [
            "",
            row(prompt="a"),
            "   \t",
            "not json",
            row(prompt="b"),
            "",
            "",
            row(prompt="c"),
        ],
    )
    rows = list(iter_rows(path))
    assert [(r.prompt, r.prompt_index, r.line_number) for r in rows] == [("a", 0, 2), ("b", 2, 5), ("c", 3, 8)]
    report = validate_dataset(path)
    assert (report.total, report.valid, report.invalid) == (4, 3, 1)
    assert report.problems == (f"{path}:4: invalid JSON: Expecting value at column 1",)


def test_only_some_rows_are_read_by_index_and_the_others_are_counted_not_decoded(tmp_path, monkeypatch):
    from hermes_batch.formats import dataset

    lines = ["", row(prompt="a"), "   ", "not json", row(prompt="b"), row(prompt="c"), "", row(prompt="d"), row(prompt="e")]
    path = write_lines(tmp_path / "d.jsonl", lines)
    every = {r.prompt_index: (r.prompt, r.line_number) for r in iter_rows(path)}
    decoded = []
    parse = dataset._parse
    monkeypatch.setattr(dataset, "_parse", lambda raw: decoded.append(raw) or parse(raw))
    for only in ([3], [0, 4], [2, 3, 5], [1, 3], [5, 6]):
        decoded.clear()
        got = [(r.prompt_index, (r.prompt, r.line_number)) for r in iter_rows(path, only=only)]
        assert got == [(i, every[i]) for i in only if i in every]  # index 1 is the invalid line: skipped
        assert len(decoded) == len([i for i in only if i < 6])  # only the rows asked for, none after the last
    assert list(iter_rows(path, only=[])) == []
    assert [r.prompt for r in iter_rows(path, max_samples=3, only=[0, 3])] == ["a"]


def test_crlf_line_endings_and_a_byte_order_mark_are_accepted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n\r\n{"prompt": "b"}\r\n')
    assert [(r.prompt, r.prompt_index, r.line_number) for r in iter_rows(path)] == [("a", 0, 1), ("b", 1, 3)]
    assert validate_dataset(path).ok


def test_last_line_without_newline_is_read(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "b"}')
    assert [r.prompt for r in iter_rows(path)] == ["a", "b"]


def test_max_samples_limits_to_the_first_non_blank_lines(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [row(prompt="a"), "", "oops", row(prompt="b"), row(prompt="c"), "bad"])

    report = validate_dataset(path, max_samples=3)
    assert (report.total, report.valid, report.invalid) == (3, 2, 1)
    assert [r.prompt_index for r in iter_rows(path, max_samples=3)] == [0, 2]
    assert validate_dataset(path, max_samples=0).total == 0
    assert list(iter_rows(path, max_samples=0)) == []
    assert validate_dataset(path, max_samples=100).total == 5
    with pytest.raises(UsageError):
        validate_dataset(path, max_samples=-1)


def test_invalid_utf8_is_reported_and_other_lines_still_load(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [row(prompt="ok"), b'{"prompt": "\xff\xfe"}', row(prompt="naïve ✓")])
    report = validate_dataset(path)
    assert report.problems == (f"{path}:2: invalid UTF-8 (byte 0xff at column 13)",)
    assert [r.prompt for r in iter_rows(path)] == ["ok", "naïve ✓"]


def test_line_separator_characters_inside_strings_do_not_split_lines(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "a\u2028b\x85c"}, ensure_ascii=False), row(prompt="d")])
    assert [(r.prompt, r.line_number) for r in iter_rows(path)] == [("a\u2028b\x85c", 1), ("d", 2)]


def test_image_docker_image_cwd_id_and_extra_fields(tmp_path):
    path = write_lines(
        tmp_path / "d.jsonl",
        [
            row(prompt="a", image="python:3.12", cwd="/work", id="row-1", topic="math", level=3),
            row(prompt="b", docker_image="node:20", id=7),
            row(prompt="c", image="same:1", docker_image="same:1"),
            row(prompt="d", image=None, cwd=None),
            row(prompt="e"),
        ],
    )
    rows = list(iter_rows(path))
    a, b, c, d, e = rows
    assert (a.image, a.cwd, a.id, a.extra) == ("python:3.12", "/work", "row-1", {"topic": "math", "level": 3})
    assert (b.image, b.cwd, b.id, b.extra) == ("node:20", None, 7, {})
    assert (c.image, c.extra) == ("same:1", {})
    assert (d.image, d.cwd, d.extra) == (None, None, {})
    assert (e.image, e.cwd, e.id) == (None, None, None)
    report = validate_dataset(path)
    assert report.images == ("node:20", "python:3.12", "same:1")


def test_images_of_invalid_rows_are_not_listed(tmp_path):
    path = write_lines(
        tmp_path / "d.jsonl",
        [row(prompt="", image="never:1"), row(prompt="x", image="used:1"), row(prompt="y", image="used:1")],
    )
    assert validate_dataset(path).images == ("used:1",)


def test_problem_list_is_capped_but_counts_stay_exact(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", ["{}"] * (MAX_PROBLEMS + 25) + [row(prompt="ok")])
    report = validate_dataset(path)
    assert report.invalid == MAX_PROBLEMS + 25
    assert report.valid == 1
    assert len(report.problems) == MAX_PROBLEMS
    assert report.problems[-1].startswith(f"{path}:{MAX_PROBLEMS}: ")
    text = format_problems(report)
    assert text.splitlines()[-1] == "... and 25 more."


def test_dataset_error_message_has_a_summary_then_the_problems(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_lines(tmp_path / "data.jsonl", ["{}", row(prompt=1), row(prompt="fine"), "[]"])
    report = validate_dataset("data.jsonl")

    error = dataset_error(report)

    assert isinstance(error, DatasetError)
    lines = str(error).splitlines()
    assert lines[0] == "data.jsonl has 3 invalid lines; fix them or pass --skip_invalid to skip them."
    assert lines[1:] == list(report.problems)
    assert [p.split(":")[1] for p in error.problems] == ["1", "2", "4"]


def test_summary_uses_singular_for_one_line(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", ["{}"])
    assert format_problems(validate_dataset(path)).splitlines()[0].endswith("has 1 invalid line; fix them or pass --skip_invalid to skip them.")


def test_missing_file_folder_and_unreadable_file_raise_dataset_error(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        validate_dataset(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="does not exist"):
        iter_rows(tmp_path / "nope.jsonl")  # raised when called, before the first row
    with pytest.raises(DatasetError, match="is a folder"):
        validate_dataset(tmp_path)
    with pytest.raises(DatasetError, match="is a folder"):
        iter_rows(tmp_path)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can read any file")
def test_unreadable_file_raises_dataset_error(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [row(prompt="a")])
    os.chmod(path, 0)
    try:
        with pytest.raises(DatasetError, match="cannot be read"):
            validate_dataset(path)
    finally:
        os.chmod(path, 0o644)


def test_empty_file_is_valid_with_nothing_in_it(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"")
    report = validate_dataset(path)
    assert (report.total, report.valid, report.invalid, report.images) == (0, 0, 0, ())
    assert list(iter_rows(path)) == []


def test_large_file_streams_quickly_without_holding_it_in_memory(tmp_path):
    path = tmp_path / "big.jsonl"
    line = json.dumps({"prompt": "Write a function that adds two numbers " * 3, "image": "python:3.12", "n": 0}) + "\n"
    count = 200_000
    with open(path, "w") as handle:
        for i in range(count):
            handle.write(line if i % 1000 else "{broken\n")
    size = path.stat().st_size

    tracemalloc.start()
    started = time.perf_counter()
    report = validate_dataset(path)
    elapsed = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    # the least any check does, timed alike: parse every line (on a busy machine both slow down together)
    started = time.perf_counter()
    with open(path, "rb") as handle:
        for raw in handle:
            try:
                json.loads(raw)
            except ValueError:
                pass
    parse_only = time.perf_counter() - started
    tracemalloc.stop()

    assert report.total == count
    assert report.invalid == count // 1000
    assert report.images == ("python:3.12",)
    assert peak < size / 5, f"peak {peak} bytes for a {size}-byte file"
    assert elapsed < 5 * parse_only, f"{elapsed:.1f} s to check what takes {parse_only:.1f} s to parse"  # 2.4x here

    indices = [r.prompt_index for r in iter_rows(path, max_samples=3000)]
    assert indices[:2] == [1, 2] and 1000 not in indices and indices[-1] == 2999


def test_negative_max_samples_is_refused_before_reading(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [row(prompt="a")])
    with pytest.raises(UsageError, match="--max_samples"):
        iter_rows(path, max_samples=-2)
