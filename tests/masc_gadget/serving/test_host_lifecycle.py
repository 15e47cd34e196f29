"""One host for every entry point: memory held within its limits, nothing lost at shutdown, a soak
of good and hostile clients, errors that name the problem, and the metrics an operator scrapes (real
sockets, loopback only)."""

from __future__ import annotations

import socket
import struct
import threading
import time
import tracemalloc

import ismrmrd
import numpy as np
import pytest

from masc_gadget.config import ConfigError
from masc_gadget.device import resolve_device
from masc_gadget.mrd.frames import Limits
from masc_gadget.mrd.header import parse_header
from masc_gadget.mrd.frames import ID_CLOSE, ID_ERROR, ID_IMAGE, ID_TEXT, frame_text, ConnectionClosed
from masc_gadget.mrd.protocol import MrdStream
from masc_gadget.serving.host import Host, MemoryBudget, ServerConfig
from masc_gadget.serving.settings import GadgetSettings, parameters_json, settings_from_xml
from masc_gadget.serving.stages import process

from tests.conftest import CONFIGS
from tests.masc_gadget.serving.hostile import (CACHE, LINES, N_PE, N_RO, assert_serves, connect, connect_mode, drain,
                                               errors_of, gadgetron_stream, good_scan, header_xml, line,
                                               listening_port, open_scan, running_server, settle, threads_named)


# ------------------------------------------------------------------------------ memory

def test_an_image_message_is_refused_at_its_id():
    """Regression: an image (1022) announcing 256 MiB as a first message was allocated before
    any of its bytes arrived; no client ever sends an image."""
    head = ismrmrd.ImageHeader()
    head.matrix_size[:] = (8192, 8192, 1)
    head.channels = 1
    head.data_type = ismrmrd.DATATYPE_CXFLOAT
    with running_server() as (_, port):
        stream = connect(port)
        stream.send_frame(struct.pack("<H", ID_IMAGE) + bytes(head))
        _, texts, ids = drain(stream, timeout=5)
        stream.close()
        assert ids == [ID_TEXT, ID_CLOSE] and "message 1022 (image) is not accepted here" in texts[0]
        assert_serves(port)


def test_an_announced_length_costs_memory_only_as_its_bytes_arrive():
    a, b = socket.socketpair()
    with a, b:
        stream = MrdStream(b, limits=Limits(max_text_bytes=64 << 20))
        a.sendall(frame_text(b"x" * (64 << 20))[:4096])
        a.shutdown(socket.SHUT_WR)
        tracemalloc.start()
        with pytest.raises(ConnectionClosed, match="truncated frame"):
            stream.read_message()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 4 << 20  # the announced 64 MiB was never allocated


def test_handshake_texts_are_capped_before_authentication():
    with running_server("server.max_handshake_bytes=4096", "server.token=s3cret") as (_, port):
        _, texts, _ = errors_of(port, lambda s: (s.send_config_text("<configuration>" + " " * 8000
                                                                    + "</configuration>")))
        assert texts and "config text: length" in texts[0] and "exceeds the limit 4096" in texts[0]
        images, texts = good_scan(port, params={"token": "s3cret"})
        assert sorted(images) == [0, 1] and not texts


def test_the_memory_budget_covers_all_connections():
    """Regression: max_kspace_bytes bounded one connection; 32 of them could hold 128 GiB."""
    one_slice = 1 * N_PE * N_RO * 8  # coils x matrix x 8 bytes, counted as the slice opens
    with running_server(f"server.memory_budget_bytes={2 * one_slice + 100}") as (server, port):
        holder = open_scan(port, (0, 8), (1, 8))
        assert settle(lambda: server.host.budget.used == 2 * one_slice)
        images, texts = good_scan(port)
        assert not images and "memory budget for all scans (4.1 KiB, server.memory_budget_bytes)" in texts[0]
        holder.send_close()
        images, texts, _ = drain(holder)
        holder.close()
        assert sorted(images) == [0, 1] and not texts  # the first scan went on
        assert settle(lambda: server.host.budget.used == 0)
        assert_serves(port)


