"""Toolset distributions: the sampler, distribution files, listing, and the seed's built-ins (SPEC section 6)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hermes_batch.default_plugins import distributions as builtin
from hermes_batch.run.distributions import (
    distribution_from_percent,
    distributions_as_json,
    format_distributions,
    load_distribution_file,
    rng_for,
    sample_toolsets,
    unavailable_toolsets,
    unavailable_warning,
)
from hermes_batch.errors import ConfigError
from hermes_batch.contract.interfaces import Distribution
from hermes_batch.contract.plugins import collect, get_plugin_manager

SEED_NAMES = (
    "default image_gen research science development safe balanced minimal terminal_only terminal_web "
    "creative reasoning browser_use browser_only browser_tasks terminal_tasks mixed_tasks"
).split()

MIXED = Distribution("mixed", "test", (("terminal", 0.9), ("file", 0.3), ("web", 0.5), ("vision", 0.05)))


def builtins() -> dict[str, Distribution]:
    registered: list[Distribution] = []
    builtin.register_distributions(register=registered.append)
    return {d.name: d for d in registered}


# --- sampler -------------------------------------------------------------------


def test_same_seed_and_content_key_give_the_same_toolsets():
    available = {"terminal", "file", "web", "vision"}
    first = [sample_toolsets(MIXED, available, rng_for(7, f"key{i}")) for i in range(200)]
    again = [sample_toolsets(MIXED, available, rng_for(7, f"key{i}")) for i in range(200)]
    assert first == again
    assert len(set(first)) > 3  # different keys really do vary


def test_a_different_seed_or_key_changes_the_stream():
    assert rng_for(1, "a").random() == rng_for(1, "a").random()
    assert rng_for(1, "a").random() != rng_for(2, "a").random()
    assert rng_for(1, "a").random() != rng_for(1, "b").random()
    # seed and key are not simply concatenated
    assert rng_for(1, "2x").random() != rng_for(12, "x").random()


def test_rng_is_stable_across_processes():
    # Resumed and distributed runs must draw the same toolsets whatever the hash randomisation.
    code = "from hermes_batch.run.distributions import rng_for; print(rng_for(42, 'abc').getrandbits(32))"
    outputs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": seed}, check=True).stdout
        for seed in ("1", "2")
    }
    assert outputs == {f"{rng_for(42, 'abc').getrandbits(32)}\n"}


def test_at_least_one_toolset_is_always_sampled_and_it_is_the_most_likely():
    rare = Distribution("rare", "", (("file", 0.01), ("terminal", 0.02), ("web", 0.02)))
    results = [sample_toolsets(rare, {"terminal", "file", "web"}, rng_for(3, str(i))) for i in range(2000)]
    assert all(results)
    # ties go to the first in the distribution's order
    assert results.count(("terminal",)) > 1800


def test_unavailable_toolsets_are_never_sampled():
    available = {"terminal", "file"}
    for i in range(3000):
        assert set(sample_toolsets(MIXED, available, rng_for(5, str(i)))) <= available


def test_fallback_picks_the_most_likely_available_toolset():
    dist = Distribution("d", "", (("web", 0.9), ("file", 0.001), ("terminal", 0.002)))
    results = {sample_toolsets(dist, {"terminal", "file"}, rng_for(1, str(i))) for i in range(500)}
    assert ("terminal",) in results
    assert all(r in {("terminal",), ("file",), ("file", "terminal")} for r in results)


def test_result_follows_the_distribution_order():
    dist = Distribution("d", "", (("web", 1.0), ("terminal", 1.0), ("file", 1.0)))
    assert sample_toolsets(dist, {"file", "terminal", "web"}, rng_for(0, "k")) == ("web", "terminal", "file")


def test_empirical_frequencies_match_the_probabilities():
    available = {"terminal", "file", "web", "vision"}
    draws = 20000
    counts = dict.fromkeys(available, 0)
    for i in range(draws):
        for name in sample_toolsets(MIXED, available, rng_for(11, f"prompt-{i}")):
            counts[name] += 1
    for name, p in MIXED.probabilities:
        # P(at least terminal) rises by the all-tails fallback, 0.1*0.7*0.5*0.95
        expected = p + (0.1 * 0.7 * 0.5 * 0.95 if name == "terminal" else 0)
        assert abs(counts[name] / draws - expected) < 0.015, (name, counts[name] / draws, expected)


def test_no_available_toolset_is_a_config_error_naming_the_needed_ones():
    dist = Distribution("webby", "", (("web", 0.5), ("browser", 0.5)))
    with pytest.raises(ConfigError, match="'webby' needs one of the toolsets web, browser"):
        sample_toolsets(dist, {"terminal", "file"}, rng_for(0, "k"))


def test_unavailable_helpers_list_missing_toolsets_in_order():
    assert unavailable_toolsets(MIXED, {"terminal", "file"}) == ("web", "vision")
    assert unavailable_toolsets(MIXED, {"terminal", "file", "web", "vision"}) == ()
    warning = unavailable_warning(MIXED, ["terminal", "file"])
    assert "'mixed'" in warning and "web, vision" in warning and "terminal, file" in warning
    assert unavailable_warning(MIXED, {"terminal", "file", "web", "vision"}) is None


# --- distribution files ---------------------------------------------------------


TOML_OK = """
[code_heavy]
description = "Mostly terminal"
toolsets = { terminal = 95, file = 90.5, web = 0 }

