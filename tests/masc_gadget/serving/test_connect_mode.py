"""Gadgetron's connect mode: one module process serves many streams at once, warmed up before
its port opens, with TCP_NODELAY on every stream; Gadgetron's side is played by real sockets."""

import copy
import socket
import threading

import h5py
import ismrmrd
import pytest

from masc_gadget.acquisition.policies import make_policy, run_episode
from masc_gadget.mrd.feedback import decision_from_acquisition
from masc_gadget.mrd.frames import ID_ACQUISITION, ID_CLOSE, ID_IMAGE, ConnectionClosed
from masc_gadget.mrd.protocol import MrdStream
from masc_gadget.config import load_config
from masc_gadget.serving import gadget, server
from masc_gadget.serving.connection import Connection
from masc_gadget.serving.gadget import GadgetSettings
from masc_gadget.serving.server import serve_connect_mode
from masc_gadget.serving.host import Host
from masc_gadget.serving.models import ModelCache
from sim_scanner.dataset.layout import read_manifest, subject_path

CONFIG = ('<configuration><property name="policy" value="center-out"/>'
          '<property name="initial" value="1"/><property name="budget" value="2"/>'
          '<property name="feedback" value="inband"/><property name="device" value="cpu"/>'
          '</configuration>')


@pytest.fixture(scope="module")
def subject(tiny_dataset):
    path = subject_path(tiny_dataset, read_manifest(tiny_dataset)["splits"]["test"][0])
    dset = ismrmrd.Dataset(str(path), "metal", create_if_needed=False)
    header = dset.read_xml_header()
    acqs = {(a.idx.slice, a.idx.kspace_encode_step_1): a
            for a in (dset.read_acquisition(i) for i in range(dset.number_of_acquisitions()))}
    dset.close()
    with h5py.File(path, "r") as f:
        n_slices, n_pe = f["kspace/metal"].shape[:2]
    return (header.decode() if isinstance(header, bytes) else header), acqs, n_slices, n_pe


@pytest.fixture
def module(monkeypatch):
    """The connect-mode module on a free port; yields (port, events it logged)."""
    warmed = []
    real = server.warm_up
    monkeypatch.setattr(server, "warm_up", lambda *a, **k: warmed.append(real(*a, **k)))
    stop, ready = threading.Event(), []
    thread = threading.Thread(
        target=serve_connect_mode, daemon=True,
        args=(load_config(None, ["gadget.device=cpu"]), 0, "127.0.0.1", ModelCache(), stop, ready.append))
    thread.start()
    for _ in range(200):
        if ready:
            break
        threading.Event().wait(0.05)
    assert ready, "the module never started listening"
    assert warmed, "the port opened before the models were warmed up"
    yield ready[0]
    stop.set()
    thread.join(5)


def _stream(port, subject, results, key):
    """What Gadgetron does for one stream: config, header, then the lines the gadget asks for."""
    header, acqs, n_slices, n_pe = subject
    stream = MrdStream(socket.create_connection(("127.0.0.1", port), timeout=20))
    stream.send_config_text(CONFIG)
    stream.send_header(header)
    lines, images = {}, {}
    for s in range(n_slices):
        lines[s] = [n_pe // 2]
        stream.send_acquisition(acqs[(s, n_pe // 2)])
        while len(lines[s]) < 3:
            msg = stream.read_message()
            if msg.id == ID_IMAGE:
                images[msg.payload.slice] = msg.payload
            elif msg.id == ID_ACQUISITION:
                lines[s].append(decision_from_acquisition(msg.payload).line)
                stream.send_acquisition(acqs[(s, lines[s][-1])])
    stream.send_close()
    while True:
        try:
            msg = stream.read_message()
        except ConnectionClosed:
            break
        if msg.id == ID_IMAGE:
            images[msg.payload.slice] = msg.payload
        elif msg.id == ID_CLOSE:
            break
    stream.close()
    results[key] = (lines, images)


def test_connect_mode_serves_concurrent_streams(module, subject):
    results = {}
    threads = [threading.Thread(target=_stream, args=(module, subject, results, k)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1, 2]
    _, _, n_slices, n_pe = subject
    expected = run_episode(make_policy("center-out"), n_pe, 1, 2).tolist()
    for lines, images in results.values():
        assert all(got == expected for got in lines.values())
        assert sorted(images) == list(range(n_slices))
    # a later stream is served too: the module does not exit after its first stream
    _stream(module, subject, results, "later")
    assert results["later"][0] == results[0][0]


def test_streams_get_tcp_nodelay_and_quick_acks(module, subject, monkeypatch):
    seen = []
    real = Connection.run

    def spy(connection):
        sock = connection.stream.sock
        seen.append((sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), connection.stream.quick_ack))
        real(connection)

    monkeypatch.setattr(Connection, "run", spy)
    results = {}
    _stream(module, subject, results, 0)
    assert seen and all(nodelay and quick for nodelay, quick in seen)


def test_lines_beyond_the_header_slice_limit_are_rejected_inside_gadgetron_too(subject):
    """Through Gadgetron no server checks the stream: the gadget's own stages refuse a slice
    index beyond the header's limit, and keep the other slices."""
    from masc_gadget.mrd.header import parse_header, slice_limit
    from masc_gadget.serving.gadget import process

    header, acqs, n_slices, n_pe = subject
    parsed = parse_header(header)
    assert slice_limit(parsed) == n_slices
    rogue = copy.deepcopy(acqs[(0, n_pe // 2)])
    rogue.idx.slice = n_slices + 100
    errors, sent = [], []
    stream = [acqs[(0, k)] for k in range(n_pe)] + [rogue]
    stats = process(iter(stream), parsed, GadgetSettings(device="cpu"), sent.append, on_error=errors.append,
                    host=Host(cache=ModelCache()))
    assert stats["rejected"] == 1 and f"slice {n_slices + 100}" in errors[0] and "slice limit" in errors[0]
    # the slice's MAR series and its zero-filled series
    assert [(im.slice, im.image_series_index) for im in sent if isinstance(im, ismrmrd.Image)] == [(0, 1), (0, 2)]


def test_message_1028_feedback_is_refused_through_gadgetron():
    from masc_gadget.config import ConfigError

    class Stream:
        config = '<configuration><property name="feedback" value="fire"/></configuration>'
        header = None

    with pytest.raises(ConfigError, match="feedback fire .* is for masc serve"):
        gadget.masc(Stream())
