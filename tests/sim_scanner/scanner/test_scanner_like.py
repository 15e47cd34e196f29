"""masc scan sends what scanners send (readout oversampling, receive arrays with correlated noise,
asymmetric echoes, channel-mask styles), open and closed loop against masc serve, and masc simulate
stream writes such streams for the stock clients."""

import subprocess
import sys

import ismrmrd
import numpy as np
import pytest

from masc_gadget.acquisition.policies import make_policy, run_episode
from masc_gadget.mrd.header import encoding_geometry

from tests.sim_scanner.scanner.serve import scan_against_serve

STYLES = {
    "2x oversampling": ["scanner.readout_oversampling=2"],
    "8 coils, correlated noise": ["scanner.coils=8", "scanner.noise=0.0001", "scanner.noise_correlation=0.4"],
    "asymmetric echo, mask of channel 0": ["scanner.readout_oversampling=2", "scanner.asymmetric_echo=0.15",
                                           "scanner.coils=2", "scanner.channel_mask=first"],
}


@pytest.mark.parametrize("feedback", ["inband", "none"])
@pytest.mark.parametrize("style", list(STYLES))
def test_masc_scan_sends_scanner_like_streams(tiny_dataset, tmp_path, style, feedback):
    report, scan_config = scan_against_serve(
        tiny_dataset, tmp_path / "scan", scan=[f"scanner.feedback={feedback}", "acquisition.policy=equispaced", "scanner.policy=equispaced",
                                               *STYLES[style]])
    acq = scan_config["acquisition"]
    assert report.totals.fallbacks == (0 if feedback == "inband" else report.totals.fallbacks)
    assert report.totals.connections_lost == 0
    expected = list(run_episode(make_policy("equispaced"), 32, acq.initial, acq.budget))
    exact = style == "2x oversampling"  # no noise, no samples left out: the simulator's own image
    for subject in report.subjects:
        assert not subject.gadget_errors
        for sl in subject.slices:
            if feedback == "inband":
                assert sl.lines == expected  # closed loop: the gadget chose, in the scanner's numbering
            assert sl.image_source == "gadget"
            assert sl.image_lines == sl.lines  # the image says it holds every line sent
            # the gadget's image is on the simulator's grid (oversampling removed): with one coil and
            # every sample, the scanner's zero-filled image of the same lines; an array combines the
            # coils' undersampled images (RSS), the echo loses samples: near it, not equal (their exact
            # maths is checked against a numpy reference in tests/masc_gadget/serving/test_recon_space.py)
            if exact:
                assert sl.metrics["ssim"] == pytest.approx(sl.zero_filled_metrics["ssim"], abs=2e-3)
                assert sl.metrics["nmse"] == pytest.approx(sl.zero_filled_metrics["nmse"], abs=1e-4)
            else:
                assert 0 < sl.metrics["nmse"] < 1.5 * sl.zero_filled_metrics["nmse"]


def test_masc_simulate_stream_writes_what_the_stock_clients_send(tiny_dataset, tmp_path):
    subject = sorted((tiny_dataset / "test").glob("*.h5"))[0]
    out = tmp_path / "stream.h5"
    rc = subprocess.run([sys.executable, "-m", "masc_gadget.cli", "simulate", "stream", str(subject), "--out", str(out),
                         "--oversampling", "2", "--coils", "4", "--noise", "0.001", "--order", "centric",
                         "--partial-fourier", "0.75"], capture_output=True, text=True, timeout=120)
    assert rc.returncode == 0, rc.stderr
    dataset = ismrmrd.Dataset(str(out), "dataset", create_if_needed=False)
    try:
        header = dataset.read_xml_header()
        acqs = [dataset.read_acquisition(i) for i in range(dataset.number_of_acquisitions())]
    finally:
        dataset.close()
    geometry = encoding_geometry(header.decode() if isinstance(header, bytes) else header)
    assert (geometry.n_readout, geometry.grid_readout, geometry.readout_ratio) == (64, 32, 2.0)
    first_slice = [a for a in acqs if a.idx.slice == 0]
    lines = [int(a.idx.kspace_encode_step_1) for a in first_slice]
    assert len(lines) == 24 and lines[0] == 16 and min(lines) == 8  # centric, the top 3/4 of 32 lines
    assert first_slice[-1].is_flag_set(ismrmrd.ACQ_LAST_IN_SLICE)
    assert all(a.data.shape == (4, 64) for a in acqs)