def test_a_scan_holds_what_it_sent_lines_for_and_keeps_its_open_slices_when_refused():
    """Regression (serving round 4, item 1): the budget was reserved at the first line for every
    slice the header announced (two idle connections locked everyone out); now a slice counts
    from its first line, and a slice beyond the limit ends the scan after the open slices'
    images."""
    one_slice = N_PE * N_RO * 8
    header = header_xml(slices=256)  # announces 256 slices: 512 KiB that nobody has sent
    with running_server(f"server.max_kspace_bytes={2 * one_slice}") as (server, port):
        stream = connect(port)
        stream.send_config_file("default")
        stream.send_header(header)
        for slice_index in (0, 1):
            stream.send_acquisition(line(slice_index, 8))
        assert settle(lambda: server.host.budget.used == 2 * one_slice)
        stream.send_acquisition(line(2, 8))  # a third open slice: over the scan's limit
        images, texts, _ = drain(stream)
        stream.close()
        assert sorted(images) == [0, 1]  # nothing acquired is lost
        assert "slice 2's k-space (1 coils x 16 x 16 samples, 2.0 KiB) beside the 4.0 KiB this scan holds " \
               "exceeds this server's limit of 4.0 KiB per scan (server.max_kspace_bytes)" in texts[-1]
        assert settle(lambda: server.host.budget.used == 0)
        assert_serves(port)


class _PeakBudget(MemoryBudget):
    """A budget that remembers the most it held."""

    peak = 0

    def reserve(self, nbytes):
        ok = super().reserve(nbytes)
        self.peak = max(self.peak, self.used)
        return ok


