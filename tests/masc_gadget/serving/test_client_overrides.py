"""The operator's settings stand: a client of masc serve changes only what server.client_overrides
allows (feedback and the ZeroMQ address always); a different protocol is an error naming both."""

import json

import numpy as np
import pytest

from masc_gadget.acquisition.policies import FixedOrder, run_episode
from masc_gadget.config import ConfigError, load_config
from masc_gadget.models.checkpoint import save_checkpoint
from masc_gadget.serving.host import ClientError, NamedConfigs, ServerConfig
from masc_gadget.serving.server import MascServer
from masc_gadget.serving.settings import GadgetSettings, client_values, settings_from_json, settings_from_xml

from tests.conftest import CONFIGS

OPERATOR = GadgetSettings(policy="equispaced", initial=1, budget=2)


def test_a_client_changes_only_what_the_operator_allows(caplog):
    notes: list[str] = []
    with caplog.at_level("WARNING"):
        got = settings_from_json(json.dumps({"policy": "random", "feedback": "inband", "initial": 1, "budget": 2,
                                             "mar_fallback": "off"}), OPERATOR, (), notes)
    assert got.policy == "equispaced" and got.feedback == "inband" and got.mar_fallback == "auto"
    assert len(notes) == 2 and "parameters.policy: 'random' refused" in notes[0]
    assert "server.client_overrides: [policy]" in notes[0]
    assert sum("refused" in r.getMessage() for r in caplog.records) == 2
    with caplog.at_level("WARNING"):
        allowed = settings_from_json('{"policy": "random"}', OPERATOR, ("policy",))
    assert allowed.policy == "random" and any("client override applied" in r.getMessage() for r in caplog.records)
    assert settings_from_json('{"policy": "random", "seed": 4}', OPERATOR, ("*",)).seed == 4
    script = '<configuration><property name="policy" value="center-out"/><property name="budget" value="2"/></configuration>'
    assert settings_from_xml(script, OPERATOR, ()).policy == "equispaced"
    assert settings_from_xml(script, OPERATOR).policy == "center-out"  # the operator's own script: whole


def test_a_different_protocol_is_an_error_naming_both():
    with pytest.raises(ConfigError, match=r"parameters.budget: 18 differs from this server's 2 \(it serves 1 \+ 2 "
                                          r"lines.*server.client_overrides"):
        settings_from_json('{"budget": 18}', OPERATOR, ())
    assert client_values({"budget": 18, "initial": 3}, OPERATOR, ("budget", "initial"), "parameters") == {
        "budget": 18, "initial": 3}
    with pytest.raises(ConfigError, match="unknown setting 'polcy'"):
        settings_from_json('{"polcy": "x"}', OPERATOR, ())


def test_naming_a_policy_as_the_configuration_is_a_policy_override():
    named = NamedConfigs(OPERATOR, [])
    assert named.resolve("equispaced").policy == "equispaced"  # the server's own: fine
    with pytest.raises(ClientError, match="would change the policy.*server.client_overrides: \\[policy\\]"):
        named.resolve("random")
    assert NamedConfigs(OPERATOR, [], ("policy",)).resolve("random").policy == "random"
    with pytest.raises(ValueError, match="client_overrides: unknown setting 'polcy'"):
        ServerConfig(client_overrides=("polcy",))


def test_the_readme_recipe_serves_the_operators_model_whatever_the_scan_config_says(tiny_dataset, tmp_path, capsys):
    """Regression: masc serve configured for the fixed order, then masc scan with a config whose
    acquisition.policy is masc: the scan sent its policy, the server played it without its
    checkpoint, and every decision fell back. Now the scan sends none and gets the fixed order;
    asking for another with --policy is refused with a warning and the scan still completes."""
    from masc_gadget.cli import main
    from masc_gadget.models.unet import MarModelConfig, build_mar
    from masc_gadget.config import to_dict

    order = [3, 28]
    mar = build_mar(MarModelConfig(width=4)).eval()
    checkpoint = save_checkpoint(tmp_path / "fixed.pt", {"mar": mar}, {
        "kind": "fixed-order", "n_pe": 32, "order": order, "mar_model": to_dict(mar.config)})
    config = load_config(CONFIGS / "tiny.yaml", [
        "gadget.device=cpu", "server.client_overrides=[]", "acquisition.policy=fixed-order",
        f"gadget.policy_checkpoint={checkpoint}", f"gadget.mar_checkpoint={checkpoint}"])
    server = MascServer(config, address="127.0.0.1", port=0)
    _, port = server.start()
    try:
        common = ["scan", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset), "--server",
                  f"127.0.0.1:{port}", "--no-progress", "--deadline-ms", "5000", "--set", "acquisition.policy=masc"]
        code = main([*common, "--out", str(tmp_path / "scan")])
        assert code == 0, capsys.readouterr().err
        asked = main([*common, "--out", str(tmp_path / "asked"), "--policy", "random"])
        err = capsys.readouterr().err
        assert asked == 0 and "did not apply 1 setting(s)" in err and "'random' refused" in err
        wrong = main([*common, "--out", str(tmp_path / "wrong"), "--set", "acquisition.budget=5"])
        err = capsys.readouterr().err
        assert wrong == 1 and "budget: 5 differs from this server's 2" in err
    finally:
        server.shutdown()
    expected = [int(x) for x in run_episode(FixedOrder(np.array(order)), 32, 1, 2)]
    for folder in ("scan", "asked"):
        report = json.loads((tmp_path / folder / "report.json").read_text())
        slices = [sl for sub in report["subjects"] for sl in sub["slices"]]
        assert slices and all(sl["lines"] == expected for sl in slices), folder
        assert report["totals"]["fallbacks"] == 0


def test_a_repeated_key_is_refused_not_resolved_last_wins():
    """Regression: {"token": "wrong", "token": "<right>"} authenticated (the last key won)."""
    from masc_gadget.serving.settings import parameters_json

    with pytest.raises(ConfigError, match="repeats the key 'token'"):
        parameters_json('{"token": "wrong", "token": "right"}')
    assert parameters_json('{"a": {"b": 1, "c": 2}}') == {"a": {"b": 1, "c": 2}}


@pytest.mark.parametrize("channels, fov, match", [
    ("<receiverChannels>0</receiverChannels>", None, "receiverChannels must be >= 1"),
    ("<receiverChannels>-3</receiverChannels>", None, "receiverChannels must be >= 1"),
    ("", "NaN", "fieldOfView_mm must be finite"), ("", "INF", "fieldOfView_mm must be finite"),
    ("", "0", "fieldOfView_mm must be finite and > 0")])
def test_a_header_without_channels_or_with_a_field_of_view_that_is_not_finite_is_refused(channels, fov, match):
    from masc_gadget.mrd.header import parse_header
    from masc_gadget.serving.connection import check_header
    from tests.scanner_streams import base_stream

    xml, _ = base_stream(32, 32, (200.0, 200.0, 5.0))
    if channels:
        xml = xml.replace("<acquisitionSystemInformation>", f"<acquisitionSystemInformation>{channels}", 1) \
            if "<acquisitionSystemInformation>" in xml else xml.replace(
                "<encoding>", f"<acquisitionSystemInformation>{channels}</acquisitionSystemInformation><encoding>", 1)
    if fov:
        import re

        xml, n = re.subn(r"(<fieldOfView_mm>\s*<x>)[^<]*(</x>)", rf"\g<1>{fov}\g<2>", xml, count=1)
        assert n == 1
    with pytest.raises((ClientError, ValueError), match=match):
        check_header(parse_header(xml), ServerConfig())
