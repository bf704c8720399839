"""Hostile input: option values, dataset rows and model text that must never crash a run or its resume.

Lone surrogates (a ``\\ud800`` escape, half an emoji), absurd nesting, absurd
sizes and numbers JSON cannot carry are reported as bad input with FILE:LINE
when they come from the dataset, and stored safely when they come from the model.
"""

from __future__ import annotations

import json

import pytest

from hermes_batch.testing import write_dataset

from hermes_batch.testing import Reply

from hermes_batch.run.config import RunConfig
from hermes_batch.errors import ConfigError, UsageError
from hermes_batch.formats.serialization import parse_key_values, structure_config

# --- float options ---------------------------------------------------------------------------

FLOAT_OPTIONS = ("command_timeout", "request_timeout", "prompt_timeout", "max_requests_per_minute",
                 "max_tokens_per_minute", "max_cost")


@pytest.mark.parametrize("option", FLOAT_OPTIONS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "Infinity"])
def test_every_float_option_refuses_nan_and_infinity_in_one_sentence(runner, tmp_path, option, value):
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    result = runner.invoke(dataset, f"--{option}", value)
    assert result.exit_code == 2, result.output
    message = result.output.strip().splitlines()[-1]
    assert message.startswith(f"Error: --{option} must be a finite number") and message.endswith(".")
    assert "Traceback" not in result.output
    assert not runner.folder().exists()


@pytest.mark.parametrize("value", ["0", "-1", "-0.5"])
def test_command_timeout_must_be_more_than_zero(runner, tmp_path, value):
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    result = runner.invoke(dataset, "--command_timeout", value)
    assert result.exit_code == 2, result.output
    assert "Error: --command_timeout must be more than 0" in result.output


def test_every_float_field_of_the_run_config_is_checked():
    # a float option added later is covered without being listed anywhere
    floats = [name for name, a in attrs_fields(RunConfig) if "float" in str(a.type)]
    assert set(FLOAT_OPTIONS) <= set(floats)
    for name in floats:
        with pytest.raises(UsageError, match=f"--{name} must be a finite number"):
            RunConfig(dataset_file="d", batch_size=1, run_name="r", **{name: float("nan")})


def attrs_fields(cls):
    import attrs

    return [(a.name, a) for a in attrs.fields(cls)]


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_plugin_options_refuse_non_finite_numbers(raw):
    import attrs

    @attrs.frozen
    class Options:
        cpus: float = 1.0

    with pytest.raises(ConfigError, match="cpus"):
        structure_config(parse_key_values((f"cpus={raw}",), "-S/--sandbox_option"), Options, "sandbox options")
    assert parse_key_values(("cpus=1.5",), "-S")["cpus"] == 1.5


@pytest.mark.parametrize("option", ["-S", "-T", "-E"])
@pytest.mark.parametrize("item, expected", [
    ("x=" + "[" * 5000 + "]" * 5000, "x is nested more than 100 levels deep; flatten the field."),
    ("x=" + "[" * 150 + "]" * 150, "x is nested more than 100 levels deep; flatten the field."),
    ("x=caf\udce9", "x holds a lone surrogate (\\udce9)"),  # argv bytes that are not UTF-8
])
def test_plugin_option_values_no_record_can_carry_are_one_sentence(runner, tmp_path, option, item, expected):
    if option == "-T":
        item = "terminal." + item
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    result = runner.invoke(dataset, option, item)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "Error: The value of " in result.output
    assert expected in result.output


# --- dataset rows ----------------------------------------------------------------------------


def nested(depth: int, leaf="x") -> str:
    """A JSON object ``depth`` levels deep, as text (the row object around it adds one more level)."""
    return '{"a": ' * depth + json.dumps(leaf) + "}" * depth


