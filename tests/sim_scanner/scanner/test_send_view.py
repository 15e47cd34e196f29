"""masc send (an MRD file in open loop, the images back into an MRD file) and masc view (PNG and
DICOM with the images' geometry), against a real masc serve."""

import json

import numpy as np
import pytest

from masc_gadget.cli import main
from masc_gadget.config import load_config
from masc_gadget.serving.server import MascServer
from sim_scanner.dataset.layout import read_manifest, subject_path
from sim_scanner.scanner.send import send_file, write_images
from sim_scanner.scanner.view import direction_letters, read_images, write_dicom, write_png

from tests.conftest import CONFIGS


@pytest.fixture(scope="module")
def stream(tiny_dataset, tmp_path_factory):
    """A tiny subject's metal group as a scanner would have recorded it (every line)."""
    out = tmp_path_factory.mktemp("stream") / "stream.h5"
    subject = subject_path(tiny_dataset, read_manifest(tiny_dataset)["splits"]["test"][0])
    assert main(["simulate", "stream", str(subject), "--out", str(out)]) == 0
    return out


@pytest.fixture
def server(perturbed_mar):
    srv = MascServer(load_config(CONFIGS / "tiny.yaml", ["gadget.device=cpu", f"gadget.mar_checkpoint={perturbed_mar}"]),
                     address="127.0.0.1", port=0)
    _, port = srv.start()
    yield f"127.0.0.1:{port}"
    srv.shutdown()


def test_send_writes_every_returned_image_and_view_draws_and_exports_them(stream, server, tmp_path):
    import h5py
    import pydicom

    result = send_file(stream, server)
    assert result.closed and not result.errors and result.sent > 0
    with h5py.File(stream, "r") as f:
        n_slices = len({int(a["head"]["idx"]["slice"]) for a in f["dataset/data"][:]})
    assert result.by_series() == {1: n_slices, 2: n_slices}
    out = write_images(tmp_path / "out.h5", result.images, result.header)
    images = read_images(out)
    assert [(im.series, im.slice) for im in images] == [(s, k) for s in (1, 2) for k in range(n_slices)]
    first = images[0]
    assert first.meta["MASC.policy"] and first.meta["ImageComments"].startswith("MASC")
    np.testing.assert_allclose(first.pixels, np.abs(result.images[0].data[0, 0]), rtol=1e-6)
    png = write_png(images, tmp_path / "view.png", title="t")
    assert png.stat().st_size > 10_000
    files = write_dicom(images, tmp_path / "dicom")
    assert len(files) == len(images)
    ds = pydicom.dcmread(str(files[0]))
    assert ds.Modality == "MR" and ds.SeriesNumber == 1 and ds.InstanceNumber == 1
    np.testing.assert_allclose([float(v) for v in ds.ImagePositionPatient], first.position, atol=1e-6)
    np.testing.assert_allclose([float(v) for v in ds.ImageOrientationPatient], [*first.read_dir, *first.phase_dir])
    np.testing.assert_allclose([float(v) for v in ds.PixelSpacing], first.pixel_mm, rtol=1e-6)
    restored = ds.pixel_array * float(ds.RescaleSlope) + float(ds.RescaleIntercept)
    np.testing.assert_allclose(restored, first.pixels, atol=first.pixels.max() / 60000)


@pytest.fixture
def fallback_server(perturbed_mar, tmp_path):
    """A server whose network's OOD rule sends every slice to the zero-filled fallback."""
    from training.export import export_checkpoint

    calibrated = tmp_path / "calibrated.pt"
    export_checkpoint(perturbed_mar, calibrated, ood={"score": "residual", "threshold": 1e-9})
    srv = MascServer(load_config(CONFIGS / "tiny.yaml", ["gadget.device=cpu", f"gadget.mar_checkpoint={calibrated}"]),
                     address="127.0.0.1", port=0)
    _, port = srv.start()
    yield f"127.0.0.1:{port}"
    srv.shutdown()


def test_the_commands_and_a_fallback_marked_where_viewers_look(stream, fallback_server, tmp_path, capsys):
    out = tmp_path / "out.h5"
    assert main(["send", str(stream), "--server", fallback_server, "--out", str(out)]) == 0
    assert "images back (series 1:" in capsys.readouterr().out
    assert main(["view", str(out), "--out", str(tmp_path / "v.png"), "--dicom", str(tmp_path / "d")]) == 0
    said = capsys.readouterr().out
    images = read_images(out)
    n = len(images) // 2
    assert f"{len(images)} images ({n} MAR fallback) drawn in" in said and "DICOM files written" in said
    for im in images:  # the MAR series served zero-filled says so in ImageComments and in the DICOM
        if im.series == 1:
            assert im.fallback and im.meta["ImageComments"].startswith("MASC zero-filled, MAR fallback: OOD score")
    import pydicom

    assert pydicom.dcmread(str(tmp_path / "d" / "series1_slice000.dcm")).ImageComments.startswith(
        "MASC zero-filled, MAR fallback")
    with pytest.raises(ValueError, match="no group 'nope'"):
        read_images(out, "nope")
    assert main(["send", str(stream), "--server", "127.0.0.1:1", "--out", str(tmp_path / "x.h5")]) != 0
    assert "cannot connect to 127.0.0.1:1" in capsys.readouterr().err


def test_patient_directions_of_the_image_axes():
    assert direction_letters((1, 0, 0)) == "L" and direction_letters((-1, 0, 0)) == "R"
    assert direction_letters((0, -1, 0)) == "A" and direction_letters((0, 0.6, 0.8)) == "SP"
    assert direction_letters((0, 0, 0)) == ""


def test_a_recorded_scan_replays_in_closed_loop(stream, server, tmp_path, capsys):
    """masc scan --mrd: every line of a recorded file, the gadget's decisions obeyed, the lines sent
    with their recorded headers, the images scored against the file's own fully sampled image."""
    from sim_scanner.dataset.streams import read_mrd_scan_input, read_stream

    data = read_mrd_scan_input(stream)
    _, acquisitions = read_stream(stream, "dataset")
    assert data.kspace.shape[0] * data.kspace.shape[2] == len(acquisitions) == len(data.templates)
    out = tmp_path / "scan"
    assert main(["scan", "--config", str(CONFIGS / "tiny.yaml"), "--mrd", str(stream), "--server", server,
                 "--out", str(out), "--no-progress", "--deadline-ms", "5000"]) == 0
    report = json.loads((out / "report.json").read_text())
    (subject,) = report["subjects"]
    assert subject["reference"] == "fully sampled as recorded" and report["totals"]["fallbacks"] == 0
    assert all(len(sl["lines"]) == 3 and sl["sources"].count("gadget") == 2 for sl in subject["slices"])
    assert all(0 < sl["metrics"]["ssim"] <= 1 for sl in subject["slices"])
    assert main(["scan", "--config", str(CONFIGS / "tiny.yaml"), "--server", server, "--out", str(out)]) == 2
    assert "give --data DIR" in capsys.readouterr().err


def test_a_recording_without_every_line_cannot_be_replayed(stream, tmp_path):
    from sim_scanner.dataset.streams import read_mrd_scan_input, read_stream, write_stream

    header, acquisitions = read_stream(stream, "dataset")
    partial = write_stream(tmp_path / "partial.h5", header, acquisitions[1:])
    with pytest.raises(ValueError, match="lines are not recorded.*needs every line"):
        read_mrd_scan_input(partial)
