"""Per-subject scanner and positioning variation: config checks, draws, the turned patient
(anatomy, texture, implant) and the coil shading map."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from masc_gadget.config import ConfigError, from_dict
from sim_scanner.physics.forward import PhysicsConfig
from sim_scanner.physics.grid import Grid, rotate_zyx, unrotate_yx
from sim_scanner.physics.implant import (
    ImplantConfig,
    draw_implant,
    rasterize_implant,
    turned_implant,
)
from sim_scanner.physics.phantom import (
    PhantomConfig,
    draw_anatomy,
    rasterize_anatomy,
    turned_landmarks,
)
from sim_scanner.physics.phantom.texture import _value_noise, _value_noise_turned
from sim_scanner.physics.sequence import SequenceConfig
from sim_scanner.physics.variation import (
    N_DRAWS,
    CoilShading,
    VariationConfig,
    coil_sensitivity,
    draw_variation,
)

# 8 planes of 4 mm voxels, 440 x 360 mm in plane: the whole body at the hips, isotropic in plane
GRID = Grid((8, 90, 110), (6.0, 4.0, 4.0), (-15.0, 0.0, 0.0))

STRONG = VariationConfig(
    fov_shift_mm=(30.0, 20.0), rotation_deg=15.0, slab_offset_jitter_mm=10.0, b0_t=(1.5, 3.0),
    bandwidth_scale=(0.8, 2.0), snr=(15.0, 40.0), coil_shading=1.0,
    stem_materials=("cocr", "titanium"), head_materials=("cocr", "ceramic"),
)


@pytest.fixture(scope="module")
def anatomy():
    return draw_anatomy(PhantomConfig(), np.random.default_rng(3))


def _draw(cfg: VariationConfig, seed: int = 0):
    return draw_variation(cfg, SequenceConfig(), PhysicsConfig(), ImplantConfig(),
                          np.random.default_rng(seed))


def _turned_back(labels: np.ndarray, grid: Grid, angle_deg: float) -> np.ndarray:
    """Nearest-neighbour resampling of ``labels`` (patient not turned) at the anatomical
    coordinates of ``grid``'s voxel centres for a patient turned by ``angle_deg``; -1 outside."""
    ya, xa = unrotate_yx(grid.axis_mm(1)[:, None], grid.axis_mm(2)[None, :], angle_deg)
    _, y0, x0 = grid.index_of((0.0, 0.0, 0.0))
    iy = np.rint(y0 + ya / grid.voxel_mm[1]).astype(int)
    ix = np.rint(x0 + xa / grid.voxel_mm[2]).astype(int)
    inside = (iy >= 0) & (iy < grid.shape[1]) & (ix >= 0) & (ix < grid.shape[2])
    out = labels[:, np.clip(iy, 0, grid.shape[1] - 1), np.clip(ix, 0, grid.shape[2] - 1)].astype(int)
    out[:, ~inside] = -1
    return out


