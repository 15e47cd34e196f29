"""Hostile connections against the models, the side channel and the images of the gadget:
which checkpoints a connection may name, the model cache, where feedback may go, and what a
returned image carries. Synthetic 16 x 8 scans through :func:`process`, no sockets needed."""

import json
import os
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

import ismrmrd
import numpy as np
import pytest

from masc_gadget.acquisition.engine import SliceResult
from masc_gadget.acquisition.episode import initial_lines
from masc_gadget.config import ConfigError, load_config
from masc_gadget.models import checkpoint, shipped
from masc_gadget.mrd import feedback
from masc_gadget.mrd.feedback import FeedbackConfig, ZmqFeedback, ZmqFeedbackReceiver, endpoint_allowed
from masc_gadget.mrd.header import parse_header
from masc_gadget.serving.gadget import process
from masc_gadget.serving.host import Host, ServerConfig
from masc_gadget.serving.models import ModelCache, ModelsConfig, load_models
from masc_gadget.serving.settings import GadgetSettings
from masc_gadget.serving.stages import make_image

from tests.conftest import CONFIGS, write_perturbed_mar

N_PE, N_RO = 16, 8
INITIAL, BUDGET = 2, 3
BASE = GadgetSettings(policy="center-out", initial=INITIAL, budget=BUDGET, device="cpu")


def _header(n_slices=2):
    return parse_header(
        '<?xml version="1.0"?><ismrmrdHeader xmlns="http://www.ismrm.org/ISMRMRD">'
        "<experimentalConditions><H1resonanceFrequency_Hz>63500000</H1resonanceFrequency_Hz>"
        f"</experimentalConditions><encoding><encodedSpace><matrixSize><x>{N_RO}</x><y>{N_PE}</y>"
        "<z>1</z></matrixSize><fieldOfView_mm><x>200</x><y>200</y><z>5</z></fieldOfView_mm>"
        f"</encodedSpace><reconSpace><matrixSize><x>{N_RO}</x><y>{N_PE}</y><z>1</z></matrixSize>"
        "<fieldOfView_mm><x>200</x><y>200</y><z>5</z></fieldOfView_mm></reconSpace><encodingLimits>"
        f"<kspace_encoding_step_1><minimum>0</minimum><maximum>{N_PE - 1}</maximum><center>{N_PE // 2}"
        f"</center></kspace_encoding_step_1><slice><minimum>0</minimum><maximum>{n_slices - 1}</maximum>"
        "<center>0</center></slice></encodingLimits><trajectory>cartesian</trajectory></encoding>"
        "</ismrmrdHeader>")


def _line(slice_index, pe, last=False):
    rng = np.random.default_rng([7, slice_index, pe])
    data = (rng.standard_normal((1, N_RO)) + 1j * rng.standard_normal((1, N_RO))).astype(np.complex64)
    acq = ismrmrd.Acquisition.from_array(data)
    acq.idx.slice = slice_index
    acq.idx.kspace_encode_step_1 = pe
    if last:
        acq.set_flag(ismrmrd.ACQ_LAST_IN_SLICE)
    return acq


def _run(items, settings=BASE, cache=None, params=None):
    """``process`` over ``items`` (JSON ``params`` first): (images, errors)."""
    sent, errors = [], []
    items = list(items)
    if params is not None:
        items.insert(0, json.dumps(params))
    process(iter(items), _header(), settings, sent.append, on_error=errors.append,
            host=Host(limits=ServerConfig(client_overrides=("*",)), cache=ModelCache() if cache is None else cache))
    return [x for x in sent if isinstance(x, ismrmrd.Image) and x.image_series_index == 1], errors


@pytest.fixture
def folder(tmp_path):
    """The operator's models folder: mar.pt (a MAR checkpoint) and bad.pt (not a checkpoint)."""
    models = tmp_path / "models"
    models.mkdir()
    write_perturbed_mar(models / "mar.pt")
    (models / "bad.pt").write_bytes(b"Qsecret content of a file")
    return models


def _scan(slices=(0,)):
    """A short closed-loop-free scan: the initial lines of each slice, then three more."""
    return [_line(s, pe) for s in slices for pe in [*initial_lines(N_PE, INITIAL), 0, 1, 2]]


# --- 1. the model cache --------------------------------------------------------------------------


