"""Typed configs: defaults, YAML overrides, --set, and errors that name the key."""

from dataclasses import dataclass, field
from typing import Literal

import pytest

from masc_gadget.config import (
    ConfigError,
    build_config,
    config_sections,
    from_dict,
    load_config,
    parse_overrides,
    to_dict,
)

from tests.conftest import CONFIGS  # noqa: E402


@dataclass(frozen=True)
class Inner:
    width: int = 8
    """channels"""


@dataclass(frozen=True)
class Demo:
    rate: float = 1.0
    steps: int = 3
    mode: Literal["a", "b"] = "a"
    pair: tuple[float, float] = (0.0, 1.0)
    maybe: int | None = None
    flags: dict[str, float] = field(default_factory=dict)
    inner: Inner = field(default_factory=Inner)

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")


def test_defaults_and_overrides():
    d = from_dict(Demo, {"rate": 2, "pair": [1, 2], "inner": {"width": 4}, "maybe": 5})
    assert d.rate == 2.0 and isinstance(d.rate, float)
    assert d.pair == (1.0, 2.0)
    assert d.inner.width == 4 and d.maybe == 5
    assert to_dict(d)["pair"] == [1.0, 2.0]


@pytest.mark.parametrize(
    "data,message",
    [
        ({"rat": 1.0}, "unknown key demo.rat; allowed keys of demo: flags, inner, maybe, mode, pair, rate, steps"),
        ({"steps": 1.5}, "demo.steps: must be an integer"),
        ({"steps": True}, "demo.steps: must be an integer"),
        ({"mode": "c"}, "demo.mode: must be one of 'a', 'b'"),
        ({"pair": [1.0]}, "demo.pair: must have 2 items"),
        ({"inner": {"depth": 2}}, "unknown key demo.inner.depth"),
        ({"steps": -1}, "demo: steps must be >= 0"),
        ({"rate": "fast"}, "demo.rate: must be a number"),
    ],
)
def test_errors_name_the_key(data, message):
    with pytest.raises(ConfigError) as err:
        from_dict(Demo, data, "demo")
    assert message in str(err.value)


def test_parse_overrides_types_values_as_yaml():
    assert parse_overrides(["a.b=1.5", "a.c=[1, 2]", "d.e=true", "d.f=text"]) == {
        "a": {"b": 1.5, "c": [1, 2]}, "d": {"e": True, "f": "text"}
    }
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["nodot=1"])


def test_build_config_rejects_unknown_sections():
    sections = {"demo": Demo}
    cfg = build_config({"demo": {"rate": 3}}, ["demo.steps=7"], sections)
    assert cfg["demo"].rate == 3.0 and cfg.demo.steps == 7
    with pytest.raises(ConfigError, match="unknown config section 'other'; known sections: demo"):
        build_config({"other": {}}, [], sections)


def test_shipped_configs_load_against_all_installed_sections():
    sections = config_sections()
    assert {"dataset", "sequence", "physics", "phantom", "implant"} <= set(sections)
    for name in ("tiny", "small", "paper"):
        cfg = load_config(CONFIGS / f"{name}.yaml")
        assert cfg["sequence"].n_pe >= 8
    paper = load_config(CONFIGS / "paper.yaml")
    seq = paper["sequence"]
    assert (seq.b0_t, seq.tr_ms, seq.te_ms, seq.readout_bw_hz_per_px, seq.rf_bw_hz) == (3.0, 4050.0, 32.0, 710.0, 1000.0)
    assert (seq.slice_thickness_mm, seq.n_slices, seq.n_pe) == (3.0, 36, 200)
    assert paper["dataset"].subjects == 200


def test_load_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("sequence: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("sequence:\n  b0_t: -1\n")
    with pytest.raises(ConfigError, match="sequence: b0_t must be > 0"):
        load_config(wrong)


def test_override_replaces_dict_valued_fields():

    @dataclass(frozen=True)
    class WithDict:
        table: dict[str, int] = field(default_factory=lambda: {"a": 1, "b": 2})
        other: int = 0

    cfg = build_config({"w": {"table": {"a": 5, "c": 3}, "other": 1}}, ["w.table={z: 9}"], {"w": WithDict})
    assert cfg["w"].table == {"z": 9} and cfg["w"].other == 1


def test_config_files_layer_left_to_right(tmp_path):
    from masc_gadget.config import ConfigError, load_config

    base = tmp_path / "a.yaml"
    base.write_text("dataset:\n  subjects: 5\n  seed: 1\nsequence:\n  n_slices: 4\n")
    layer = tmp_path / "b.yaml"
    layer.write_text("dataset:\n  seed: 9\n")
    config = load_config(f"{base},{layer}", ["sequence.n_slices=6"])
    assert (config["dataset"].subjects, config["dataset"].seed, config["sequence"].n_slices) == (5, 9, 6)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(f"{base},{tmp_path / 'missing.yaml'}")
    bad = tmp_path / "c.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(f"{base},{bad}")


def test_the_harm_cases_layer_over_the_small_config():
    from masc_gadget.config import load_config

    config = load_config(f"{CONFIGS / 'small.yaml'},{CONFIGS / 'harm-hip.yaml'}")
    assert config["variation"].stem_materials == ("stainless_steel",) and config["dataset"].seed != 0
    assert config["sequence"].matrix == (128, 128)  # the small protocol underneath


def test_a_number_in_exponent_notation_is_a_number():
    from masc_gadget.config import ConfigError, load_config

    config = load_config(None, ["ppo.lr=1e-12", "mar_train.lr=5E-4"])
    assert config["ppo"].lr == 1e-12 and config["mar_train"].lr == 5e-4
    with pytest.raises(ConfigError, match="must be a number"):
        load_config(None, ["ppo.lr=fast"])