# -- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"fov_shift_mm": (-1.0, 0.0)}, "fov_shift_mm"),
        ({"fov_shift_mm": (math.inf, 0.0)}, "fov_shift_mm"),
        ({"rotation_deg": -5.0}, "rotation_deg"),
        ({"rotation_deg": 200.0}, "rotation_deg"),
        ({"slab_offset_jitter_mm": -1.0}, "slab_offset_jitter_mm"),
        ({"b0_t": (1.5, 0.0)}, "b0_t"),
        ({"bandwidth_scale": (0.0, 1.0)}, "bandwidth_scale"),
        ({"bandwidth_scale": (2.0, 1.0)}, "bandwidth_scale"),
        ({"snr": (0.0, 30.0)}, "snr"),
        ({"snr": (40.0, 30.0)}, "snr"),
        ({"coil_shading": -0.1}, "coil_shading"),
        ({"stem_materials": ("cocr", "unobtainium")}, "stem_materials"),
        ({"head_materials": ("gold",)}, "head_materials"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        VariationConfig(**kwargs)


def test_config_loads_from_plain_data_and_names_known_materials():
    cfg = from_dict(VariationConfig, {"fov_shift_mm": [10, 5], "b0_t": [1.5, 3],
                                      "stem_materials": ["titanium"]}, "variation")
    assert cfg.fov_shift_mm == (10.0, 5.0) and cfg.b0_t == (1.5, 3.0)
    assert cfg.stem_materials == ("titanium",)
    with pytest.raises(ConfigError, match="variation: stem_materials: unknown material 'x'; known "
                                          "materials: ceramic, cocr"):
        from_dict(VariationConfig, {"stem_materials": ["x"]}, "variation")


# -- draws -------------------------------------------------------------------------------------


def test_defaults_draw_the_configured_scan_exactly():
    seq, phys, icfg = SequenceConfig(slab_offset_mm=-21.3), PhysicsConfig(snr=17.0), ImplantConfig()
    var = draw_variation(VariationConfig(), seq, phys, icfg, np.random.default_rng(5))
    assert var.sequence(seq) == seq and var.physics(phys) == phys and var.implant(icfg) == icfg
    assert var.rotation_deg == 0.0 and var.fov_shift_mm == (0.0, 0.0) and var.coil.strength == 0.0
    assert var.fov_centre((1.25, -91.5)) == (1.25, -91.5)
    assert coil_sensitivity(var.coil, np.ones(GRID.shape, bool), GRID).tolist() == np.ones(
        (1, GRID.shape[1], GRID.shape[2])).tolist()


def test_draws_lie_in_their_ranges_and_differ_between_subjects(global_rng_guard):
    draws = [_draw(STRONG, seed) for seed in range(40)]
    for v in draws:
        assert all(abs(s) <= m for s, m in zip(v.fov_shift_mm, STRONG.fov_shift_mm))
        assert abs(v.rotation_deg) <= 15.0 and abs(v.slab_offset_jitter_mm) <= 10.0
        assert v.slab_offset_mm == pytest.approx(SequenceConfig().slab_offset_mm + v.slab_offset_jitter_mm)
        assert v.b0_t in (1.5, 3.0) and 0.8 <= v.bandwidth_scale <= 2.0 and 15.0 <= v.snr <= 40.0
        assert v.readout_bw_hz_per_px == pytest.approx(710.0 * v.bandwidth_scale)
        assert v.rf_bw_hz == pytest.approx(1000.0 * v.bandwidth_scale)
        assert v.stem_material in ("cocr", "titanium") and v.head_material in ("cocr", "ceramic")
        assert all(0.6 <= g <= 1.4 for g in v.coil.gains)
    assert len({v.rotation_deg for v in draws}) == len(draws)
    assert {v.b0_t for v in draws} == {1.5, 3.0} and {v.stem_material for v in draws} == {"cocr", "titanium"}
    # both signs of every +- range
    assert min(v.rotation_deg for v in draws) < -5 < 5 < max(v.rotation_deg for v in draws)
    record = draws[0].to_dict()
    assert record["sequence"] == {"b0_t": draws[0].b0_t, "readout_bw_hz_per_px": draws[0].readout_bw_hz_per_px,
                                  "rf_bw_hz": draws[0].rf_bw_hz, "slab_offset_mm": draws[0].slab_offset_mm}
    assert record["physics"] == {"snr": draws[0].snr}


def test_each_quantity_keeps_its_draw_when_others_are_switched_on():
    only_rotation = _draw(VariationConfig(rotation_deg=15.0), seed=9)
    everything = _draw(STRONG, seed=9)
    assert only_rotation.rotation_deg == everything.rotation_deg
    assert only_rotation.b0_t == 3.0 and only_rotation.snr == 0.0
    assert _draw(VariationConfig(b0_t=(1.5, 3.0)), seed=9).b0_t == everything.b0_t
    assert np.random.default_rng(9).random(N_DRAWS)[2] == pytest.approx((everything.rotation_deg / 15.0 + 1) / 2)


def test_fov_centre_turns_with_the_patient_then_shifts():
    var = _draw(STRONG, seed=2)
    y, x = var.fov_centre((0.0, 90.0))
    theta = math.radians(var.rotation_deg)
    assert x == pytest.approx(90.0 * math.cos(theta) + var.fov_shift_mm[0])
    assert y == pytest.approx(90.0 * math.sin(theta) + var.fov_shift_mm[1])


# -- the turned patient ------------------------------------------------------------------------


def test_rotate_zyx_is_right_handed_about_z_and_unrotate_inverts_it():
    assert rotate_zyx((5.0, 0.0, 1.0), 90.0) == pytest.approx((5.0, 1.0, 0.0))  # +x -> +y
    z, y, x = rotate_zyx((2.0, 3.0, -4.0), 33.0)
    ya, xa = unrotate_yx(np.float32(y), np.float32(x), 33.0)
    assert (z, float(ya), float(xa)) == pytest.approx((2.0, 3.0, -4.0), abs=1e-5)


@pytest.mark.parametrize("angle", [17.0, -40.0])
def test_turned_patient_is_the_anatomy_turned(anatomy, angle):
    cfg = PhantomConfig()
    upright = rasterize_anatomy(anatomy, GRID, cfg)
    turned = rasterize_anatomy(anatomy, GRID, cfg, rotation_deg=angle)
    expected = _turned_back(upright, GRID, angle)
    inside = expected >= 0
    agree = (turned == expected)[inside].mean()
    assert agree > 0.93  # the rest: voxel staircases of both volumes at tissue boundaries
    assert (turned == upright).mean() < agree - 0.1
    # every tissue keeps its volume (pelvis halves included: nothing painted twice or lost)
    for label in np.unique(upright):
        n0, n1 = (upright == label).sum(), (turned == label).sum()
        assert abs(n1 - n0) <= 0.15 * n0 + 30, label
    # the body's principal axis turns by the angle
    assert _orientation_deg(turned > 0) - _orientation_deg(upright > 0) == pytest.approx(angle, abs=2.0)


def _orientation_deg(mask: np.ndarray) -> float:
    """Angle of the major axis of a [z, y, x] mask's in-plane second moments, from +x to +y."""
    _, y, x = np.nonzero(mask)
    y, x = y - y.mean(), x - x.mean()
    return math.degrees(0.5 * math.atan2(2 * (x * y).mean(), (x * x).mean() - (y * y).mean()))


def test_no_turn_is_bit_identical(anatomy):
    cfg = PhantomConfig(deform_amplitude_mm=(3.0, 5.0))
    deformed = draw_anatomy(cfg, np.random.default_rng(4))
    np.testing.assert_array_equal(rasterize_anatomy(deformed, GRID, cfg),
                                  rasterize_anatomy(deformed, GRID, cfg, rotation_deg=0.0))
    assert turned_landmarks(anatomy, 0.0) is anatomy


def test_turned_texture_at_zero_matches_the_separable_one():
    a = _value_noise(11, GRID, 16.0, slice(0, 4))
    b = _value_noise_turned(11, GRID, 16.0, slice(0, 4), 0.0)
    np.testing.assert_allclose(a, b, atol=1e-5)
    assert not np.allclose(a, _value_noise_turned(11, GRID, 16.0, slice(0, 4), 30.0), atol=0.05)


def test_turned_implant_is_the_implant_turned(anatomy):
    implant = draw_implant(ImplantConfig(side="left"), anatomy, np.random.default_rng(1))
    turned = turned_implant(implant, 25.0)
    assert turned_implant(implant, 0.0) is implant
    assert turned.centre_mm == pytest.approx(rotate_zyx(implant.centre_mm, 25.0))
    assert turned.cup_axis == pytest.approx(rotate_zyx(implant.cup_axis, 25.0))
    assert turned.cup_inclination_deg == implant.cup_inclination_deg  # measured on the body
    grid = Grid((20, 150, 150), (4.0, 2.0, 2.0), (implant.centre_mm[0] - 20.0, 0.0, 0.0))
    upright, placed = rasterize_implant(implant, grid) > 0, rasterize_implant(turned, grid) > 0
    assert placed.sum() == pytest.approx(upright.sum(), rel=0.05)
    z, y, x = (c.astype(float) for c in np.nonzero(upright))
    expected = rotate_zyx((0.0, grid.axis_mm(1)[y.astype(int)].mean(), grid.axis_mm(2)[x.astype(int)].mean()), 25.0)
    _, y, x = np.nonzero(placed)
    assert (grid.axis_mm(1)[y].mean(), grid.axis_mm(2)[x].mean()) == pytest.approx(expected[1:], abs=1.0)
    hip = turned_landmarks(anatomy, 25.0).hips["left"]
    assert hip.head_centre_mm == pytest.approx(rotate_zyx(anatomy.hips["left"].head_centre_mm, 25.0))
    assert hip.head_radius_mm == anatomy.hips["left"].head_radius_mm


# -- coil shading ------------------------------------------------------------------------------


def test_coil_shading_is_positive_smooth_unit_mean_and_brightest_at_the_surfaces(anatomy):
    body = rasterize_anatomy(anatomy, GRID, PhantomConfig()) > 0
    var = _draw(STRONG, seed=3)
    shading = coil_sensitivity(var.coil, body, GRID)[0]
    inplane = body.any(axis=0)
    assert shading.shape == GRID.shape[1:] and (shading > 0).all()
    assert shading[inplane].mean() == pytest.approx(1.0, rel=1e-5)
    # smooth (under 10 % change per 4 mm voxel) and real (surfaces brighter than the centre)
    for axis in (0, 1):
        assert (np.abs(np.diff(shading, axis=axis)) / shading.max()).max() < 0.1
        assert (np.abs(np.diff(np.log(shading), axis=axis))).max() < 0.1
    mid = inplane.shape[1] // 2
    ys = np.nonzero(inplane[:, mid])[0]
    centre = shading[(ys[0] + ys[-1]) // 2, mid]
    assert shading[ys[0], mid] > 1.2 * centre and shading[ys[-1], mid] > 1.2 * centre
    weak = coil_sensitivity(dataclasses.replace(var.coil, strength=0.3), body, GRID)[0]
    assert 0 < np.ptp(weak[inplane]) < np.ptp(shading[inplane])