def _ended_every_line(n_lines, n=N_PE):
    """Slice 0 ended with every line (legal: a later line of the slice starts a new episode)."""
    for i in range(n_lines):
        acq = line(0, n // 2 - 1 + i % 3, seed=i, n_ro=n)
        acq.setFlag(ismrmrd.ACQ_LAST_IN_SLICE)
        yield acq


def test_finished_slices_queue_within_the_reservation_and_the_reader_waits():
    """Regression (serving round 4, item 1): slices ended by ACQ_LAST_IN_SLICE queued without
    bound for the image worker, each with its whole k-space, outside every limit."""
    from masc_gadget.serving.stages import MAX_QUEUED_SLICES

    n = 64
    one_slice = n * n * 8
    budget = _PeakBudget(10**9)
    host = Host(cache=CACHE, budget=budget)
    sent = []

    def slow_send(item):
        time.sleep(0.01)  # the image worker is slower than the client
        sent.append(type(item))  # the type only: the test holds no image

    settings = GadgetSettings(device="cpu", initial=1, budget=2)
    process(_ended_every_line(2, n), parse_header(header_xml(n, n)), settings, lambda item: None, host=host,
            background_images=True)  # imports and first-call allocations, before measuring
    tracemalloc.start()
    try:
        stats = process(_ended_every_line(40, n), parse_header(header_xml(n, n)),
                        GadgetSettings(device="cpu", initial=1, budget=2), slow_send, host=host, background_images=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # every slice's image, and its zero-filled one (series 2)
    assert stats["images"] == 40 and sent.count(ismrmrd.Image) == 80
    assert budget.peak <= (MAX_QUEUED_SLICES + 1) * one_slice  # counted, and bounded
    assert peak < 12 * one_slice  # held: 40 queued slices would be 1.25 MiB
    assert budget.used == 0


def test_nothing_is_computed_for_a_client_that_has_gone():
    calls = []

    def gone(item):
        calls.append(item)
        raise BrokenPipeError("the client closed its socket")

    host = Host(cache=CACHE, budget=MemoryBudget(10**9))
    with pytest.raises(BrokenPipeError):
        process(_ended_every_line(20), parse_header(header_xml()), GadgetSettings(device="cpu", initial=1, budget=2),
                gone, host=host, background_images=True)
    assert len(calls) == 1 and host.budget.used == 0  # one failed send; the queued slices were dropped


def test_memory_budget_reserve_and_release():
    budget = MemoryBudget(100)
    assert budget.reserve(60) and not budget.reserve(50) and budget.used == 60
    budget.release(60)
    assert budget.reserve(100)


# ------------------------------------------------------------------------------ data loss

def test_shutdown_mid_scan_sends_the_open_slices_then_names_itself():
    """Regression: on SIGTERM the open slices were computed but not sent, and the client got a
    normal close."""
    with running_server() as (server, port):
        stream = open_scan(port, *((0, pe) for pe in LINES[:2]))
        assert settle(lambda: server.host.budget.used > 0)  # its lines are in: slice 0 is open
        server.shutdown(timeout=5)
        images, texts, ids = drain(stream)
        stream.close()
    assert sorted(images) == [0] and ids[-2:] == [ID_TEXT, ID_CLOSE]
    assert "the server is shutting down: the open slices were sent" in texts[-1]


def test_with_no_time_left_the_slices_are_served_zero_filled_and_say_so(perturbed_mar):
    """Serving round 4, item 2: past half of server.shutdown_s a shutdown serves the slices
    still to finish zero-filled (no MAR pass), named in MASC.mar."""
    hurry = threading.Event()
    hurry.set()
    sent = []
    settings = GadgetSettings(device="cpu", initial=1, budget=2, mar_checkpoint=str(perturbed_mar))
    for background in (False, True):
        sent.clear()
        process(iter([line(0, pe) for pe in LINES] + [line(1, pe) for pe in LINES]), parse_header(header_xml()),
                settings, sent.append, host=Host(cache=CACHE), hurry=hurry, background_images=background)
        series1 = [im for im in sent if isinstance(im, ismrmrd.Image) and im.image_series_index == 1]
        assert sorted(im.slice for im in series1) == [0, 1]
        for im in series1:
            meta = ismrmrd.Meta.deserialize(im.attribute_string)
            assert meta["MASC.mar"] == "none (no time left for the network: the server is shutting down: served " \
                                       "zero-filled)"


def test_a_shutdown_sends_every_open_and_queued_slice_then_names_itself(perturbed_mar, monkeypatch):
    """Regression (serving round 4, item 2): with background workers a SIGTERM lost slices (11
    of 32) and ended with a plain close. Here the network takes 0.3 s a slice (8 slices: 2.4 s)
    and the shutdown 1 s."""
    from masc_gadget.acquisition.engine import AcquisitionEngine

    finish = AcquisitionEngine.finish_detached

    def slow_network(self, detached, hurried=""):
        if not hurried:
            time.sleep(0.3)
        return finish(self, detached, hurried)

    monkeypatch.setattr(AcquisitionEngine, "finish_detached", slow_network)
    with running_server(f"gadget.mar_checkpoint={perturbed_mar}", "server.shutdown_s=1") as (server, port):
        stream = connect(port)
        stream.send_config_file("default")
        stream.send_header(header_xml(slices=8))
        for slice_index in range(8):
            for pe in LINES[:2]:
                stream.send_acquisition(line(slice_index, pe))
        assert settle(lambda: server.host.budget.used == 8 * N_PE * N_RO * 8)  # 8 slices open
        t0 = time.monotonic()
        server.shutdown()
        took = time.monotonic() - t0
        images, texts, ids = drain(stream)
        stream.close()
    assert sorted(images) == list(range(8)) and ids[-2:] == [ID_TEXT, ID_CLOSE]
    assert "the server is shutting down" in texts[-1] and took < 2.0


def test_connect_mode_stop_sends_the_open_slices_then_an_error():
    with connect_mode() as (port, stop):
        stream = open_scan(port, *((0, pe) for pe in LINES[:2]), script="<configuration/>")
        time.sleep(0.3)
        stop.set()
        images, texts, ids = drain(stream)
        stream.close()
    assert sorted(images) == [0] and ids.count(ID_IMAGE) == 2 and ids[-2:] == [ID_ERROR, ID_CLOSE]
    assert "shutting down" in texts[-1]


def _run(items, header=None):
    sent, errors = [], []
    stats = process(iter(items), parse_header(header or header_xml()), GadgetSettings(device="cpu", initial=1, budget=2),
                    sent.append, on_error=errors.append, host=Host(cache=CACHE))
    return [im for im in sent if isinstance(im, ismrmrd.Image)], errors, stats


def test_a_rejected_first_line_does_not_fix_the_coil_set():
    """Regression: a rejected first line (here 2 channels, too many samples) fixed the scan's
    coils, and every valid line after it was refused."""
    bad = ismrmrd.Acquisition.from_array(np.ones((2, 4 * N_RO), np.complex64))
    bad.idx.kspace_encode_step_1 = 8
    images, errors, stats = _run([bad, *(line(0, pe) for pe in LINES)])
    assert stats["rejected"] == 1 and "samples" in errors[0]
    assert stats["acquisitions"] == len(LINES) and len(images) == 2


def test_two_coils_at_1e20_give_the_image_not_zeros():
    def two_coils(scale):
        out = []
        for pe in LINES:
            acq = line(0, pe)
            data = np.concatenate([acq.data, 0.5 * acq.data]) * np.complex64(scale)
            two = ismrmrd.Acquisition.from_array(data.astype(np.complex64))
            two.idx.kspace_encode_step_1 = pe
            out.append(two)
        return out

    reference, _, _ = _run(two_coils(1.0))
    images, errors, _ = _run(two_coils(1e20))
    zero_filled = [im for im in images if im.image_series_index == 2][0].data
    expected = [im for im in reference if im.image_series_index == 2][0].data * 1e20
    assert not errors and zero_filled.max() > 0
    np.testing.assert_allclose(zero_filled, expected, rtol=1e-4, atol=1e-4 * expected.max())


# ------------------------------------------------------------------------------ clear errors

def test_zero_active_channels_is_named():
    empty = ismrmrd.Acquisition()
    empty.resize(number_of_samples=N_RO, active_channels=0)
    empty.idx.kspace_encode_step_1 = 8
    images, errors, stats = _run([empty, *(line(0, pe) for pe in LINES)])
    assert "no receive channel (active_channels 0)" in errors[0] and len(images) == 2


def test_a_number_of_thousands_of_digits_is_named():
    with pytest.raises(ConfigError, match="thousands of digits"):
        parameters_json('{"budget": 1' + "0" * 5000 + "}")
    with pytest.raises(ConfigError, match="configuration.budget: must be an integer"):
        settings_from_xml(f'<configuration><property name="budget" value="1{"0" * 4000}"/></configuration>',
                          GadgetSettings())


def test_a_device_index_is_reported_as_written():
    with pytest.raises(ValueError, match="'cuda:9999'"):
        resolve_device("cuda:9999")


def test_connect_mode_says_why_it_refuses_fire_feedback():
    config = '<configuration><property name="feedback" value="fire"/></configuration>'
    with connect_mode() as (port, _):
        _, texts, ids = gadgetron_stream(port, config=config, lines=())
        assert ids == [ID_ERROR, ID_CLOSE] and "feedback fire (message 1028) is for masc serve" in texts[0]


def test_server_config_checks_its_new_limits():
    for key in ("max_connections_per_peer", "max_pending_per_peer", "max_handshake_bytes", "memory_budget_bytes"):
        with pytest.raises(ValueError, match=key):
            ServerConfig(**{key: 0})
    with pytest.raises(ValueError, match="reclaim_idle_s"):
        ServerConfig(reclaim_idle_s=0)


# ------------------------------------------------------------------------------ soak

def test_soak_good_and_hostile_clients_leave_nothing_behind():
    """A short soak: rounds of good scans beside hostile ones (idle, cut mid-frame, oversized,
    wrong ids); afterwards no thread, slot or byte of the memory budget is left held."""
    with running_server("server.reclaim_idle_s=0.5") as (server, port):
        baseline = threads_named("masc-127.0.0.1")
        for round_ in range(3):
            hostile = [connect(port) for _ in range(3)]
            hostile[0].send_frame(struct.pack("<HI", 3, 1 << 30))  # a header of 1 GiB announced
            hostile[1].send_frame(struct.pack("<H", 1028))
            hostile[2].send_config_file("default")
            results = {}
            threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, good_scan(port)))
                       for k in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert all(sorted(images) == [0, 1] and not texts for images, texts in results.values()), round_
            for stream in hostile:
                stream.close()
        assert settle(lambda: threads_named("masc-127.0.0.1") == baseline, 5)
        assert server.host.budget.used == 0 and not server._slots and not server._pending


