"""The MASC gadget over real sockets: masc serve, gadgetron.external.Connection, bad clients."""

import json
import socket
import threading
import time

import h5py
import ismrmrd
import numpy as np
import pytest
import torch

from masc_gadget.acquisition.episode import initial_lines
from masc_gadget.config import load_config
from masc_gadget.mrd.feedback import decision_from_acquisition, is_feedback
from masc_gadget.serving.gadget import GadgetSettings, masc, settings_from_json, settings_from_xml
from masc_gadget.core.kspace import zero_filled
from masc_gadget.acquisition.policies import make_policy, run_episode
from masc_gadget.mrd.frames import ID_ACQUISITION, ID_CLOSE, ID_IMAGE, ID_TEXT, ConnectionClosed
from masc_gadget.mrd.protocol import MrdStream
from masc_gadget.serving.server import MascServer
from sim_scanner.dataset.layout import read_manifest, subject_path

from tests.conftest import CONFIGS

N_LINES = 3  # tiny.yaml: 1 initial + 2 chosen of 32


@pytest.fixture(scope="module")
def mar_ckpt(perturbed_mar):
    return perturbed_mar


@pytest.fixture(scope="module")
def server():
    config = load_config(CONFIGS / "tiny.yaml", ["gadget.device=cpu", "server.port=0"])
    srv = MascServer(config, address="127.0.0.1", port=0)
    host, port = srv.start()
    yield srv, port
    srv.shutdown()


@pytest.fixture(scope="module")
def subject(tiny_dataset):
    manifest = read_manifest(tiny_dataset)
    path = subject_path(tiny_dataset, manifest["splits"]["test"][0])
    dset = ismrmrd.Dataset(str(path), "metal", create_if_needed=False)
    header = dset.read_xml_header()
    header = header.decode() if isinstance(header, bytes) else header
    acqs = [dset.read_acquisition(i) for i in range(dset.number_of_acquisitions())]
    dset.close()
    with h5py.File(path, "r") as f:
        kspace = f["kspace/metal"][()]
    return header, acqs, kspace


def _connect(port):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return MrdStream(sock)


def _line(acqs, slice_index, line):
    for a in acqs:
        if a.idx.slice == slice_index and a.idx.kspace_encode_step_1 == line:
            return a
    raise KeyError((slice_index, line))


def _drain(stream, timeout=10.0):
    """Read until the server closes: (images by slice, texts, feedback decisions)."""
    images, texts, decisions = {}, [], []
    stream_sock_deadline = time.time() + timeout
    while time.time() < stream_sock_deadline:
        try:
            msg = stream.read_message()
        except ConnectionClosed:
            break
        if msg.id == ID_IMAGE:
            if msg.payload.image_series_index == 1:  # the MAR series (2: zero-filled)
                images[msg.payload.slice] = msg.payload
        elif msg.id == ID_TEXT:
            texts.append(msg.payload)
        elif msg.id == ID_ACQUISITION and is_feedback(msg.payload):
            decisions.append(decision_from_acquisition(msg.payload))
        elif msg.id == ID_CLOSE:
            break
    return images, texts, decisions


def closed_loop(port, header, acqs, params, config_name="default"):
    """A minimal in-band client: acquire what the gadget asks for, slice after slice."""
    stream = _connect(port)
    stream.send_config_file(config_name)
    stream.send_header(header)
    stream.send_text(json.dumps({"feedback": "inband", **params}))
    n_slices = 1 + max(a.idx.slice for a in acqs)
    n_pe = 1 + max(a.idx.kspace_encode_step_1 for a in acqs)
    initial = params.get("initial", 1)
    lines = {}
    images, texts = {}, []
    for s in range(n_slices):
        lines[s] = list(initial_lines(n_pe, initial))
        for line in lines[s]:
            stream.send_acquisition(_line(acqs, s, line))
        while len(lines[s]) < N_LINES:
            msg = stream.read_message()
            if msg.id == ID_IMAGE:
                if msg.payload.image_series_index == 1:  # the MAR series (2: zero-filled)
                    images[msg.payload.slice] = msg.payload
                continue
            if msg.id == ID_TEXT:
                texts.append(msg.payload)
                continue
            d = decision_from_acquisition(msg.payload)
            assert d.slice == s and d.step == len(lines[s]) - initial
            lines[s].append(d.line)
            stream.send_acquisition(_line(acqs, s, d.line))
    stream.send_close()
    more, more_texts, _ = _drain(stream)
    images.update(more)
    stream.close()
    return lines, images, texts + more_texts


