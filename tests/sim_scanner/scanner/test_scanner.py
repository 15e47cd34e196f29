"""The simulated scanner (sim_scanner.scanner.session) against a small in-test fake gadget.

The fake speaks the MRD protocol with masc_gadget.mrd.protocol.MrdStream on 127.0.0.1 (port 0),
records what the scanner sent, answers with decisions chosen by the test (in-band or over the
ZeroMQ side channel), returns one zero-filled image per finished slice, and can go silent, answer
nonsense or die mid-scan. The real server / gadget integration is tested elsewhere.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ismrmrd
import numpy as np
import pytest

from masc_gadget.acquisition.episode import initial_lines
from masc_gadget.cli import common_options
from masc_gadget.config import ConfigError, from_dict, load_config
from masc_gadget.acquisition.decision import Decision
from masc_gadget.mrd.feedback import ZmqFeedback, feedback_acquisition, is_feedback
from masc_gadget.mrd.frames import ID_ACQUISITION, ID_CLOSE, ID_CONFIG_FILE, ID_HEADER, ID_TEXT
from masc_gadget.mrd.protocol import MrdStream
from sim_scanner.scanner.config import (
    IMAGE_FROM_GADGET,
    IMAGE_ZERO_FILLED,
    ScannerConfig,
    parse_server,
)
from sim_scanner.scanner.session import run_scan

from tests.conftest import CONFIGS

N_PE = 32  # configs/tiny.yaml: 32 x 32 matrix, 4 slices, 1 initial + 2 budget lines
N_SLICES = 4
CENTRE = int(initial_lines(N_PE, 1)[0])  # 16
CENTER_OUT = [CENTRE, 17, 15]  # the fallback order (center-out) after the initial line
FAST_MS = 2000.0
"""Deadline for tests where the fake answers: generous, since an answer ends the wait at once."""
SHORT_MS = 50.0
"""Deadline for tests where decisions are missing."""

Decide = Callable[[int, int, set[int]], "int | None"]


@dataclass
class Connection:
    """What the fake saw on one connection."""

    config_name: str = ""
    header: str = ""
    params: dict = field(default_factory=dict)
    acquisitions: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    """(slice, line, flags, scan_counter, acquisition_time_stamp) in arrival order."""
    closed_by_client: bool = False


class FakeGadget:
    """A one-connection-at-a-time MRD gadget on a background thread.

    decide(slice, step, acquired_lines) -> line to request (None: stay silent);
    die_after: close the socket abruptly after that many acquisitions on a connection;
    hang_on_close: never answer the scanner's close.
    """

    def __init__(
        self,
        decide: Decide | None = None,
        *,
        die_after: int | None = None,
        hang_on_close: bool = False,
        send_images: bool = True,
    ) -> None:
        self.decide = decide
        self.die_after = die_after
        self.hang_on_close = hang_on_close
        self.send_images = send_images
        self.connections: list[Connection] = []
        self.errors: list[BaseException] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                self._handle(MrdStream(sock))
            except Exception as err:  # noqa: BLE001 - reported by the test
                self.errors.append(err)

    def _handle(self, stream: MrdStream) -> None:
        conn = Connection()
        self.connections.append(conn)
        push: ZmqFeedback | None = None
        received: dict[int, dict[int, np.ndarray]] = {}
        finished: set[int] = set()
        try:
            msg = stream.read_message()
            assert msg.id == ID_CONFIG_FILE, msg.id
            conn.config_name = msg.payload
            msg = stream.read_message()
            assert msg.id == ID_HEADER, msg.id
            conn.header = msg.payload
            while True:
                msg = stream.read_message()
                if msg.id == ID_TEXT:
                    conn.params = json.loads(msg.payload)
                    if conn.params.get("zmq_address"):
                        push = ZmqFeedback(conn.params["zmq_address"])
                    continue
                if msg.id == ID_CLOSE:
                    conn.closed_by_client = True
                    if not self.hang_on_close:
                        stream.send_close()
                    else:
                        time.sleep(1.0)
                    return
                assert msg.id == ID_ACQUISITION, msg.id
                acq = msg.payload
                assert not is_feedback(acq)
                s, line = int(acq.idx.slice), int(acq.idx.kspace_encode_step_1)
                conn.acquisitions.append(
                    (s, line, int(acq.flags), int(acq.scan_counter), int(acq.acquisition_time_stamp))
                )
                if self.die_after is not None and len(conn.acquisitions) >= self.die_after:
                    return  # die: the finally below closes the socket without a close message
                lines = received.setdefault(s, {})
                lines[line] = np.array(acq.data[0])
                initial, budget = conn.params["initial"], conn.params["budget"]
                step = len(lines) - initial
                if 0 <= step < budget and self.decide is not None:
                    choice = self.decide(s, step, set(lines))
                    if choice is not None:
                        decision = Decision(slice=s, line=choice, step=step, latency_us=123)
                        if conn.params.get("feedback") == "inband":
                            stream.send_acquisition(feedback_acquisition(decision, acq))
                        if push is not None:
                            push.send(decision)
                if len(lines) == initial + budget and s not in finished and self.send_images:
                    finished.add(s)
                    stream.send_image(_zero_filled_image(s, lines))
        finally:
            if push is not None:
                push.close()
            stream.close()


def _zero_filled_image(s: int, lines: dict[int, np.ndarray]) -> ismrmrd.Image:
    kspace = np.zeros((N_PE, len(next(iter(lines.values())))), dtype=np.complex64)
    for line, data in lines.items():
        kspace[line] = data
    img = np.fft.fftshift(np.fft.ifft2(np.fft.ifftshift(kspace), norm="ortho"))
    image = ismrmrd.Image.from_array(np.abs(img).astype(np.float32))
    image.slice = s
    return image


@pytest.fixture
def gadgets():
    made: list[FakeGadget] = []

    def make(*args, **kwargs) -> FakeGadget:
        gadget = FakeGadget(*args, **kwargs)
        made.append(gadget)
        return gadget

    yield make
    for gadget in made:
        gadget.close()
        assert not gadget.errors, gadget.errors


@pytest.fixture(scope="module")
def config():
    return load_config(CONFIGS / "tiny.yaml")


def scan(config, data, out, gadget: FakeGadget, split="test", **scanner):
    scfg = ScannerConfig(server=gadget.server, **scanner)
    return run_scan(config, data, split, out, scanner=scfg, progress=False)


def fixed_order(order: list[int]) -> Decide:
    """A gadget that asks for ``order[step]`` in every slice."""
    return lambda s, step, acquired: order[step]


def check_flags(conn: Connection, n_slices: int, per_slice: int) -> None:
    seen: dict[int, int] = {}
    for k, (s, _line, flags, counter, stamp) in enumerate(conn.acquisitions):
        count = seen[s] = seen.get(s, 0) + 1
        head = ismrmrd.AcquisitionHeader()
        head.flags = flags
        assert counter == k
        assert bool(head.flags & (1 << (ismrmrd.ACQ_FIRST_IN_SLICE - 1))) == (count == 1)
        assert bool(head.flags & (1 << (ismrmrd.ACQ_LAST_IN_SLICE - 1))) == (count == per_slice)
        last = k == len(conn.acquisitions) - 1
        assert bool(head.flags & (1 << (ismrmrd.ACQ_LAST_IN_MEASUREMENT - 1))) == last
        if k:
            assert stamp > conn.acquisitions[k - 1][4]
    assert seen == {s: per_slice for s in range(n_slices)}


# ------------------------------------------------------------------------------------------ tests


def test_gadget_decisions_are_obeyed(config, tiny_dataset, tmp_path, gadgets):
    gadget = gadgets(fixed_order([3, 28]))
    report = scan(config, tiny_dataset, tmp_path, gadget, split="train", deadline_ms=FAST_MS)

    assert len(gadget.connections) == 2  # one connection per subject
    for conn in gadget.connections:
        assert conn.config_name == "default"
        assert "ismrmrdHeader" in conn.header
        # no policy unless asked for (scanner.policy): the server serves its operator's
        assert conn.params == {"feedback": "inband", "zmq_address": "", "initial": 1, "budget": 2}
        assert conn.closed_by_client
        check_flags(conn, N_SLICES, 3)
        assert [a[0] for a in conn.acquisitions] == [s for s in range(N_SLICES) for _ in range(3)]
    for sub in report.subjects:
        assert sub.connection == "ok" and sub.server_closed and not sub.gadget_errors
        assert sub.images_returned == N_SLICES
        for rep in sub.slices:
            assert rep.lines == [CENTRE, 3, 28]
            assert rep.sources == ["initial", "gadget", "gadget"]
            assert rep.fallback_reasons == [None, None]
            assert rep.from_gadget == 2 and rep.fallbacks == rep.misses == rep.invalid == 0
            assert all(0 <= v < FAST_MS for v in rep.latencies_ms)
            assert rep.gadget_latencies_ms == [0.123, 0.123]
            assert rep.image_source == IMAGE_FROM_GADGET
            assert rep.image_latency_ms is not None and rep.image_latency_ms >= 0
            # the fake returns the zero-filled image of the lines it got: same as the scanner's
            assert rep.metrics == pytest.approx(rep.zero_filled_metrics, rel=1e-4, abs=1e-5)
            assert set(rep.metrics) == {"ssim", "psnr", "mse", "nmse", "mae"}
            assert 0 < rep.metrics["ssim"] < 1

    t = report.totals
    assert (t.subjects, t.slices, t.lines) == (2, 8, 24)
    assert (t.from_gadget, t.fallbacks, t.misses, t.invalid) == (16, 0, 0, 0)
    assert t.latency_ms.count == 16 and t.latency_ms.p50 <= t.latency_ms.p90 <= t.latency_ms.max
    assert t.images_from_gadget == 8 and t.images_zero_filled == 0
    assert t.image_latency_ms.count == 8 and 0 <= t.image_latency_ms.p50 <= t.image_latency_ms.max

    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["totals"]["from_gadget"] == 16
    assert saved["subjects"][0]["slices"][0]["sources"] == ["initial", "gadget", "gadget"]
    assert saved["totals"]["latency_ms"]["p99"] is not None
    for sub in report.subjects:
        dset = ismrmrd.Dataset(str(tmp_path / "images.h5"), sub.subject, create_if_needed=False)
        try:
            assert dset.number_of_images("images") == N_SLICES
            assert [dset.read_image("images", i).slice for i in range(N_SLICES)] == [0, 1, 2, 3]
        finally:
            dset.close()
    assert "decisions from gadget: 16" in report.summary()
    assert "last line to image ms: p50" in report.summary()


def test_silent_gadget_falls_back_on_every_step(config, tiny_dataset, tmp_path, gadgets):
    gadget = gadgets(None, hang_on_close=True)
    started = time.perf_counter()
    report = scan(config, tiny_dataset, tmp_path, gadget, deadline_ms=SHORT_MS, close_timeout_s=0.3)
    elapsed = time.perf_counter() - started

    (sub,) = report.subjects
    for rep in sub.slices:
        assert rep.lines == CENTER_OUT
        assert rep.sources == ["initial", "fallback", "fallback"]
        assert rep.fallback_reasons == ["miss", "miss"]
        assert rep.misses == 2 and rep.from_gadget == 0 and rep.latencies_ms == [None, None]
        assert rep.image_source == IMAGE_FROM_GADGET  # images still come back
    assert report.totals.misses == 8 and report.totals.fallbacks == 8
    assert report.totals.latency_ms.count == 0
    # a gadget that never answers the close is given up on, and said so
    assert not sub.server_closed
    assert any("did not close" in e for e in sub.gadget_errors)
    check_flags(gadget.connections[0], N_SLICES, 3)
    assert elapsed < 8 * SHORT_MS / 1e3 + 0.3 + 3.0


def test_late_decisions_are_misses_and_counted_late(config, tiny_dataset, tmp_path, gadgets):
    def slow(s, step, acquired):
        time.sleep(3 * SHORT_MS / 1e3)
        return 3 if step == 0 else 28

    gadget = gadgets(slow)
    report = scan(config, tiny_dataset, tmp_path, gadget, deadline_ms=SHORT_MS, max_slices=1)
    (sub,) = report.subjects
    (rep,) = sub.slices
    assert rep.lines == CENTER_OUT and rep.fallback_reasons == ["miss", "miss"]
    assert sub.late_decisions == 2  # they came, after the deadline
    assert all(v >= 2.5 * SHORT_MS for v in sub.late_latencies_ms)
    assert report.totals.latency_ms.count == 2 and report.totals.latency_ms.p50 >= 2.5 * SHORT_MS


def test_invalid_decisions_fall_back(config, tiny_dataset, tmp_path, gadgets):
    # step 0 asks for the (already acquired) centre line, step 1 for a line out of range
    gadget = gadgets(fixed_order([CENTRE, N_PE + 5]))
    report = scan(config, tiny_dataset, tmp_path, gadget, deadline_ms=FAST_MS)
    (sub,) = report.subjects
    for rep in sub.slices:
        assert rep.lines == CENTER_OUT
        assert rep.sources == ["initial", "fallback", "fallback"]
        assert rep.fallback_reasons == ["invalid", "invalid"]
        assert rep.invalid == 2 and rep.misses == 0
        assert all(v is not None for v in rep.latencies_ms)  # they did arrive, in time
    assert report.totals.invalid == 8


def test_gadget_dying_mid_scan_is_survived(config, tiny_dataset, tmp_path, gadgets):
    gadget = gadgets(fixed_order([3, 28]), die_after=5)  # dies on slice 1's first chosen line
    report = scan(config, tiny_dataset, tmp_path, gadget, deadline_ms=FAST_MS)

    (sub,) = report.subjects
    assert sub.connection == "lost" and "closed the connection" in sub.connection_error
    assert sub.connection_lost_at == 5  # the first line acquired without the gadget
    assert len(gadget.connections[0].acquisitions) == 5
    assert sub.slices[0].lines == [CENTRE, 3, 28]  # obeyed while alive
    assert sub.slices[0].image_source == IMAGE_FROM_GADGET
    for rep in sub.slices:
        assert len(rep.lines) == 3 and len(set(rep.lines)) == 3  # full budget, nothing repeated
    for rep in sub.slices[1:]:
        assert rep.image_source == IMAGE_ZERO_FILLED
        assert rep.metrics == rep.zero_filled_metrics and 0 < rep.metrics["ssim"] < 1
    for rep in sub.slices[2:]:
        assert rep.lines == CENTER_OUT and rep.fallback_reasons == ["disconnected"] * 2
    # a disconnection is not a deadline miss
    assert sub.misses == 0 and sub.fallbacks >= 5
    assert report.totals.connections_lost == 1
    assert report.totals.images_zero_filled == 3
    dset = ismrmrd.Dataset(str(tmp_path / "images.h5"), sub.subject, create_if_needed=False)
    try:
        assert dset.number_of_images("images") == 1
        assert dset.number_of_images("scanner_zero_filled") == 3
    finally:
        dset.close()


def test_open_loop_streams_without_waiting(config, tiny_dataset, tmp_path, gadgets):
    # the fake would answer, but an open-loop scanner neither asks nor waits
    gadget = gadgets(fixed_order([3, 28]))
    started = time.perf_counter()
    report = scan(config, tiny_dataset, tmp_path, gadget, feedback="none", deadline_ms=5000.0)
    assert time.perf_counter() - started < 5.0  # one wait would take 5 s

    conn = gadget.connections[0]
    assert conn.params["feedback"] == "none" and conn.params["zmq_address"] == ""
    assert [a[1] for a in conn.acquisitions] == CENTER_OUT * N_SLICES
    (sub,) = report.subjects
    for rep in sub.slices:
        assert rep.lines == CENTER_OUT
        assert rep.fallback_reasons == ["open-loop", "open-loop"] and rep.misses == 0
        assert rep.image_source == IMAGE_FROM_GADGET


def test_interleaved_acquires_all_initial_lines_first(config, tiny_dataset, tmp_path, gadgets):
    gadget = gadgets(fixed_order([3, 28]))
    report = scan(config, tiny_dataset, tmp_path, gadget, interleave=True, deadline_ms=FAST_MS)
    conn = gadget.connections[0]
    order = [(s, line) for s, line, *_ in conn.acquisitions]
    assert order[:N_SLICES] == [(s, CENTRE) for s in range(N_SLICES)]
    assert order[N_SLICES : 2 * N_SLICES] == [(s, 3) for s in range(N_SLICES)]
    assert order[2 * N_SLICES :] == [(s, 28) for s in range(N_SLICES)]
    check_flags(conn, N_SLICES, 3)
    for rep in report.subjects[0].slices:
        assert rep.sources == ["initial", "gadget", "gadget"]


def test_zmq_side_channel(config, tiny_dataset, tmp_path, gadgets):
    gadget = gadgets(fixed_order([5, 30]))
    report = scan(config, tiny_dataset, tmp_path, gadget, feedback="zmq",
                  zmq_address="tcp://127.0.0.1:*", deadline_ms=FAST_MS)
    conn = gadget.connections[0]
    assert conn.params["feedback"] == "none"  # no in-band feedback ...
    assert conn.params["zmq_address"].startswith("tcp://127.0.0.1:")  # ... but the bound endpoint
    (sub,) = report.subjects
    for rep in sub.slices:
        assert rep.lines == [CENTRE, 5, 30]
        assert rep.sources == ["initial", "gadget", "gadget"]
    assert report.totals.from_gadget == 8


def test_gadget_not_running_is_a_clear_error(config, tiny_dataset, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    scfg = ScannerConfig(server=f"127.0.0.1:{port}", connect_timeout_s=1.0)
    with pytest.raises(ConnectionError, match=rf"cannot connect to gadget at 127.0.0.1:{port}: "
                       r".*\(is masc serve running\?\)"):
        run_scan(config, tiny_dataset, "test", tmp_path, scanner=scfg, progress=False)


def test_scanner_config_validation():
    assert parse_server("localhost:9002") == ("localhost", 9002)
    assert parse_server("[::1]:9002") == ("::1", 9002)
    for kwargs, message in [
        ({"server": "localhost"}, "HOST:PORT"),
        ({"server": "h:99999"}, "HOST:PORT"),
        ({"feedback": "carrier-pigeon"}, "feedback must be one of"),
        ({"deadline_ms": 0.0}, "deadline_ms must be"),
        ({"fallback": "random"}, "deterministic"),
        ({"fallback": "nope"}, "unknown policy"),
        ({"zmq_address": "127.0.0.1:9003"}, "ZeroMQ endpoint"),
        ({"max_slices": -1}, "max_slices"),
        ({"config_name": ""}, "config_name"),
    ]:
        with pytest.raises(ValueError, match=message):
            ScannerConfig(**kwargs)
    with pytest.raises(ConfigError, match="scanner.feedback"):
        from_dict(ScannerConfig, {"feedback": "loud"}, "scanner")


def test_scan_command(config, tiny_dataset, tmp_path, gadgets, capsys):
    from sim_scanner.scanner import cli as scan_cli

    gadget = gadgets(fixed_order([3, 28]))
    parser = argparse.ArgumentParser(prog="masc")
    scan_cli.register(parser.add_subparsers(dest="command"), common_options())
    args = parser.parse_args([
        "scan", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset),
        "--split", "test", "--server", gadget.server, "--feedback", "inband", "--deadline-ms", "2000",
        "--fallback", "equispaced", "--out", str(tmp_path / "scan"), "--interleave",
        "--max-slices", "2", "--no-progress",
    ])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "decisions from gadget: 4" in out and "report.json" in out
    saved = json.loads((tmp_path / "scan" / "report.json").read_text())
    assert saved["scanner"]["fallback"] == "equispaced" and saved["scanner"]["interleave"] is True
    assert saved["totals"]["slices"] == 2
    assert [a[0] for a in gadget.connections[0].acquisitions] == [0, 1, 0, 1, 0, 1]


def test_config_xml_is_sent_as_the_configuration_script(tmp_path):
    import socket as _socket

    from masc_gadget.mrd.frames import ID_CONFIG_TEXT, ID_HEADER, ID_TEXT
    from masc_gadget.mrd.protocol import MrdStream
    from sim_scanner.scanner.link import DecisionBoard, GadgetLink
    from sim_scanner.scanner.session import read_config_xml

    xml = '<configuration><property name="policy" value="equispaced"/></configuration>'
    path = tmp_path / "stream.xml"
    path.write_text(xml)
    scfg = ScannerConfig(config_xml=str(path))
    assert read_config_xml(scfg) == xml and read_config_xml(ScannerConfig()) == ""
    with pytest.raises(ValueError, match="is not a file"):
        read_config_xml(ScannerConfig(config_xml=str(tmp_path / "missing.xml")))
    ours, theirs = _socket.socketpair()
    link = GadgetLink(ours, "inband", DecisionBoard(), [])
    assert link.handshake("ignored", "<ismrmrdHeader/>", {"feedback": "inband"}, config_xml=xml)
    gadget = MrdStream(theirs)
    first, second, third = (gadget.read_message() for _ in range(3))
    assert (first.id, first.payload.rstrip("\x00")) == (ID_CONFIG_TEXT, xml)
    assert second.id == ID_HEADER and third.id == ID_TEXT
    ours.close()
    theirs.close()
