"""masc scan against a real masc serve: closed loop equals offline; killing the server mid-scan."""

import os
import signal
import socket
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from masc_gadget.acquisition.episode import AcquisitionConfig
from masc_gadget.config import load_config
from masc_gadget.acquisition.policies import make_policy, run_episode
from masc_gadget.serving.server import MascServer
from sim_scanner.dataset.layout import read_manifest, subject_path
from sim_scanner.scanner.config import ScannerConfig
from sim_scanner.scanner.session import run_scan, scan_subject

from tests.conftest import CONFIGS, free_port


def _start_serve(port, *extra):
    """``masc serve`` on the tiny config as a real process; returns once it accepts connections."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "masc_gadget.cli", "serve", "--config", str(CONFIGS / "tiny.yaml"),
         "--port", str(port), "--set", "gadget.device=cpu", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("masc serve did not start: " + proc.stdout.read().decode())
            time.sleep(0.1)


@pytest.mark.parametrize("interleave, feedback", [(False, "inband"), (True, "inband"), (False, "fire")])
def test_masc_scan_closed_loop_equals_offline(tiny_dataset, tmp_path, interleave, feedback):
    config = load_config(CONFIGS / "tiny.yaml", ["gadget.device=cpu"])
    server = MascServer(config, address="127.0.0.1", port=0)
    _, port = server.start()
    try:
        scan_config = load_config(CONFIGS / "tiny.yaml", [
            f"scanner.server=127.0.0.1:{port}", f"scanner.feedback={feedback}", "scanner.deadline_ms=2000",
            f"scanner.interleave={str(interleave).lower()}", "acquisition.policy=equispaced", "scanner.policy=equispaced",
        ])
        report = run_scan(scan_config, tiny_dataset, "test", tmp_path / "scan", progress=False)
    finally:
        server.shutdown()
    acq = scan_config["acquisition"]
    assert report.totals.fallbacks == 0 and report.totals.connections_lost == 0
    expected = list(run_episode(make_policy("equispaced"), 32, acq.initial, acq.budget))
    for subject in report.subjects:
        for sl in subject.slices:
            assert sl.lines == expected  # the gadget chose exactly what the offline policy chooses
            assert sl.sources == ["initial"] * acq.initial + ["gadget"] * acq.budget
            assert sl.image_source == "gadget"
            # the returned image is the zero-filled image of these lines (MAR off)
            assert sl.metrics["ssim"] == pytest.approx(sl.zero_filled_metrics["ssim"], abs=1e-5)
    assert (tmp_path / "scan" / "report.json").is_file() and (tmp_path / "scan" / "images.h5").is_file()
    assert (tmp_path / "scan" / "scan.png").stat().st_size > 10_000  # the first subject's lines and images


def test_killing_the_server_mid_scan_completes_on_fallback(tiny_dataset, tmp_path):
    port = free_port()
    proc = _start_serve(port, "--log-level", "WARNING")
    try:
        manifest = read_manifest(tiny_dataset)
        sid = manifest["splits"]["test"][0]
        scfg = ScannerConfig(server=f"127.0.0.1:{port}", feedback="inband", deadline_ms=5000.0,
                             close_timeout_s=2.0)
        acq = AcquisitionConfig(initial=1, budget=2)

        def kill_after_first_slice(slice_index):
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)

        report = scan_subject(subject_path(tiny_dataset, sid), sid, scfg, acq,
                              on_slice_done=kill_after_first_slice)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    assert report.connection == "lost"
    assert report.fallbacks > 0
    with h5py.File(subject_path(tiny_dataset, sid), "r") as f:
        n_slices = f["kspace/metal"].shape[0]
    assert len(report.slices) == n_slices
    for sl in report.slices:  # every slice still has its full budget, nothing lost
        assert len(sl.lines) == len(set(sl.lines)) == acq.initial + acq.budget
        assert sl.metrics and np.isfinite(sl.metrics["ssim"])
    assert report.slices[0].sources.count("gadget") == acq.budget
    assert any(sl.image_source == "scanner zero-filled" for sl in report.slices)


def test_sigterm_stops_the_server_cleanly(tmp_path):
    port = free_port()
    proc = _start_serve(port)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        out = proc.stdout.read().decode()
        assert "shutting down" in out and "MASC server stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_masc_scan_sends_the_token_a_server_requires(tiny_dataset, tmp_path):
    config = load_config(CONFIGS / "tiny.yaml", ["gadget.device=cpu", "server.token=sesame"])
    server = MascServer(config, address="127.0.0.1", port=0)
    _, port = server.start()
    try:
        scan = [f"scanner.server=127.0.0.1:{port}", "scanner.deadline_ms=2000", "scanner.max_subjects=1"]
        with_token = run_scan(load_config(CONFIGS / "tiny.yaml", [*scan, "scanner.token=sesame"]),
                              tiny_dataset, "test", tmp_path / "ok", progress=False)
        without = run_scan(load_config(CONFIGS / "tiny.yaml", scan), tiny_dataset, "test", tmp_path / "no",
                           progress=False)
    finally:
        server.shutdown()
    assert with_token.totals.fallbacks == 0 and with_token.totals.gadget_errors == 0
    assert without.totals.from_gadget == 0 and without.totals.images_zero_filled == without.totals.slices
    assert any("authentication required" in e for s in without.subjects for e in s.gadget_errors)


def test_masc_scan_fails_when_the_gadget_refused_what_it_asked(tiny_dataset, tmp_path, capsys):
    """Regression: a misspelt policy ran the whole scan on the fallback order and exited 0."""
    from masc_gadget.cli import main

    server = MascServer(load_config(CONFIGS / "tiny.yaml", ["gadget.device=cpu"]), address="127.0.0.1", port=0)
    _, port = server.start()
    try:
        code = main(["scan", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset), "--server",
                     f"127.0.0.1:{port}", "--out", str(tmp_path / "scan"), "--no-progress",
                     "--policy", "mascc"])
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert code == 1 and "the gadget reported" in err and "unknown policy 'mascc'" in err
    assert (tmp_path / "scan" / "report.json").is_file() and (tmp_path / "scan" / "images.h5").is_file()