def test_a_port_out_of_range_is_a_one_line_error():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "masc_gadget.cli", "serve", "--port", "70000"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "a port is a number from 0 (any free port) to 65535, got '70000'" in done.stderr
    assert len(done.stderr.strip().splitlines()[-1]) < 120  # a one-line error after the usage


def test_connect_mode_on_sigterm_sends_the_open_slices_and_exits():
    """Regression: connect mode died at once on SIGTERM, losing the open slices."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "masc_gadget.serving.gadget", "0", "--config",
                             str(CONFIGS / "tiny.yaml")], stderr=subprocess.PIPE, text=True)
    try:
        port = listening_port(proc)
        stream = open_scan(port, *((0, pe) for pe in LINES[:2]),
                           script='<configuration><property name="device" value="cpu"/></configuration>')
        time.sleep(0.5)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        images, texts, ids = drain(stream)
        stream.close()
        assert proc.wait(timeout=10) == 0 and time.monotonic() - start < 5
        assert sorted(images) == [0] and ids.count(ID_IMAGE) == 2 and ids[-2:] == [ID_ERROR, ID_CLOSE]
        assert "shutting down" in texts[-1]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


# ------------------------------------------------------------------------------ metrics

def _scrape(port: int, path: str = "/metrics") -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return response.read().decode()


def _value(text: str, name: str) -> float:
    for row in text.splitlines():
        if row.startswith(name + " "):
            return float(row.split()[-1])
    raise AssertionError(f"{name} not in the scrape")


def test_an_operator_scrapes_the_metrics_while_scans_run():
    """Serving round 4, item 6: health and Prometheus metrics on an operator port, each host its
    own registry, no label from a header."""
    pytest.importorskip("prometheus_client")
    with running_server("server.metrics_port=0") as (server, port):
        metrics_port = server.metrics_server.port
        assert metrics_port in server.host.own_ports
        holder = open_scan(port, (0, 8))
        assert settle(lambda: '"scans_open": 1' in _scrape(metrics_port, "/health"))
        images, texts = good_scan(port)
        assert sorted(images) == [0, 1] and not texts
        bad = line(0, 8, n_ro=2 * N_RO)  # more samples than the matrix: rejected
        _, texts, _ = errors_of(port, lambda s: (s.send_config_file("default"), s.send_header(header_xml()),
                                                 s.send_acquisition(bad)))
        text = _scrape(metrics_port)
        assert _value(text, "masc_scans_open") == 1.0 and _value(text, "masc_scans_total") >= 2
        assert _value(text, "masc_decisions_total") >= 2 and _value(text, "masc_decision_seconds_count") >= 2
        assert _value(text, 'masc_images_total{served="zero_filled"}') == 2.0  # tiny serves no network
        assert _value(text, 'masc_rejections_total{reason="samples"}') == 1.0
        assert _value(text, "masc_memory_budget_used_bytes") == N_PE * N_RO * 8  # the holder's slice
        assert "MASC" not in text.replace("masc_", "")  # no header or protocol text in a label
        holder.send_close()
        drain(holder)
        holder.close()
        assert settle(lambda: _value(_scrape(metrics_port), "masc_scans_open") == 0.0)
    other = Host()
    other.metrics.scan_started()
    assert server.host.metrics.registry is not other.metrics.registry  # one registry per host


def test_the_metrics_port_names_the_extra_it_needs(monkeypatch):
    from masc_gadget.serving import metrics

    monkeypatch.setattr(metrics, "available", lambda: False)
    off = metrics.Metrics()
    off.decided(3, 0.1)  # counts nothing, fails nothing
    assert off.exposition() == b"" and not off.enabled
    with pytest.raises(RuntimeError, match=r"pip install 'masc\[metrics\]'"):
        metrics.MetricsServer(off)
