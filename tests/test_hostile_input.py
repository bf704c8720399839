"""Hostile input: option values, dataset rows and model text that must never crash a run or its resume.

Lone surrogates (a ``\\ud800`` escape, half an emoji), absurd nesting, absurd
sizes and numbers JSON cannot carry are reported as bad input with FILE:LINE
when they come from the dataset, and stored safely when they come from the model.
"""

from __future__ import annotations

import json

import pytest

from conftest import write_dataset

from hermes_batch.config import RunConfig
from hermes_batch.errors import ConfigError, UsageError
from hermes_batch.serialization import parse_key_values, structure_config

# --- float options ---------------------------------------------------------------------------

FLOAT_OPTIONS = ("command_timeout", "request_timeout", "prompt_timeout", "max_requests_per_minute",
                 "max_tokens_per_minute", "max_cost")


@pytest.mark.parametrize("option", FLOAT_OPTIONS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "Infinity"])
def test_every_float_option_refuses_nan_and_infinity_in_one_sentence(runner, tmp_path, option, value):
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    result = runner.invoke(dataset, "run", f"--{option}", value)
    assert result.exit_code == 2, result.output
    message = result.output.strip().splitlines()[-1]
    assert message.startswith(f"Error: --{option} must be a finite number") and message.endswith(".")
    assert "Traceback" not in result.output
    assert not runner.folder().exists()


@pytest.mark.parametrize("value", ["0", "-1", "-0.5"])
def test_command_timeout_must_be_more_than_zero(runner, tmp_path, value):
    dataset = write_dataset(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    result = runner.invoke(dataset, "run", "--command_timeout", value)
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