@pytest.mark.parametrize("order", ["linear", "reverse", "centric", "interleaved"])
def test_a_stream_file_in_any_order_over_the_wire(tiny_dataset, tmp_path, order):
    """A scanner-like file (2x oversampling, 4 correlated coils, asymmetric echo) sent as a plain
    MRD client sends it, open loop, to a real masc serve socket: one image per slice, each the
    in-process gadget's image of the same stream, whatever the line order."""
    from masc_gadget.config import load_config
    from masc_gadget.mrd.header import parse_header
    from masc_gadget.serving.gadget import GadgetSettings, process
    from masc_gadget.serving.host import Host
    from masc_gadget.serving.models import ModelCache
    from masc_gadget.serving.server import MascServer
    from sim_scanner.dataset.streams import StreamStyle, read_stream, scanner_like
    from sim_scanner.scanner.config import ScannerConfig
    from sim_scanner.scanner.link import DecisionBoard, GadgetLink
    from tests.conftest import CONFIGS

    subject = sorted((tiny_dataset / "test").glob("*.h5"))[0]
    header_xml, acqs = scanner_like(*read_stream(subject, "metal"), StreamStyle(
        readout_oversampling=2, coils=4, noise=1e-3, noise_correlation=0.3, order=order, asymmetric_echo=0.1),
        np.random.default_rng(3))
    server = MascServer(load_config(CONFIGS / "tiny.yaml", ["gadget.device=cpu"]), address="127.0.0.1", port=0)
    _, port = server.start()
    errors = []
    try:
        link = GadgetLink.connect(ScannerConfig(server=f"127.0.0.1:{port}", feedback="none"), DecisionBoard(), errors)
        assert link.handshake("default", header_xml, {"feedback": "none", "zmq_address": "", "policy": "center-out"})
        for acq in acqs:
            assert link.send_acquisition(acq)
        link.finish(30.0)
    finally:
        server.shutdown()
    assert errors == [] and not link.lost_reason
    got = sorted((im for im in link.images if im.image_series_index == 1), key=lambda im: im.slice)
    offline = []
    process(iter(acqs), parse_header(header_xml), GadgetSettings(policy="center-out", device="cpu"),
            offline.append, host=Host(cache=ModelCache()))
    offline = sorted((im for im in offline if isinstance(im, ismrmrd.Image) and im.image_series_index == 1),
                     key=lambda im: im.slice)
    assert len(got) == len(offline) == len({a.idx.slice for a in acqs})
    for a, b in zip(got, offline):
        assert a.data.shape[-2:] == (32, 32) and tuple(a.matrix_size) == (32, 32, 1)
        np.testing.assert_allclose(a.data, b.data, rtol=1e-5, atol=1e-6)


def test_masc_scan_open_loop_in_a_scanners_line_order(tiny_dataset, tmp_path):
    """feedback none with scanner.order: each slice's planned lines go out in that order (the
    centre late for linear / reverse), a 4-coil sensitivity combine rejects none, and every order
    gives the image of the same lines."""
    from masc_gadget.acquisition.episode import initial_lines
    from sim_scanner.dataset.streams import line_order

    ssim = {}
    for order in ("", "linear", "reverse", "centric", "interleaved"):
        report, scan_config = scan_against_serve(
            tiny_dataset, tmp_path / (order or "default"), gadget=["gadget.coil_combine=sensitivity"],
            scan=["scanner.feedback=none", "scanner.coils=4", "acquisition.initial=2", "acquisition.budget=6",
                  *([f"scanner.order={order}"] if order else [])])
        acq = scan_config["acquisition"]
        planned = [int(x) for x in run_episode(make_policy("center-out"), 32, acq.initial, acq.budget)]
        for subject in report.subjects:
            assert not subject.gadget_errors
            for sl in subject.slices:
                assert sl.lines == (line_order(32, order, planned) if order else planned)
                assert sl.image_source == "gadget" and sorted(sl.image_lines) == sorted(planned)
                ssim[order, subject.subject, sl.slice] = sl.metrics["ssim"]
    assert list(initial_lines(32, 2)) == planned[:2]
    for (order, subject, s), value in ssim.items():
        assert value == pytest.approx(ssim["", subject, s], abs=1e-6), order


def test_a_line_order_is_refused_in_closed_loop_and_out_of_range_styles_are_named():
    from sim_scanner.scanner.config import ScannerConfig

    with pytest.raises(ValueError, match="order linear is for open-loop scans .* the gadget decides the order"):
        ScannerConfig(feedback="inband", order="linear")
    with pytest.raises(ValueError, match="order must be one of linear, reverse, centric, interleaved"):
        ScannerConfig(feedback="none", order="spiral")
    with pytest.raises(ValueError, match="readout_oversampling must be 1 or 2"):
        ScannerConfig(readout_oversampling=3)
    with pytest.raises(ValueError, match="asymmetric_echo must be in"):
        ScannerConfig(asymmetric_echo=0.7)
