"""One deploy path: every serving entry point without a configuration, and the shipped Gadgetron
XMLs, serve the recommended shipped model on its protocol; a configuration without a model warns."""

import pytest

from masc_gadget.config import load_config
from masc_gadget.models.shipped import RECOMMENDED, provenance, recommended_overrides
from masc_gadget.serving.host import serving_config
from masc_gadget.serving.settings import GadgetSettings, settings_from_xml

from tests.conftest import CONFIGS

XMLS = sorted((CONFIGS / "gadgetron").glob("*.xml"))


def _recommended() -> GadgetSettings:
    return GadgetSettings.from_config(load_config(None, recommended_overrides()))


def test_the_recommended_model_is_served_on_its_own_protocol():
    record = provenance(RECOMMENDED)
    s = _recommended()
    assert s.policy == record["kind"] and s.policy_checkpoint == s.mar_checkpoint == f"shipped:{RECOMMENDED}"
    assert (s.initial, s.budget) == (record["config"]["acquisition"]["initial"], record["config"]["acquisition"]["budget"])
    with pytest.raises(FileNotFoundError, match="no shipped checkpoint 'nope'"):
        recommended_overrides("nope")


@pytest.mark.parametrize("xml", XMLS, ids=lambda p: p.name)
def test_every_shipped_gadgetron_xml_names_the_recommended_model(xml):
    got = settings_from_xml(xml.read_text(), GadgetSettings())
    want = _recommended()
    for key in ("policy", "initial", "budget", "policy_checkpoint", "mar_checkpoint"):
        assert getattr(got, key) == getattr(want, key), (xml.name, key)


def test_without_a_configuration_every_entry_point_serves_it(caplog, monkeypatch):
    import masc_gadget.serving.gadget as gadget

    with caplog.at_level("WARNING"):
        config = serving_config(None, ["gadget.device=cpu"])
    assert GadgetSettings.from_config(config).policy_checkpoint == f"shipped:{RECOMMENDED}"
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    monkeypatch.setattr(gadget, "_EXECUTE_HOST", None)
    assert gadget.execute_host().default.policy_checkpoint == f"shipped:{RECOMMENDED}"
    with caplog.at_level("WARNING"):
        bare = serving_config(CONFIGS / "tiny.yaml")  # a configuration without a model: served, with a warning
    assert not GadgetSettings.from_config(bare).mar_checkpoint
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("with no trained model" in m and f"shipped:{RECOMMENDED}" in m for m in said)


def test_masc_serve_without_config_says_what_it_serves(tmp_path):
    """The real command, as a user starts it: no --config, it answers with the recommended model's
    protocol (a scan of another budget is refused with both numbers)."""
    import socket
    import subprocess
    import sys
    import time

    from tests.conftest import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "masc_gadget.cli", "serve", "--port", str(port),
                             "--set", "gadget.device=cpu", "--log-level", "INFO"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.time() < deadline and proc.poll() is None, proc.stdout.read()
                time.sleep(0.1)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert f"serving the recommended shipped model {RECOMMENDED}" in out
    assert "policy fixed-order, 2 + 11 lines" in out, out[-2000:]
