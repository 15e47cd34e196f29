"""Per-subject scanner and positioning variation in simulated datasets: defaults change
nothing, drawn values reach the images, the subject files and the ISMRMRD headers, and
datasets written before the ``variation`` section still read and resume."""

from __future__ import annotations

import json
import math

import h5py
import ismrmrd
import ismrmrd.xsd
import numpy as np
import pytest

from masc_gadget.config import load_config
from sim_scanner.dataset import simulate
from sim_scanner.dataset.layout import (
    read_manifest,
    read_scan_input,
    read_subject,
    same_simulation,
    write_manifest,
)
from sim_scanner.dataset.simulate import assign_splits, simulate_dataset, simulate_subject
from sim_scanner.physics.sequence import GAMMA_BAR_HZ_PER_T

from tests.conftest import CONFIGS

STRONG = [
    "variation.fov_shift_mm=[30, 20]", "variation.rotation_deg=15", "variation.slab_offset_jitter_mm=9",
    "variation.b0_t=[1.5, 3.0]", "variation.bandwidth_scale=[0.8, 2.0]", "variation.snr=[15, 40]",
    "variation.coil_shading=0.8", "variation.stem_materials=[cocr, titanium, stainless_steel]",
    "variation.head_materials=[cocr, ceramic]",
]
WHOLE_BODY = ["sequence.fov_centre=pelvis", "sequence.fov_mm=[480, 480]", "sequence.matrix=[48, 48]"]
"""The whole body in the FOV (10 mm pixels), centred where the patient turns."""


def _tiny(*overrides: str):
    return load_config(CONFIGS / "tiny.yaml", list(overrides))


def _orientation_deg(mask: np.ndarray) -> float:
    """Angle of the major axis of a [slice, y, x] mask's in-plane second moments, +x to +y."""
    _, y, x = np.nonzero(mask)
    y, x = y - y.mean(), x - x.mean()
    return math.degrees(0.5 * math.atan2(2 * (x * y).mean(), (x * x).mean() - (y * y).mean()))


def _centroid_px(mask: np.ndarray) -> np.ndarray:
    """(y, x) centroid in pixels of a [slice, y, x] mask."""
    _, y, x = np.nonzero(mask)
    return np.array([y.mean(), x.mean()])


def _body(images: np.ndarray) -> np.ndarray:
    return images > 0.15 * np.percentile(images, 99)


@pytest.fixture(scope="module")
def varied_dataset(tmp_path_factory):
    """Two tiny subjects with every variation on (one worker)."""
    out = tmp_path_factory.mktemp("varied") / "data"
    config = _tiny("dataset.subjects=2", "dataset.split_fractions=[0.5, 0.5, 0.0]", *STRONG)
    simulate_dataset(config, out, progress=False)
    return out, config


# -- defaults ----------------------------------------------------------------------------------


def test_default_variation_changes_nothing(tiny_config, monkeypatch):
    reference = simulate_subject(1, tiny_config)
    # options that name the configured values, and a different variation stream, change no bit
    explicit = _tiny("variation.b0_t=[3.0]", "variation.bandwidth_scale=[1, 1]",
                     "variation.stem_materials=[cocr]", "variation.snr=[0, 0]")
    draw = simulate.draw_variation
    monkeypatch.setattr(simulate, "draw_variation",
                        lambda cfg, seq, phys, icfg, rng: draw(cfg, seq, phys, icfg, np.random.default_rng(99)))
    other = simulate_subject(1, explicit)
    for name in ("kspace_metal", "kspace_clean", "implant_mask", "field_map_hz"):
        np.testing.assert_array_equal(getattr(other, name), getattr(reference, name))
    assert other.fov_centre_mm == reference.fov_centre_mm
    assert other.slice_centres_mm == reference.slice_centres_mm
    assert reference.scanner["rotation_deg"] == 0.0 and reference.scanner["sequence"]["b0_t"] == 3.0


def test_variation_leaves_the_anatomy_and_implant_alone(tiny_config):
    plain = simulate_subject(2, tiny_config)
    varied = simulate_subject(2, _tiny(*STRONG))
    assert varied.anatomy == plain.anatomy
    keep = {k: v for k, v in varied.implant.items() if k not in ("materials", "chi_ppm")}
    assert keep == {k: v for k, v in plain.implant.items() if k not in ("materials", "chi_ppm")}
    assert varied.implant["materials"]["stem"] == varied.scanner["stem_material"]


