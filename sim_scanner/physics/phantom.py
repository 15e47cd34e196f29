"""Procedural 3D pelvis / proximal-femur phantoms with per-subject anatomical variation.

Two phases, so that the scan geometry can depend on the anatomy before anything is rasterised:

1. :func:`draw_anatomy` draws every per-subject parameter from a seeded generator and returns
   an :class:`Anatomy` (parameters + landmarks such as the hip joints);
2. :func:`rasterize_anatomy` turns it into a label volume on any :class:`~sim_scanner.physics.grid.Grid`,
   and :func:`tissue_maps` into proton density, T1, T2 and susceptibility maps.

Coordinates follow :mod:`sim_scanner.physics.grid` (mm, LPS, volumes [z, y, x]); z = 0 is the level of
the femoral head centres, x = 0 the mid-sagittal plane, y = 0 the middle of the body's
antero-posterior extent at that level.

How the volume is built
-----------------------
Every structure is an implicit shape (an approximate signed distance in mm, negative inside)
evaluated on voxel centres, and the labels are painted from the outside in: air, skin,
subcutaneous fat, muscle groups, the pelvic cavity with its organs, vessels, then bones and the
hip joints. Muscle groups are a labelled Voronoi partition of the space inside the fat: each
group is a chain of tapered capsules that reaches at most ``margin`` mm past them, every voxel
goes to the nearest group, and voxels almost equally near two groups (or at the end of a
group's reach) become the thin fat planes that separate muscles on MR images.

Structures: body outline (one trunk section down to the perineum, two thighs below it), skin,
subcutaneous fat (thicker over the buttocks), about 20 muscle groups per side, iliotibial band;
pelvic cavity fat with bladder (urine, detrusor wall), rectum / anal canal, sigmoid and small
bowel loops, levator ani; external iliac / femoral artery and vein, deep femoral artery; ilium
wing, acetabulum, posterior column, ischium, pubic rami and body, sacrum, coccyx, lumbar bodies
and discs, symphysis and sacro-iliac cartilage; femoral head, neck, trochanters and shaft
(cortex of drawn thickness, red marrow proximally, yellow marrow in the diaphyseal canal),
articular cartilage on head and socket with a synovial fluid film, acetabular fossa fat,
labrum, joint capsule. Above the pelvis the trunk and below the hips the thighs simply continue.
Not modelled: prostate / uterus, nerves, bowel gas, flow voids.

Soft tissue (outline, fat, muscles, organs, vessels) is evaluated at smoothly warped coordinates
``p + u(p)``, ``u`` a sum of a few random low-frequency plane waves defined in mm (so it does
not depend on the grid). Bones and joints are not warped, so the :class:`HipJoint` landmarks
that the implant model is fitted to are exact.

The volume is rasterised in slabs of whole z planes (:meth:`Grid.zslab`), and inside a slab each
shape is evaluated only in its bounding box, so memory stays bounded on large grids and the
result does not depend on the slab size.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from .grid import Grid
from .tissues import Tissue, tissue_properties

logger = logging.getLogger(__name__)

Vec3 = tuple[float, float, float]
"""A point or direction in mm, ordered (z, y, x) like the volumes."""


@dataclass(frozen=True)
class HipJoint:
    """Landmarks of one hip joint (all points (z, y, x) in mm, directions unit vectors)."""

    side: str
    """"left" (x > 0) or "right" (x < 0)."""
    head_centre_mm: Vec3
    """Centre of the femoral head (= centre of the acetabular socket)."""
    head_radius_mm: float
    acetabulum_radius_mm: float
    """Radius of the acetabular socket surface (head radius + cartilage / joint space)."""
    acetabulum_axis: Vec3
    """Unit vector along the opening of the socket (points lateral, inferior and anterior)."""
    neck_axis: Vec3
    """Unit vector from the head centre along the femoral neck towards the shaft.

    It runs lateral and inferior, and (femoral anteversion) slightly posterior: read from the
    shaft to the head, the neck points anteriorly."""
    neck_length_mm: float
    """Distance from the head centre to the point where the neck axis meets the shaft axis."""
    shaft_top_mm: Vec3
    """Point where the neck axis meets the shaft axis (top of the femoral canal)."""
    shaft_axis: Vec3
    """Unit vector down the femoral shaft (mostly -z, slightly medial)."""
    shaft_radius_mm: float
    """Outer radius of the femoral diaphysis."""
    canal_radius_mm: float
    """Radius of the medullary canal (inside the cortical shell)."""
    neck_shaft_angle_deg: float
    anteversion_deg: float


@dataclass(frozen=True)
class Anatomy:
    """Everything drawn for one subject; rasterising it twice gives identical volumes."""

    seed: int
    """Seed of the generator for texture and deformation, derived from the subject's seed."""
    hips: dict[str, HipJoint]
    """"left" and "right" hip joints."""
    params: dict[str, Any] = field(default_factory=dict)
    """All drawn scalar parameters (JSON-able), written to the dataset attributes."""


@dataclass(frozen=True)
class PhantomConfig:
    """Per-subject ranges of the procedural pelvis / hip phantom (config section ``phantom``).

    Every ``(min, max)`` range is sampled uniformly per subject. Body size and subcutaneous fat
    are drawn jointly so that the drawn skeleton always fits: the fat is drawn below what the
    body width / depth ranges can hold, and the body is widened past its range only when even
    the minimum fat does not fit around the drawn skeleton.
    """

    body_width_mm: tuple[float, float] = (300.0, 400.0)
    """Left-right width of the body at the greater trochanters, mm."""
    body_depth_mm: tuple[float, float] = (200.0, 280.0)
    """Antero-posterior depth of the body at the femoral heads, mm."""
    fat_thickness_mm: tuple[float, float] = (8.0, 45.0)
    """Subcutaneous fat thickness at the sides of the hips, mm."""
    fat_posterior_extra: tuple[float, float] = (0.0, 0.4)
    """Relative extra subcutaneous fat over the buttocks and back (0.2 = 20 % thicker)."""
    fat_anterior_extra: tuple[float, float] = (-0.2, 0.3)
    """Relative extra (or, negative, less) subcutaneous fat over the abdomen and groin."""
    skin_thickness_mm: tuple[float, float] = (1.5, 3.0)
    """Skin (dermis) thickness, mm."""
    inter_hip_mm: tuple[float, float] = (160.0, 195.0)
    """Distance between the two femoral head centres, mm; the pelvis scales with it."""
    head_radius_mm: tuple[float, float] = (21.0, 27.0)
    """Radius of the bony femoral head, mm."""
    neck_shaft_angle_deg: tuple[float, float] = (120.0, 140.0)
    """Femoral neck-shaft (CCD) angle, degrees."""
    anteversion_deg: tuple[float, float] = (5.0, 25.0)
    """Femoral anteversion: the neck, read from the shaft to the head, points anteriorly."""
    femoral_offset_mm: tuple[float, float] = (34.0, 48.0)
    """Perpendicular distance from the head centre to the femoral shaft axis, mm."""
    shaft_radius_mm: tuple[float, float] = (12.5, 16.0)
    """Outer radius of the femoral diaphysis, mm."""
    cortical_thickness_mm: tuple[float, float] = (4.5, 7.5)
    """Cortical thickness of the femoral diaphysis, mm (canal radius = shaft radius - this)."""
    shaft_tilt_deg: tuple[float, float] = (5.0, 9.0)
    """Medial tilt of the femoral shaft axis from the body's long axis, degrees."""
    acetabular_inclination_deg: tuple[float, float] = (38.0, 52.0)
    """Radiographic inclination of the acetabular opening, degrees."""
    acetabular_anteversion_deg: tuple[float, float] = (8.0, 22.0)
    """Radiographic anteversion of the acetabular opening, degrees."""
    cartilage_thickness_mm: tuple[float, float] = (1.5, 2.5)
    """Thickness of each articular cartilage layer (femoral head and acetabulum), mm."""
    joint_fluid_mm: float = 0.8
    """Thickness of the synovial fluid film between the two cartilage layers, mm."""
    side_jitter_mm: float = 2.0
    """Independent left / right jitter (uniform +-) of hip positions and lengths, mm."""
    side_jitter_deg: float = 3.0
    """Independent left / right jitter (uniform +-) of hip and femur angles, degrees."""
    head_z_jitter_mm: float = 3.0
    """Femoral head centres lie within +- this of z = 0, mm."""
    pelvic_tilt_deg: tuple[float, float] = (-6.0, 6.0)
    """Sagittal tilt of the pelvis about the hip axis; positive moves its top anteriorly."""
    crest_height_mm: tuple[float, float] = (95.0, 115.0)
    """Height of the iliac crest above the femoral head centres (before pelvic scaling), mm."""
    bladder_radius_mm: tuple[float, float] = (20.0, 45.0)
    """Mean semi-axis of the (filled) urinary bladder, mm."""
    thigh_gap_mm: tuple[float, float] = (10.0, 40.0)
    """Gap between the thighs 100 mm below the hips when the fat allows it, mm."""
    muscle_bulk: tuple[float, float] = (0.85, 1.15)
    """Scale of the muscle group radii."""
    fat_plane_mm: float = 1.5
    """Approximate thickness of the fat planes between muscle groups, mm."""
    deform_amplitude_mm: tuple[float, float] = (0.0, 6.0)
    """Peak displacement of the smooth random deformation of soft tissue, per axis, mm."""
    texture_amplitude: tuple[float, float] = (0.03, 0.05)
    """Relative amplitude of the smooth multiplicative texture on proton density."""
    texture_scale_mm: float = 16.0
    """Correlation length (lattice spacing) of the coarse texture octave, mm."""
    property_variation: float = 0.05
    """Relative standard deviation of the per-subject, per-tissue variation of PD, T1, T2."""
    chunk_voxels: int = 1_000_000
    """Voxels per z slab while rasterising (bounds memory; does not change the result)."""

    def __post_init__(self) -> None:
        ranges = {
            "body_width_mm": (100.0, 1000.0),
            "body_depth_mm": (80.0, 800.0),
            "fat_thickness_mm": (0.0, 150.0),
            "fat_posterior_extra": (-0.9, 3.0),
            "fat_anterior_extra": (-0.9, 3.0),
            "skin_thickness_mm": (0.1, 10.0),
            "inter_hip_mm": (100.0, 300.0),
            "head_radius_mm": (10.0, 40.0),
            "neck_shaft_angle_deg": (95.0, 170.0),
            "anteversion_deg": (-30.0, 60.0),
            "femoral_offset_mm": (15.0, 80.0),
            "shaft_radius_mm": (6.0, 30.0),
            "cortical_thickness_mm": (1.0, 15.0),
            "shaft_tilt_deg": (0.0, 20.0),
            "acetabular_inclination_deg": (20.0, 70.0),
            "acetabular_anteversion_deg": (-20.0, 45.0),
            "cartilage_thickness_mm": (0.2, 6.0),
            "pelvic_tilt_deg": (-30.0, 30.0),
            "crest_height_mm": (80.0, 160.0),
            "bladder_radius_mm": (5.0, 80.0),
            "thigh_gap_mm": (0.0, 150.0),
            "muscle_bulk": (0.3, 3.0),
            "deform_amplitude_mm": (0.0, 30.0),
            "texture_amplitude": (0.0, 0.5),
        }
        for name, (lo, hi) in ranges.items():
            value = getattr(self, name)
            if len(value) != 2:
                raise ValueError(f"{name} must be a (min, max) pair, got {value!r}")
            vmin, vmax = float(value[0]), float(value[1])
            if not (math.isfinite(vmin) and math.isfinite(vmax)):
                raise ValueError(f"{name} must be finite, got {list(value)}")
            if vmin > vmax:
                raise ValueError(f"{name} must be (min, max) with min <= max, got {list(value)}")
            if vmin < lo or vmax > hi:
                raise ValueError(f"{name} must lie within [{lo}, {hi}], got {list(value)}")
        if self.shaft_radius_mm[0] - self.cortical_thickness_mm[1] < 2.0:
            raise ValueError(
                "shaft_radius_mm min - cortical_thickness_mm max must leave a canal of >= 2 mm, "
                f"got {self.shaft_radius_mm[0]} - {self.cortical_thickness_mm[1]}"
            )
        scalars = {
            "joint_fluid_mm": (0.0, 5.0),
            "side_jitter_mm": (0.0, 10.0),
            "side_jitter_deg": (0.0, 15.0),
            "head_z_jitter_mm": (0.0, 20.0),
            "fat_plane_mm": (0.0, 10.0),
            "texture_scale_mm": (2.0, 200.0),
            "property_variation": (0.0, 0.3),
        }
        for name, (lo, hi) in scalars.items():
            value = float(getattr(self, name))
            if not lo <= value <= hi:
                raise ValueError(f"{name} must lie within [{lo}, {hi}], got {value}")
        if self.chunk_voxels < 10_000:
            raise ValueError(f"chunk_voxels must be >= 10000, got {self.chunk_voxels}")


