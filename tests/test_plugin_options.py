"""NAME[:OPTIONS]: one syntax for the options of every filter and writer."""

import attrs
import pytest

from hermes_batch.errors import HermesBatchError
from hermes_batch.plugin_options import build_config, parse_spec


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
