"""NAME[:OPTIONS]: one syntax for the options of every filter and writer."""

import attrs
import pytest

from hermes_batch.errors import ConfigError, HermesBatchError
from hermes_batch.contract.plugin_options import build_config, parse_spec, structure_options
from hermes_batch.testing import ToolLoopScript, write_dataset


class Plugin:
    @attrs.frozen
    class Config:
        share: float = 0.5
        unit: str = "chars"
        names: tuple = ()


class Plain:
    pass


@pytest.mark.parametrize("text, options, primary", [
    ("f", {}, None),
    ("f:0.3", {}, 0.3),
    ("f:0.3,unit=tokens", {"unit": "tokens"}, 0.3),
    ("f:share=1,unit=tokens", {"share": 1, "unit": "tokens"}, None),
    ('f:names=["a,b","c"],unit=x', {"names": ["a,b", "c"], "unit": "x"}, None),
    ('f:{"share": 0.1}', {"share": 0.1}, None),
])
def test_parse(text, options, primary):
    spec = parse_spec(text, "--filter")
    assert (spec.name, spec.options, spec.primary) == ("f", options, primary)


def test_build_config_structures_strictly():
    assert build_config(Plugin, parse_spec("f:0.25", "--filter"), "filter") == Plugin.Config(share=0.25)
    assert build_config(Plugin, parse_spec('f:names=["a"]', "--filter"), "filter").names == ("a",)
    for text, message in [
        ("f:colour=red", "colour"),
        ("f:share=high", "share"),
        ("f:0.2,share=0.3", "sets 'share' twice"),
        ("f:", "no options"),
        (":x", "names no plugin"),
        ("f:{nope", "not a valid JSON object"),
    ]:
        with pytest.raises(HermesBatchError, match=message):
            build_config(Plugin, parse_spec(text, "--filter"), "filter")
    with pytest.raises(HermesBatchError, match="takes no options"):
        build_config(Plain, parse_spec("p:1", "--writer"), "writer")


def test_options_files(tmp_path):
    (tmp_path / "o.toml").write_text('share = 0.75\nunit = "tokens"\n')
    (tmp_path / "o.json").write_text('{"share": 0.1}')
    (tmp_path / "bad.toml").write_text("share = \n")
    assert build_config(Plugin, parse_spec(f"f:@{tmp_path / 'o.toml'}", "--filter"), "filter") == Plugin.Config(0.75, "tokens")
    assert build_config(Plugin, parse_spec(f"f:@{tmp_path / 'o.json'}", "--filter"), "filter").share == 0.1
    with pytest.raises(HermesBatchError, match="not valid TOML"):
        parse_spec(f"f:@{tmp_path / 'bad.toml'}", "--filter")


class Box:
    @attrs.frozen
    class Config:
        image: str = "x"
        memory: str = "1g"
        cpus: float = 1.0


def test_an_unknown_option_is_named_with_the_valid_ones_and_the_closest():
    with pytest.raises(ConfigError) as info:
        structure_options({"memroy": "2g"}, Box.Config, "the box sandbox (-S)", "-S {key}=...")
    assert str(info.value) == (
        "The box sandbox (-S) has no option 'memroy' (it takes image, memory, cpus); did you mean -S memory=...?"
    )
    with pytest.raises(ConfigError) as info:
        structure_options({"cpu": 2, "colour": "red"}, Box.Config, "the box sandbox (-S)", "-S {key}=...")
    assert str(info.value) == (
        "The box sandbox (-S) has no options 'cpu', 'colour' (it takes image, memory, cpus); did you mean -S cpus=...?"
    )
    with pytest.raises(ConfigError) as info:
        structure_options({"zzz": 1}, Box.Config, "the filter box", "box:{key}=...")
    assert str(info.value) == "The filter box has no option 'zzz' (it takes image, memory, cpus); use one of them."
    with pytest.raises(ConfigError) as info:
        build_config(Box, parse_spec("box:memroy=1", "--filter"), "filter")  # the filter's own spelling
    assert str(info.value).endswith("did you mean box:memory=...?")
    assert structure_options({"memory": "2g"}, Box.Config, "the box sandbox (-S)", "-S {key}=...") == Box.Config(memory="2g")


@pytest.mark.parametrize(
    "args, says",
    [
        (["-S", "kep=true"], "The local sandbox (-S) has no option 'kep' (it takes keep, max_starting, "),
        (["-S", "kep=true"], "did you mean -S keep=...?"),
        (["--executor", "processes", "-E", "worker=2"],
         "The processes executor (-E) has no option 'worker' (it takes workers); did you mean -E workers=...?"),
        (["--filter", "no-reasoning:min_shares=0.5"],
         "The filter no-reasoning has no option 'min_shares' (it takes min_share); "
         "did you mean no-reasoning:min_share=...?"),
    ],
)
def test_option_typos_on_the_command_line_get_the_valid_keys(runner, model_server, tmp_path, args, says):
    server = model_server(ToolLoopScript(tool_calls=0))
    result = runner.invoke(write_dataset(tmp_path / "d.jsonl", [{"prompt": "p"}]), *args, server=server)
    assert result.exit_code == 2, result.output
    assert says in result.output
    assert server.request_count == 0