# ---------------------------------------------------------------------------------------------
# Small vector helpers (layout maths in float64; voxel maths in float32)
# ---------------------------------------------------------------------------------------------

_BIG = np.float32(1e6)
"""Stand-in for +infinity in distance accumulators (inf * 0 would give NaN in smooth unions)."""


def _v(z: float, y: float, x: float) -> np.ndarray:
    return np.array([z, y, x], dtype=np.float64)


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def _smoothstep(t: np.ndarray | float) -> np.ndarray | float:
    t = np.clip(t, 0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def _smin(a: np.ndarray, b: np.ndarray, k: float) -> np.ndarray:
    """Polynomial smooth minimum (blend radius ``k`` mm) of two distance fields."""
    if k <= 0:
        return np.minimum(a, b)
    h = np.clip(0.5 + (0.5 / k) * (b - a), 0.0, 1.0)
    return b + (a - b) * h - k * h * (1.0 - h)


def _seg_dist(q, a: np.ndarray, b: np.ndarray):
    """Distance from points ``q`` (tuple of z, y, x arrays) to segment a-b, and t in [0, 1]."""
    qz, qy, qx = q
    pz, py, px = qz - float(a[0]), qy - float(a[1]), qx - float(a[2])
    dz, dy, dx = (float(c) for c in (b - a))
    l2 = dz * dz + dy * dy + dx * dx
    if l2 < 1e-12:
        d = np.sqrt(pz * pz + py * py + px * px)
        return d, np.zeros_like(d)
    t = pz * (dz / l2) + py * (dy / l2)
    t = t + px * (dx / l2)
    np.clip(t, 0.0, 1.0, out=t)
    acc = t * dz
    np.subtract(pz, acc, out=acc)
    np.multiply(acc, acc, out=acc)
    tmp = t * dy
    np.subtract(py, tmp, out=tmp)
    np.multiply(tmp, tmp, out=tmp)
    acc += tmp
    np.multiply(t, dx, out=tmp)
    np.subtract(px, tmp, out=tmp)
    np.multiply(tmp, tmp, out=tmp)
    acc += tmp
    np.sqrt(acc, out=acc)
    return acc, t


def _capsule(q, a, b, r0: float, r1: float) -> np.ndarray:
    """Tapered capsule (radius r0 at a, r1 at b): approximate signed distance."""
    d, t = _seg_dist(q, a, b)
    t *= r1 - r0
    t += r0
    d -= t
    return d


def _sphere(q, c, r: float) -> np.ndarray:
    qz, qy, qx = q
    dz, dy, dx = qz - float(c[0]), qy - float(c[1]), qx - float(c[2])
    return np.sqrt(dz * dz + dy * dy + dx * dx) - r


def _ellipsoid(q, c, radii) -> np.ndarray:
    """Axis-aligned ellipsoid, semi-axes (rz, ry, rx): approximate signed distance."""
    qz, qy, qx = q
    rz, ry, rx = (float(r) for r in radii)
    uz, uy, ux = (qz - float(c[0])) / rz, (qy - float(c[1])) / ry, (qx - float(c[2])) / rx
    k0 = np.sqrt(uz * uz + uy * uy + ux * ux)
    k1 = np.sqrt((uz / rz) ** 2 + (uy / ry) ** 2 + (ux / rx) ** 2)
    eps = 1e-3
    return (k0 - 1.0) * (k0 + eps) / (k1 + eps / min(rz, ry, rx))


def _ellipse2(x, y, a, b) -> np.ndarray:
    """Ellipse with semi-axes a (x) and b (y) in the xy plane: approximate signed distance."""
    X, Y = x / a, y / b
    rho = np.sqrt(X * X + Y * Y)
    g = np.sqrt((X / a) ** 2 + (Y / b) ** 2)
    eps = 1e-3
    return (rho - 1.0) * (rho + eps) / (g + eps / np.minimum(a, b))


def _dot(q, c, d) -> np.ndarray:
    """(q - c) . d for points q (tuple of arrays)."""
    return ((q[0] - float(c[0])) * float(d[0]) + (q[1] - float(c[1])) * float(d[1])
            + (q[2] - float(c[2])) * float(d[2]))


# ---------------------------------------------------------------------------------------------
# Drawing a subject
# ---------------------------------------------------------------------------------------------


def _uniform(rng: np.random.Generator, r: Sequence[float]) -> float:
    return float(rng.uniform(float(r[0]), float(r[1]))) if r[1] > r[0] else float(r[0])


def _jitter(rng: np.random.Generator, amount: float) -> float:
    return float(rng.uniform(-amount, amount)) if amount > 0 else 0.0


def _hip_joint(side: str, p: dict[str, Any], y_shift: float) -> HipJoint:
    """The landmarks of one hip from the drawn parameters (``p``), y moved by ``y_shift``."""
    sigma = 1.0 if side == "left" else -1.0
    g = lambda name: float(p[f"{side}_{name}"])  # noqa: E731
    head = _v(g("head_z_mm"), g("head_dy_mm") + y_shift, sigma * g("head_lateral_mm"))
    r_h = g("head_radius_mm")
    cart = float(p["cartilage_thickness_mm"])
    r_acet = r_h + 2.0 * cart + float(p["joint_fluid_mm"])
    # Acetabular axis: radiographic inclination / anteversion in the pelvic frame, then tilted.
    incl, av = math.radians(g("acetabular_inclination_deg")), math.radians(
        g("acetabular_anteversion_deg"))
    a_pel = _v(-math.cos(av) * math.cos(incl), -math.sin(av), sigma * math.cos(av) * math.sin(incl))
    axis = _unit(_pelvic_to_world_dir(a_pel, float(p["pelvic_tilt_deg"])))
    # Femur: shaft tilted medially downwards; neck at the neck-shaft angle from the shaft,
    # rotated posteriorly (head -> shaft) by the anteversion.
    tilt = math.radians(g("shaft_tilt_deg"))
    shaft = _v(-math.cos(tilt), 0.0, -sigma * math.sin(tilt))
    lateral = _v(-math.sin(tilt), 0.0, sigma * math.cos(tilt))  # perpendicular to the shaft
    ant = math.radians(g("anteversion_deg"))
    m = math.cos(ant) * lateral + math.sin(ant) * _v(0.0, 1.0, 0.0)
    beta = math.radians(180.0 - g("neck_shaft_angle_deg"))
    neck = _unit(math.cos(beta) * shaft + math.sin(beta) * m)
    neck_len = g("femoral_offset_mm") / math.sin(beta)
    top = head + neck_len * neck
    r_shaft = g("shaft_radius_mm")
    return HipJoint(
        side=side,
        head_centre_mm=tuple(float(c) for c in head),
        head_radius_mm=r_h,
        acetabulum_radius_mm=r_acet,
        acetabulum_axis=tuple(float(c) for c in axis),
        neck_axis=tuple(float(c) for c in neck),
        neck_length_mm=float(neck_len),
        shaft_top_mm=tuple(float(c) for c in top),
        shaft_axis=tuple(float(c) for c in shaft),
        shaft_radius_mm=r_shaft,
        canal_radius_mm=r_shaft - g("cortical_thickness_mm"),
        neck_shaft_angle_deg=g("neck_shaft_angle_deg"),
        anteversion_deg=g("anteversion_deg"),
    )


def _pelvic_to_world_dir(v: np.ndarray, tilt_deg: float) -> np.ndarray:
    th = math.radians(-tilt_deg)
    c, s = math.cos(th), math.sin(th)
    return _v(c * v[0] - s * v[1], s * v[0] + c * v[1], v[2])


def draw_anatomy(cfg: PhantomConfig, rng: np.random.Generator) -> Anatomy:
    """Draw one subject: skeleton, hips, body habitus and soft-tissue parameters.

    Only ``rng`` is used (never the global numpy state). ``Anatomy.seed`` (drawn from ``rng``)
    drives the texture, deformation and bowel layout at rasterisation time.
    """
    p: dict[str, Any] = {}
    seed = int(rng.integers(0, 2**31 - 1))
    u = lambda r: _uniform(rng, r)  # noqa: E731
    p["inter_hip_mm"] = u(cfg.inter_hip_mm)
    p["pelvic_scale"] = p["inter_hip_mm"] / 178.0
    p["pelvic_tilt_deg"] = u(cfg.pelvic_tilt_deg)
    p["crest_height_mm"] = u(cfg.crest_height_mm)
    p["cartilage_thickness_mm"] = u(cfg.cartilage_thickness_mm)
    p["joint_fluid_mm"] = float(cfg.joint_fluid_mm)
    base = {
        "head_radius_mm": u(cfg.head_radius_mm),
        "neck_shaft_angle_deg": u(cfg.neck_shaft_angle_deg),
        "anteversion_deg": u(cfg.anteversion_deg),
        "femoral_offset_mm": u(cfg.femoral_offset_mm),
        "shaft_radius_mm": u(cfg.shaft_radius_mm),
        "cortical_thickness_mm": u(cfg.cortical_thickness_mm),
        "shaft_tilt_deg": u(cfg.shaft_tilt_deg),
        "acetabular_inclination_deg": u(cfg.acetabular_inclination_deg),
        "acetabular_anteversion_deg": u(cfg.acetabular_anteversion_deg),
    }
    mm_j, deg_j = cfg.side_jitter_mm, cfg.side_jitter_deg
    for side in ("left", "right"):
        p[f"{side}_head_lateral_mm"] = p["inter_hip_mm"] / 2.0 + _jitter(rng, mm_j / 2.0)
        p[f"{side}_head_dy_mm"] = _jitter(rng, mm_j)
        p[f"{side}_head_z_mm"] = _jitter(rng, cfg.head_z_jitter_mm)
        for name, value in base.items():
            if name.endswith("_deg"):
                j = _jitter(rng, deg_j)
            elif name in ("head_radius_mm", "shaft_radius_mm", "cortical_thickness_mm"):
                j = _jitter(rng, 0.25 * mm_j)
            else:
                j = _jitter(rng, mm_j)
            p[f"{side}_{name}"] = value + j
        # keep the drawn values inside the configured ranges after jitter
        for name in base:
            lo, hi = getattr(cfg, name)
            p[f"{side}_{name}"] = float(min(max(p[f"{side}_{name}"], lo), hi))
        p[f"{side}_cortical_thickness_mm"] = min(
            p[f"{side}_cortical_thickness_mm"], p[f"{side}_shaft_radius_mm"] - 2.0)

    # Body habitus: fat drawn so that skeleton + fat fit the body size ranges.
    p["skin_thickness_mm"] = u(cfg.skin_thickness_mm)
    p["fat_anterior_extra"] = u(cfg.fat_anterior_extra)
    p["fat_posterior_extra"] = u(cfg.fat_posterior_extra)
    hips0 = {side: _hip_joint(side, p, 0.0) for side in ("left", "right")}
    spheres = _required_spheres(hips0, p)
    ant0 = max(-c[1] + r for c, r in spheres)
    post0 = max(c[1] + r for c, r in spheres)
    lat0 = max(abs(c[2]) + r for c, r in spheres)
    sk, ca, cp = p["skin_thickness_mm"], p["fat_anterior_extra"], p["fat_posterior_extra"]
    # the smooth deformation may push the outline out by its amplitude: keep room for it
    p["deform_amplitude_mm"] = u(cfg.deform_amplitude_mm)
    room = 2.0 * p["deform_amplitude_mm"]
    w_lo, w_hi = cfg.body_width_mm
    d_lo, d_hi = cfg.body_depth_mm
    w_hi, d_hi = max(w_lo, w_hi - room), max(d_lo, d_hi - room)
    fat_max = min(w_hi / 2.0 - lat0 - sk, (d_hi - ant0 - post0 - 2.0 * sk) / (2.0 + ca + cp))
    f_lo, f_hi = cfg.fat_thickness_mm
    fat = _uniform(rng, (f_lo, max(f_lo, min(f_hi, fat_max))))
    p["fat_thickness_mm"] = fat
    w_req = 2.0 * (lat0 + fat + sk)
    d_req = ant0 + post0 + fat * (2.0 + ca + cp) + 2.0 * sk
    w_min, d_min = max(w_lo, w_req), max(d_lo, d_req)
    p["body_width_mm"] = w_min + (max(w_hi, w_min) - w_min) * float(rng.uniform())
    p["body_depth_mm"] = d_min + (max(d_hi, d_min) - d_min) * float(rng.uniform())
    if w_req > w_hi or d_req > d_hi:
        logger.debug("skeleton + minimum fat exceed the body size ranges: width %.0f, depth %.0f",
                     w_req, d_req)
    slack = p["body_depth_mm"] - d_req
    p["anterior_slack_fraction"] = float(rng.uniform(0.3, 0.5))
    anterior = ant0 + fat * (1.0 + ca) + sk + p["anterior_slack_fraction"] * slack
    p["head_y_mm"] = -p["body_depth_mm"] / 2.0 + anterior
    hips = {side: _hip_joint(side, p, p["head_y_mm"]) for side in ("left", "right")}

    # Soft tissue.
    p["bladder_radius_mm"] = u(cfg.bladder_radius_mm)
    p["bladder_x_mm"] = _jitter(rng, 6.0)
    p["thigh_gap_mm"] = u(cfg.thigh_gap_mm)
    p["muscle_bulk"] = u(cfg.muscle_bulk)
    p["texture_amplitude"] = u(cfg.texture_amplitude)
    return Anatomy(seed=seed, hips=hips, params=p)


# ---------------------------------------------------------------------------------------------
# Skeleton landmarks (shared by draw_anatomy and the rasteriser)
# ---------------------------------------------------------------------------------------------


class _Pelvis:
    """Pelvic frame: rotation by the pelvic tilt about the left-right axis through the hips."""

    def __init__(self, hips: dict[str, HipJoint], p: dict[str, Any]):
        hl, hr = (np.array(hips[s].head_centre_mm) for s in ("left", "right"))
        self.pivot = 0.5 * (hl + hr)
        th = math.radians(-float(p["pelvic_tilt_deg"]))
        self.c, self.s = math.cos(th), math.sin(th)
        self.scale = float(p["pelvic_scale"])
        self.crest = float(p["crest_height_mm"]) * self.scale
        self.hp = {side: self.to_pelvic(np.array(hips[side].head_centre_mm)) for side in hips}

    def to_world(self, q: np.ndarray) -> np.ndarray:
        dz, dy = q[0], q[1]
        return _v(self.pivot[0] + self.c * dz - self.s * dy,
                  self.pivot[1] + self.s * dz + self.c * dy, q[2])

    def to_pelvic(self, w: np.ndarray) -> np.ndarray:
        dz, dy = w[0] - self.pivot[0], w[1] - self.pivot[1]
        return _v(self.c * dz + self.s * dy, -self.s * dz + self.c * dy, w[2])

    def coords(self, z, y):
        """Pelvic-frame (zp, yp) of world coordinates (z, y) (arrays broadcast)."""
        dz, dy = z - float(self.pivot[0]), y - float(self.pivot[1])
        return self.c * dz + self.s * dy, -self.s * dz + self.c * dy

    # landmarks in the pelvic frame --------------------------------------------------------
    def rel(self, side: str, dz: float, dy: float, dx: float) -> np.ndarray:
        """Pelvic-frame point offset from the hip centre (dx > 0 lateral), scaled."""
        sig = 1.0 if side == "left" else -1.0
        h = self.hp[side]
        return _v(h[0] + dz * self.scale, h[1] + dy * self.scale, h[2] + sig * dx * self.scale)

    def mid(self, dz: float, dy: float) -> np.ndarray:
        """Pelvic-frame midline point relative to the mean hip centre, scaled."""
        hz = 0.5 * (self.hp["left"][0] + self.hp["right"][0])
        hy = 0.5 * (self.hp["left"][1] + self.hp["right"][1])
        return _v(hz + dz * self.scale, hy + dy * self.scale, 0.0)

    # ilium wing: a curved slab on an elliptic arc around an anteromedial centre ---------------
    WING_Z = (0.03, 0.18, 0.32, 0.50, 0.65, 0.80, 0.92, 1.0)
    WING_PHI0 = (25.0, 18.0, 12.0, 8.0, 10.0, 14.0, 22.0, 35.0)
    WING_PHI1 = (55.0, 60.0, 66.0, 88.0, 92.0, 92.0, 86.0, 60.0)
    WING_T = (30.0, 22.0, 12.0, 8.0, 6.0, 6.0, 8.0, 10.0)
    WING_AX_Z = (0.0, 0.3, 0.6, 0.9, 1.3)
    WING_AX = (58.0, 66.0, 82.0, 90.0, 90.0)

    def wing_centre(self, side: str) -> tuple[float, float]:
        h = self.hp[side]
        sig = 1.0 if side == "left" else -1.0
        return sig * (abs(h[2]) - 50.0 * self.scale), h[1] - 55.0 * self.scale

    def wing_ax(self, zr):
        """Lateral semi-axis of the wing ellipse at height ``zr`` above the hip centre."""
        return self.scale * np.interp(zr / self.crest, self.WING_AX_Z, self.WING_AX)

    def wing_point(self, side: str, zfrac: float, phi_deg: float, offset: float) -> np.ndarray:
        """Pelvic-frame point on the wing mid-surface at height zfrac * crest, angle phi."""
        sig = 1.0 if side == "left" else -1.0
        cx, cy = self.wing_centre(side)
        zr = zfrac * self.crest
        ax, ay = float(self.wing_ax(zr)), 110.0 * self.scale
        ph = math.radians(phi_deg)
        # offset along the outward normal of the ellipse (approximately radial)
        nx, ny = math.cos(ph) / ax, math.sin(ph) / ay
        nn = math.hypot(nx, ny)
        px = cx + sig * (ax * math.cos(ph) + offset * nx / nn)
        py = cy + ay * math.sin(ph) + offset * ny / nn
        return _v(self.hp[side][0] + zr, py, px)

    def wing_phi0(self, zfrac: float) -> float:
        return float(np.interp(zfrac, self.WING_Z, self.WING_PHI0))

    # sacrum profile (pelvic frame, relative to the mean hip centre; scaled) -------------------
    def sacrum_profile(self):
        s = self.scale
        z_s1 = self.crest - 18.0 * s
        zk = np.array([-32.0 * s, -15.0 * s, 0.0, 20.0 * s, 45.0 * s, 70.0 * s, z_s1])
        w = s * np.array([6.0, 12.0, 20.0, 30.0, 42.0, 50.0, 52.0])
        d = s * np.array([5.0, 7.0, 10.0, 14.0, 19.0, 23.0, 24.0])
        yc = s * np.array([62.0, 66.0, 70.0, 70.0, 65.0, 58.0, 52.0])
        order = np.argsort(zk, kind="stable")
        return zk[order], w[order], d[order], yc[order], z_s1


def _femur_parts(h: HipJoint) -> dict[str, Any]:
    """Derived femur geometry (world frame)."""
    sig = 1.0 if h.side == "left" else -1.0
    head, shaft, top = np.array(h.head_centre_mm), np.array(h.shaft_axis), np.array(h.shaft_top_mm)
    r_meta = 1.6 * h.shaft_radius_mm
    # lateral direction perpendicular to the shaft, in the coronal plane
    lat = _unit(_v(-abs(shaft[2]), 0.0, sig * abs(shaft[0])))
    gt = top - 17.0 * shaft + 0.45 * r_meta * lat + _v(0.0, 5.0, 0.0)
    gt_radii = (22.0, 18.0, 13.0)
    pm = _unit(-0.6 * lat + _v(0.0, 0.8, 0.0))
    lt = top + 38.0 * shaft + 1.15 * h.shaft_radius_mm * pm
    return {
        "sigma": sig, "head": head, "shaft": shaft, "top": top, "lat": lat,
        "r_meta": r_meta, "gt": gt, "gt_radii": gt_radii, "lt": lt, "lt_radius": 9.0,
        "r_neck": 0.62 * h.head_radius_mm,
    }


def _femur_axis_point(h: HipJoint, z: float) -> np.ndarray:
    """Point of the shaft axis at world height z."""
    top, shaft = np.array(h.shaft_top_mm), np.array(h.shaft_axis)
    return top + (z - top[0]) / shaft[0] * shaft


def _required_spheres(
    hips: dict[str, HipJoint], p: dict[str, Any]
) -> list[tuple[np.ndarray, float]]:
    """Spheres (bone + the least muscle around it) that must lie inside the subcutaneous fat."""
    pel = _Pelvis(hips, p)
    s = pel.scale
    out: list[tuple[np.ndarray, float]] = []
    for side, h in hips.items():
        fp = _femur_parts(h)
        out.append((fp["head"], h.head_radius_mm + 40.0))
        out.append((fp["gt"], fp["gt_radii"][2] + 12.0))
        out.append((fp["top"], fp["r_meta"] + 15.0))
        for z in (-60.0, -100.0):
            out.append((_femur_axis_point(h, z), h.shaft_radius_mm + 28.0))
        out.append((pel.to_world(pel.rel(side, -50.0, 44.0, -31.0)), 13.0 * s + 30.0))
        out.append((pel.to_world(pel.rel(side, 0.0, 25.0, -5.0)), 14.0 * s + 38.0))
        out.append((pel.to_world(pel.wing_point(side, 0.5, pel.wing_phi0(0.5), 0.0)), 16.0))
        out.append((pel.to_world(pel.wing_point(side, 0.85, pel.wing_phi0(0.85) + 10.0, 0.0)),
                    20.0))
        sig = 1.0 if side == "left" else -1.0
        sym = pel.mid(-24.0, -46.0) + _v(0.0, 0.0, sig * 11.0 * s)
        out.append((pel.to_world(sym), 10.0 * s + 10.0))
    zk, w, d, yc, _ = pel.sacrum_profile()
    z70 = float(zk[-2])
    out.append((pel.to_world(pel.mid(0.0, 0.0) + _v(z70, float(yc[-2] + d[-2]), 0.0)), 15.0))
    return out


# ---------------------------------------------------------------------------------------------
# Layout: everything the rasteriser needs, derived deterministically from an Anatomy
# ---------------------------------------------------------------------------------------------


@dataclass
class _Group:
    """A muscle group: polylines of (point, radius) and how far past them it may grow."""

    name: str
    chains: list[list[tuple[np.ndarray, float]]]
    margin: float


class _Layout:
    """Every point, radius and profile the rasteriser paints, derived from one Anatomy.

    Pure function of the anatomy (and of ``cfg.fat_plane_mm``): texture, deformation and bowel
    loops come from generators seeded with ``anatomy.seed``.
    """

    def __init__(self, anatomy: Anatomy, cfg: PhantomConfig):
        p = anatomy.params
        self.p = p
        self.hips = anatomy.hips
        self.pel = _Pelvis(anatomy.hips, p)
        self.fem = {side: _femur_parts(h) for side, h in anatomy.hips.items()}
        self.W, self.D = float(p["body_width_mm"]), float(p["body_depth_mm"])
        self.fat, self.skin = float(p["fat_thickness_mm"]), float(p["skin_thickness_mm"])
        self.fat_ant = float(p["fat_anterior_extra"])
        self.fat_post = float(p["fat_posterior_extra"])
        self.yh = float(p["head_y_mm"])
        self.scale = float(p["pelvic_scale"])
        self.bulk = float(p["muscle_bulk"])
        self.plane = float(cfg.fat_plane_mm)
        self.fluid = float(p["joint_fluid_mm"])
        self.cart = float(p["cartilage_thickness_mm"])
        self.amp = float(p["deform_amplitude_mm"])
        self._deformation(anatomy.seed)
        self._body_profile()
        self._thigh_profiles()
        self._cavity_profile()
        self._organs(anatomy.seed)
        self._vessels()
        self._muscles()

    # -- deformation -------------------------------------------------------------------------
    def _deformation(self, seed: int) -> None:
        rng = np.random.default_rng([seed, 0])
        n = 6
        dirs = rng.normal(size=(n, 3))
        dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
        wavelength = rng.uniform(100.0, 260.0, size=n)
        self.wave_k = 2.0 * np.pi * dirs / wavelength[:, None]  # rad / mm, (n, 3) in z, y, x
        self.wave_phase = rng.uniform(0.0, 2.0 * np.pi, size=n)
        amps = rng.normal(size=(3, n))
        amps /= np.abs(amps).sum(axis=1, keepdims=True)
        self.wave_amp = amps * self.amp  # (component, wave); |u_c| <= amp

    # -- body outline --------------------------------------------------------------------------
    def _body_profile(self) -> None:
        W2, D2 = self.W / 2.0, self.D / 2.0
        zc = np.array([-85.0, -75.0, -62.0, -50.0, -35.0, -10.0, 30.0, 70.0, 100.0, 160.0])
        a_frac = np.array([0.22, 0.40, 0.62, 0.85, 0.96, 1.0, 0.95, 0.88, 0.86, 0.86])
        ba_frac = np.array([0.35, 0.45, 0.62, 0.80, 0.92, 1.0, 0.97, 0.98, 1.0, 1.0])
        bp_frac = np.array([0.45, 0.62, 0.82, 0.95, 1.0, 1.0, 0.95, 0.88, 0.85, 0.85])
        zk = np.arange(-100.0, 260.0, 5.0)
        a = np.interp(zk, zc, a_frac) * W2
        ba = np.interp(zk, zc, ba_frac) * D2
        bp = np.interp(zk, zc, bp_frac) * D2
        spheres = _required_spheres(self.hips, self.p)
        f, sk = self.fat, self.skin
        for i, z in enumerate(zk):
            if z < -40.0:
                continue  # the thighs carry the requirement below the pelvis
            for c, r in spheres:
                dz = z - c[0]
                if abs(dz) >= r:
                    continue
                ch = math.sqrt(r * r - dz * dz)
                a[i] = max(a[i], abs(c[2]) + ch + f + sk)
                ba[i] = max(ba[i], -(c[1] - ch) + f * (1.0 + self.fat_ant) + sk)
                bp[i] = max(bp[i], c[1] + ch + f * (1.0 + self.fat_post) + sk)
        self.body_z, self.body_a, self.body_ba, self.body_bp = zk, a, ba, bp
        self.trunk_bottom = -88.0

    def trunk(self, z):
        """Per-plane trunk half-width, anterior and posterior half-depths (mm)."""
        return (np.interp(z, self.body_z, self.body_a), np.interp(z, self.body_z, self.body_ba),
                np.interp(z, self.body_z, self.body_bp))

    def _thigh_profiles(self) -> None:
        W2, D2 = self.W / 2.0, self.D / 2.0
        f, sk = self.fat, self.skin
        gap = float(self.p["thigh_gap_mm"])
        zk = np.arange(-300.0, -14.0, 5.0)
        self.thigh_z = zk
        self.thigh = {}
        for side, h in self.hips.items():
            sig = 1.0 if side == "left" else -1.0
            lat = np.interp(zk, [-200.0, -120.0, -80.0, -50.0, -20.0],
                            W2 * np.array([0.80, 0.86, 0.92, 0.97, 0.99]))
            med = np.interp(zk, [-200.0, -110.0, -80.0, -50.0, -20.0],
                            [gap / 2.0 + 15.0, gap / 2.0, 2.0, -8.0, -30.0])
            ant_t, post_t = np.empty_like(zk), np.empty_like(zk)
            for i, z in enumerate(zk):
                fpt = _femur_axis_point(h, float(z))
                fx, fy = sig * fpt[2], fpt[1]
                r_f = h.shaft_radius_mm
                lat[i] = max(lat[i], fx + r_f + 24.0 + f + sk)
                med[i] = min(med[i], fx - r_f - 45.0 - f - sk)
                width = lat[i] - med[i]
                depth = 0.88 * width
                ant_t[i] = min(fy - 0.45 * depth, fy - r_f - 35.0 - f * (1 + self.fat_ant) - sk)
                post_t[i] = max(fy + 0.55 * depth, fy + r_f + 40.0 + f * (1 + self.fat_post) + sk)
            # pelvic (buttock) proportions above -80 mm, thigh proportions below -110 mm
            _, ba, bp = self.trunk(zk)
            wt = _smoothstep((zk + 110.0) / 30.0)  # 0 below -110, 1 above -80
            ant = np.maximum((1 - wt) * ant_t + wt * (-0.92 * ba), -D2)
            post = np.minimum((1 - wt) * post_t + wt * np.maximum(bp, post_t), D2)
            lat = np.minimum(lat, W2)
            self.thigh[side] = (sig, lat, med, ant, post)
        self.thigh_top = -15.0

    def thigh_at(self, side: str, z):
        sig, lat, med, ant, post = self.thigh[side]
        zk = self.thigh_z
        li, mi = np.interp(z, zk, lat), np.interp(z, zk, med)
        ai, pi = np.interp(z, zk, ant), np.interp(z, zk, post)
        return sig * (li + mi) / 2.0, (li - mi) / 2.0, (ai + pi) / 2.0, (pi - ai) / 2.0

    # -- pelvic cavity -------------------------------------------------------------------------
    def _cavity_profile(self) -> None:
        pel, s = self.pel, self.scale
        xh = 0.5 * sum(abs(h.head_centre_mm[2]) for h in self.hips.values())
        r_acet = max(h.acetabulum_radius_mm for h in self.hips.values())
        yh = self.yh
        zk = np.array([-80.0, -62.0, -45.0, -28.0, -5.0, 20.0, 50.0, 80.0, 110.0, 150.0, 260.0])
        a_body, ba, _ = self.trunk(zk)
        ac_lo = max(25.0, xh - r_acet - 21.0)
        wall = self.fat + self.skin + 22.0
        ac = np.array([14.0, 26.0, 34.0, ac_lo, ac_lo, ac_lo + 5.0, xh - 30.0 * s,
                       xh - 10.0 * s, a_body[8] - wall, a_body[9] - wall, a_body[10] - wall])
        ac = np.minimum(ac, a_body - wall)
        ac = np.maximum(ac, 8.0)
        # front: behind the pubis low down, behind the abdominal wall higher up
        y_body_front = -ba + self.skin + self.fat * (1.0 + self.fat_ant) + 14.0
        sym_back = pel.to_world(pel.mid(-24.0, -36.0))[1]
        y_front = np.array([yh + 5.0, yh - 10.0, yh - 22.0, sym_back + 2.0, sym_back - 4.0,
                            0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
        y_front[5:] = y_body_front[5:]
        y_front[4] = max(y_front[4], y_body_front[4])
        # back: the sacrum / coccyx, the gluteal cleft below it, the spine above it
        szk, sw, sd, syc, z_s1 = pel.sacrum_profile()
        y_back = np.empty_like(zk)
        for i, z in enumerate(zk):
            zp = pel.to_pelvic(_v(z, yh, 0.0))[0] - pel.mid(0.0, 0.0)[0]
            if zp < szk[0]:
                y_back[i] = yh + 55.0 * s
            elif zp > z_s1:
                y_back[i] = pel.to_world(pel.mid(0.0, 0.0) + _v(zp, 25.0 * s - 3.0, 0.0))[1]
            else:
                front = float(np.interp(zp, szk, syc - sd)) - 3.0
                y_back[i] = pel.to_world(pel.mid(0.0, 0.0) + _v(zp, front, 0.0))[1]
        y_back = np.maximum(y_back, y_front + 20.0)
        self.cav_z, self.cav_a, self.cav_front, self.cav_back = zk, ac, y_front, y_back
        self.cav_lo = float(zk[0])
        self.xh = xh

    def cavity(self, z):
        zk = self.cav_z
        a = np.interp(z, zk, self.cav_a)
        f, b = np.interp(z, zk, self.cav_front), np.interp(z, zk, self.cav_back)
        ym = f + 0.5 * (b - f)
        return a, ym, ym - f, b - ym

    # -- organs ---------------------------------------------------------------------------------
    def _organs(self, seed: int) -> None:
        pel, s, yh = self.pel, self.scale, self.yh
        xh = self.xh
        # bladder
        R = float(self.p["bladder_radius_mm"])
        sym_back = pel.to_world(pel.mid(-24.0, -36.0))[1]
        rx = min(1.15 * R, max(self.cav_a[3] - 3.0, 12.0))
        ry, rz = 0.85 * R, 0.8 * R
        z_neck = pel.to_world(pel.mid(-28.0, -36.0))[0]
        self.bladder = (_v(z_neck + rz, sym_back + ry + 5.0, float(self.p["bladder_x_mm"])),
                        (rz, ry, rx))
        # rectum / anal canal: along the front of the sacrum
        szk, sw, sd, syc, _ = pel.sacrum_profile()

        def pre_sacral(zs: float, gap: float) -> np.ndarray:
            zp = zs * s
            front = float(np.interp(zp, szk, syc - sd))
            return pel.to_world(pel.mid(0.0, 0.0) + _v(zp, front - gap, 0.0))

        self.rectum = [
            (pre_sacral(45.0, 17.0) + _v(0, 0, 6.0), 15.0, 12.0),
            (pre_sacral(15.0, 18.0), 17.0, 14.0),
            (pre_sacral(-15.0, 18.0), 16.0, 13.0),
            (_v(-38.0 * s, yh + 45.0 * s, 0.0), 12.0, 6.0),
            (_v(-58.0 * s, yh + 40.0 * s, 0.0), 10.0, 3.0),
            (_v(-85.0, yh + 38.0 * s, 0.0), 9.0, 2.0),
        ]
        # sigmoid colon from the left iliac fossa to the top of the rectum
        self.sigmoid = [
            (_v(75.0, yh - 5.0, xh - 42.0 * s), 13.0),
            (_v(58.0, yh + 15.0, xh - 60.0 * s), 13.0),
            (self.rectum[0][0] + _v(4.0, 0.0, 2.0), 13.0),
        ]
        # small bowel loops (deterministic from the seed), clipped to the cavity when painted
        rng = np.random.default_rng([seed, 3])
        z_dome = self.bladder[0][0] + rz
        loops = []
        for _ in range(72):
            zc = rng.uniform(z_dome - 5.0, 240.0)
            a, ym, hf, hb = self.cavity(zc)
            xc = rng.uniform(-0.85, 0.85) * a
            yc = rng.uniform(ym - 0.8 * hf, ym + 0.6 * hb)
            d = rng.normal(size=3)
            d /= np.linalg.norm(d)
            half = rng.uniform(8.0, 25.0)
            r = rng.uniform(9.0, 15.0)
            c = _v(zc, yc, xc)
            loops.append((c - half * d, c + half * d, r))
        self.bowel = loops

    # -- vessels --------------------------------------------------------------------------------
    def _vessels(self) -> None:
        yh, s = self.yh, self.scale
        self.vessels = []  # (chain of points, radius, sheath)
        for side, h in self.hips.items():
            sig = 1.0 if side == "left" else -1.0
            xh, r_h = abs(h.head_centre_mm[2]), h.head_radius_mm
            hz = h.head_centre_mm[0]
            f50, f100, f180 = (_femur_axis_point(h, z) for z in (-50.0, -100.0, -180.0))
            art = [
                _v(125.0, yh + 22.0 * s, sig * 20.0),
                _v(85.0, yh + 8.0 * s, sig * 36.0 * s),
                _v(45.0, yh - 22.0 * s, sig * (xh - 38.0 * s)),
                _v(hz + 12.0, yh - r_h - 24.0, sig * (xh - 16.0 * s)),
                _v(hz - 15.0, yh - r_h - 22.0, sig * (xh - 15.0 * s)),
                _v(-50.0, f50[1] - 42.0, sig * (xh - 20.0 * s)),
                _v(-100.0, f100[1] - 32.0, f100[2] - sig * 36.0),
                _v(-180.0, f180[1] - 20.0, f180[2] - sig * 34.0),
            ]
            vein = [q + (_v(0.0, 5.0, -sig * 13.0) if q[0] > -40.0 else _v(0.0, 11.0, -sig * 7.0))
                    for q in art]
            self.vessels.append((art, 4.0, 1.5))
            self.vessels.append((vein, 5.5, 1.5))
            prof = [art[5] + _v(5.0, 0.0, 0.0), _v(-110.0, f100[1] + 4.0, f100[2] - sig * 26.0)]
            self.vessels.append((prof, 3.0, 1.0))

    # -- muscles --------------------------------------------------------------------------------
    def _muscles(self) -> None:
        pel, s, yh, k = self.pel, self.scale, self.yh, self.bulk
        groups: list[_Group] = []
        szk, sw, sd, syc, z_s1 = pel.sacrum_profile()
        mid0 = pel.mid(0.0, 0.0)

        def sac_back(zs: float) -> float:
            zp = zs * s
            return pel.to_world(mid0 + _v(zp, float(np.interp(zp, szk, syc + sd)), 0.0))[1]

        for side, h in self.hips.items():
            sig = 1.0 if side == "left" else -1.0
            fp = self.fem[side]
            xh = abs(h.head_centre_mm[2])
            T, G = fp["top"], fp["gt"]
            gt_lat = sig * G[2] + fp["gt_radii"][2]

            def P(dz, dy, dx):  # pelvic-frame offset from the hip centre -> world
                return pel.to_world(pel.rel(side, dz, dy, dx))

            def Wg(zf, phi, off):  # point on / off the ilium wing -> world
                return pel.to_world(pel.wing_point(side, zf, phi, off))

            def F(z, dy, dx):  # point beside the femoral shaft axis at height z
                a = _femur_axis_point(h, z)
                return a + _v(0.0, dy, sig * dx)

            def X(z, y, x):  # absolute z / y, lateral x
                return _v(z, y, sig * x)

            b = lambda r: r * k  # noqa: E731
            a_ab, ba_ab, _ = self.trunk(np.array([100.0, 160.0, 30.0]))
            y_wall = -ba_ab + self.skin + self.fat * (1.0 + self.fat_ant) + 7.0
            x_flank = a_ab - self.skin - self.fat - 9.0
            groups += [
                _Group(f"{side}_gluteus_maximus", [
                    [(X(70.0, sac_back(70.0) + 22.0, 45.0 * s), b(16.0)),
                     (P(25.0, 78.0, 5.0), b(30.0)),
                     (P(-25.0, 72.0, 15.0), b(36.0)),
                     (F(-70.0, 48.0, 10.0), b(26.0)),
                     (F(-110.0, 30.0, 22.0), b(8.0))],
                    # medial fibres from the lower sacrum and coccyx
                    [(X(40.0, sac_back(40.0) + 12.0, 26.0 * s), b(12.0)),
                     (X(-15.0, sac_back(-15.0) + 14.0, 20.0 * s), b(14.0)),
                     (P(-30.0, 72.0, -10.0), b(30.0))],
                ], 55.0),
                _Group(f"{side}_gluteus_medius", [[
                    (Wg(0.92, 40.0, 14.0), b(9.0)),
                    (Wg(0.6, 40.0, 20.0), b(18.0)),
                    (Wg(0.3, 30.0, 22.0), b(18.0)),
                    (G + _v(18.0, 0.0, sig * 6.0), b(9.0)),
                ]], 40.0),
                _Group(f"{side}_gluteus_minimus", [[
                    (Wg(0.6, 25.0, 7.0), b(6.0)),
                    (Wg(0.25, 20.0, 8.0), b(9.0)),
                    (G + _v(14.0, -8.0, -sig * 4.0), b(6.0)),
                ]], 15.0),
                _Group(f"{side}_tensor_fasciae_latae", [[
                    (Wg(0.5, pel.wing_phi0(0.5), 10.0), b(6.0)),
                    (X(-5.0, yh - 42.0, gt_lat + 8.0), b(10.0)),
                    (X(-60.0, _femur_axis_point(h, -60.0)[1] - 22.0, gt_lat + 10.0), b(6.0)),
                ]], 15.0),
                _Group(f"{side}_iliopsoas", [
                    [(pel.to_world(mid0 + _v(z_s1 + 60.0, 30.0 * s, sig * 35.0 * s)), b(18.0)),
                     (pel.to_world(mid0 + _v(z_s1, 22.0 * s, sig * 45.0 * s)), b(19.0)),
                     (P(45.0, -5.0, -32.0), b(19.0)),
                     (P(15.0, -32.0, -16.0), b(17.0))],
                    [(Wg(0.85, 35.0, -16.0), b(11.0)),
                     (Wg(0.5, 25.0, -18.0), b(15.0)),
                     (P(15.0, -32.0, -16.0), b(17.0)),
                     (P(-5.0, -(h.head_radius_mm + 16.0) / s, -8.0), b(15.0)),
                     (F(-40.0, -12.0, -22.0), b(11.0)),
                     (fp["lt"], b(6.0))],
                ], 30.0),
                _Group(f"{side}_sartorius", [[
                    (Wg(0.5, pel.wing_phi0(0.5), 6.0), b(5.0)),
                    (X(-10.0, yh - 64.0 * s, xh + 14.0 * s), b(8.0)),
                    (F(-70.0, -50.0, -8.0), b(9.0)),
                    (F(-180.0, -35.0, -45.0), b(11.0)),
                ]], 10.0),
                _Group(f"{side}_rectus_femoris", [[
                    (Wg(0.25, 6.0, 4.0), b(6.0)),
                    (X(-20.0, yh - 52.0 * s, xh + 20.0 * s), b(11.0)),
                    (F(-80.0, -42.0, 4.0), b(15.0)),
                    (F(-220.0, -42.0, -2.0), b(15.0)),
                ]], 20.0),
                _Group(f"{side}_vastus_lateralis", [[
                    (F(T[0] - 22.0, 2.0, fp["r_meta"] + 4.0), b(8.0)),
                    (F(-75.0, 2.0, 30.0), b(20.0)),
                    (F(-220.0, -2.0, 30.0), b(22.0)),
                ]], 40.0),
                _Group(f"{side}_vastus_intermedius_medialis", [[
                    (F(T[0] - 45.0, -20.0, 0.0), b(8.0)),
                    (F(-100.0, -24.0, -6.0), b(17.0)),
                    (F(-220.0, -22.0, -18.0), b(22.0)),
                ]], 25.0),
                _Group(f"{side}_adductor_longus_brevis", [[
                    (P(-22.0, -42.0, -62.0), b(8.0)),
                    (X(-60.0, yh - 28.0 * s, xh - 38.0 * s), b(17.0)),
                    (F(-120.0, -12.0, -50.0), b(22.0)),
                    (F(-220.0, -12.0, -42.0), b(15.0)),
                ]], 35.0),
                _Group(f"{side}_pectineus", [[
                    (P(-8.0, -40.0, -32.0), b(7.0)),
                    (F(-45.0, -8.0, -30.0), b(8.0)),
                ]], 15.0),
                _Group(f"{side}_adductor_magnus", [[
                    (P(-52.0, 36.0, -40.0), b(10.0)),
                    (F(-100.0, 14.0, -45.0), b(24.0)),
                    (F(-220.0, 14.0, -30.0), b(24.0)),
                ]], 40.0),
                _Group(f"{side}_hamstrings", [[
                    (P(-55.0, 50.0, -25.0), b(8.0)),
                    (F(-95.0, 42.0, -14.0), b(18.0)),
                    (F(-220.0, 40.0, -5.0), b(25.0)),
                ]], 45.0),
                _Group(f"{side}_obturator_internus", [[
                    (P(18.0, 8.0, -46.0), b(7.0)),
                    (P(-20.0, 14.0, -47.0), b(9.0)),
                    (P(-45.0, 30.0, -40.0), b(7.0)),
                ]], 15.0),
                _Group(f"{side}_obturator_externus", [[
                    (P(-34.0, -8.0, -40.0), b(7.0)),
                    (P(-28.0, 10.0, 6.0), b(6.0)),
                ]], 10.0),
                _Group(f"{side}_quadratus_femoris", [[
                    (P(-44.0, 40.0, -22.0), b(7.0)),
                    (F(T[0] - 6.0, 20.0, -4.0), b(7.0)),
                ]], 12.0),
                _Group(f"{side}_piriformis", [[
                    (pel.to_world(mid0 + _v(40.0 * s, 55.0 * s, sig * 28.0 * s)), b(8.0)),
                    (P(18.0, 52.0, -12.0), b(10.0)),
                    (G + _v(16.0, 6.0, -sig * 6.0), b(5.0)),
                ]], 12.0),
                _Group(f"{side}_rectus_abdominis", [[
                    (X(300.0, y_wall[1], 40.0), b(8.0)),
                    (X(100.0, y_wall[0], 38.0), b(8.0)),
                    (X(30.0, y_wall[2], 30.0), b(7.0)),
                    (pel.to_world(pel.mid(-2.0, -58.0)) + _v(0.0, 0.0, sig * 14.0), b(5.0)),
                ]], 15.0),
                _Group(f"{side}_abdominal_obliques", [[
                    (X(300.0, yh - 10.0, x_flank[1]), b(9.0)),
                    (X(110.0, yh - 10.0, x_flank[0]), b(9.0)),
                    (Wg(0.97, 35.0, 0.0), b(6.0)),
                ]], 20.0),
                _Group(f"{side}_erector_spinae", [[
                    (X(300.0, sac_back(z_s1 / s) + 22.0, 28.0), b(20.0)),
                    (X(z_s1 + 5.0, sac_back(z_s1 / s) + 16.0, 26.0 * s), b(17.0)),
                    (X(45.0, sac_back(45.0) + 8.0, 16.0 * s), b(6.0)),
                ]], 15.0),
            ]
        self.groups = groups


# ---------------------------------------------------------------------------------------------
# Rasterisation
# ---------------------------------------------------------------------------------------------

Box = tuple[float, float, float, float, float, float]
"""(zlo, zhi, ylo, yhi, xlo, xhi) in mm."""


def _points_box(points: Sequence[np.ndarray], pad: float) -> Box:
    arr = np.asarray(points, dtype=np.float64)
    lo, hi = arr.min(axis=0) - pad, arr.max(axis=0) + pad
    return (lo[0], hi[0], lo[1], hi[1], lo[2], hi[2])


class _Chunk:
    """One z slab: axes, labels and warped coordinates."""

    def __init__(self, grid: Grid, lay: _Layout):
        self.z = grid.axis_mm(0)
        self.y = grid.axis_mm(1)
        self.x = grid.axis_mm(2)
        self.shape = grid.shape
        self.labels = np.zeros(grid.shape, dtype=np.uint8)
        self.body_depth: np.ndarray | None = None  # signed distance past the subcutaneous fat
        self.pad = lay.amp
        z3, y3, x3 = self.z[:, None, None], self.y[None, :, None], self.x[None, None, :]
        uz = np.zeros(grid.shape, np.float32)
        uy = np.zeros(grid.shape, np.float32)
        ux = np.zeros(grid.shape, np.float32)
        if lay.amp > 0:
            for i in range(lay.wave_k.shape[0]):
                kz, ky, kx = (np.float32(c) for c in lay.wave_k[i])
                th = (z3 * kz + np.float32(lay.wave_phase[i])) + y3 * ky + x3 * kx
                sn = np.sin(th)
                uz += np.float32(lay.wave_amp[0, i]) * sn
                uy += np.float32(lay.wave_amp[1, i]) * sn
                ux += np.float32(lay.wave_amp[2, i]) * sn
        uz += z3
        uy += y3
        ux += x3
        self.warped = (uz, uy, ux)

    def slices(self, box: Box, warped: bool):
        pad = self.pad if warped else 0.0
        out = []
        for axis, (lo, hi) in zip((self.z, self.y, self.x), ((box[0], box[1]), (box[2], box[3]),
                                                             (box[4], box[5]))):
            i0 = int(np.searchsorted(axis, lo - pad, side="left"))
            i1 = int(np.searchsorted(axis, hi + pad, side="right"))
            if i1 <= i0:
                return None
            out.append(slice(i0, i1))
        return tuple(out)

    def coords(self, sl, warped: bool):
        if warped:
            return tuple(c[sl] for c in self.warped)
        return (self.z[sl[0]][:, None, None], self.y[sl[1]][None, :, None],
                self.x[sl[2]][None, None, :])

    def paint(self, sl, mask, label: Tissue) -> None:
        view = self.labels[sl]
        view[mask] = np.uint8(label)


def rasterize_anatomy(anatomy: Anatomy, grid: Grid, cfg: PhantomConfig) -> np.ndarray:
    """Label volume (uint8 [z, y, x], values of :class:`Tissue`) of ``anatomy`` on ``grid``.

    Deterministic: the same anatomy, grid and config give bit-identical labels. Works in z slabs
    of about ``cfg.chunk_voxels`` voxels.
    """
    lay = _Layout(anatomy, cfg)
    nz, ny, nx = grid.shape
    out = np.empty(grid.shape, dtype=np.uint8)
    step = max(1, int(cfg.chunk_voxels) // (ny * nx))
    for z0 in range(0, nz, step):
        z1 = min(nz, z0 + step)
        chunk = _Chunk(grid.zslab(z0, z1), lay)
        _rasterize_chunk(chunk, lay)
        out[z0:z1] = chunk.labels
    return out


def _rasterize_chunk(ch: _Chunk, lay: _Layout) -> None:
    env = _paint_body(ch, lay)
    cav = _cavity_mask(ch, lay, env)
    _paint_muscles(ch, lay, env, cav)
    _paint_pelvic_organs(ch, lay, cav)
    _paint_vessels(ch, lay)
    for side in ("left", "right"):
        _paint_pelvis_side(ch, lay, side)
    for side in ("left", "right"):
        _paint_hip_joint(ch, lay, side)


# -- body outline, skin, subcutaneous fat ------------------------------------------------------


def _paint_body(ch: _Chunk, lay: _Layout) -> np.ndarray:
    """Skin and subcutaneous fat; returns the mask of the space inside the fat.

    The outline's cross-section profiles are looked up at the plane's own z; the deformation
    moves the outline within the plane.
    """
    _, yw, xw = ch.warped
    z = ch.z.astype(np.float64)
    a, ba, bp = lay.trunk(z)
    a3 = a.astype(np.float32)[:, None, None]
    b3 = np.where(yw < 0, np.float32(ba)[:, None, None], np.float32(bp)[:, None, None])
    body = _ellipse2(xw, yw, a3, b3)
    cap = (lay.trunk_bottom - z).astype(np.float32)[:, None, None]
    body = np.maximum(body, cap)
    sel = np.nonzero(z < lay.thigh_top + 20.0)[0]
    if sel.size:
        zs = slice(int(sel[0]), int(sel[-1]) + 1)
        for side in ("left", "right"):
            xc, rx, yc, ry = lay.thigh_at(side, z[zs])
            f32 = lambda v: np.asarray(v, np.float32)[:, None, None]  # noqa: E731
            th = _ellipse2(xw[zs] - f32(xc), yw[zs] - f32(yc), f32(rx), f32(ry))
            th = np.maximum(th, f32(z[zs] - lay.thigh_top))
            body[zs] = _smin(body[zs], th, 18.0)
    inside = body < 0
    ch.labels[inside] = Tissue.SKIN
    # subcutaneous fat, thicker over the back / buttocks and (optionally) the abdomen
    Y = np.clip(yw * np.float32(2.0 / lay.D), -1.0, 1.0)
    fat = np.float32(lay.fat) * (1.0 + np.float32(lay.fat_post) * np.maximum(Y, 0) ** 2
                                 + np.float32(lay.fat_ant) * np.minimum(Y, 0) ** 2)
    body += np.float32(lay.skin)
    ch.labels[body < 0] = Tissue.FAT
    body += fat
    env = body < 0
    ch.body_depth = body  # distance past the fat (negative inside), reused for fascia
    return env


# -- pelvic cavity -----------------------------------------------------------------------------


def _cavity_mask(ch: _Chunk, lay: _Layout, env: np.ndarray) -> np.ndarray:
    z = ch.z.astype(np.float64)
    cav = np.zeros(ch.shape, dtype=bool)
    sel = np.nonzero(z >= lay.cav_lo)[0]
    if not sel.size:
        return cav
    zs = slice(int(sel[0]), int(sel[-1]) + 1)
    a, ym, hf, hb = lay.cavity(z[zs])
    f32 = lambda v: np.asarray(v, np.float32)[:, None, None]  # noqa: E731
    amax = float(np.max(a)) + lay.amp
    ylo, yhi = float(np.min(ym - hf)) - lay.amp, float(np.max(ym + hb)) + lay.amp
    ys = slice(int(np.searchsorted(ch.y, ylo)), int(np.searchsorted(ch.y, yhi, side="right")))
    xs = slice(int(np.searchsorted(ch.x, -amax)), int(np.searchsorted(ch.x, amax, side="right")))
    if ys.stop <= ys.start or xs.stop <= xs.start:
        return cav
    sl = (zs, ys, xs)
    _, yw, xw = (c[sl] for c in ch.warped)
    dy = yw - f32(ym)
    b = np.where(dy < 0, f32(hf), f32(hb))
    d = _ellipse2(xw, dy, f32(a), b)
    cav[sl] = (d < 0) & env[sl]
    return cav


# -- muscles -----------------------------------------------------------------------------------


def _chain_box(chain, pad: float) -> Box:
    pts = [q for q, _ in chain]
    rmax = max(r for _, r in chain)
    return _points_box(pts, rmax + pad)


def _paint_muscles(ch: _Chunk, lay: _Layout, env: np.ndarray, cav: np.ndarray) -> None:
    """Labelled Voronoi partition of the space inside the fat into muscle groups."""
    m1 = np.full(ch.shape, _BIG, np.float32)
    m2 = np.full(ch.shape, _BIG, np.float32)
    idx = np.zeros(ch.shape, np.uint8)
    tau = np.float32(lay.plane)
    for gi, grp in enumerate(lay.groups, start=1):
        # a group exists only within ``margin`` of its capsules: evaluate it in that box only
        boxes = [_chain_box(chain, grp.margin + 1.0) for chain in grp.chains]
        gbox = (min(b[0] for b in boxes), max(b[1] for b in boxes), min(b[2] for b in boxes),
                max(b[3] for b in boxes), min(b[4] for b in boxes), max(b[5] for b in boxes))
        gsl = ch.slices(gbox, warped=True)
        if gsl is None:
            continue
        q = ch.coords(gsl, warped=True)
        dist = None
        for chain in grp.chains:
            for (pa, ra), (pb, rb) in zip(chain[:-1], chain[1:]):
                d = _capsule(q, pa, pb, ra, rb)
                dist = d if dist is None else np.minimum(dist, d, out=dist)
        dist[dist >= grp.margin] = _BIG
        v1, v2, vi = m1[gsl], m2[gsl], idx[gsl]
        closer = dist < v1
        second = np.where(closer, v1, np.minimum(v2, dist))
        np.minimum(v1, dist, out=v1)
        v2[...] = second
        vi[closer] = gi
    margins = np.array([0.0] + [g.margin for g in lay.groups], np.float32)
    # muscle: inside some group, not near the bisector with the next group (fat plane) and not
    # at the rim of the group's reach (fat plane against whatever lies beyond)
    muscle = env & ~cav & ((m2 - m1) >= tau) & (m1 <= margins[idx] - tau)
    ch.labels[env] = Tissue.FAT
    ch.labels[muscle] = Tissue.MUSCLE
    # iliotibial band / fascia lata: a thin tendon sheet under the fat on the side of the thigh
    depth = ch.body_depth
    zs = np.nonzero(ch.z < -20.0)[0]
    if zs.size:
        s = slice(int(zs[0]), int(zs[-1]) + 1)
        for side, h in lay.hips.items():
            sig = 1.0 if side == "left" else -1.0
            fx = np.array([_femur_axis_point(h, float(zz))[2] for zz in ch.z[s]], np.float32)
            fy = np.array([_femur_axis_point(h, float(zz))[1] for zz in ch.z[s]], np.float32)
            _, yw, xw = (c[s] for c in ch.warped)
            band = ((depth[s] < 0) & (depth[s] > -2.0) & (sig * (xw - fx[:, None, None]) > 15.0)
                    & (np.abs(yw - fy[:, None, None]) < 30.0))
            ch.labels[s][band] = Tissue.TENDON


# -- pelvic organs -----------------------------------------------------------------------------


def _paint_pelvic_organs(ch: _Chunk, lay: _Layout, cav: np.ndarray) -> None:
    ch.labels[cav] = Tissue.FAT
    s = lay.scale
    # levator ani: a thin muscular funnel from the pelvic side walls to the anorectal junction
    z = ch.z.astype(np.float64)
    sel = np.nonzero((z > -60.0 * s) & (z < -8.0 * s))[0]
    if sel.size:
        zs = slice(int(sel[0]), int(sel[-1]) + 1)
        rl = np.interp(z[zs], [-60.0 * s, -42.0 * s, -25.0 * s, -8.0 * s], [9.0, 22.0, 33.0, 40.0])
        yr = np.interp(z[zs], [-60.0 * s, -8.0 * s], [lay.yh + 40.0 * s, lay.yh + 30.0 * s])
        _, yw, xw = (c[zs] for c in ch.warped)
        dy = (yw - np.asarray(yr, np.float32)[:, None, None]) * np.float32(1.25)
        r = np.sqrt(xw * xw + dy * dy)
        funnel = (np.abs(r - np.asarray(rl, np.float32)[:, None, None]) < 2.5) & cav[zs]
        ch.labels[zs][funnel] = Tissue.MUSCLE
    # small bowel and sigmoid colon, only inside the cavity
    for pa, pb, r in lay.bowel:
        sl = ch.slices(_points_box([pa, pb], r), warped=True)
        if sl is None:
            continue
        q = ch.coords(sl, warped=True)
        inside = (_capsule(q, pa, pb, r, r) < 0) & cav[sl]
        ch.paint(sl, inside, Tissue.BOWEL)
    _paint_chain(ch, lay.sigmoid, Tissue.BOWEL, wall=(Tissue.MUSCLE, 2.0), within=cav)
    # rectum and anal canal: muscular wall, lumen
    outer = [(q, ro) for q, ro, _ in lay.rectum]
    inner = [(q, ri) for q, _, ri in lay.rectum]
    _paint_chain(ch, outer, Tissue.MUSCLE)
    _paint_chain(ch, inner, Tissue.BOWEL)
    # urinary bladder: detrusor wall around urine
    c, (rz, ry, rx) = lay.bladder
    wall = 2.5
    sl = ch.slices(_points_box([c], max(rz, ry, rx) + wall), warped=True)
    if sl is not None:
        q = ch.coords(sl, warped=True)
        d = _ellipsoid(q, c, (rz + wall, ry + wall, rx + wall))
        ch.paint(sl, d < 0, Tissue.MUSCLE)
        d = _ellipsoid(q, c, (rz, ry, rx))
        ch.paint(sl, d < 0, Tissue.URINE)


def _paint_chain(ch: _Chunk, chain, label: Tissue, wall=None, within=None) -> None:
    """Paint a chain of tapered capsules [(point, radius), ...] (warped coordinates)."""
    extra = wall[1] if wall else 0.0
    sl = ch.slices(_chain_box(chain, extra), warped=True)
    if sl is None:
        return
    q = ch.coords(sl, warped=True)
    d = None
    for (pa, ra), (pb, rb) in zip(chain[:-1], chain[1:]):
        di = _capsule(q, pa, pb, ra, rb)
        d = di if d is None else np.minimum(d, di)
    lim = within[sl] if within is not None else True
    if wall:
        ch.paint(sl, (d < extra) & lim, wall[0])
    ch.paint(sl, (d < 0) & lim, label)


def _paint_vessels(ch: _Chunk, lay: _Layout) -> None:
    for pts, r, sheath in lay.vessels:
        chain = [(q, r) for q in pts]
        _paint_chain(ch, chain, Tissue.BLOOD, wall=(Tissue.FAT, sheath))


# -- bones -------------------------------------------------------------------------------------


def _paint_bone(ch: _Chunk, sl, sdf: np.ndarray, cortex, marrow_label) -> None:
    """Cortical shell of thickness ``cortex`` (mm, scalar or array) around marrow."""
    bone = sdf < 0
    ch.paint(sl, bone, Tissue.CORTICAL_BONE)
    inner = sdf < -cortex
    if isinstance(marrow_label, np.ndarray):
        view = ch.labels[sl]
        view[inner] = marrow_label[inner]
    else:
        ch.paint(sl, inner, marrow_label)


class _Accum:
    """Smooth union of distance fields over one box of the chunk."""

    def __init__(self, ch: _Chunk, box: Box, warped: bool = False):
        self.ch = ch
        self.sl = ch.slices(box, warped)
        if self.sl is not None:
            self.d = np.full(tuple(s.stop - s.start for s in self.sl), _BIG, np.float32)
            self.q = ch.coords(self.sl, warped)

    def add(self, dist: np.ndarray, k: float) -> None:
        self.d = _smin(self.d, dist, k)


def _paint_pelvis_side(ch: _Chunk, lay: _Layout, side: str) -> None:
    pel, s = lay.pel, lay.scale
    h = lay.hips[side]
    sig = 1.0 if side == "left" else -1.0
    H = np.array(h.head_centre_mm)
    xh = abs(H[2])
    # conservative world box of this half-pelvis
    zlo = H[0] - 80.0 * s - 25.0
    zhi = H[0] + pel.crest + 60.0 * s + 25.0
    ylo, yhi = lay.yh - 95.0 * s - 25.0, lay.yh + 115.0 * s + 25.0
    x_out = xh + 65.0 * s
    box = (zlo, zhi, ylo, yhi, 0.0, x_out) if sig > 0 else (zlo, zhi, ylo, yhi, -x_out, -1e-3)
    acc = _Accum(ch, box)
    if acc.sl is None:
        return
    zq, yq, xq = acc.q
    zp, yp = pel.coords(zq, yq)  # (nz, ny, 1) pelvic-frame coordinates
    qp = (zp, yp, xq)
    hp = pel.hp[side]
    # ilium wing
    cx, cy = pel.wing_centre(side)
    zr = zp - float(hp[0])
    zf = zr * (1.0 / pel.crest)
    ax = np.asarray(pel.wing_ax(zr), np.float32)
    ay = np.float32(110.0 * s)
    X = (xq - np.float32(cx)) * np.float32(sig) / ax
    Y = (yp - np.float32(cy)) / ay
    rho = np.sqrt(X * X + Y * Y)
    g = np.sqrt((X / ax) ** 2 + (Y / ay) ** 2)
    d_perp = np.abs(rho - 1.0) * (rho + 1e-3) / (g + 1e-3 / ay)
    phi = np.degrees(np.arctan2(Y, X))
    phi0 = np.asarray(np.interp(zf, pel.WING_Z, pel.WING_PHI0), np.float32)
    phi1 = np.asarray(np.interp(zf, pel.WING_Z, pel.WING_PHI1), np.float32)
    t = np.asarray(np.interp(zf, pel.WING_Z, pel.WING_T), np.float32) * np.float32(s)
    win = np.clip((zf - 0.4) / 0.1, 0, 1) * np.clip((0.97 - zf) / 0.1, 0, 1)
    t = t + np.float32(14.0 * s) * np.clip((phi - 60.0) / 25.0, 0, 1) * np.asarray(win, np.float32)
    arc = np.float32(math.radians(1.0) * 0.5 * (84.0 + 110.0) * s)
    d_ang = np.maximum(phi0 - phi, phi - phi1) * arc
    wing = np.maximum(np.maximum(d_perp - 0.5 * t, d_ang),
                      np.maximum(zr - np.float32(pel.crest), np.float32(0.03 * pel.crest) - zr))
    acc.add(wing, 0.0)
    # acetabular block (world frame; the socket is carved below)
    a = np.array(h.acetabulum_axis)
    r_acet = h.acetabulum_radius_mm
    lat = _v(0.0, 0.0, sig)
    cblk = H + _v(3.0, 3.0, 0.0) + 4.0 * lat
    qw = acc.q
    blk = np.maximum(_sphere(qw, cblk, r_acet + 10.0), _dot(qw, H, a))
    acc.add(blk, 6.0)
    # posterior column, ischium, pubic rami (pelvic frame)
    R = lambda dz, dy, dx: pel.rel(side, dz, dy, dx)  # noqa: E731
    acc.add(_capsule(qp, R(8.0, 24.0, -4.0), R(-40.0, 40.0, -28.0), 15.0 * s, 12.0 * s), 6.0)
    acc.add(_ellipsoid(qp, R(-50.0, 44.0, -31.0), (15.0 * s, 13.0 * s, 12.0 * s)), 5.0)
    sym = pel.mid(-24.0, -46.0) + _v(0.0, 0.0, sig * 11.0 * s)
    sym_top = pel.mid(-10.0, -44.0) + _v(0.0, 0.0, sig * 16.0 * s)
    acc.add(_capsule(qp, R(-4.0, -22.0, -14.0), sym_top, 11.0 * s, 9.0 * s), 5.0)
    acc.add(_ellipsoid(qp, sym, (18.0 * s, 10.0 * s, 9.5 * s)), 4.0)
    sym_low = pel.mid(-36.0, -42.0) + _v(0.0, 0.0, sig * 13.0 * s)
    acc.add(_capsule(qp, sym_low, R(-52.0, 32.0, -36.0), 7.0 * s, 8.0 * s), 4.0)
    # carve the socket
    d_pel = np.maximum(acc.d, r_acet - (_sphere(qw, H, 0.0)))
    # sacrum and coccyx (+ lumbar column above), midline, in this half
    szk, sw, sd, syc, z_s1 = pel.sacrum_profile()
    m0 = pel.mid(0.0, 0.0)
    zm = zp - float(m0[0])
    w = np.asarray(np.interp(zm, szk, sw), np.float32)
    dd = np.asarray(np.interp(zm, szk, sd), np.float32)
    yc = np.asarray(np.interp(zm, szk, syc), np.float32) + np.float32(m0[1])
    sac = _ellipse2(xq, yp - yc, w, dd)
    sac = np.maximum(sac, np.maximum(zm - np.float32(z_s1), np.float32(szk[0]) - zm))
    # lumbar vertebral bodies and discs above S1 (period 38 mm: 28 bone + 10 disc)
    vb = _ellipse2(xq, yp - np.float32(m0[1] + 42.0 * s), np.float32(24.0 * s),
                   np.float32(17.0 * s))
    vb = np.maximum(vb, np.float32(z_s1) - zm)
    phase = np.mod(zm - np.float32(z_s1), np.float32(38.0))
    disc = vb < 0
    disc &= phase < 10.0
    # SI joint: a thin cartilage line where sacrum meets ilium
    sl = acc.sl
    _paint_bone(ch, sl, np.minimum(sac, np.where(phase >= 10.0, vb, _BIG)), 1.5, Tissue.RED_MARROW)
    ch.paint(sl, disc, Tissue.CARTILAGE)
    # pubic symphysis disc
    symd = _ellipsoid(qp, pel.mid(-24.0, -46.0), (16.0 * s, 8.0 * s, 3.0))
    ch.paint(sl, symd < 0, Tissue.CARTILAGE)
    _paint_bone(ch, sl, d_pel, 1.8, Tissue.RED_MARROW)
    si = (sac < 0) & (np.abs(wing) < 1.2)
    ch.paint(sl, si, Tissue.CARTILAGE)


def _paint_hip_joint(ch: _Chunk, lay: _Layout, side: str) -> None:
    """Socket contents, capsule, femur, femoral cartilage (unwarped, world frame)."""
    h = lay.hips[side]
    fp = lay.fem[side]
    H, n, a = np.array(h.head_centre_mm), np.array(h.neck_axis), np.array(h.acetabulum_axis)
    r_h, r_acet = h.head_radius_mm, h.acetabulum_radius_mm
    cart, fluid = lay.cart, lay.fluid
    # socket: acetabular cartilage, fluid film, fossa fat pad, labrum
    sl = ch.slices(_points_box([H], r_acet + 6.0), warped=False)
    if sl is not None:
        q = ch.coords(sl, warped=False)
        r = _sphere(q, H, 0.0)
        ax = _dot(q, H, a)
        in_socket = (r < r_acet) & (ax < 0)
        ch.paint(sl, in_socket & (r >= r_h + cart), Tissue.SYNOVIAL_FLUID)
        ch.paint(sl, in_socket & (r >= r_h + cart + fluid), Tissue.CARTILAGE)
        fossa = in_socket & (r >= r_h + cart + fluid) & (-ax > 0.9 * r)
        ch.paint(sl, fossa, Tissue.FAT)
        labrum = (ax >= 0) & (ax < 5.0) & (r >= r_h + cart) & (r < r_acet + 4.0)
        labrum &= ch.labels[sl] != Tissue.CORTICAL_BONE
        ch.paint(sl, labrum, Tissue.TENDON)
    # joint capsule (ligaments) around head and neck, fluid in the recess
    T = fp["top"]
    c_end = H + 0.8 * h.neck_length_mm * n
    r0, r1 = r_h + cart + 0.5, fp["r_neck"] + 2.5
    sl = ch.slices(_points_box([H, c_end], max(r0, r1) + 3.0), warped=False)
    if sl is not None:
        q = ch.coords(sl, warped=False)
        d = _capsule(q, H, c_end, r0, r1)
        soft = np.isin(ch.labels[sl], (Tissue.FAT, Tissue.MUSCLE))
        outside_socket = _dot(q, H, a) > -2.0
        ch.paint(sl, soft & outside_socket & (d < 2.0), Tissue.TENDON)
        ch.paint(sl, soft & outside_socket & (d < 0), Tissue.SYNOVIAL_FLUID)
    # femur: head, neck, trochanters, shaft
    shaft = fp["shaft"]
    above, bottom = T - 12.0 * shaft, T + 3000.0 * shaft  # the shaft runs past any grid
    # bounding box: the proximal femur plus the part of the shaft level with this slab
    t_end = max(0.0, (float(ch.z[0]) - 1.0 - T[0]) / shaft[0]) + 20.0
    pts = [H, T, fp["gt"], fp["lt"], above, T + t_end * shaft]
    box = _points_box(pts, max(r_h, fp["r_meta"], max(fp["gt_radii"])) + 3.0)
    acc = _Accum(ch, box)
    if acc.sl is None:
        return
    q = acc.q
    acc.add(_sphere(q, H, r_h), 0.0)
    acc.add(_capsule(q, H, T, fp["r_neck"], 0.75 * fp["r_meta"]), 5.0)
    ts = _dot(q, T, shaft)  # distance down the shaft from the shaft top
    ds, _ = _seg_dist(q, above, bottom)
    r_sh = h.shaft_radius_mm + (fp["r_meta"] - h.shaft_radius_mm) * (1.0 - _smoothstep(ts / 60.0))
    acc.add(ds - r_sh, 6.0)
    acc.add(_ellipsoid(q, fp["gt"], fp["gt_radii"]), 7.0)
    acc.add(_sphere(q, fp["lt"], fp["lt_radius"]), 5.0)
    cort_shaft = h.shaft_radius_mm - h.canal_radius_mm
    cortex = 1.8 + (cort_shaft - 1.8) * _smoothstep((ts - 25.0) / 60.0)
    marrow = np.where(ts > 50.0, np.uint8(Tissue.YELLOW_MARROW), np.uint8(Tissue.RED_MARROW))
    _paint_bone(ch, acc.sl, acc.d, cortex, np.broadcast_to(marrow, acc.d.shape))
    # femoral head cartilage (not on the neck side)
    sl = ch.slices(_points_box([H], r_h + cart + 1.0), warped=False)
    if sl is not None:
        q = ch.coords(sl, warped=False)
        r = _sphere(q, H, 0.0)
        off_neck = _dot(q, H, n) < math.cos(math.radians(40.0)) * r
        ch.paint(sl, (r >= r_h) & (r < r_h + cart) & off_neck, Tissue.CARTILAGE)


# ---------------------------------------------------------------------------------------------
# Tissue property maps
# ---------------------------------------------------------------------------------------------


@dataclass
class TissueMaps:
    """MR property maps on the phantom grid, each float32 [z, y, x]."""

    pd: np.ndarray
    """Relative proton density (0..1)."""
    t1_ms: np.ndarray
    t2_ms: np.ndarray
    chi_ppm: np.ndarray
    """Volume susceptibility, ppm (SI); not textured."""


def _hash_uniform(seed: int, i: np.ndarray, j: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Deterministic uniform values in [-1, 1) for integer lattice nodes (broadcast i, j, k)."""
    with np.errstate(over="ignore"):
        h = (i.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             ^ j.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
             ^ k.astype(np.uint64) * np.uint64(0x165667B19E3779F9)
             ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * np.uint64(0x27D4EB2F165667C5))
        # splitmix64 finaliser
        h ^= h >> np.uint64(30)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(27)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    return ((h >> np.uint64(11)).astype(np.float64) * (2.0 / 2**53) - 1.0).astype(np.float32)


def _lattice_weights(coord: np.ndarray, spacing: float):
    """Lattice node indices and smoothstep weights of 1D coordinates (mm)."""
    u = coord.astype(np.float64) / spacing
    i0 = np.floor(u).astype(np.int64)
    w = u - i0
    w = w * w * (3.0 - 2.0 * w)
    return i0, w.astype(np.float32)


def _value_noise(seed: int, grid: Grid, spacing: float, z_slice: slice) -> np.ndarray:
    """Smooth value noise (node values uniform in [-1, 1)) on planes ``z_slice`` of ``grid``.

    Lattice nodes sit at integer multiples of ``spacing`` mm in patient coordinates, so the
    field does not depend on the grid. Separable smoothstep interpolation between nodes.
    """
    iz, wz = _lattice_weights(grid.axis_mm(0)[z_slice], spacing)
    iy, wy = _lattice_weights(grid.axis_mm(1), spacing)
    ix, wx = _lattice_weights(grid.axis_mm(2), spacing)
    lz = np.arange(iz.min(), iz.max() + 2)
    ly = np.arange(iy.min(), iy.max() + 2)
    lx = np.arange(ix.min(), ix.max() + 2)
    nodes = _hash_uniform(seed, lz[:, None, None], ly[None, :, None], lx[None, None, :])
    # interpolate along x, then y, then z
    jx = ix - lx[0]
    a = nodes[:, :, jx] * (1.0 - wx) + nodes[:, :, jx + 1] * wx
    jy = iy - ly[0]
    a = a[:, jy, :] * (1.0 - wy)[None, :, None] + a[:, jy + 1, :] * wy[None, :, None]
    jz = iz - lz[0]
    return a[jz] * (1.0 - wz)[:, None, None] + a[jz + 1] * wz[:, None, None]


def _texture(seed: int, grid: Grid, spacing: float, z_slice: slice) -> np.ndarray:
    """Two octaves of value noise, unit-ish standard deviation."""
    coarse = _value_noise(seed, grid, spacing, z_slice)
    fine = _value_noise(seed + 7919, grid, spacing / 2.5, z_slice)
    return (coarse + 0.5 * fine) * np.float32(1.6)


def tissue_maps(labels: np.ndarray, anatomy: Anatomy, grid: Grid, b0_t: float,
                cfg: PhantomConfig) -> TissueMaps:
    """PD, T1, T2 and susceptibility maps (float32 [z, y, x]) of a label volume.

    Properties come from :func:`~sim_scanner.physics.tissues.tissue_properties` at ``b0_t``, varied per
    subject and tissue by ``cfg.property_variation`` (deterministic from ``anatomy.seed``); PD
    (and, less, T2) carry a smooth multiplicative texture defined in mm. Susceptibility is not
    textured. Unknown label values raise ValueError.
    """
    if labels.shape != grid.shape:
        raise ValueError(f"labels shape {labels.shape} does not match grid shape {grid.shape}")
    if labels.dtype != np.uint8:
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"labels must be an integer (uint8) array, got {labels.dtype}")
        if labels.size and (labels.min() < 0 or labels.max() > 255):
            bad = int(labels.min()) if labels.min() < 0 else int(labels.max())
            raise ValueError(f"labels contain values with no tissue properties: [{bad}]")
        labels = labels.astype(np.uint8)
    props = tissue_properties(b0_t)
    known = np.zeros(256, dtype=bool)
    for t in props:
        known[int(t)] = True
    present = np.flatnonzero(np.bincount(labels.ravel(), minlength=256))
    unknown = [int(v) for v in present if not known[v]]
    if unknown:
        raise ValueError(f"labels contain values with no tissue properties: {unknown} "
                         f"(known: {sorted(int(t) for t in props)})")
    rng = np.random.default_rng([anatomy.seed, 2])
    v = float(cfg.property_variation)
    pd_t = np.zeros(256, np.float32)
    t1_t = np.ones(256, np.float32)
    t2_t = np.ones(256, np.float32)
    chi_t = np.zeros(256, np.float32)
    for t in sorted(props, key=int):
        pr = props[t]
        f = 1.0 + v * np.clip(rng.normal(size=3), -2.5, 2.5)
        pd_t[int(t)] = min(1.0, pr.pd * f[0])
        t1_t[int(t)] = pr.t1_ms * f[1]
        t2_t[int(t)] = pr.t2_ms * f[2]
        chi_t[int(t)] = pr.chi_ppm
    amp = float(anatomy.params.get("texture_amplitude", 0.0))
    out = TissueMaps(
        pd=np.empty(grid.shape, np.float32), t1_ms=np.empty(grid.shape, np.float32),
        t2_ms=np.empty(grid.shape, np.float32), chi_ppm=np.empty(grid.shape, np.float32),
    )
    nz, ny, nx = grid.shape
    step = max(1, int(cfg.chunk_voxels) // (ny * nx))
    seed_pd = (anatomy.seed * 2 + 1) & 0x7FFFFFFF
    seed_t2 = (anatomy.seed * 2 + 2) & 0x7FFFFFFF
    for z0 in range(0, nz, step):
        zs = slice(z0, min(nz, z0 + step))
        lab = labels[zs]
        pd = pd_t[lab]
        t2 = t2_t[lab]
        if amp > 0:
            pd *= 1.0 + np.float32(amp) * _texture(seed_pd, grid, cfg.texture_scale_mm, zs)
            t2 *= 1.0 + np.float32(0.5 * amp) * _texture(seed_t2, grid, cfg.texture_scale_mm, zs)
        np.clip(pd, 0.0, 1.0, out=pd)
        out.pd[zs] = pd
        out.t1_ms[zs] = t1_t[lab]
        out.t2_ms[zs] = t2
        out.chi_ppm[zs] = chi_t[lab]
    return out


def phantom_params(anatomy: Anatomy) -> dict[str, Any]:
    """JSON-able summary of a subject: its drawn parameters and hip landmarks."""
    out: dict[str, Any] = {"seed": anatomy.seed, **anatomy.params}
    for side, h in anatomy.hips.items():
        for f in fields(h):
            val = getattr(h, f.name)
            out[f"hip_{side}_{f.name}"] = list(val) if isinstance(val, tuple) else val
    return out