BAD_ROWS = [
    ('{"prompt": "half an emoji \\ud83d"}', "$.prompt: holds a lone surrogate (\\ud83d)"),
    ('{"prompt": "low half \\udc00 alone"}', "$.prompt: holds a lone surrogate (\\udc00)"),
    ('{"prompt": "x", "image": "img\\ud800"}', "$.image: holds a lone surrogate"),
    ('{"prompt": "x", "cwd": "/w\\udfff"}', "$.cwd: holds a lone surrogate"),
    ('{"prompt": "x", "meta": {"tags": ["ok", "bad\\ud800"]}}', "$.meta.tags[1]: holds a lone surrogate"),
    ('{"prompt": "x", "k\\ud800": 1}', "$: a key holds a lone surrogate (\\ud800)"),
    ('{"prompt": "x", "deep": ' + nested(100) + "}", "is nested more than 100 levels deep"),
    ('{"prompt": "x", "deep": ' + "[" * 150 + "]" * 150 + "}", "$.deep[0][0]"),
    ('{"prompt": "x", "deep": ' + nested(50_000) + "}", "is nested more than 100 levels deep"),
    ('{"prompt": "x", "score": NaN}', "invalid JSON: NaN is not a number JSON can hold"),
    ('{"prompt": "x", "score": -Infinity}', "invalid JSON: -Infinity is not a number JSON can hold"),
    ('{"prompt": "x", "score": 1e999}', "$.score: inf is not a number JSON can hold"),
    ('{"prompt": "x", "n": ' + "9" * 5000 + "}", "an integer has more than 4300 digits"),
    ('{"prompt": "x", "n": 18446744073709551616}', "$.n: the integer 18446744073709551616"),
    ('{"prompt": "x", "id": "a\\ud800"}', "$.id: holds a lone surrogate"),
]


@pytest.mark.parametrize(("line", "reason"), BAD_ROWS, ids=[r for _, r in BAD_ROWS])
def test_rows_no_record_could_carry_are_bad_input_with_file_and_line(tmp_path, line, reason):
    from hermes_batch.formats.dataset import iter_rows, validate_dataset

    path = write_dataset(tmp_path / "d.jsonl", [{"prompt": "first"}, line, {"prompt": "last"}])
    report = validate_dataset(path)
    assert (report.valid, report.invalid) == (2, 1), report.problems
    assert report.problems[0].startswith(f"{path}:2: ") and reason in report.problems[0], report.problems
    assert len(report.problems[0]) < 300
    assert [r.prompt for r in iter_rows(path)] == ["first", "last"]


def test_the_depth_limit_is_exactly_one_hundred_levels_and_ids_may_be_any_integer(tmp_path):
    from hermes_batch.formats.dataset import iter_rows, validate_dataset

    fits = '{"prompt": "x", "deep": ' + nested(99) + ', "id": 18446744073709551616}'  # 1 + 99 levels
    path = write_dataset(tmp_path / "d.jsonl", [fits])
    assert validate_dataset(path).problems == ()
    (row,) = iter_rows(path)
    assert row.id == 2**64


