"""Per-connection settings from a hostile client: bounded values, typed properties, Gadgetron
stream configurations, JSON limits, the device rule."""

from __future__ import annotations

import time
import tracemalloc
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from masc_gadget.acquisition.episode import AcquisitionConfig
from masc_gadget.config import ConfigError, from_dict
from masc_gadget.serving import settings as settings_module
from masc_gadget.serving.settings import (
    MAX_VALUE_CHARS, GadgetConfig, GadgetSettings, settings_from_json, settings_from_xml,
)

ROOT = Path(__file__).resolve().parents[3]


def _bomb(levels: int = 8, width: int = 9) -> str:
    parts = ["&a0 [" + ", ".join(["x"] * width) + "]"]
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


def _prop(name: str, value: str) -> str:
    from xml.sax.saxutils import quoteattr

    return f"<configuration><property name={quoteattr(name)} value={quoteattr(value)}/></configuration>"


def test_a_yaml_alias_bomb_is_refused_in_bounded_time_and_memory():
    tracemalloc.start()
    start = time.monotonic()
    with pytest.raises(ConfigError, match="configuration.budget: must be an integer") as info:
        settings_from_xml(_prop("budget", _bomb()), GadgetSettings())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.monotonic() - start < 1 and peak < 8 << 20 and len(str(info.value)) < 200


def test_text_settings_take_the_text_as_it_is():
    base = GadgetSettings(mar_checkpoint="mar.pt", zmq_address="tcp://127.0.0.1:1")
    s = settings_from_xml('<configuration><property name="mar_checkpoint" value=""/>'
                          '<zmq_address/></configuration>', base)
    assert s.mar_checkpoint == "" and s.zmq_address == ""
    s = settings_from_xml(_prop("policy_checkpoint", "  null  "), base)  # YAML would read None
    assert s.policy_checkpoint == "null"
    with pytest.raises(ConfigError, match="configuration.budget: must be an integer, got ''"):
        settings_from_xml(_prop("budget", ""), base)
    assert settings_from_xml(_prop("return_zero_filled", "true"), base).return_zero_filled is True
    assert settings_from_xml(_prop("budget", " 5 "), base).budget == 5


def test_values_and_their_errors_are_bounded():
    with pytest.raises(ConfigError, match=f"more than the limit {MAX_VALUE_CHARS}"):
        settings_from_xml(_prop("mar_checkpoint", "x" * (MAX_VALUE_CHARS + 1)), GadgetSettings())
    with pytest.raises(ConfigError) as info:
        settings_from_xml(_prop("budget", "[" + "1, " * 1000 + "1]"), GadgetSettings())
    assert "must be an integer" in str(info.value) and len(str(info.value)) < 200
    with pytest.raises(ConfigError) as info:
        settings_from_xml(_prop("k" * 10_000, "1"), GadgetSettings())
    assert "unknown setting" in str(info.value) and len(str(info.value)) < 400
    with pytest.raises(ConfigError) as info:
        from_dict(AcquisitionConfig, {"policy": ["x" * 1_000_000] * 1000}, "parameters")
    assert len(str(info.value)) < 200


@pytest.mark.parametrize("name", ["masc_external.xml", "masc_connect.xml"])
def test_the_shipped_gadgetron_stream_configurations_are_config_scripts(name):
    path = ROOT / "configs" / "gadgetron" / name
    inner = ET.parse(path).getroot().find("stream/external/configuration")
    expected = {p.get("name"): p.get("value") for p in inner.iter("property")}
    s = settings_from_xml(path.read_text(), GadgetSettings())
    assert expected and s == GadgetSettings().updated(
        {k: settings_module._typed(k, v) for k, v in expected.items()}, "expected")


def test_a_gadgetron_stream_configuration_gives_its_external_properties():
    stream = """<?xml version="1.0" encoding="UTF-8"?>
<!-- a comment -->
<configuration>
    <version>2</version>
    <readers><reader><dll>gadgetron_core_readers</dll><classname>AcquisitionReader</classname></reader></readers>
    <writers><writer><dll>gadgetron_core_writers</dll><classname>ImageWriter</classname></writer></writers>
    <stream>
        <external>
            <execute name="masc_gadget.serving.gadget" target="masc" type="python"/>
            <configuration>
                <property name="feedback" value="inband"/>
                <property name="budget" value="3"/>
            </configuration>
        </external>
    </stream>
</configuration>"""
    s = settings_from_xml(stream, GadgetSettings())
    assert (s.feedback, s.budget, s.policy) == ("inband", 3, AcquisitionConfig.policy)


def test_stream_configurations_without_or_with_several_externals():
    plain = "<configuration><version>2</version><stream><gadget><name>x</name></gadget></stream></configuration>"
    assert settings_from_xml(plain, GadgetSettings(budget=3)) == GadgetSettings(budget=3)
    ext = '<external><configuration><property name="budget" value="{}"/></configuration></external>'
    two = f"<configuration><stream>{ext.format(3)}{ext.format(4)}</stream></configuration>"
    with pytest.raises(ConfigError, match="2 <external> modules"):
        settings_from_xml(two, GadgetSettings())
    assert settings_from_xml(f"<configuration><stream>{ext.format(3)}</stream></configuration>",
                             GadgetSettings()).budget == 3


def test_the_device_is_cpu_cuda_or_auto():
    for device in ("cpu", "cuda", "cuda:1", "auto"):
        assert GadgetConfig(device=device).device == device
    for device in ("meta", "cuda:x", "mps", "cpu " * 100):
        with pytest.raises(ValueError, match="device must be cpu, cuda, cuda:N or auto"):
            GadgetConfig(device=device)
    with pytest.raises(ConfigError, match="parameters: device must be cpu, cuda, cuda:N or auto, got 'meta'"):
        settings_from_json('{"device": "meta"}', GadgetSettings())


@pytest.mark.parametrize("text, message", [
    ("[" * 100_000 + "]" * 100_000, "more than the limit 65536"),
    ("[" * 9 + "]" * 9, "deeper than the limit 8"),
    ('{"a": "[[[[[[[[[[[[[[[[[[[["}', "unknown setting 'a'"),  # brackets in strings do not count
    ('{"budget": 1' + "0" * 5000 + "}", "parameters text has a number of thousands of digits"),
    ("[1]", "must be a JSON object"),
])
def test_json_parameters_limits(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        settings_from_json(text, GadgetSettings())
    assert len(str(info.value)) < 400


def test_the_token_is_not_a_setting():
    assert settings_from_json('{"token": "x", "budget": 3}', GadgetSettings()) == GadgetSettings(budget=3)


@pytest.mark.parametrize("key", ["budget", "initial", "seed", "mar_fallback"])
def test_a_number_of_hundreds_of_digits_is_refused_by_name_and_quoted_short(key):
    """Regression: a 330-digit budget passed the settings (and an error later quoted all of it); a
    330-digit mar_fallback raised Python's own OverflowError message."""
    from masc_gadget.config import ConfigError

    with pytest.raises(ConfigError) as info:
        settings_from_json('{"%s": %s}' % (key, "9" * 330), GadgetSettings())
    assert key in str(info.value) and len(str(info.value)) < 200