[browsing.toolsets]
browser = 100
"""


def test_load_toml_file_percents_become_fractions(tmp_path):
    path = tmp_path / "dists.toml"
    path.write_text(TOML_OK)
    code, browsing = load_distribution_file(path)
    assert code == Distribution("code_heavy", "Mostly terminal", (("terminal", 0.95), ("file", 0.905), ("web", 0.0)))
    assert browsing == Distribution("browsing", "", (("browser", 1.0),))


def test_load_json_file(tmp_path):
    path = tmp_path / "dists.json"
    path.write_text(json.dumps({"quick": {"description": "Q", "toolsets": {"file": 40, "terminal": 60}}}))
    assert load_distribution_file(str(path)) == (Distribution("quick", "Q", (("file", 0.4), ("terminal", 0.6))),)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"d": {"toolsets": {"web": 150}}}, "distribution 'd': toolset 'web' has 150, outside 0 to 100"),
        ({"d": {"toolsets": {"web": -1}}}, "toolset 'web' has -1"),
        ({"d": {"toolsets": {"web": "50"}}}, "toolset 'web' must have a number from 0 to 100, got a string"),
        ({"d": {"toolsets": {"web": True}}}, "got a boolean"),
        ({"d": {"toolsets": {}}}, "distribution 'd': 'toolsets' is empty"),
        ({"d": {"toolsets": {"web": 0}}}, "every toolset has 0%"),
        ({"d": {"toolsets": ["web"]}}, "'toolsets' must be a table"),
        ({"d": {"description": "x"}}, "distribution 'd' has no 'toolsets'"),
        ({"d": {"toolsets": {"web": 5}, "weights": {}}}, "distribution 'd' has unknown key 'weights'"),
        ({"d": {"description": 3, "toolsets": {"web": 5}}}, "'description' must be a string"),
        ({"d": [1]}, "distribution 'd' must be a table"),
        ([1, 2], "expected a table of distributions"),
        ({}, "defines no distributions"),
    ],
)
def test_bad_json_distribution_files_name_the_file_and_distribution(tmp_path, body, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(body))
    with pytest.raises(ConfigError) as info:
        load_distribution_file(path)
    assert str(info.value).startswith(str(path))
    assert message in str(info.value)


def test_bad_toml_file_names_the_file_and_distribution(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[fast]\ntoolsets = { terminal = 0.5, file = 101 }\n')
    with pytest.raises(ConfigError, match=r"bad\.toml: distribution 'fast': toolset 'file' has 101"):
        load_distribution_file(path)


def test_unparsable_files_are_config_errors(tmp_path):
    toml = tmp_path / "broken.toml"
    toml.write_text("[a\ntoolsets = 3")
    with pytest.raises(ConfigError, match="broken.toml: invalid TOML"):
        load_distribution_file(toml)
    js = tmp_path / "broken.json"
    js.write_text('{"a": {"toolsets": {"web": 1,}}}')
    with pytest.raises(ConfigError, match=r"broken.json:1: invalid JSON"):
        load_distribution_file(js)
    dup = tmp_path / "dup.json"
    dup.write_text('{"a": {"toolsets": {"web": 1}}, "a": {"toolsets": {"file": 1}}}')
    with pytest.raises(ConfigError, match="key 'a' is given twice"):
        load_distribution_file(dup)


def test_missing_file_folder_and_wrong_extension(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_distribution_file(tmp_path / "nope.toml")
    folder = tmp_path / "dir.json"
    folder.mkdir()
    with pytest.raises(ConfigError, match="is a folder"):
        load_distribution_file(folder)
    yaml = tmp_path / "d.yaml"
    yaml.write_text("a: b")
    with pytest.raises(ConfigError, match=r"must end in \.toml or \.json"):
        load_distribution_file(yaml)


# --- listing ---------------------------------------------------------------------


def test_format_lists_toolsets_highest_first_and_marks_unavailable():
    text = format_distributions([MIXED, Distribution("solo", "Only files", (("file", 1.0),))], {"terminal", "file"})
    blocks = text.split("\n\n")
    mixed_lines = blocks[0].splitlines()
    assert mixed_lines[0] == "mixed: test"
    assert [line.split()[0] for line in mixed_lines[1:]] == ["terminal", "web", "file", "vision"]
    assert [line.split()[1] for line in mixed_lines[1:]] == ["90%", "50%", "30%", "5%"]
    assert [line.endswith("(unavailable)") for line in mixed_lines[1:]] == [False, True, False, True]
    assert blocks[1].splitlines() == ["solo: Only files", "    file   100%"]


def test_format_shows_clean_percents():
    dist = Distribution("d", "", (("a", 0.07), ("b", 0.905)))
    text = format_distributions([dist], {"a", "b"})
    assert "90.5%" in text and " 7%" in text and "0000" not in text


def test_json_listing_is_plain_data():
    data = distributions_as_json([MIXED], ["terminal"])
    json.dumps(data)
    (entry,) = data
    assert entry["name"] == "mixed" and entry["description"] == "test"
    assert [t["name"] for t in entry["toolsets"]] == ["terminal", "web", "file", "vision"]
    assert entry["toolsets"][0] == {"name": "terminal", "probability": 0.9, "percent": 90, "available": True}
    assert entry["unavailable"] == ["file", "web", "vision"]


# --- the seed's distributions -------------------------------------------------------


def test_all_seed_distributions_are_registered_with_descriptions_and_valid_probabilities():
    dists = builtins()
    assert sorted(dists) == sorted(SEED_NAMES)
    for dist in dists.values():
        assert dist.description and "\n" not in dist.description
        assert dist.probabilities
        names = [name for name, _ in dist.probabilities]
        assert len(names) == len(set(names))
        assert all(isinstance(p, float) and 0 < p <= 1 for _, p in dist.probabilities), dist.name


def test_seed_facts():
    dists = builtins()
    assert dict(dists["terminal_only"].probabilities) == {"terminal": 1.0, "file": 1.0}
    assert dict(dists["minimal"].probabilities) == {"web": 1.0}
    assert dict(dists["browser_tasks"].probabilities) == {"browser": 0.97, "vision": 0.12, "terminal": 0.15}
    assert "terminal" not in dict(dists["safe"].probabilities)
    assert all(p == 0.5 for _, p in dists["balanced"].probabilities)
    assert set(dict(dists["default"].probabilities)) == {"web", "vision", "image_gen", "terminal", "file", "moa", "browser"}


def test_core_toolsets_alone_can_run_every_seed_distribution_that_names_them():
    core = {"terminal", "file"}
    for dist in builtins().values():
        if unavailable_toolsets(dist, core) == tuple(name for name, _ in dist.probabilities):
            with pytest.raises(ConfigError):
                sample_toolsets(dist, core, rng_for(0, "k"))
        else:
            assert set(sample_toolsets(dist, core, rng_for(0, "k"))) <= core


def test_builtins_come_through_the_plugin_manager():
    registry = collect(get_plugin_manager(load_entry_points=False))
    assert set(SEED_NAMES) <= set(registry.names("distributions"))
    assert registry.kinds["distributions"]["default"].plugin == "hermes_batch.default_plugins.distributions"


def test_distribution_from_percent_rejects_bad_plugin_tables():
    with pytest.raises(ConfigError, match="Distribution 'x': toolset 'web' has 200"):
        distribution_from_percent("x", "d", {"web": 200})
