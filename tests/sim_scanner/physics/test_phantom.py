"""Procedural pelvis / hip phantoms: determinism, anatomy landmarks, labels and property maps."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from sim_scanner.physics.grid import Grid
from sim_scanner.physics.phantom import (
    Anatomy,
    PhantomConfig,
    TissueMaps,
    draw_anatomy,
    rasterize_anatomy,
    tissue_maps,
)
from sim_scanner.physics.tissues import Tissue, TissueProperties, tissue_properties

# 48 x 64 x 64 voxels covering z -158..78 mm, y +-160 mm, x +-208 mm: the whole hip region.
COARSE = Grid((48, 64, 64), (5.0, 5.0, 6.5), (-40.0, 0.0, 0.0))


@pytest.fixture(scope="module")
def cfg() -> PhantomConfig:
    return PhantomConfig()


@pytest.fixture(scope="module")
def anatomy(cfg) -> Anatomy:
    return draw_anatomy(cfg, np.random.default_rng(0))


@pytest.fixture(scope="module")
def labels(anatomy, cfg) -> np.ndarray:
    return rasterize_anatomy(anatomy, COARSE, cfg)


@pytest.fixture(scope="module")
def maps(labels, anatomy, cfg) -> TissueMaps:
    return tissue_maps(labels, anatomy, COARSE, 3.0, cfg)


def _voxel(grid: Grid, point) -> tuple[int, int, int]:
    return tuple(int(round(i)) for i in grid.index_of(tuple(point)))


# -- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["body_width_mm", "fat_thickness_mm", "head_radius_mm", "neck_shaft_angle_deg",
             "anteversion_deg", "bladder_radius_mm", "deform_amplitude_mm"]
)
def test_config_rejects_min_above_max(name):
    lo, hi = getattr(PhantomConfig(), name)
    with pytest.raises(ValueError, match=name):
        PhantomConfig(**{name: (hi + 1.0, lo)})


def test_config_rejects_out_of_domain_values():
    with pytest.raises(ValueError, match="head_radius_mm"):
        PhantomConfig(head_radius_mm=(-5.0, 20.0))
    with pytest.raises(ValueError, match="property_variation"):
        PhantomConfig(property_variation=-0.1)
    with pytest.raises(ValueError, match="chunk_voxels"):
        PhantomConfig(chunk_voxels=10)


def test_config_section_loads_from_plain_data():
    from masc_gadget.config import from_dict

    cfg = from_dict(PhantomConfig, {"fat_thickness_mm": [10, 20], "fat_plane_mm": 2}, "phantom")
    assert cfg.fat_thickness_mm == (10.0, 20.0) and cfg.fat_plane_mm == 2.0


# -- drawing -----------------------------------------------------------------------------------


def test_draw_is_deterministic_and_seed_dependent(cfg):
    a = draw_anatomy(cfg, np.random.default_rng(5))
    b = draw_anatomy(cfg, np.random.default_rng(5))
    c = draw_anatomy(cfg, np.random.default_rng(6))
    assert a == b
    assert a.params != c.params and a.seed != c.seed


def test_params_are_json_scalars_within_ranges(cfg):
    for seed in range(8):
        an = draw_anatomy(cfg, np.random.default_rng(seed))
        json.dumps(an.params)
        assert all(isinstance(v, (int, float, str, bool)) for v in an.params.values())
        p = an.params
        for side in ("left", "right"):
            lo, hi = cfg.head_radius_mm
            assert lo <= p[f"{side}_head_radius_mm"] <= hi
            lo, hi = cfg.neck_shaft_angle_deg
            assert lo <= p[f"{side}_neck_shaft_angle_deg"] <= hi
        assert cfg.fat_thickness_mm[0] <= p["fat_thickness_mm"] <= cfg.fat_thickness_mm[1]
        assert p["body_width_mm"] <= cfg.body_width_mm[1]
        assert p["body_depth_mm"] <= cfg.body_depth_mm[1]


def test_hip_landmarks(cfg):
    for seed in range(6):
        an = draw_anatomy(cfg, np.random.default_rng(seed))
        for side, sign in (("left", 1.0), ("right", -1.0)):
            h = an.hips[side]
            head = np.array(h.head_centre_mm)
            assert h.side == side
            assert sign * head[2] > 60.0  # left hip at x > 0
            assert abs(head[0]) <= cfg.head_z_jitter_mm
            for axis in (h.acetabulum_axis, h.neck_axis, h.shaft_axis):
                assert np.linalg.norm(axis) == pytest.approx(1.0)
            a, n, s = (np.array(v) for v in (h.acetabulum_axis, h.neck_axis, h.shaft_axis))
            # socket opens lateral, inferior, anterior (-y)
            assert sign * a[2] > 0.4 and a[0] < -0.4 and a[1] < -0.05
            # neck runs lateral and inferior from the head; the shaft mostly down, a bit medial
            assert sign * n[2] > 0.3 and n[0] < -0.3
            assert s[0] < -0.95 and sign * s[2] < 0
            angle = math.degrees(math.acos(float(np.dot(-n, s))))
            assert angle == pytest.approx(h.neck_shaft_angle_deg, abs=1e-6)
            top = head + h.neck_length_mm * n
            np.testing.assert_allclose(top, h.shaft_top_mm, atol=1e-9)
            assert h.acetabulum_radius_mm > h.head_radius_mm
            assert 0 < h.canal_radius_mm < h.shaft_radius_mm


# -- rasterising -------------------------------------------------------------------------------


def test_labels_are_valid_and_deterministic(labels, anatomy, cfg):
    assert labels.dtype == np.uint8 and labels.shape == COARSE.shape
    valid = {int(t) for t in Tissue}
    assert set(np.unique(labels).tolist()) <= valid
    again = rasterize_anatomy(anatomy, COARSE, cfg)
    np.testing.assert_array_equal(labels, again)


def test_other_seed_gives_other_volume(labels, cfg):
    other = draw_anatomy(cfg, np.random.default_rng(1))
    assert (rasterize_anatomy(other, COARSE, cfg) != labels).mean() > 0.01


def test_slab_size_does_not_change_labels(anatomy, labels, cfg):
    small = dataclasses.replace(cfg, chunk_voxels=10_000)
    np.testing.assert_array_equal(rasterize_anatomy(anatomy, COARSE, small), labels)


def test_library_leaves_global_rng_alone(cfg):
    np.random.seed(1234)
    before = np.random.get_state()
    an = draw_anatomy(cfg, np.random.default_rng(3))
    lab = rasterize_anatomy(an, COARSE, cfg)
    tissue_maps(lab, an, COARSE, 1.5, cfg)
    after = np.random.get_state()
    assert before[0] == after[0] and before[2:] == after[2:]
    np.testing.assert_array_equal(before[1], after[1])


def test_main_tissues_present(labels):
    present = set(np.unique(labels).tolist())
    for t in (Tissue.AIR, Tissue.SKIN, Tissue.FAT, Tissue.MUSCLE, Tissue.CORTICAL_BONE,
              Tissue.RED_MARROW, Tissue.YELLOW_MARROW, Tissue.URINE, Tissue.BLOOD):
        assert int(t) in present, t.name


def test_body_fits_400_by_300_box(cfg):
    for seed in range(6):
        an = draw_anatomy(cfg, np.random.default_rng(seed))
        body = rasterize_anatomy(an, COARSE, cfg) != Tissue.AIR
        ys, xs = np.nonzero(body.any(axis=0))
        y, x = COARSE.axis_mm(1)[ys], COARSE.axis_mm(2)[xs]
        # voxel-centre extents never exceed the true extent of the body
        assert x.max() - x.min() <= 400.0 and y.max() - y.min() <= 300.0
        assert x.max() - x.min() > 250.0 and y.max() - y.min() > 150.0


def test_femoral_heads_sit_in_acetabula(anatomy, cfg):
    for side, sign in (("left", 1.0), ("right", -1.0)):
        h = anatomy.hips[side]
        head = np.array(h.head_centre_mm)
        grid = Grid((40, 40, 40), (2.0, 2.0, 2.0), tuple(head))
        lab = rasterize_anatomy(anatomy, grid, cfg)
        centre = _voxel(grid, head)
        assert lab[centre] in (Tissue.RED_MARROW, Tissue.CORTICAL_BONE)
        # pelvic bone just outside the socket: medially, superiorly and posteriorly
        bone = (Tissue.CORTICAL_BONE, Tissue.RED_MARROW)
        r = h.acetabulum_radius_mm + 4.0
        for direction in ((0.0, 0.0, -sign), (1.0, 0.0, 0.0), (0.0, 1.0, 0.0)):
            p = head + r * np.array(direction)
            assert lab[_voxel(grid, p)] in bone, (side, direction)
        # articular cartilage and joint fluid around the head
        present = set(np.unique(lab).tolist())
        assert int(Tissue.CARTILAGE) in present and int(Tissue.SYNOVIAL_FLUID) in present
        # the bony head is a sphere of the drawn radius
        zz, yy, xx = grid.axes_mm()
        r2 = (zz - head[0]) ** 2 + (yy - head[1]) ** 2 + (xx - head[2]) ** 2
        inner = r2 < (h.head_radius_mm - 2.0) ** 2
        assert np.isin(lab[inner], [Tissue.RED_MARROW, Tissue.CORTICAL_BONE]).all()


def test_femoral_shaft_has_cortex_around_yellow_marrow(anatomy, cfg):
    h = anatomy.hips["left"]
    top, shaft = np.array(h.shaft_top_mm), np.array(h.shaft_axis)
    centre = top + 110.0 * shaft
    grid = Grid((1, 32, 32), (1.0, 1.5, 1.5), tuple(centre))
    lab = rasterize_anatomy(anatomy, grid, cfg)[0]
    assert lab[_voxel(grid, centre)[1:]] == Tissue.YELLOW_MARROW
    ring = centre + np.array([0.0, 0.0, 0.5 * (h.shaft_radius_mm + h.canal_radius_mm)])
    assert lab[_voxel(grid, ring)[1:]] == Tissue.CORTICAL_BONE


def test_bladder_anterior_midline_and_thighs_separate(cfg):
    lean = dataclasses.replace(cfg, fat_thickness_mm=(8.0, 12.0))
    an = draw_anatomy(lean, np.random.default_rng(2))
    lab = rasterize_anatomy(an, COARSE, lean)
    zz, yy, xx = (np.broadcast_to(a, lab.shape) for a in COARSE.axes_mm())
    urine = lab == Tissue.URINE
    assert abs(xx[urine].mean()) < 15.0
    assert yy[urine].mean() < an.params["head_y_mm"] + 20.0
    iz = int(round(COARSE.index_of((-130.0, 0.0, 0.0))[0]))
    ix = int(round(COARSE.index_of((0.0, 0.0, 0.0))[2]))
    assert (lab[iz, :, ix] == Tissue.AIR).all()  # thighs apart below the perineum
    assert (lab[iz, :, :ix] != Tissue.AIR).any() and (lab[iz, :, ix + 1:] != Tissue.AIR).any()


def test_deformation_changes_soft_tissue_not_bones(cfg):
    an = draw_anatomy(cfg, np.random.default_rng(4))
    flat = Anatomy(an.seed, an.hips, {**an.params, "deform_amplitude_mm": 0.0})
    warped = Anatomy(an.seed, an.hips, {**an.params, "deform_amplitude_mm": 6.0})
    a, b = rasterize_anatomy(flat, COARSE, cfg), rasterize_anatomy(warped, COARSE, cfg)
    assert (a != b).mean() > 0.002
    head = _voxel(COARSE, an.hips["right"].head_centre_mm)
    assert a[head] == b[head] == Tissue.RED_MARROW


def test_bowel_gas_is_air_inside_bowel_loops_only(anatomy, labels, cfg):
    gassy = dataclasses.replace(cfg, bowel_gas_fraction=(1.0, 1.0))
    lab = rasterize_anatomy(anatomy, COARSE, gassy)
    changed = lab != labels
    assert changed.sum() > 20  # a few loops' worth of coarse voxels
    assert (lab[changed] == Tissue.AIR).all() and (labels[changed] == Tissue.BOWEL).all()
    chi = tissue_maps(lab, anatomy, COARSE, 3.0, gassy).chi_ppm
    assert np.allclose(chi[changed], tissue_properties(3.0)[Tissue.AIR].chi_ppm)
    half = rasterize_anatomy(anatomy, COARSE, dataclasses.replace(cfg, bowel_gas_fraction=(0.3, 0.3)))
    assert 0 < (half != labels).sum() < changed.sum()


# -- tissue properties and maps ----------------------------------------------------------------


def test_tissue_properties_table():
    p15, p3 = tissue_properties(1.5), tissue_properties(3.0)
    assert set(p3) == set(Tissue)
    assert all(isinstance(v, TissueProperties) for v in p3.values())
    assert p15[Tissue.MUSCLE].t1_ms < p3[Tissue.MUSCLE].t1_ms
    assert p3[Tissue.FAT].chi_ppm == -5.55 and p3[Tissue.CORTICAL_BONE].chi_ppm == -8.86
    for t in (Tissue.SKIN, Tissue.MUSCLE, Tissue.CARTILAGE, Tissue.SYNOVIAL_FLUID, Tissue.URINE,
              Tissue.BLOOD, Tissue.TENDON, Tissue.BOWEL, Tissue.IMPLANT):
        assert p3[t].chi_ppm == -9.05, t.name
    assert p3[Tissue.AIR].chi_ppm == 0.36 and p3[Tissue.AIR].pd == 0.0
    assert p3[Tissue.IMPLANT].pd == 0.0
    assert -9.05 < p3[Tissue.RED_MARROW].chi_ppm < p3[Tissue.YELLOW_MARROW].chi_ppm < -5.55
    assert p3[Tissue.CORTICAL_BONE].pd < 0.1 and p3[Tissue.TENDON].pd <= 0.1
    assert p3[Tissue.CORTICAL_BONE].t2_ms < 2.0 and p3[Tissue.TENDON].t2_ms < 10.0
    # fat bright, muscle dark on a T2-weighted TSE (TR 4050, TE 32) at 3 T
    s = {t: v.pd * math.exp(-32.0 / v.t2_ms) * (1 - math.exp(-4050.0 / v.t1_ms))
         for t, v in p3.items()}
    assert s[Tissue.FAT] > 2 * s[Tissue.MUSCLE] and s[Tissue.URINE] > 2 * s[Tissue.MUSCLE]
    assert s[Tissue.CORTICAL_BONE] < 0.01 and s[Tissue.TENDON] < 0.01


def test_tissue_properties_other_fields():
    p15, p2, p3, p7 = (tissue_properties(b) for b in (1.5, 2.0, 3.0, 7.0))
    m15, m2, m3 = p15[Tissue.MUSCLE], p2[Tissue.MUSCLE], p3[Tissue.MUSCLE]
    beta = math.log(m3.t1_ms / m15.t1_ms) / math.log(2.0)
    assert m2.t1_ms == pytest.approx(m15.t1_ms * (2.0 / 1.5) ** beta)
    assert m2.t2_ms == pytest.approx(m15.t2_ms + (m3.t2_ms - m15.t2_ms) / 3.0)
    assert all(v.t2_ms > 0 and v.t1_ms > 0 for v in p7.values())
    assert p7[Tissue.MUSCLE].t1_ms > m3.t1_ms
    for bad in (0.0, -1.5):
        with pytest.raises(ValueError, match="b0_t"):
            tissue_properties(bad)


def test_maps_values(maps, labels, anatomy):
    for m in (maps.pd, maps.t1_ms, maps.t2_ms, maps.chi_ppm):
        assert m.dtype == np.float32 and m.shape == labels.shape and np.isfinite(m).all()
    air, fat, muscle = (labels == t for t in (Tissue.AIR, Tissue.FAT, Tissue.MUSCLE))
    assert (maps.pd[air] == 0).all()
    np.testing.assert_array_equal(maps.chi_ppm[fat], np.float32(-5.55))
    np.testing.assert_array_equal(maps.chi_ppm[muscle], np.float32(-9.05))
    np.testing.assert_array_equal(maps.chi_ppm[air], np.float32(0.36))
    assert ((maps.pd >= 0) & (maps.pd <= 1)).all()
    # textured PD: varies smoothly within a tissue, around the table value
    table = tissue_properties(3.0)
    pd_m = maps.pd[muscle]
    assert pd_m.std() > 0.005
    assert abs(pd_m.mean() / table[Tissue.MUSCLE].pd - 1.0) < 0.15
    # T1 is not textured: one value per tissue
    assert np.unique(maps.t1_ms[muscle]).size == 1
    assert abs(maps.t1_ms[muscle][0] / table[Tissue.MUSCLE].t1_ms - 1.0) < 0.15


def test_maps_deterministic_and_field_dependent(maps, labels, anatomy, cfg):
    again = tissue_maps(labels, anatomy, COARSE, 3.0, cfg)
    for name in ("pd", "t1_ms", "t2_ms", "chi_ppm"):
        np.testing.assert_array_equal(getattr(maps, name), getattr(again, name))
    low = tissue_maps(labels, anatomy, COARSE, 1.5, cfg)
    muscle = labels == Tissue.MUSCLE
    assert (low.t1_ms[muscle] < maps.t1_ms[muscle]).all()
    np.testing.assert_array_equal(low.pd, maps.pd)
    other = Anatomy(anatomy.seed + 1, anatomy.hips, anatomy.params)
    assert not np.array_equal(tissue_maps(labels, other, COARSE, 3.0, cfg).pd, maps.pd)


def test_maps_without_variation_match_the_table(labels, anatomy, cfg):
    plain = dataclasses.replace(cfg, property_variation=0.0)
    flat = Anatomy(anatomy.seed, anatomy.hips, {**anatomy.params, "texture_amplitude": 0.0})
    m = tissue_maps(labels, flat, COARSE, 1.5, plain)
    table = tissue_properties(1.5)
    for t in (Tissue.FAT, Tissue.MUSCLE, Tissue.URINE, Tissue.CORTICAL_BONE):
        sel = labels == t
        np.testing.assert_allclose(m.pd[sel], table[t].pd, rtol=1e-6)
        np.testing.assert_allclose(m.t1_ms[sel], table[t].t1_ms, rtol=1e-6)
        np.testing.assert_allclose(m.t2_ms[sel], table[t].t2_ms, rtol=1e-6)


def test_maps_reject_unknown_labels(labels, anatomy, cfg):
    bad = labels.copy()
    bad[0, 0, 0] = 13
    with pytest.raises(ValueError, match="13"):
        tissue_maps(bad, anatomy, COARSE, 3.0, cfg)