def test_a_line_over_the_size_limit_is_reported_without_being_read_whole(tmp_path):
    import tracemalloc

    from hermes_batch.formats import dataset

    path = tmp_path / "d.jsonl"
    with open(path, "w") as handle:
        handle.write('{"prompt": "first"}\n')
        handle.write('{"prompt": "' + "x" * (100 << 20) + '"}\n')  # 100 MiB
        handle.write('{"prompt": "last"}\n')
    tracemalloc.start()
    report = dataset.validate_dataset(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert (report.valid, report.invalid) == (2, 1)
    assert report.problems == (f"{path}:2: the line is longer than 16 MiB, the limit for one row",)
    assert peak < 2 * dataset.MAX_LINE_BYTES + (4 << 20), peak  # the limit's worth, never the 100 MiB
    assert [(r.prompt, r.prompt_index, r.line_number) for r in dataset.iter_rows(path)] == [
        ("first", 0, 1), ("last", 2, 3)]


def test_hostile_rows_stop_the_run_before_any_model_call_and_skip_invalid_runs_the_rest(model_server, runner, tmp_path):
    server = runner.server = model_server()
    lines = [{"prompt": "fine one"}] + [line for line, _ in BAD_ROWS] + [{"prompt": "fine two"}]
    dataset = write_dataset(tmp_path / "d.jsonl", lines)
    result = runner.invoke(dataset, "--distribution", "terminal_only")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for number, (_line, reason) in enumerate(BAD_ROWS, start=2):
        assert f"{dataset}:{number}: " in result.output and reason in result.output
    assert server.request_count == 0 and not runner.folder().exists()

    result = runner.invoke(dataset, "--distribution", "terminal_only", "--skip_invalid")
    assert result.exit_code == 0, result.output
    kept = runner.records("trajectories.jsonl") + [r["trajectory"] for r in runner.records("discarded.jsonl")]
    assert sorted(t["prompt_index"] for t in kept) == [0, len(BAD_ROWS) + 1]
    assert json.loads((runner.folder() / "statistics.json").read_text())["prompts"]["skipped_invalid"] == len(BAD_ROWS)


def test_a_dataset_whose_file_name_is_not_utf8_is_listed_safely(model_server, runner, tmp_path):
    # a file name's bytes that are not UTF-8 reach Python as lone surrogates, and FILE:LINE goes into a file
    runner.server = model_server()
    dataset = write_dataset(tmp_path / "rows-\udcff.jsonl", [{"prompt": "fine"}, "{broken"])
    result = runner.invoke(dataset, "--distribution", "terminal_only", "--skip_invalid")
    assert result.exit_code == 0, result.output
    listed = (runner.folder() / "skipped_lines.txt").read_bytes().decode("utf-8")
    assert listed.startswith(f"{tmp_path}/rows-\ufffd.jsonl:2: ")
    assert len(runner.records("trajectories.jsonl")) == 1


def test_rows_at_the_limits_run_and_keep_their_fields_whole(model_server, runner, tmp_path):
    # 1 + 99 levels: the deepest row validation accepts must be written (no RecursionError), never skipped
    runner.server = model_server()
    deep = json.loads(nested(99))
    rows = [{"prompt": "deep row", "deep": deep}, {"prompt": "big id", "id": 2**64}, {"prompt": "plain"},
            {"prompt": "\u00e9t\u00e9 \U0001f600 \ud55c\uad6d\uc5b4"}]
    dataset = write_dataset(tmp_path / "d.jsonl", rows)
    result = runner.invoke(dataset, "--distribution", "terminal_only", "--no_filters")
    assert result.exit_code == 0, result.output
    merged = {t["prompt_index"]: t for t in runner.records("trajectories.jsonl")}
    assert sorted(merged) == [0, 1, 2, 3]
    assert json.loads(merged[0]["metadata"]["row"]) == {"deep": deep}
    assert merged[1]["metadata"]["id"] == str(2**64)
    assert merged[3]["conversations"][1]["value"] == rows[3]["prompt"]


# --- model text --------------------------------------------------------------------------------

HALF_EMOJI = "\ud83d"  # the first half of U+1F600, as a model cut off mid-emoji sends it


def half_emoji_script(request):
    """A model whose text ends in half an emoji, in every field a reply has."""
    if request.turn == 0:
        return Reply(content=f"Let me look {HALF_EMOJI}", reasoning=f"thinking \udc00 {HALF_EMOJI}",
                     tool_calls=[("terminal", {"command": f"echo 'a{HALF_EMOJI}b'"})],
                     provider=f"Prov{HALF_EMOJI}")
    return Reply(content=f"All done {HALF_EMOJI}", reasoning="Finished.")


def deep_arguments_script(request):
    """Tool-call arguments nested far beyond any sane depth, then NaN, then a final answer."""
    if request.turn == 0:
        return Reply(reasoning="Deep.", tool_calls=[("terminal", '{"command": "ls", "x": ' + nested(300) + "}")])
    if request.turn == 1:
        return Reply(reasoning="Not a number.", tool_calls=[("terminal", '{"command": "ls", "timeout": NaN}')])
    return Reply(content="Gave up.", reasoning="Done.")


def test_half_an_emoji_from_the_model_is_stored_as_a_replacement_character(model_server, runner, tmp_path):
    from hermes_batch.testing import RoutedScript

    runner.server = model_server(RoutedScript({"emoji": half_emoji_script, "deep": deep_arguments_script}))
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "emoji"}, {"prompt": "deep"}])
    result = runner.invoke(dataset, "--distribution", "terminal_only", "--no_filters")
    assert result.exit_code == 0, result.output
    for name in ("batch_0.jsonl", "trajectories.jsonl", "statistics.json", "checkpoint.json", "calls.jsonl"):
        text = (runner.folder() / name).read_bytes().decode("utf-8")  # strict: every byte is UTF-8
        assert "\\ud83d" not in text.lower()  # nor an escaped lone surrogate, which strict readers refuse
    by_prompt = {t["conversations"][1]["value"]: t for t in runner.records("trajectories.jsonl")}
    emoji = by_prompt["emoji"]
    gpt = [turn for turn in emoji["conversations"] if turn["from"] == "gpt"]
    assert gpt[0]["value"].startswith("<think>\nthinking \ufffd \ufffd\n</think>\nLet me look \ufffd")
    assert json.loads(gpt[0]["tool_calls"][0]["arguments"]) == {"command": "echo 'a\ufffdb'"}
    assert gpt[-1]["value"].endswith("All done \ufffd")
    assert [call["provider"] for call in emoji["metadata"]["calls"]] == ["Prov\ufffd", ""]
    assert emoji["tool_stats"]["terminal"] == {"count": 1, "success": 1, "failure": 0}

    deep = by_prompt["deep"]
    invalid = json.loads(deep["metadata"]["invalid_tool_calls"])
    reasons = sorted(entry["reason"] for entry in invalid)
    assert reasons == ["arguments are nested more than 100 levels deep",
                       "arguments are not valid JSON (NaN is not a number JSON can hold)"]
    calls = [c for turn in deep["conversations"] if turn.get("tool_calls") for c in turn["tool_calls"]]
    # kept as the raw text the model sent, never as a deep object
    assert [c["arguments"] for c in calls] == ['{"command": "ls", "x": ' + nested(300) + "}",
                                               '{"command": "ls", "timeout": NaN}']