@pytest.mark.parametrize("policy", ["center-out", "equispaced"])
def test_closed_loop_equals_offline(server, subject, policy):
    _, port = server
    header, acqs, kspace = subject
    lines, images, texts = closed_loop(port, header, acqs, {"policy": policy, "initial": 1, "budget": 2})
    assert not texts
    n_pe = kspace.shape[1]
    for s, got in lines.items():
        expected = run_episode(make_policy(policy), n_pe, 1, 2)
        assert got == list(expected)
        mask = torch.zeros(1, n_pe, dtype=torch.bool)
        mask[0, got] = True
        offline = zero_filled(torch.from_numpy(kspace[s : s + 1]), mask)[0].numpy()
        np.testing.assert_allclose(images[s].data[0, 0], offline, rtol=1e-5, atol=1e-6 * offline.max())
        meta = ismrmrd.Meta.deserialize(images[s].attribute_string)
        assert [int(v) for v in meta["MASC.lines"]] == got  # every acquired line, in arrival order


def test_closed_loop_with_mar_equals_offline(subject, mar_ckpt):
    """A client chooses a MAR model by name from the server's models folder; the image is the
    offline MAR image, clamped at 0 (a magnitude image)."""
    from masc_gadget.models.checkpoint import load_mar
    from masc_gadget.serving.models import ModelCache

    config = load_config(CONFIGS / "tiny.yaml", ["gadget.device=cpu", "server.port=0",
                                                 f"models.directory={mar_ckpt.parent}"])
    srv = MascServer(config, address="127.0.0.1", port=0, cache=ModelCache())
    _, port = srv.start()
    header, acqs, kspace = subject
    try:
        lines, images, texts = closed_loop(port, header, acqs, {"policy": "center-out", "initial": 1, "budget": 2,
                                                                 "mar_checkpoint": mar_ckpt.stem, "device": "cpu"})
    finally:
        srv.shutdown()
    assert not texts
    mar, _ = load_mar(mar_ckpt, "cpu")
    for s, got in lines.items():
        mask = torch.zeros(1, kspace.shape[1], dtype=torch.bool)
        mask[0, got] = True
        with torch.no_grad():
            offline = mar(zero_filled(torch.from_numpy(kspace[s : s + 1]), mask))[0].numpy()
        np.testing.assert_allclose(images[s].data[0, 0], np.maximum(offline, 0), rtol=1e-4, atol=1e-5 * offline.max())


def _gadgetron_handshake(sock, config_xml, header):
    """What Gadgetron sends an external module: config (2), header (3)."""
    stream = MrdStream(sock)
    stream.send_config_text(config_xml)
    stream.send_header(header)
    return stream