# -- drawn values in the files -----------------------------------------------------------------


def test_drawn_values_round_trip_and_reach_the_mrd_headers(varied_dataset):
    out, config = varied_dataset
    manifest = read_manifest(out)
    assert manifest["config"]["variation"]["rotation_deg"] == 15.0
    records = []
    for path in sorted(out.glob("*/*.h5")):
        sub = read_subject(path, ())
        sc = sub.scanner
        records.append(sc)
        index = int(path.stem.split("-")[1])
        assert sc == json.loads(json.dumps(simulate_subject(index, config).scanner))
        assert abs(sc["rotation_deg"]) <= 15 and all(abs(s) <= m for s, m in zip(sc["fov_shift_mm"], (30, 20)))
        assert sc["b0_t"] in (1.5, 3.0) and 0.8 <= sc["bandwidth_scale"] <= 2.0 and 15 <= sc["snr"] <= 40
        assert sc["slab_offset_mm"] == pytest.approx(config["sequence"].slab_offset_mm + sc["slab_offset_jitter_mm"])
        seq = sub.sequence
        assert (seq.b0_t, seq.readout_bw_hz_per_px, seq.rf_bw_hz) == (
            sc["b0_t"], sc["readout_bw_hz_per_px"], sc["rf_bw_hz"])
        assert sub.attrs["sequence.b0_t"] == sc["b0_t"] and sub.attrs["physics.snr"] == sc["snr"]
        assert sub.attrs["implant.stem_material"] == sc["stem_material"]
        assert read_scan_input(path).seq == seq
        for group in ("metal", "clean"):
            dset = ismrmrd.Dataset(str(path), group, create_if_needed=False)
            try:
                header = ismrmrd.xsd.CreateFromDocument(dset.read_xml_header())
                acq = dset.read_acquisition(0)
            finally:
                dset.close()
            assert header.acquisitionSystemInformation.systemFieldStrength_T == pytest.approx(sc["b0_t"])
            assert header.experimentalConditions.H1resonanceFrequency_Hz == round(GAMMA_BAR_HZ_PER_T * sc["b0_t"])
            doubles = {p.name: p.value for p in header.userParameters.userParameterDouble}
            assert doubles["readout_bandwidth_hz_per_px"] == pytest.approx(sc["readout_bw_hz_per_px"])
            assert acq.sample_time_us == pytest.approx(seq.dwell_time_us, rel=1e-6)
            assert tuple(acq.position[:2]) == pytest.approx((sub.fov_centre_mm[1], sub.fov_centre_mm[0]), abs=1e-3)
    assert records[0]["rotation_deg"] != records[1]["rotation_deg"]
    assert records[0]["fov_shift_mm"] != records[1]["fov_shift_mm"]


def test_files_and_manifests_from_before_the_section(varied_dataset, tiny_config, tmp_path):
    out, _ = varied_dataset
    path = sorted(out.glob("*/*.h5"))[0]
    old = tmp_path / "old.h5"
    old.write_bytes(path.read_bytes())
    with h5py.File(old, "a") as f:
        del f.attrs["scanner_json"]
    sub = read_subject(old, ())
    assert sub.scanner == {}
    assert sub.sequence.b0_t == sub.sim_config["sequence"]["b0_t"]
    # a manifest without the section holds what its defaults simulate: resumable with them only
    splits = assign_splits(tiny_config["dataset"])
    manifest = write_manifest(tmp_path, tiny_config, splits)
    del manifest["config"]["variation"]
    assert same_simulation(manifest, tiny_config, splits)
    assert not same_simulation(manifest, _tiny("variation.rotation_deg=5"), splits)


# -- what the drawn values do to the images ----------------------------------------------------