def escape_script(request):
    if request.turn == 0:
        return Reply(content="\x1b[2J\x1b]0;pwned\x07 cleared\x00", reasoning="\x1b[31mred",
                     tool_calls=[("terminal", '{"command": "printf \'\\033[5m\'; echo \\u001b[0m"}'),
                                 ("term\x1binal", "{}")])
    return Reply(content="Done \x9b31m\u202e.", reasoning="ok")


def test_verbose_shows_the_models_control_characters_escaped(model_server, runner, tmp_path):
    # ESC, NUL, BEL and CSI from the model (or a tool's output) would drive the terminal of whoever watches the run
    server = model_server(escape_script)
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "hostile"}])
    result = runner.invoke(dataset, "--distribution", "terminal_only", "--no_filters", "--verbose", server=server)
    assert result.exit_code == 0, result.output
    shown = [line for line in result.output.splitlines() if "[B0:P0]" in line]
    assert any("\\x1b[2J\\x1b]0;pwned\\x07 cleared\\x00" in line for line in shown), shown
    assert any("term\\x1binal" in line for line in shown) and any("\\x9b31m\\u202e" in line for line in shown)
    for char in ("\x1b", "\x00", "\x07", "\x9b", "\u202e"):
        assert char not in result.output
    # the records keep the model's text as it was
    record = runner.records("trajectories.jsonl")[0]
    assert "\x1b[2J" in record["conversations"][2]["value"]


@pytest.mark.parametrize("option", ["--ephemeral_system_prompt", "--model", "--providers_order"])
def test_option_text_that_is_not_utf8_is_refused_before_any_model_call(model_server, runner, tmp_path, option):
    # on Linux argv bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape)
    server = runner.server = model_server()
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    result = runner.invoke(dataset, option, b"caf\xe9".decode("utf-8", "surrogateescape"))
    assert result.exit_code == 2, result.output
    assert f"Error: {option} holds bytes that are not UTF-8 text; pass it as UTF-8." in result.output
    assert server.request_count == 0


@pytest.mark.parametrize("new_row", ["appended", "inserted"])  # inserted: the records are renumbered (reindex.py)
def test_resume_over_records_holding_lone_surrogates_works(model_server, runner, tmp_path, new_row):
    # Files written by another tool, an older version or a hand edit may hold \ud83d escapes (ensure_ascii JSON).
    runner.server = model_server()
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "one"}, {"prompt": "two"}])
    assert runner.invoke(dataset, "--distribution", "terminal_only", "--no_filters").exit_code == 0
    batch = runner.folder() / "batch_0.jsonl"
    records = [json.loads(line) for line in batch.read_text().splitlines()]
    for record in records:
        record["conversations"][-1]["value"] += HALF_EMOJI
        record["metadata"]["row"] = json.dumps({"note": "\udc00"})
    batch.write_text("".join(json.dumps(r) + "\n" for r in records))  # ensure_ascii: "\\ud83d" escapes
    rows = [{"prompt": "one"}, {"prompt": "two"}]
    write_dataset(dataset, rows + [{"prompt": "three"}] if new_row == "appended" else [{"prompt": "three"}] + rows)

    server = runner.server = model_server()
    result = runner.invoke(dataset, "--distribution", "terminal_only", "--no_filters", "--resume")
    assert result.exit_code == 0, result.output
    assert {r.prompt for r in server.requests if not r.preflight} == {"three"}
    text = (runner.folder() / "trajectories.jsonl").read_bytes().decode("utf-8")
    merged = [json.loads(line) for line in text.splitlines()]
    by_prompt = {t["conversations"][1]["value"]: t for t in merged}
    order = ["one", "two", "three"] if new_row == "appended" else ["three", "one", "two"]
    assert [t["conversations"][1]["value"] for t in merged] == order
    assert by_prompt["one"]["conversations"][-1]["value"].endswith("\ufffd")
    assert json.loads(by_prompt["one"]["metadata"]["row"]) == {"note": "\ufffd"}
    json.loads((runner.folder() / "statistics.json").read_bytes().decode("utf-8"))