def test_every_spelling_of_one_checkpoint_shares_one_load(tmp_path, monkeypatch):
    write_perturbed_mar(tmp_path / "x.pt")
    (tmp_path / "link.pt").symlink_to(tmp_path / "x.pt")
    monkeypatch.chdir(tmp_path)
    cache = ModelCache()
    models = [cache.mar(spelling, "cpu") for spelling in ("x.pt", "./x.pt", str(tmp_path / "x.pt"), "link.pt",
                                                          f"{tmp_path}/../{tmp_path.name}/x.pt")]
    assert all(m is models[0] for m in models) and cache.loads == 1 and len(cache) == 1
    path = str(shipped.resolve("shipped:masc_small"))
    assert cache.masc("shipped:masc_small", "cpu") is cache.masc(path, "cpu") and cache.loads == 2


def test_the_cache_is_bounded_and_drops_the_least_recently_used(tmp_path):
    for name in "abc":
        write_perturbed_mar(tmp_path / f"{name}.pt")
    cache = ModelCache(max_loaded=2)
    a = cache.mar(str(tmp_path / "a.pt"), "cpu")
    cache.mar(str(tmp_path / "b.pt"), "cpu")
    assert cache.mar(str(tmp_path / "a.pt"), "cpu") is a  # a is now the most recent
    cache.mar(str(tmp_path / "c.pt"), "cpu")  # drops b
    assert len(cache) == 2 and cache.loads == 3
    assert cache.mar(str(tmp_path / "a.pt"), "cpu") is a and cache.loads == 3
    cache.mar(str(tmp_path / "b.pt"), "cpu")
    assert cache.loads == 4 and len(cache) == 2


def test_a_changed_checkpoint_file_loads_again(tmp_path):
    path = write_perturbed_mar(tmp_path / "x.pt")
    cache = ModelCache()
    first = cache.mar(str(path), "cpu")
    write_perturbed_mar(path, seed=2)
    os.utime(path, ns=(1, 1))
    assert cache.mar(str(path), "cpu") is not first and cache.loads == 2


def test_many_connections_naming_the_shipped_model_load_it_once():
    cache = ModelCache()
    settings = GadgetSettings(policy="masc", policy_checkpoint="shipped:masc_small", device="cpu")
    policies = {id(load_models(settings, cache, trusted=GadgetSettings()).policy) for _ in range(5)}
    assert len(policies) == 1 and cache.loads == 1


# --- 3. one lock per model ------------------------------------------------------------------------


def test_a_model_loading_for_one_connection_does_not_hold_up_another(tmp_path, monkeypatch):
    slow, fast = write_perturbed_mar(tmp_path / "slow.pt"), write_perturbed_mar(tmp_path / "fast.pt")
    real_load, release, started = checkpoint.load_mar, threading.Event(), threading.Event()
    calls = []

    def load_mar(path, device="cpu", name=None):
        calls.append(Path(path).name)
        if Path(path).name == slow.name:
            started.set()
            release.wait(10)
        return real_load(path, device, name=name)

    monkeypatch.setattr(checkpoint, "load_mar", load_mar)
    cache, got = ModelCache(), {}
    slow_threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, cache.mar(str(slow), "cpu")))
                    for i in range(2)]
    other = threading.Thread(target=lambda: got.__setitem__("fast", cache.mar(str(fast), "cpu")))
    try:
        slow_threads[0].start()
        assert started.wait(10)
        slow_threads[1].start()  # the same model: waits for the first load, loads nothing itself
        other.start()
        other.join(5)
        assert "fast" in got and not other.is_alive()  # done while the slow model still loads
    finally:
        release.set()
        for t in (*slow_threads, other):
            if t.ident is not None:
                t.join(10)
    assert got[0] is got[1] and calls.count(slow.name) == 1 and cache.loads == 2


# --- 2. clients choose models by name -------------------------------------------------------------


@pytest.mark.parametrize("value", ["{real}", "{folder}/mar.pt", "../models/mar.pt", "sub/mar.pt", "mar.pt/..", "..",
                                   "C:mar.pt", "\\\\host\\share\\mar.pt", "/etc/passwd", "~/mar.pt",
                                   "shipped:../shipped/masc_small", "shipped:nope", "nope", "bad.pt.pt",
                                   "x" * 200, "a\x00b", "{folder}"])
@pytest.mark.parametrize("key", ["mar_checkpoint", "policy_checkpoint"])
def test_a_connection_cannot_name_a_path_or_an_unknown_model(folder, key, value):
    value = value.format(real=folder / "mar.pt", folder=folder)
    settings = BASE.updated({"policy": "masc"} if key == "policy_checkpoint" else {}, "test")
    with pytest.raises(ConfigError) as err:
        _run(_scan(), settings, ModelCache(directory=str(folder)), params={key: value})
    message = str(err.value)
    assert "a connection chooses a model by name from those the server offers: shipped:fixed_small, shipped:masc_small, bad, mar" in message
    assert str(folder.parent) not in message and "/etc" not in message and "Qsecret" not in message
    assert len(message) < 400