def test_gadget_through_gadgetron_connection_matches_server(server, subject):
    from gadgetron.external import Connection

    _, port = server
    header, acqs, kspace = subject
    ours, theirs = socket.socketpair()
    # execute mode serves the recommended model; the tiny server has no network: MAR off on both
    config_xml = ('<configuration><property name="policy" value="center-out"/>'
                  '<property name="initial" value="1"/><property name="budget" value="2"/>'
                  '<property name="mar_checkpoint" value=""/>'
                  '<property name="feedback" value="inband"/><property name="device" value="cpu"/></configuration>')
    stream = _gadgetron_handshake(ours, config_xml, header)
    errors = []

    def module():
        try:
            with Connection(theirs) as connection:
                masc(connection)
        except Exception as err:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(err)

    thread = threading.Thread(target=module, daemon=True)
    thread.start()
    n_slices = kspace.shape[0]
    lines, early = {}, {}
    for s in range(n_slices):
        lines[s] = [int(kspace.shape[1] // 2)]
        stream.send_acquisition(_line(acqs, s, lines[s][0]))
        while len(lines[s]) < N_LINES:
            msg = stream.read_message()
            if msg.id == ID_IMAGE:  # an earlier slice's image
                if msg.payload.image_series_index == 1:
                    early[msg.payload.slice] = msg.payload
                continue
            d = decision_from_acquisition(msg.payload)
            lines[s].append(d.line)
            stream.send_acquisition(_line(acqs, s, d.line))
    stream.send_close()
    images, texts, _ = _drain(stream)
    images = {**images, **early}
    thread.join(10)
    assert not errors and not texts
    served_lines, served_images, _ = closed_loop(port, header, acqs, {"policy": "center-out", "initial": 1, "budget": 2})
    assert lines == served_lines
    assert sorted(images) == sorted(served_images)  # every slice came back through Gadgetron's client
    for s in range(n_slices):
        np.testing.assert_array_equal(images[s].data, served_images[s].data)


def test_plain_open_loop_client_gets_one_image_per_slice(server, subject):
    _, port = server
    header, acqs, kspace = subject
    stream = _connect(port)
    stream.send_config_file("default")
    stream.send_header(header)
    for acq in acqs:  # every line of the metal group, no feedback requested
        stream.send_acquisition(acq)
    stream.send_close()
    images, texts, decisions = _drain(stream)
    stream.close()
    assert sorted(images) == list(range(kspace.shape[0])) and not decisions
    # the scanner is the authority: the image uses the lines that arrived, here all of them
    full = np.abs(np.fft.fftshift(np.fft.ifft2(np.fft.ifftshift(kspace, axes=(-2, -1)), norm="ortho"), axes=(-2, -1)))
    for s, image in images.items():
        assert image.data.shape[-2:] == kspace.shape[1:]
        assert image.image_series_index == 1
        np.testing.assert_allclose(image.data[0, 0], full[s], rtol=1e-4, atol=1e-6 * full.max())


def _bad_client(port, actions):
    stream = _connect(port)
    actions(stream)
    images, texts, _ = _drain(stream, timeout=5)
    stream.close()
    return images, texts


@pytest.mark.parametrize("case", ["unknown_id", "truncated", "absurd_length", "wrong_matrix", "nan",
                                  "line_out_of_range", "bad_header", "unknown_config", "no_config"])
def test_malformed_input_gets_an_error_and_the_server_keeps_serving(server, subject, case):
    _, port = server
    header, acqs, kspace = subject
    good_result = {}

    def good():  # a well-behaved client at the same time
        good_result["out"] = closed_loop(port, header, acqs, {"policy": "center-out", "initial": 1, "budget": 2})

    good_thread = threading.Thread(target=good)
    good_thread.start()

    def actions(stream):
        if case == "no_config":
            stream.send_header(header)
            return
        stream.send_config_file("nonexistent" if case == "unknown_config" else "default")
        if case == "bad_header":
            stream.send_header("<ismrmrdHeader><garbage")
            return
        stream.send_header(header)
        acq = _line(acqs, 0, kspace.shape[1] // 2)
        if case == "unknown_id":
            stream.stream_sock = None
            stream._sock.sendall(np.uint16(4321).tobytes())
        elif case == "truncated":
            frame = np.uint16(1008).tobytes() + bytes(100)
            stream._sock.sendall(frame)
            stream._sock.shutdown(socket.SHUT_WR)
        elif case == "absurd_length":
            stream._sock.sendall(np.uint16(5).tobytes() + np.uint32(2**31).tobytes())
        elif case == "wrong_matrix":
            bad = ismrmrd.Acquisition.from_array(np.zeros((1, 7), np.complex64))
            bad.setHead(acq.getHead())
            bad.resize(7, 1)
            stream.send_acquisition(bad)
            stream.send_close()
        elif case == "nan":
            nan = ismrmrd.Acquisition.from_array(np.full((1, kspace.shape[2]), np.nan, np.complex64))
            nan.idx.kspace_encode_step_1 = acq.idx.kspace_encode_step_1
            stream.send_acquisition(nan)
            stream.send_close()
        elif case == "line_out_of_range":
            out = ismrmrd.Acquisition.from_array(acq.data.copy())
            out.idx.kspace_encode_step_1 = 10_000
            stream.send_acquisition(out)
            stream.send_close()

    images, texts = _bad_client(port, actions)
    good_thread.join(30)
    assert texts, f"{case}: no error text came back"
    assert all(t.startswith("MASC error:") for t in texts)
    expected = {
        "unknown_id": "unknown message id 4321",
        "truncated": "truncated",
        "absurd_length": "exceeds",
        "wrong_matrix": "7 samples",
        "nan": "NaN",
        "line_out_of_range": "10000",
        "bad_header": "header",
        "unknown_config": "known configurations: default",
        "no_config": "expected a configuration",
    }[case]
    assert any(expected in t for t in texts), texts
    lines, good_images, good_texts = good_result["out"]
    assert len(good_images) == kspace.shape[0] and not good_texts


def test_settings_from_xml_and_json():
    base = GadgetSettings()
    s = settings_from_xml('<configuration><property name="budget" value="5"/><policy>random</policy></configuration>', base)
    assert s.budget == 5 and s.policy == "random"
    with pytest.raises(ValueError, match="unknown setting 'bogus'"):
        settings_from_xml('<configuration><property name="bogus" value="1"/></configuration>', base)
    with pytest.raises(ValueError, match="feedback"):
        settings_from_json('{"feedback": "smoke"}', base)
    assert settings_from_json('{"initial": 3}', base).initial == 3


def test_settings_defaults_and_checks_come_from_the_config_sections():
    from masc_gadget.acquisition.episode import AcquisitionConfig
    from masc_gadget.serving.settings import GadgetConfig

    s = GadgetSettings()
    assert s.acquisition == AcquisitionConfig() and s.gadget == GadgetConfig()
    assert (s.policy, s.budget) == (AcquisitionConfig.policy, AcquisitionConfig.budget)
    assert s.feedback == GadgetConfig.feedback
    config = load_config(CONFIGS / "tiny.yaml")
    assert GadgetSettings.from_config(config).acquisition is config["acquisition"]
    t = s.updated({"budget": 3, "feedback": "inband"}, "parameters")  # each key to its own section
    assert t.acquisition == AcquisitionConfig(budget=3) and t.gadget == GadgetConfig(feedback="inband")
    assert GadgetSettings(budget=3, feedback="inband") == t
    with pytest.raises(ValueError, match="parameters: budget must be >= 1"):  # the section's own check
        s.updated({"budget": 0}, "parameters")
