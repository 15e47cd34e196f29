"""Total hip arthroplasty (THA) placed in a phantom's hip joint, for metal-artifact simulation.

The implant has four components, as in the MASC paper's simulator: a femoral stem, a femoral
head, an acetabular liner and an acetabular cup, the last two hemispherical shells. Three phases,
like the phantom:

1. :func:`draw_implant` draws sizes, materials and placement from the anatomy's hip landmarks
   (:class:`~sim_scanner.physics.phantom.HipJoint`) and a seeded generator -> :class:`ImplantParams`;
2. :func:`rasterize_implant` labels the voxels of each :class:`Component` on a
   :class:`~sim_scanner.physics.grid.Grid` (uint8 [z, y, x], by voxel centre);
3. :func:`postop_labels` turns the native tissue labels into the post-operative anatomy
   (resected femoral head and neck, implant voxels labelled ``Tissue.IMPLANT``), and
   :func:`implant_chi_ppm` gives each component's volume susceptibility.

Coordinates follow :mod:`sim_scanner.physics.grid`: points and directions are (z, y, x) in mm, DICOM LPS
(+x patient left, +y posterior, +z superior).

Cup orientation uses the *radiographic* definitions of Murray (J Bone Joint Surg Br 1993;
75-B:228-232), measured against the body axes, not against the native acetabulum:

* the cup axis is the unit normal of the cup's opening plane, pointing out of the opening
  (lateral, inferior and anterior);
* radiographic inclination: angle between the longitudinal (z) axis and the cup axis projected
  onto the coronal (x-z) plane, 0 deg = opening facing straight down, 90 deg = facing laterally;
* radiographic anteversion: angle between the cup axis and the coronal plane (positive anterior).

So ``axis = (-cos(RA) cos(RI), -sin(RA), +-cos(RA) sin(RI))`` in (z, y, x), + for the left hip.
The Lewinnek "safe zone" is 40 +- 10 deg inclination, 15 +- 10 deg anteversion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from sim_scanner.physics.grid import Grid, rotate_zyx
from sim_scanner.physics.tissues import Tissue

if TYPE_CHECKING:
    from sim_scanner.physics.phantom import Anatomy, HipJoint


class Component(IntEnum):
    """Implant component labels (stored in datasets; never renumber)."""

    NONE = 0
    STEM = 1
    HEAD = 2
    LINER = 3
    CUP = 4


COMPONENT_NAMES: tuple[str, ...] = ("stem", "head", "liner", "cup")
"""Lower-case names of the components, the keys of :attr:`ImplantParams.materials`."""

MATERIAL_CHI_PPM: dict[str, float] = {
    # Cobalt-chromium(-molybdenum) alloy: 900 ppm, the value of the MASC paper's implant model.
    "cocr": 900.0,
    # Commercially pure titanium: 182 ppm (Schenck, Med Phys 1996; 23:815-850). Ti-6Al-4V is
    # within a few ppm of it.
    "titanium": 182.0,
    # Austenitic (non-ferromagnetic) stainless steel, e.g. 316L: Schenck 1996 gives roughly
    # 3520-6700 ppm depending on composition and cold work; we take the low end.
    "stainless_steel": 3520.0,
    # UHMW polyethylene liner: diamagnetic like water. The Pascal-constant estimate for
    # -(CH2)- chains at 0.94 g/cm^3 is about -9.5 ppm; within ~0.5 ppm of tissue either way.
    "polyethylene": -9.1,
    # Alumina / zirconia ceramics (heads, liners): diamagnetic, near tissue. Approximate values
    # from the CRC Handbook molar susceptibilities (chi_SI = 4 pi chi_mol rho / M): Al2O3
    # (-37e-6 cm^3/mol, 3.97 g/cm^3) ~ -18 ppm, ZrO2 (-13.8e-6 cm^3/mol, ~5.7 g/cm^3) ~ -8 ppm.
    "ceramic": -18.0,
    # Soft tissue / water, the simulator default quoted by the MASC paper.
    "tissue": -9.05,
}
"""Volume susceptibility (SI, ppm) of the implant materials, by name."""

_FEMUR_LABELS = (Tissue.CORTICAL_BONE, Tissue.YELLOW_MARROW, Tissue.RED_MARROW, Tissue.CARTILAGE)
"""Native labels that the resection of the femoral head and neck removes."""

_CORTEX_MARGIN_MM = 1.0
"""The stem's proximal radius stays this far inside the femur's outer radius."""


@dataclass(frozen=True)
class ImplantConfig:
    """Total hip arthroplasty: stem, head, liner and cup (config section ``implant``).

    Defaults: CoCr stem, head and cup (the MASC paper's implant) with a polyethylene liner.
    Ranges ``(low, high)`` are drawn uniformly per subject.
    """

    side: Literal["random", "left", "right"] = "random"
    """Hip that receives the implant; "random" draws left or right with equal probability."""
    stem_material: str = "cocr"
    """Material of the femoral stem (a key of MATERIAL_CHI_PPM or extra_materials_chi_ppm)."""
    head_material: str = "cocr"
    """Material of the femoral head."""
    liner_material: str = "polyethylene"
    """Material of the acetabular liner."""
    cup_material: str = "cocr"
    """Material of the acetabular cup (shell)."""
    extra_materials_chi_ppm: dict[str, float] = field(default_factory=dict)
    """User-defined materials, name -> volume susceptibility in ppm (may override built-ins)."""
    head_diameters_mm: tuple[float, ...] = (28.0, 32.0, 36.0)
    """Available femoral head sizes, mm; one that leaves room for the liner is drawn uniformly."""
    cup_oversize_mm: tuple[float, float] = (2.0, 6.0)
    """Cup outer diameter minus the native acetabulum diameter (reaming), mm; the result is
    rounded to the 2 mm size steps of commercial cups."""
    cup_diameter_limits_mm: tuple[float, float] = (44.0, 64.0)
    """Smallest and largest cup outer diameter, mm."""
    cup_thickness_mm: tuple[float, float] = (3.0, 5.0)
    """Thickness of the metal shell, mm."""
    min_liner_thickness_mm: float = 3.0
    """Thinnest allowed liner (cup inner radius - head radius), mm; larger heads that would
    leave less are not drawn."""
    cup_inclination_deg: tuple[float, float] = (30.0, 50.0)
    """Radiographic inclination (Murray 1993) relative to the body axes, degrees."""
    cup_anteversion_deg: tuple[float, float] = (5.0, 25.0)
    """Radiographic anteversion (Murray 1993) relative to the body axes, degrees."""
    stem_length_mm: tuple[float, float] = (110.0, 160.0)
    """Length of the stem body from the neck-shaft junction to its distal tip, mm."""
    stem_neck_shaft_jitter_deg: float = 5.0
    """The stem's neck-shaft angle is the native one +- up to this, degrees."""
    stem_neck_radius_mm: tuple[float, float] = (5.5, 7.0)
    """Radius of the prosthetic neck (trunnion side), mm."""
    stem_proximal_extra_mm: tuple[float, float] = (2.0, 5.0)
    """Proximal (metaphyseal) stem radius = canal radius + this, capped 1 mm inside the femur's
    outer radius, mm."""
    stem_distal_fill: tuple[float, float] = (0.6, 0.9)
    """Radius of the distal tip as a fraction of the canal radius."""
    resection_offset_mm: tuple[float, float] = (8.0, 12.0)
    """The neck is cut on a plane perpendicular to the native neck axis, this far beyond the
    native head radius from the head centre, mm."""
    position_jitter_mm: float = 2.0
    """Standard deviation of the offset of the cup / head centre from the native head centre
    (isotropic Gaussian, clipped at 2 sigma), mm."""
    clean_mode: Literal["void", "no_implant"] = "void"
    """Clean partner: "void" keeps the implant as a true-shape signal void without its field;
    "no_implant" removes it and restores the native anatomy."""

    def __post_init__(self) -> None:
        for name, chi in self.extra_materials_chi_ppm.items():
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f"extra_materials_chi_ppm keys must be non-empty names, got {name!r}"
                )
            if not math.isfinite(chi):
                raise ValueError(f"extra_materials_chi_ppm.{name} must be finite, got {chi}")
        known = self.materials_chi_ppm()
        for comp in COMPONENT_NAMES:
            name = f"{comp}_material"
            mat = getattr(self, name)
            if mat not in known:
                raise ValueError(
                    f"{name}: unknown material {mat!r}; known materials: "
                    + ", ".join(sorted(known))
                )
        if not self.head_diameters_mm or min(self.head_diameters_mm) <= 0:
            raise ValueError(
                f"head_diameters_mm must list positive sizes, got {list(self.head_diameters_mm)}"
            )
        ranges = {
            "cup_oversize_mm": (-20.0, 30.0),
            "cup_diameter_limits_mm": (1e-6, math.inf),
            "cup_thickness_mm": (1e-6, math.inf),
            "cup_inclination_deg": (0.0, 90.0),
            "cup_anteversion_deg": (-60.0, 60.0),
            "stem_length_mm": (1e-6, math.inf),
            "stem_neck_radius_mm": (1e-6, math.inf),
            "stem_proximal_extra_mm": (0.0, math.inf),
            "stem_distal_fill": (1e-6, 1.0),
            "resection_offset_mm": (0.0, math.inf),
        }
        for name, (lo, hi) in ranges.items():
            a, b = getattr(self, name)
            if not lo <= a <= b <= hi:
                raise ValueError(
                    f"{name} must be (low, high) with {lo:g} <= low <= high <= {hi:g}, "
                    f"got {list(getattr(self, name))}"
                )
        if self.min_liner_thickness_mm < 0:
            raise ValueError(
                f"min_liner_thickness_mm must be >= 0, got {self.min_liner_thickness_mm}"
            )
        if self.stem_neck_shaft_jitter_deg < 0 or self.position_jitter_mm < 0:
            raise ValueError(
                "stem_neck_shaft_jitter_deg and position_jitter_mm must be >= 0, got "
                f"{self.stem_neck_shaft_jitter_deg}, {self.position_jitter_mm}"
            )
        smallest_head = min(self.head_diameters_mm)
        room = (self.cup_diameter_limits_mm[0] - smallest_head) / 2 - self.cup_thickness_mm[1]
        if room < self.min_liner_thickness_mm:
            raise ValueError(
                "the smallest cup must fit the smallest head: cup_diameter_limits_mm[0] / 2 - "
                "cup_thickness_mm[1] - min(head_diameters_mm) / 2 must be >= "
                f"min_liner_thickness_mm ({self.min_liner_thickness_mm}), got {room}"
            )

    def materials_chi_ppm(self) -> dict[str, float]:
        """Built-in materials updated with :attr:`extra_materials_chi_ppm`, name -> ppm."""
        return {**MATERIAL_CHI_PPM, **self.extra_materials_chi_ppm}


