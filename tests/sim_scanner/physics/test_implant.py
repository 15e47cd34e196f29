"""Total hip arthroplasty model: placement, geometry, labels and configuration."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from sim_scanner.physics import phantom
from sim_scanner.physics.grid import Grid
from sim_scanner.physics.implant import (
    MATERIAL_CHI_PPM,
    Component,
    ImplantConfig,
    ImplantParams,
    cup_axis_from_angles,
    draw_implant,
    implant_chi_ppm,
    implant_mask,
    postop_labels,
    rasterize_implant,
)
from sim_scanner.physics.phantom import Anatomy, HipJoint
from sim_scanner.physics.tissues import Tissue


FEMORAL = [Tissue.RED_MARROW, Tissue.YELLOW_MARROW, Tissue.CARTILAGE, Tissue.CORTICAL_BONE]


def unit3(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


def make_hip(side: str) -> HipJoint:
    """A realistic adult hip: 48 mm head, neck-shaft angle 130 deg, 12 deg femoral anteversion."""
    sign = 1.0 if side == "left" else -1.0
    centre = np.array([0.0, 0.0, sign * 95.0])
    shaft = unit3([-math.cos(math.radians(7)), 0.0, -sign * math.sin(math.radians(7))])
    lateral = np.array([0.0, 0.0, sign])
    perp = unit3(lateral - np.dot(lateral, shaft) * shaft)
    posterior = np.cross(shaft, perp)  # unit, orthogonal to both
    if posterior[1] < 0:
        posterior = -posterior
    av = math.radians(12)
    perp = math.cos(av) * perp + math.sin(av) * posterior
    nsa = math.radians(130)
    neck = unit3(math.cos(math.pi - nsa) * shaft + math.sin(math.pi - nsa) * perp)
    top = centre + 50.0 * neck
    acetabulum = cup_axis_from_angles(52.0, 20.0, side)
    return HipJoint(
        side=side,
        head_centre_mm=tuple(centre),
        head_radius_mm=24.0,
        acetabulum_radius_mm=26.5,
        acetabulum_axis=tuple(acetabulum),
        neck_axis=tuple(neck),
        neck_length_mm=50.0,
        shaft_top_mm=tuple(top),
        shaft_axis=tuple(shaft),
        shaft_radius_mm=14.0,
        canal_radius_mm=7.0,
        neck_shaft_angle_deg=130.0,
        anteversion_deg=12.0,
    )


@pytest.fixture(scope="module")
def anatomy() -> Anatomy:
    return Anatomy(seed=0, hips={"left": make_hip("left"), "right": make_hip("right")})


@pytest.fixture(scope="module")
def left(anatomy) -> ImplantParams:
    return draw_implant(ImplantConfig(side="left"), anatomy, np.random.default_rng(3))


def hip_grid(hip: HipJoint, shape=(60, 48, 48), voxel=3.0) -> Grid:
    """Grid centred below the head so that it holds the cup and most of the stem."""
    c = hip.head_centre_mm
    return Grid(shape, (voxel,) * 3, (c[0] - 0.3 * shape[0] * voxel, c[1], c[2]))


def label_at(params: ImplantParams, point) -> int:
    """Component at an exact point (a one-voxel grid centred there)."""
    point = tuple(float(v) for v in point)
    return int(rasterize_implant(params, Grid((1, 1, 1), (1.0, 1.0, 1.0), point))[0, 0, 0])


def voxel_points(grid: Grid, mask: np.ndarray) -> np.ndarray:
    """(N, 3) mm coordinates (z, y, x) of the voxels in ``mask``."""
    idx = np.nonzero(mask)
    return np.stack([grid.axis_mm(a)[idx[a]] for a in range(3)], axis=1).astype(np.float64)


def distance_to_line(points: np.ndarray, origin, direction) -> tuple[np.ndarray, np.ndarray]:
    """(distance from the line, signed position along it) of each point."""
    d = points - np.asarray(origin)
    s = d @ np.asarray(direction)
    return np.linalg.norm(d - s[:, None] * np.asarray(direction), axis=1), s


# --- drawing ---------------------------------------------------------------------------------


def test_draw_is_deterministic_and_leaves_global_rng(anatomy):
    cfg = ImplantConfig()
    np.random.seed(1234)
    state = np.random.get_state()
    a = draw_implant(cfg, anatomy, np.random.default_rng(7))
    b = draw_implant(cfg, anatomy, np.random.default_rng(7))
    grid = hip_grid(anatomy.hips[a.side])
    la, lb = rasterize_implant(a, grid), rasterize_implant(b, grid)
    after = np.random.get_state()
    assert a == b
    np.testing.assert_array_equal(la, lb)
    assert after[0] == state[0] and np.array_equal(after[1], state[1]) and after[2:] == state[2:]
    c = draw_implant(cfg, anatomy, np.random.default_rng(8))
    assert c.to_dict() != a.to_dict()


def test_random_side_draws_both(anatomy):
    rngs = [np.random.default_rng(s) for s in range(20)]
    sides = {draw_implant(ImplantConfig(), anatomy, rng).side for rng in rngs}
    assert sides == {"left", "right"}


@pytest.mark.parametrize("side", ["left", "right"])
def test_side_puts_implant_on_that_side(anatomy, side):
    params = draw_implant(ImplantConfig(side=side), anatomy, np.random.default_rng(0))
    grid = hip_grid(anatomy.hips[side])
    grid = Grid(grid.shape, grid.voxel_mm, (grid.centre_mm[0], 0.0, 0.0))  # both hips in view
    comps = rasterize_implant(params, grid)
    x = voxel_points(grid, comps > 0)[:, 2]
    sign = 1.0 if side == "left" else -1.0
    assert params.side == side
    assert sign * params.centre_mm[2] > 0
    assert x.size > 0 and np.all(sign * x > 0)


def test_sizes_fit_the_anatomy_over_many_subjects(anatomy):
    cfg = ImplantConfig()
    hip = anatomy.hips["left"]
    for seed in range(25):
        p = draw_implant(ImplantConfig(side="left"), anatomy, np.random.default_rng(seed))
        assert 2 * p.head_radius_mm in cfg.head_diameters_mm
        d = 2 * p.cup_outer_radius_mm
        assert cfg.cup_diameter_limits_mm[0] <= d <= cfg.cup_diameter_limits_mm[1]
        assert d >= 2 * hip.acetabulum_radius_mm  # reamed, at least the socket size
        assert cfg.cup_thickness_mm[0] <= p.cup_thickness_mm <= cfg.cup_thickness_mm[1]
        assert p.liner_thickness_mm >= cfg.min_liner_thickness_mm
        inner = p.cup_outer_radius_mm - p.cup_thickness_mm
        assert p.liner_thickness_mm == pytest.approx(inner - p.head_radius_mm)
        offset = np.asarray(p.centre_mm) - np.asarray(hip.head_centre_mm)
        assert np.all(np.abs(offset) <= 2 * cfg.position_jitter_mm + 1e-9)
        assert abs(p.stem_neck_shaft_angle_deg - 130.0) <= cfg.stem_neck_shaft_jitter_deg + 1e-6
        assert cfg.stem_length_mm[0] <= p.stem_length_mm <= cfg.stem_length_mm[1]
        assert max(p.stem_radii_mm) <= hip.shaft_radius_mm - 1.0 + 1e-9
        assert np.linalg.norm(p.cup_axis) == pytest.approx(1.0)


def test_cup_angles_follow_murray_radiographic_definitions(anatomy):
    # Definitions checked by hand: 45 deg inclination, 0 anteversion faces down and laterally.
    h = math.sqrt(0.5)
    np.testing.assert_allclose(cup_axis_from_angles(45, 0, "left"), [-h, 0, h], atol=1e-12)
    np.testing.assert_allclose(cup_axis_from_angles(45, 0, "right"), [-h, 0, -h], atol=1e-12)
    # Anterior is -y (LPS).
    np.testing.assert_allclose(cup_axis_from_angles(0, 90, "left"), [0, -1, 0], atol=1e-12)
    for side in ("left", "right"):
        for seed in range(10):
            p = draw_implant(ImplantConfig(side=side), anatomy, np.random.default_rng(seed))
            a = np.asarray(p.cup_axis)
            lateral = a[2] if side == "left" else -a[2]
            # RI: angle of the coronal (x-z) projection from the inferior axis;
            # RA: angle between the axis and the coronal plane.
            ri = math.degrees(math.atan2(lateral, -a[0]))
            ra = math.degrees(math.asin(-a[1]))
            assert ri == pytest.approx(p.cup_inclination_deg, abs=1e-9)
            assert ra == pytest.approx(p.cup_anteversion_deg, abs=1e-9)
            assert 30 <= ri <= 50 and 5 <= ra <= 25
            assert a[0] < 0 and a[1] < 0 and lateral > 0  # inferior, anterior, lateral


def test_params_round_trip_through_json(left):
    d = left.to_dict()
    text = json.dumps(d)
    assert ImplantParams.from_dict(json.loads(text)) == left
    expected = {"stem": "cocr", "head": "cocr", "liner": "polyethylene", "cup": "cocr"}
    assert d["materials"] == expected
    assert isinstance(d["stem_points_mm"][0], list) and isinstance(d["stem_points_mm"][0][0], float)


# --- geometry --------------------------------------------------------------------------------


def test_head_cup_and_liner_are_concentric_shells(left):
    c = np.asarray(left.centre_mm)
    a = np.asarray(left.cup_axis)
    R, t, r = left.cup_outer_radius_mm, left.cup_thickness_mm, left.head_radius_mm
    assert label_at(left, c) == Component.HEAD
    assert label_at(left, c + 0.9 * r * a) == Component.HEAD  # full sphere, also out of the cup
    # The dome is opposite the opening axis, and tilted directions on the dome side too.
    ortho = unit3(np.cross(a, [1.0, 0.0, 0.0]))
    for direction in (-a, unit3(-a + 0.8 * ortho), unit3(-a - 0.8 * ortho)):
        assert label_at(left, c + (R - t / 2) * direction) == Component.CUP
        assert label_at(left, c + (r + left.liner_thickness_mm / 2) * direction) == Component.LINER
        assert label_at(left, c + (R + 0.5) * direction) == Component.NONE
    # The opening side holds no cup or liner.
    for point in (c + R * a, c + (R - t / 2) * a, c + (r + left.liner_thickness_mm / 2) * a):
        assert label_at(left, point) not in (Component.CUP, Component.LINER)


def test_stem_runs_down_the_canal(anatomy, left):
    hip = anatomy.hips["left"]
    shaft = np.asarray(hip.shaft_axis)
    top = np.asarray(hip.shaft_top_mm)
    assert label_at(left, top + 40.0 * shaft) == Component.STEM
    assert label_at(left, top + 90.0 * shaft) == Component.STEM
    assert label_at(left, top + (30.0 + left.stem_length_mm + 15.0) * shaft) == Component.NONE
    # The prosthetic neck joins head and shaft.
    c, junction = np.asarray(left.centre_mm), np.asarray(left.stem_points_mm[2])
    neck_mid = c + 0.6 * (junction - c)
    assert label_at(left, neck_mid) == Component.STEM

    c = hip.head_centre_mm
    grid = Grid((120, 48, 48), (1.5, 1.5, 1.5), (c[0] - 80.0, 0.0, c[2]))
    comps = rasterize_implant(left, grid)
    pts = voxel_points(grid, comps == Component.STEM)
    dist, s = distance_to_line(pts, top, shaft)
    below = s > 5.0  # distal to the top of the canal: inside the femur's outer radius
    assert below.sum() > 100
    assert dist[below].max() <= hip.shaft_radius_mm
    js = float(np.dot(junction - top, shaft))
    diaphysis = s > js + 0.3 * left.stem_length_mm
    assert diaphysis.sum() > 50
    assert dist[diaphysis].max() <= hip.canal_radius_mm
    # The stem tapers: thinner distally.
    assert left.stem_radii_mm[2] > left.stem_radii_mm[3] >= left.stem_radii_mm[4]


def test_all_components_on_a_small_grid(anatomy, left):
    grid = hip_grid(anatomy.hips["left"])
    comps = rasterize_implant(left, grid)
    assert comps.dtype == np.uint8 and comps.shape == grid.shape
    assert set(np.unique(comps)) == {0, 1, 2, 3, 4}
    mask = implant_mask(comps)
    assert mask.dtype == np.uint8 and set(np.unique(mask)) == {0, 1}
    np.testing.assert_array_equal(mask, comps > 0)


def test_implant_outside_the_grid_gives_no_labels(left):
    far = Grid((8, 8, 8), (2.0, 2.0, 2.0), (0.0, 0.0, -300.0))
    assert not rasterize_implant(left, far).any()


def test_chi_per_component(anatomy):
    cfg = ImplantConfig(
        side="left",
        stem_material="titanium",
        cup_material="tantalum",
        extra_materials_chi_ppm={"tantalum": 178.0},
    )
    chi = implant_chi_ppm(draw_implant(cfg, anatomy, np.random.default_rng(0)))
    assert chi == {Component.STEM: 182.0, Component.HEAD: 900.0,
                   Component.LINER: MATERIAL_CHI_PPM["polyethylene"], Component.CUP: 178.0}


# --- post-operative anatomy ------------------------------------------------------------------


def native_labels(hip: HipJoint, grid: Grid) -> np.ndarray:
    """Crude native hip: muscle, pelvic bone around the socket, cartilage, femur."""
    z, y, x = grid.axes_mm()
    p = [z, y, x]
    c = hip.head_centre_mm
    d = [p[i] - c[i] for i in range(3)]
    r = np.sqrt(d[0] ** 2 + d[1] ** 2 + d[2] ** 2)
    a = hip.acetabulum_axis
    along_acetabulum = d[0] * a[0] + d[1] * a[1] + d[2] * a[2]
    labels = np.full(grid.shape, Tissue.MUSCLE, np.uint8)
    socket = hip.acetabulum_radius_mm
    labels[(r >= socket) & (r < socket + 10) & (along_acetabulum < 0)] = Tissue.CORTICAL_BONE
    labels[(r >= hip.head_radius_mm) & (r < hip.acetabulum_radius_mm)] = Tissue.CARTILAGE

    def cylinder(origin, direction, length, radius):
        e = [p[i] - origin[i] for i in range(3)]
        s = e[0] * direction[0] + e[1] * direction[1] + e[2] * direction[2]
        rho2 = e[0] ** 2 + e[1] ** 2 + e[2] ** 2 - s**2
        return (s >= 0) & (s <= length) & (rho2 <= radius**2)

    neck = cylinder(c, hip.neck_axis, hip.neck_length_mm, 16.0)
    shaft_outer = cylinder(hip.shaft_top_mm, hip.shaft_axis, 300.0, hip.shaft_radius_mm)
    shaft_canal = cylinder(hip.shaft_top_mm, hip.shaft_axis, 300.0, hip.canal_radius_mm)
    labels[neck | shaft_outer] = Tissue.CORTICAL_BONE
    labels[shaft_canal] = Tissue.YELLOW_MARROW
    labels[r < hip.head_radius_mm - 2] = Tissue.RED_MARROW
    labels[(r >= hip.head_radius_mm - 2) & (r < hip.head_radius_mm)] = Tissue.CORTICAL_BONE
    return labels


def test_postop_labels(anatomy, left):
    hip = anatomy.hips["left"]
    c = hip.head_centre_mm
    grid = Grid((70, 56, 56), (2.0, 2.0, 2.0), (c[0] - 40.0, 0.0, c[2]))
    labels = native_labels(hip, grid)
    comps = rasterize_implant(left, grid)
    labels_in, comps_in = labels.copy(), comps.copy()
    post = postop_labels(labels, comps, left, anatomy, grid)
    np.testing.assert_array_equal(labels, labels_in)
    np.testing.assert_array_equal(comps, comps_in)
    assert post.dtype == labels.dtype and post.shape == labels.shape
    np.testing.assert_array_equal(post == Tissue.IMPLANT, comps > 0)

    z, y, x = grid.axes_mm()
    r = np.sqrt((z - c[0]) ** 2 + (y - c[1]) ** 2 + (x - c[2]) ** 2)
    head = r <= hip.head_radius_mm
    femoral = np.isin(post, FEMORAL)
    assert not (head & femoral).any()
    assert not ((r < hip.acetabulum_radius_mm) & femoral).any()  # cartilage reamed / resected
    assert ((post == Tissue.SYNOVIAL_FLUID) & head).any()
    # The neck is cut at the resection plane: bone remains only distal to it.
    n = np.asarray(left.resection_normal)
    s = (z - c[0]) * n[0] + (y - c[1]) * n[1] + (x - c[2]) * n[2]
    depth = float(np.dot(np.asarray(left.resection_point_mm) - np.asarray(c), n))
    neck_bone = (labels == Tissue.CORTICAL_BONE) & (s > 0) & (r > hip.acetabulum_radius_mm + 10)
    assert not (neck_bone & (s < depth) & (post == Tissue.CORTICAL_BONE)).any()
    assert (neck_bone & (s > depth + 3) & (post == Tissue.CORTICAL_BONE)).any()
    # Pelvic bone behind the cup and the femoral shaft stay.
    pelvis = (labels == Tissue.CORTICAL_BONE) & (comps == 0)
    pelvis &= (r > hip.acetabulum_radius_mm + 1) & (s < 0)
    assert pelvis.any() and np.all(post[pelvis] == Tissue.CORTICAL_BONE)
    marrow = (labels == Tissue.YELLOW_MARROW) & (comps == 0)
    assert marrow.any() and np.all(post[marrow] == Tissue.YELLOW_MARROW)


# --- configuration ---------------------------------------------------------------------------


def test_config_rejects_unknown_material():
    with pytest.raises(ValueError, match="stem_material") as err:
        ImplantConfig(stem_material="unobtanium")
    for name in MATERIAL_CHI_PPM:
        assert name in str(err.value)
    ImplantConfig(stem_material="unobtanium", extra_materials_chi_ppm={"unobtanium": 50.0})


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"cup_inclination_deg": (50.0, 30.0)}, "cup_inclination_deg"),
        ({"cup_thickness_mm": (-1.0, 3.0)}, "cup_thickness_mm"),
        ({"stem_distal_fill": (0.5, 1.5)}, "stem_distal_fill"),
        ({"head_diameters_mm": ()}, "head_diameters_mm"),
        ({"position_jitter_mm": -1.0}, "position_jitter_mm"),
        ({"head_diameters_mm": (40.0,)}, "min_liner_thickness_mm"),
        ({"extra_materials_chi_ppm": {"x": float("nan")}}, "extra_materials_chi_ppm"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ImplantConfig(**kwargs)


def test_config_loads_from_yaml_like_data():
    from masc_gadget.config import from_dict

    data = {
        "head_diameters_mm": [28, 32],
        "cup_anteversion_deg": [10, 20],
        "extra_materials_chi_ppm": {"tantalum": 178},
        "cup_material": "tantalum",
    }
    cfg = from_dict(ImplantConfig, data, "implant")
    assert cfg.head_diameters_mm == (28.0, 32.0) and cfg.cup_material == "tantalum"


# --- with the procedural phantom -------------------------------------------------------------


@pytest.mark.skipif(
    not hasattr(phantom, "rasterize_anatomy"), reason="phantom rasterisation not available"
)
def test_with_procedural_phantom():
    pcfg = phantom.PhantomConfig()
    rng = np.random.default_rng(11)
    anatomy = phantom.draw_anatomy(pcfg, rng)
    params = draw_implant(ImplantConfig(), anatomy, rng)
    hip = anatomy.hips[params.side]
    c = hip.head_centre_mm
    grid = Grid((64, 48, 48), (3.0, 3.0, 3.0), (c[0] - 50.0, c[1], c[2]))
    labels = phantom.rasterize_anatomy(anatomy, grid, pcfg)
    comps = rasterize_implant(params, grid)
    post = postop_labels(labels, comps, params, anatomy, grid)
    assert set(np.unique(comps)) == {0, 1, 2, 3, 4}
    np.testing.assert_array_equal(post == Tissue.IMPLANT, comps > 0)
    # The stem sits in the femur: nearly all of it replaces bone or marrow.
    stem = comps == Component.STEM
    pts = voxel_points(grid, stem)
    _, s = distance_to_line(pts, hip.shaft_top_mm, hip.shaft_axis)
    in_shaft = stem.copy()
    in_shaft[stem] = s > 10.0
    bone = np.isin(labels, [Tissue.CORTICAL_BONE, Tissue.YELLOW_MARROW, Tissue.RED_MARROW])
    assert in_shaft.sum() > 20
    assert bone[in_shaft].mean() > 0.95
    z, y, x = grid.axes_mm()
    r = np.sqrt((z - c[0]) ** 2 + (y - c[1]) ** 2 + (x - c[2]) ** 2)
    femoral = np.isin(post, FEMORAL)
    assert not ((r <= hip.head_radius_mm) & femoral).any()
