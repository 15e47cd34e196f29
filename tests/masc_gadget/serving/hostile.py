"""Helpers of the hostile-client tests: synthetic headers and lines, a live server, clients."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import ismrmrd
import numpy as np

from masc_gadget.config import load_config
from masc_gadget.mrd.frames import ID_CLOSE, ID_ERROR, ID_IMAGE, ID_TEXT, ConnectionClosed
from masc_gadget.mrd.protocol import MrdStream
from masc_gadget.serving.models import ModelCache
from masc_gadget.serving.server import MascServer, serve_connect_mode

from tests.conftest import CONFIGS

N_PE = N_RO = 16
LINES = (7, 8, 9)  # tiny.yaml: 1 initial + 2 chosen; open loop uses every line sent

CACHE = ModelCache()


def header_xml(n_pe: int = N_PE, n_ro: int = N_RO, slices: int | None = 2) -> str:
    """A minimal ISMRMRD header: ``n_pe`` x ``n_ro``, ``slices`` in its encoding limits (None:
    no slice limit)."""
    limits = "<encodingLimits/>" if slices is None else (
        "<encodingLimits><kspace_encoding_step_1><minimum>0</minimum>"
        f"<maximum>{n_pe - 1}</maximum><center>{n_pe // 2}</center></kspace_encoding_step_1>"
        f"<slice><minimum>0</minimum><maximum>{slices - 1}</maximum><center>0</center></slice>"
        "</encodingLimits>")
    return ('<?xml version="1.0"?><ismrmrdHeader xmlns="http://www.ismrm.org/ISMRMRD">'
            "<experimentalConditions><H1resonanceFrequency_Hz>63500000</H1resonanceFrequency_Hz>"
            f"</experimentalConditions><encoding><encodedSpace><matrixSize><x>{n_ro}</x><y>{n_pe}</y>"
            "<z>1</z></matrixSize><fieldOfView_mm><x>200</x><y>200</y><z>5</z></fieldOfView_mm>"
            f"</encodedSpace><reconSpace><matrixSize><x>{n_ro}</x><y>{n_pe}</y><z>1</z></matrixSize>"
            "<fieldOfView_mm><x>200</x><y>200</y><z>5</z></fieldOfView_mm></reconSpace>"
            f"{limits}<trajectory>cartesian</trajectory></encoding></ismrmrdHeader>")


def line(slice_index: int, pe: int, seed: int = 0, n_ro: int = N_RO) -> ismrmrd.Acquisition:
    """One synthetic single-channel line (seeded complex data)."""
    rng = np.random.default_rng([seed, slice_index, pe])
    data = (rng.standard_normal((1, n_ro)) + 1j * rng.standard_normal((1, n_ro))).astype(np.complex64)
    acq = ismrmrd.Acquisition.from_array(data)
    acq.idx.slice = slice_index
    acq.idx.kspace_encode_step_1 = pe
    return acq


@contextlib.contextmanager
def running_server(*overrides: str, host: str = "127.0.0.1", folders=None):
    """A live ``masc serve`` on a free port with the tiny config and ``server.x=...`` overrides."""
    config = load_config(CONFIGS / "tiny.yaml", ["gadget.device=cpu", "server.port=0", *overrides])
    server = MascServer(config, address=host, port=0, config_folders=folders, cache=CACHE)
    _, port = server.start()
    try:
        yield server, port
    finally:
        server.shutdown()


def listening_port(proc) -> int:
    """The port a server started as a subprocess (``stderr=PIPE, text=True``) logs it listens on."""
    import re

    for _ in range(200):
        found = re.search(r"listening on 127\.0\.0\.1:(\d+)", proc.stderr.readline())
        if found:
            return int(found.group(1))
    raise AssertionError("the server never logged that it listens")


def connect(port: int, timeout: float = 10.0) -> MrdStream:
    return MrdStream(socket.create_connection(("127.0.0.1", port), timeout=timeout))


def open_scan(port: int, *lines: tuple[int, int], script: str | None = None) -> MrdStream:
    """A connection through its handshake (configuration ``default`` by name, or ``script`` as a
    configuration script as Gadgetron sends it; the header) that then sent ``lines`` (slice, PE)."""
    stream = connect(port)
    if script is None:
        stream.send_config_file("default")
    else:
        stream.send_config_text(script)
    stream.send_header(header_xml())
    for slice_index, pe in lines:
        stream.send_acquisition(line(slice_index, pe))
    return stream


def drain(stream: MrdStream, timeout: float = 10.0) -> tuple[dict, list[str], list[int]]:
    """Read until the server closes: (images by slice, texts and error messages, ids in order of
    arrival)."""
    images, texts, ids = {}, [], []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            msg = stream.read_message()
        except (ConnectionClosed, OSError, ValueError):
            break
        ids.append(msg.id)
        if msg.id == ID_IMAGE:
            images[msg.payload.slice] = msg.payload
        elif msg.id in (ID_TEXT, ID_ERROR):
            texts.append(msg.payload)
        elif msg.id == ID_CLOSE:
            break
    return images, texts, ids


def good_scan(port: int, params: dict | None = None, slices: int = 2, config: str = "default",
              timeout: float = 10.0) -> tuple[dict, list[str]]:
    """A well-behaved open-loop client: lines 7, 8, 9 of each slice, close; (images, texts)."""
    def send(stream):
        stream.send_config_file(config)
        stream.send_header(header_xml(slices=slices))
        if params is not None:
            stream.send_text(json.dumps(params))
        for s in range(slices):
            for pe in LINES:
                stream.send_acquisition(line(s, pe))
        stream.send_close()

    images, texts, _ = errors_of(port, send, timeout)
    return images, texts


def assert_serves(port: int, **kwargs) -> None:
    """The server still answers a good client: one image per slice, no error. A connection the
    server has just refused may hold its slot for a moment after the client read the refusal
    (it lingers until the client's close arrives), so a "server busy" answer is retried for up
    to 2 s; any other error fails at once."""
    deadline = time.monotonic() + 2.0
    while True:
        images, texts = good_scan(port, **kwargs)
        if not (texts and all("server busy" in t for t in texts) and time.monotonic() < deadline):
            break
        time.sleep(0.05)
    assert not texts, texts
    assert sorted(images) == [0, 1]


def errors_of(port: int, send, timeout: float = 10.0) -> tuple[dict, list[str], list[int]]:
    """Connect, let ``send(stream)`` misbehave, then read what comes back."""
    stream = connect(port, timeout)
    try:
        try:
            send(stream)
        except OSError:  # the server already gave up on this client: read why
            pass
        return drain(stream, timeout)
    finally:
        stream.close()


@contextlib.contextmanager
def connect_mode(*overrides: str):
    """Gadgetron's connect mode (the gadgetron dialect of the same listener) on a free port."""
    config = load_config(CONFIGS / "tiny.yaml", ["gadget.device=cpu", *overrides])
    stop, ready = threading.Event(), []
    thread = threading.Thread(target=serve_connect_mode, args=(config, 0, "127.0.0.1", CACHE, stop, ready.append),
                              daemon=True)
    thread.start()
    for _ in range(400):
        if ready:
            break
        time.sleep(0.025)
    assert ready, "connect mode never listened"
    try:
        yield ready[0], stop
    finally:
        stop.set()
        thread.join(10)


def gadgetron_stream(port: int, config: str = "<configuration/>", header: str | None = None,
                     lines=LINES, slices: int = 2, close: bool = True) -> tuple[dict, list[str], list[int]]:
    """What Gadgetron sends a connect-mode module: its stream configuration, the header, lines;
    what comes back (:func:`drain`)."""
    stream = connect(port)
    try:
        stream.send_config_text(config)
        stream.send_header(header or header_xml(slices=slices))
        for s in range(slices):
            for pe in lines:
                stream.send_acquisition(line(s, pe))
        if close:
            stream.send_close()
        return drain(stream)
    except OSError:
        return drain(stream)
    finally:
        stream.close()


def threads_named(prefix: str) -> int:
    return sum(t.name.startswith(prefix) and t.is_alive() for t in threading.enumerate())


def settle(predicate, seconds: float = 10.0) -> bool:
    """Whether ``predicate()`` holds within ``seconds`` (polled; returns as soon as it does: a
    loaded machine only makes it wait longer)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