def test_rotation_turns_the_patient_in_the_image():
    upright = simulate_subject(0, _tiny(*WHOLE_BODY))
    turned = simulate_subject(0, _tiny(*WHOLE_BODY, "variation.rotation_deg=25"))
    angle = turned.scanner["rotation_deg"]
    assert abs(angle) > 3
    got = _orientation_deg(_body(turned.images_clean)) - _orientation_deg(_body(upright.images_clean))
    assert got == pytest.approx(angle, abs=3.0)
    # the implant turns about the same centre (the FOV centre, here the origin)
    c0 = _centroid_px(upright.implant_mask) - 23.5
    c1 = _centroid_px(turned.implant_mask) - 23.5
    turn = math.degrees(math.atan2(c1[0], c1[1]) - math.atan2(c0[0], c0[1]))
    assert turn == pytest.approx(angle, abs=4.0)


def test_fov_shift_moves_the_anatomy_the_other_way():
    still = simulate_subject(3, _tiny(*WHOLE_BODY))
    moved = simulate_subject(3, _tiny(*WHOLE_BODY, "variation.fov_shift_mm=[60, 40]"))
    sx, sy = moved.scanner["fov_shift_mm"]
    assert moved.fov_centre_mm == pytest.approx((still.fov_centre_mm[0] + sy, still.fov_centre_mm[1] + sx))
    pixel = 10.0
    for get in (lambda d: d.implant_mask, lambda d: _body(d.images_clean)):
        delta = _centroid_px(get(moved)) - _centroid_px(get(still))
        assert delta == pytest.approx((-sy / pixel, -sx / pixel), abs=1.0)


def test_coil_shading_scales_both_partners_smoothly():
    flat = simulate_subject(1, _tiny(*WHOLE_BODY))
    shaded = simulate_subject(1, _tiny(*WHOLE_BODY, "variation.coil_shading=0.4"))
    assert (shaded.images_clean >= 0).all() and (shaded.images_metal >= 0).all()
    bright = flat.images_clean > 0.3 * np.percentile(flat.images_clean, 99)
    ratio = np.where(bright, shaded.images_clean / np.maximum(flat.images_clean, 1e-6), np.nan)
    values = ratio[bright]
    assert values.min() > 0 and 0.8 < np.median(values) < 1.2
    assert np.percentile(values, 95) > 1.3 * np.percentile(values, 5)  # the shading is real
    for axis in (1, 2):  # and smooth: under 8 % from one 10 mm pixel to the next
        assert np.nanpercentile(np.abs(np.diff(np.log(ratio), axis=axis)), 95) < 0.08
    far = bright & ~shaded.implant_mask.any(axis=0)[None]
    metal_ratio = shaded.images_metal[far] / np.maximum(flat.images_metal[far], 1e-6)
    assert np.median(np.abs(metal_ratio - ratio[far])) < 0.05  # the same map on the metal partner


def test_snr_draw_sets_the_noise_of_the_metal_partner():
    noiseless = simulate_subject(2, _tiny())
    noisy = simulate_subject(2, _tiny("variation.snr=[15, 40]"))
    snr = noisy.scanner["snr"]
    assert 15 <= snr <= 40 and noisy.scanner["physics"] == {"snr": snr}
    np.testing.assert_array_equal(noisy.kspace_clean, noiseless.kspace_clean)
    noise = noisy.kspace_metal - noiseless.kspace_metal
    ref = noiseless.images_clean
    sigma = ref[ref > 0.1 * ref.max()].mean() / snr
    assert np.sqrt(np.mean(np.abs(noise) ** 2)) == pytest.approx(sigma, rel=0.1)


def test_field_strength_draw_scales_the_field_map():
    at3 = simulate_subject(0, _tiny())
    at15 = simulate_subject(0, _tiny("variation.b0_t=[1.5]"))
    assert at15.scanner["b0_t"] == 1.5
    np.testing.assert_allclose(at15.field_map_hz, 0.5 * at3.field_map_hz, atol=1e-3 * np.abs(at3.field_map_hz).max())


def test_preview_names_how_the_subject_was_scanned(varied_dataset, tmp_path):
    from sim_scanner.dataset.preview import scan_summary, write_preview

    out, _ = varied_dataset
    path = sorted(out.glob("*/*.h5"))[0]
    summary = scan_summary(read_subject(path, ()).scanner)
    assert summary.startswith("turned ") and "FOV shift x" in summary and "SNR" in summary
    assert scan_summary({}) == ""
    png = write_preview(out, path.stem, tmp_path / "preview.png", n_slices=1)
    assert png.stat().st_size > 1000