@dataclass(frozen=True)
class ImplantParams:
    """Everything drawn for one implant; points (z, y, x) in mm, directions unit vectors."""

    side: str
    """"left" (x > 0) or "right" (x < 0)."""
    centre_mm: tuple[float, float, float]
    """Common centre of the head, liner and cup (centre of rotation)."""
    cup_axis: tuple[float, float, float]
    """Unit normal of the cup opening, pointing out of the opening."""
    cup_inclination_deg: float
    """Radiographic inclination of :attr:`cup_axis` (Murray 1993)."""
    cup_anteversion_deg: float
    """Radiographic anteversion of :attr:`cup_axis` (Murray 1993)."""
    cup_outer_radius_mm: float
    cup_thickness_mm: float
    liner_thickness_mm: float
    """Cup inner radius - head radius."""
    head_radius_mm: float
    stem_points_mm: tuple[tuple[float, float, float], ...]
    """Stem centre line: head centre (trunnion), neck base, neck-shaft junction, mid-shaft, tip."""
    stem_radii_mm: tuple[float, ...]
    """Stem radius at each of :attr:`stem_points_mm`, linearly interpolated in between."""
    stem_length_mm: float
    """Distance from the neck-shaft junction to the distal tip along the shaft axis."""
    stem_neck_shaft_angle_deg: float
    resection_point_mm: tuple[float, float, float]
    """A point of the neck resection plane (on the native neck axis)."""
    resection_normal: tuple[float, float, float]
    """Unit normal of the resection plane, pointing from the head towards the shaft."""
    materials: dict[str, str]
    """Component name ("stem", "head", "liner", "cup") -> material name."""
    chi_ppm: dict[str, float]
    """Component name -> volume susceptibility, ppm."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able plain data (tuples become lists of floats)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            key, value = f.name, getattr(self, f.name)
            if isinstance(value, tuple):
                value = [list(map(float, v)) if isinstance(v, tuple) else float(v) for v in value]
            elif isinstance(value, dict):
                value = {k: v if isinstance(v, str) else float(v) for k, v in value.items()}
            elif isinstance(value, float):
                value = float(value)
            out[key] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ImplantParams":
        """Inverse of :meth:`to_dict`."""
        kwargs = dict(data)
        vectors = ("centre_mm", "cup_axis", "resection_point_mm", "resection_normal")
        for key in (*vectors, "stem_radii_mm"):
            kwargs[key] = tuple(float(v) for v in data[key])
        kwargs["stem_points_mm"] = tuple(tuple(float(v) for v in p) for p in data["stem_points_mm"])
        kwargs["materials"] = dict(data["materials"])
        kwargs["chi_ppm"] = {k: float(v) for k, v in data["chi_ppm"].items()}
        return cls(**kwargs)


# ---------------------------------------------------------------------------------------------
# Geometry
# ---------------------------------------------------------------------------------------------


def unit3(v: Any) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    n = float(np.linalg.norm(v))
    if n == 0:
        raise ValueError("direction vector has zero length")
    return v / n


def _lateral_sign(side: str) -> float:
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    return 1.0 if side == "left" else -1.0


def cup_axis_from_angles(inclination_deg: float, anteversion_deg: float, side: str) -> np.ndarray:
    """Unit cup axis (z, y, x) of a cup with the given radiographic angles (Murray 1993)."""
    ri, ra = math.radians(inclination_deg), math.radians(anteversion_deg)
    lateral = _lateral_sign(side)
    return np.array(
        [-math.cos(ra) * math.cos(ri), -math.sin(ra), lateral * math.cos(ra) * math.sin(ri)]
    )


def _angle_deg(a: np.ndarray, b: np.ndarray) -> float:
    return math.degrees(math.acos(float(np.clip(np.dot(unit3(a), unit3(b)), -1.0, 1.0))))


# ---------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------


def _uniform(rng: np.random.Generator, bounds: tuple[float, float]) -> float:
    return float(rng.uniform(bounds[0], bounds[1]))


def draw_implant(cfg: ImplantConfig, anatomy: "Anatomy", rng: np.random.Generator) -> ImplantParams:
    """Draw a THA that fits the chosen hip of ``anatomy`` (uses only ``rng``).

    The cup and head share a centre at the native femoral head centre (+ jitter); the cup is
    sized from the native acetabulum and oriented by radiographic angles independent of it; the
    stem runs from the head centre down a prosthetic neck to the point where it meets the native
    shaft axis (set by the stem's neck-shaft angle), then down the shaft axis inside the canal,
    tapering from the metaphysis to the tip.
    """
    side = cfg.side if cfg.side != "random" else ("left" if rng.random() < 0.5 else "right")
    if side not in anatomy.hips:
        raise ValueError(f"anatomy has no {side!r} hip; hips: {', '.join(sorted(anatomy.hips))}")
    hip: HipJoint = anatomy.hips[side]
    native = np.asarray(hip.head_centre_mm, dtype=np.float64)

    sd = cfg.position_jitter_mm
    jitter = np.clip(rng.normal(0.0, 1.0, 3), -2.0, 2.0) * sd
    centre = native + jitter

    # Cup and head sizes.
    outer_r, thickness, inner_r, head_r = _draw_cup_and_head(cfg, hip, rng)

    inclination = _uniform(rng, cfg.cup_inclination_deg)
    anteversion = _uniform(rng, cfg.cup_anteversion_deg)
    axis = cup_axis_from_angles(inclination, anteversion, side)

    # Stem: head centre -> prosthetic neck -> down the native shaft axis inside the canal.
    points, radii, length, nsa, resection = _draw_stem(cfg, hip, centre, head_r, rng)
    neck_native = unit3(hip.neck_axis)

    chi = cfg.materials_chi_ppm()
    materials = {comp: getattr(cfg, f"{comp}_material") for comp in COMPONENT_NAMES}
    return ImplantParams(
        side=side,
        centre_mm=_vec(centre),
        cup_axis=_vec(axis),
        cup_inclination_deg=inclination,
        cup_anteversion_deg=anteversion,
        cup_outer_radius_mm=outer_r,
        cup_thickness_mm=thickness,
        liner_thickness_mm=inner_r - head_r,
        head_radius_mm=head_r,
        stem_points_mm=tuple(_vec(p) for p in points),
        stem_radii_mm=tuple(float(r) for r in radii),
        stem_length_mm=length,
        stem_neck_shaft_angle_deg=nsa,
        resection_point_mm=_vec(native + resection * neck_native),
        resection_normal=_vec(neck_native),
        materials=materials,
        chi_ppm={comp: float(chi[mat]) for comp, mat in materials.items()},
    )


def _draw_cup_and_head(cfg: ImplantConfig, hip: HipJoint,
                       rng: np.random.Generator) -> tuple[float, float, float, float]:
    """Cup outer radius, cup thickness, cup inner radius and head radius (mm): the cup sized
    from the native acetabulum, the head drawn from the sizes that leave a thick enough liner."""
    diameter = 2.0 * hip.acetabulum_radius_mm + _uniform(rng, cfg.cup_oversize_mm)
    diameter = float(np.clip(2.0 * round(diameter / 2.0), *cfg.cup_diameter_limits_mm))
    outer_r = diameter / 2.0
    thickness = _uniform(rng, cfg.cup_thickness_mm)
    inner_r = outer_r - thickness
    # __post_init__ guarantees that the smallest head fits the smallest, thickest cup.
    min_liner = cfg.min_liner_thickness_mm - 1e-9
    heads = sorted(d for d in cfg.head_diameters_mm if inner_r - d / 2 >= min_liner)
    head_d = float(heads[int(rng.integers(len(heads)))]) if heads else min(cfg.head_diameters_mm)
    head_r = head_d / 2.0
    return outer_r, thickness, inner_r, head_r


def _draw_stem(
    cfg: ImplantConfig, hip: HipJoint, centre: np.ndarray, head_r: float, rng: np.random.Generator
) -> tuple[tuple[np.ndarray, ...], tuple[float, ...], float, float, float]:
    """Stem centre line and radii, its length and neck-shaft angle, and the resection depth.

    The neck-shaft junction J lies on the native shaft line where the neck from the (jittered)
    ``centre`` meets the shaft at the stem's neck-shaft angle (angle between J->centre and the
    shaft axis pointing distally). Returns ``(points, radii, length_mm, neck_shaft_angle_deg,
    resection_mm)``, the resection measured from the native head centre along the native neck.
    """
    shaft = unit3(hip.shaft_axis)
    neck_native = unit3(hip.neck_axis)
    top = np.asarray(hip.shaft_top_mm, dtype=np.float64)
    nsa_native = _angle_deg(-neck_native, shaft)
    j = cfg.stem_neck_shaft_jitter_deg
    nsa = float(np.clip(nsa_native + rng.uniform(-j, j), 100.0, 170.0))
    w = centre - top
    a = float(np.dot(w, shaft))
    w_perp = float(np.linalg.norm(w - a * shaft))
    junction = top + (a - w_perp / math.tan(math.radians(nsa))) * shaft
    neck_vec = junction - centre
    neck_len = float(np.linalg.norm(neck_vec))
    neck_dir = neck_vec / neck_len
    nsa = _angle_deg(-neck_dir, shaft)

    neck_r = _uniform(rng, cfg.stem_neck_radius_mm)
    canal_r = hip.canal_radius_mm
    prox_r = canal_r + _uniform(rng, cfg.stem_proximal_extra_mm)
    prox_r = max(min(prox_r, hip.shaft_radius_mm - _CORTEX_MARGIN_MM), neck_r)
    tip_r = canal_r * _uniform(rng, cfg.stem_distal_fill)
    mid_r = float(np.clip(0.95 * canal_r, tip_r, prox_r))
    length = _uniform(rng, cfg.stem_length_mm)
    resection = hip.head_radius_mm + _uniform(rng, cfg.resection_offset_mm)

    neck_base = centre + neck_dir * min(head_r + 0.5 * max(resection - head_r, 0.0), 0.8 * neck_len)
    mid = junction + 0.3 * length * shaft
    tip = junction + length * shaft
    points = (centre, neck_base, junction, mid, tip)
    radii = (0.9 * neck_r, neck_r, prox_r, mid_r, tip_r)
    return points, radii, length, nsa, resection


def _vec(v: np.ndarray) -> tuple[float, float, float]:
    return (float(v[0]), float(v[1]), float(v[2]))


def turned_implant(params: ImplantParams, angle_deg: float) -> ImplantParams:
    """``params`` of a patient lying turned by ``angle_deg`` about the z axis through the
    origin (:func:`~sim_scanner.physics.grid.rotate_zyx`): every point and direction turned;
    the radiographic cup angles, measured against the body axes, stay. Angle 0: ``params``."""
    if angle_deg == 0.0:
        return params
    turn = lambda v: rotate_zyx(v, angle_deg)  # noqa: E731
    return replace(
        params,
        centre_mm=turn(params.centre_mm),
        cup_axis=turn(params.cup_axis),
        stem_points_mm=tuple(turn(p) for p in params.stem_points_mm),
        resection_point_mm=turn(params.resection_point_mm),
        resection_normal=turn(params.resection_normal),
    )


def implant_chi_ppm(params: ImplantParams) -> dict[Component, float]:
    """Volume susceptibility (ppm) of each component."""
    return {Component[name.upper()]: float(params.chi_ppm[name]) for name in COMPONENT_NAMES}


# ---------------------------------------------------------------------------------------------
# Rasterisation
# ---------------------------------------------------------------------------------------------


def _box(grid: Grid, lo: np.ndarray, hi: np.ndarray):
    """Index slices of the voxels whose centres lie in [lo, hi] (mm, z y x) and their
    coordinates as broadcastable float32 vectors; None when the box misses the grid."""
    i_lo, i_hi = grid.index_of(tuple(lo)), grid.index_of(tuple(hi))
    slices, coords = [], []
    for ax in range(3):
        start = max(int(math.ceil(i_lo[ax] - 1e-6)), 0)
        stop = min(int(math.floor(i_hi[ax] + 1e-6)), grid.shape[ax] - 1) + 1
        if stop <= start:
            return None
        slices.append(slice(start, stop))
        shape = [1, 1, 1]
        shape[ax] = stop - start
        coords.append(grid.axis_mm(ax)[start:stop].reshape(shape))
    return tuple(slices), coords


def _paint_shells(out: np.ndarray, grid: Grid, p: ImplantParams) -> None:
    """Cup and liner (hemispherical shells, dome opposite the cup axis) and the head sphere."""
    c = np.asarray(p.centre_mm)
    r_out = p.cup_outer_radius_mm
    box = _box(grid, c - r_out, c + r_out)
    if box is None:
        return
    sl, (z, y, x) = box
    dz, dy, dx = z - np.float32(c[0]), y - np.float32(c[1]), x - np.float32(c[2])
    r2 = dz * dz + dy * dy + dx * dx
    ax = np.asarray(p.cup_axis, dtype=np.float32)
    dome = (dz * ax[0] + dy * ax[1] + dx * ax[2]) <= 0
    r_in = r_out - p.cup_thickness_mm
    r_head = p.head_radius_mm
    view = out[sl]
    view[dome & (r2 <= r_out**2) & (r2 > r_in**2)] = Component.CUP
    view[dome & (r2 <= r_in**2) & (r2 > r_head**2)] = Component.LINER
    view[r2 <= r_head**2] = Component.HEAD


def _paint_segment(out: np.ndarray, grid: Grid, a: np.ndarray, b: np.ndarray, ra: float, rb: float,
                   label: int) -> None:
    """Tapered capsule: points within the linearly interpolated radius of segment a-b."""
    rmax = max(ra, rb)
    box = _box(grid, np.minimum(a, b) - rmax, np.maximum(a, b) + rmax)
    if box is None:
        return
    sl, (z, y, x) = box
    seg = b - a
    length = float(np.linalg.norm(seg))
    u = (seg / length).astype(np.float32)
    dz, dy, dx = z - np.float32(a[0]), y - np.float32(a[1]), x - np.float32(a[2])
    proj = dz * u[0] + dy * u[1] + dx * u[2]
    t = np.clip(proj / np.float32(length), 0.0, 1.0)
    along = t * np.float32(length)
    dist2 = dz * dz + dy * dy + dx * dx - 2.0 * along * proj + along * along
    radius = np.float32(ra) + t * np.float32(rb - ra)
    out[sl][dist2 <= radius * radius] = label


def rasterize_implant(params: ImplantParams, grid: Grid) -> np.ndarray:
    """Component labels (uint8 [z, y, x], :class:`Component` values) by voxel centre.

    The stem is painted first, then cup, liner and head, so the head wins over the trunnion.
    Only the bounding box of each part is evaluated.
    """
    out = np.zeros(grid.shape, dtype=np.uint8)
    pts = [np.asarray(q, dtype=np.float64) for q in params.stem_points_mm]
    for i in range(len(pts) - 1):
        _paint_segment(out, grid, pts[i], pts[i + 1], params.stem_radii_mm[i],
                       params.stem_radii_mm[i + 1], Component.STEM)
    _paint_shells(out, grid, params)
    return out


def implant_mask(components: np.ndarray) -> np.ndarray:
    """1 where any component is, else 0 (uint8, same shape)."""
    return (np.asarray(components) > 0).astype(np.uint8)


# ---------------------------------------------------------------------------------------------
# Post-operative anatomy
# ---------------------------------------------------------------------------------------------


def postop_labels(labels: np.ndarray, components: np.ndarray, params: ImplantParams,
                  anatomy: "Anatomy", grid: Grid) -> np.ndarray:
    """Tissue labels (uint8 [z, y, x]) after the arthroplasty; the inputs are not modified.

    * The native femoral head (bone, marrow, cartilage inside the acetabular socket sphere) and
      the femoral neck on the head side of the resection plane become capsule tissue: synovial
      fluid within native head radius + 3 mm of the native centre, muscle further out.
      Acetabular cartilage inside the socket sphere goes the same way (reamed).
    * Every implant voxel becomes ``Tissue.IMPLANT``.
    """
    if labels.shape != components.shape or labels.shape != tuple(grid.shape):
        raise ValueError(
            f"labels {labels.shape}, components {components.shape} and grid {tuple(grid.shape)} "
            "must have the same shape"
        )
    out = labels.copy()
    hip = anatomy.hips[params.side]
    c = np.asarray(hip.head_centre_mm, dtype=np.float64)
    n = unit3(params.resection_normal)
    depth = float(np.dot(np.asarray(params.resection_point_mm) - c, n))
    socket_r = max(hip.acetabulum_radius_mm, hip.head_radius_mm)
    neck_r = hip.head_radius_mm  # generous bound on the neck radius; only femur labels go
    fluid_r = hip.head_radius_mm + 3.0
    reach = max(socket_r, math.hypot(depth, neck_r))
    box = _box(grid, c - reach, c + reach)
    if box is not None:
        sl, (z, y, x) = box
        dz, dy, dx = z - np.float32(c[0]), y - np.float32(c[1]), x - np.float32(c[2])
        r2 = dz * dz + dy * dy + dx * dx
        s = dz * np.float32(n[0]) + dy * np.float32(n[1]) + dx * np.float32(n[2])
        in_socket = r2 < socket_r**2
        in_neck = (s >= 0) & (s <= depth) & (r2 - s * s <= neck_r**2)
        sub = out[sl]
        femur = np.isin(sub, np.asarray(_FEMUR_LABELS, dtype=sub.dtype))
        remove = femur & (in_socket | in_neck)
        sub[remove & (r2 <= fluid_r**2)] = Tissue.SYNOVIAL_FLUID
        sub[remove & (r2 > fluid_r**2)] = Tissue.MUSCLE
    out[components > 0] = Tissue.IMPLANT
    return out