def test_without_a_models_folder_only_shipped_models_and_the_operators_own_are_allowed(folder):
    operator = BASE.updated({"mar_checkpoint": str(folder / "mar.pt")}, "operator's config")
    for params in ({"mar_checkpoint": "shipped:masc_small"}, {"mar_checkpoint": str(folder / "mar.pt")},
                   {"mar_checkpoint": ""}, {}):
        images, errors = _run(_scan(), operator, ModelCache(), params=params)
        assert len(images) == 1 and not errors
    with pytest.raises(ConfigError, match=r"'mar' is not a model this server offers; .*: shipped:fixed_small, shipped:masc_small \(or leaves"):
        _run(_scan(), operator, ModelCache(), params={"mar_checkpoint": "mar"})


@pytest.mark.parametrize("name", ["mar", "mar.pt"])
def test_a_connection_loads_a_model_of_the_folder_by_name(folder, name):
    cache = ModelCache.from_config(load_config(CONFIGS / "tiny.yaml", [f"models.directory={folder}"])["models"])
    images, errors = _run(_scan(), BASE, cache, params={"mar_checkpoint": name})
    assert not errors and ismrmrd.Meta.deserialize(images[0].attribute_string)["MASC.mar"] == name


def test_a_model_of_the_folder_that_does_not_load_reveals_nothing(folder):
    with pytest.raises(ConfigError) as err:
        _run(_scan(), BASE, ModelCache(directory=str(folder)), params={"mar_checkpoint": "bad"})
    assert str(err.value) == "mar_checkpoint 'bad': the model cannot be loaded (see the server log)"


def test_models_section_checks_its_values():
    with pytest.raises(ConfigError, match="max_loaded must be an integer >= 1"):
        load_config(None, ["models.max_loaded=0"])
    assert ModelsConfig().directory == ""


# --- 5. the ZeroMQ side channel -------------------------------------------------------------------


@pytest.mark.parametrize("address", ["tcp://192.0.2.7:9", "tcp://127.0.0.1:5;192.0.2.7:9", "tcp://eth0;127.0.0.1:5",
                                     "ipc:///tmp/masc", "tcp://127.0.0.1:*", "tcp://127.0.0.1:0", "pgm://x;239.0.0.1:5",
                                     "tcp://127.0.0.1.evil.example:5", "tcp://" + "a" * 4000 + ":5"])
def test_a_connection_cannot_point_the_side_channel_anywhere(address, monkeypatch):
    def no_socket(*args, **kwargs):
        raise AssertionError("a socket was made for an endpoint that is not allowed")

    monkeypatch.setattr(feedback.zmq.Context, "socket", no_socket)
    with pytest.raises(ValueError) as err:
        _run(_scan(), params={"zmq_address": address})
    assert "is not allowed: the gadget connects its feedback socket only to endpoints the server allows" in str(err.value)
    assert "tcp://127.0.0.1:*, tcp://localhost:*, tcp://[::1]:*" in str(err.value) and len(str(err.value)) < 400


def test_loopback_the_operators_own_address_and_the_allow_list_are_accepted():
    assert all(endpoint_allowed(a) for a in ("tcp://127.0.0.1:9003", "tcp://localhost:1", "tcp://[::1]:5"))
    images, errors = _run(_scan(), GadgetSettings(**{**BASE.flat(), "zmq_address": "tcp://192.0.2.7:9"}),
                          params={"zmq_address": "tcp://192.0.2.7:9"})  # the operator's, repeated
    assert len(images) == 1 and not errors
    allowed = FeedbackConfig(zmq_allow=("tcp://192.0.2.8:*", "ipc:///run/masc/*")).zmq_allow  # a host's list
    ZmqFeedback("tcp://192.0.2.8:4000", allowed=allowed).close()
    ZmqFeedback("ipc:///run/masc/scanner", allowed=allowed).close()
    with pytest.raises(ValueError, match="not allowed"):
        ZmqFeedback("ipc:///run/masc/../../tmp/x", allowed=allowed)
    with pytest.raises(ValueError, match="not allowed"):
        ZmqFeedback("tcp://127.0.0.1:9003", allowed=allowed)  # not in that list


def test_feedback_section_checks_its_entries():
    with pytest.raises(ConfigError, match="must look like tcp://HOST:PORT"):
        load_config(None, ["feedback.zmq_allow=[tcp://127.0.0.1]"])


# --- 8. closed loop only when the scanner follows the decisions -----------------------------------


def _whole_file(slices=(0, 1), last_flags=True):
    return [_line(s, pe, last=last_flags and pe == N_PE - 1) for s in slices for pe in range(N_PE)]


@pytest.mark.parametrize("last_flags", [True, False])
def test_streaming_a_whole_file_with_a_zmq_address_gives_one_image_per_slice(last_flags):
    with ZmqFeedbackReceiver("tcp://127.0.0.1:*") as receiver:
        images, errors = _run(_whole_file(last_flags=last_flags), params={"zmq_address": receiver.endpoint})
    assert not errors and sorted(i.slice for i in images) == [0, 1]
    for image in images:  # every line the client sent
        assert sorted(int(v) for v in ismrmrd.Meta.deserialize(image.attribute_string)["MASC.lines"]) == list(range(N_PE))


def test_a_scanner_following_zmq_decisions_gets_each_image_once_its_budget_is_spent():
    order = []
    with ZmqFeedbackReceiver("tcp://127.0.0.1:*") as receiver:

        def scanner():
            yield json.dumps({"zmq_address": receiver.endpoint})
            for s in (0, 1):
                for pe in initial_lines(N_PE, INITIAL):
                    yield _line(s, int(pe))
                for _ in range(BUDGET):  # no ACQ_LAST_IN_SLICE: the gadget ends the slice itself
                    decision = receiver.receive(10_000)
                    order.append(("line", s))
                    yield _line(s, decision.line)

        process(scanner(), _header(), BASE, lambda item: order.append(("image", item.slice))
                if isinstance(item, ismrmrd.Image) else None, host=Host(limits=ServerConfig(client_overrides=("*",)), cache=ModelCache()))
    # each slice's two series (MAR, zero-filled) as soon as its budget is spent
    assert order == [*[("line", 0)] * BUDGET, *[("image", 0)] * 2, *[("line", 1)] * BUDGET, *[("image", 1)] * 2]


# --- 6. and 7. what an image carries --------------------------------------------------------------


def _result(image, decided, policy="center-out", mar="mar.pt"):
    return SliceResult(slice=0, image=image, zero_filled=np.abs(image), lines=[7, 8, 3], decided=decided,
                       policy=policy, mar=mar)


def test_magnitude_images_are_never_negative():
    """A MAR output that dips below zero is served clamped (the one image path), and the image
    carries exactly the served pixels."""
    import torch

    from masc_gadget.core.served import served_images

    raw = np.linspace(-0.22, 1.0, N_PE * N_RO, dtype=np.float32).reshape(N_PE, N_RO)
    served = served_images(torch.from_numpy(np.abs(raw))[None], torch.from_numpy(raw)[None])
    pixels = served.image[0].numpy()
    image = make_image(_result(pixels, [3]), None, _header(), series=1)
    assert image.image_type == ismrmrd.IMTYPE_MAGNITUDE and image.data.min() == 0.0
    np.testing.assert_array_equal(image.data[0, 0], np.maximum(raw, 0))


@pytest.mark.parametrize("decided, policy, mar", [
    ([], "center-out", "mar.pt"),
    ([3], "po<li>cy & \"co\"", "m\x00a\x1fr\u00e9.pt"),
    ([3, 4], "", "x" * 1000),
])
def test_every_meta_attribute_has_at_least_one_value(decided, policy, mar):
    for zero_filled in (False, True):
        image = make_image(_result(np.ones((N_PE, N_RO), np.float32), decided, policy, mar), None, _header(),
                           series=2 if zero_filled else 1, zero_filled=zero_filled)
        root = ET.fromstring(image.attribute_string.encode())
        for meta in root.iter("meta"):
            values = meta.findall("value")
            assert len(values) >= 1 and all(v.text for v in values), meta.findtext("name")
            assert all(" " <= c <= "~" for v in values for c in v.text) and all(len(v.text) <= 128 for v in values)
        names = [m.findtext("name") for m in root.iter("meta")]
        assert ("MASC.decided" in names) == bool(decided) and "MASC.lines" in names


def test_a_slice_with_no_decided_line_is_returned_with_valid_meta():
    images, errors = _run([_line(0, 7), _line(0, 8, last=True)])  # the initial lines only
    root = ET.fromstring(images[0].attribute_string.encode())
    assert not errors and all(meta.findall("value") for meta in root.iter("meta"))
    assert "MASC.decided" not in ismrmrd.Meta.deserialize(images[0].attribute_string)
