"""Records of one drawn subject: :class:`HipJoint` landmarks, the :class:`Anatomy` that
:func:`~sim_scanner.physics.phantom.anatomy.draw_anatomy` returns, and :func:`phantom_params`,
its JSON-able summary.

They live apart from the drawing code so that the skeleton geometry, the rasteriser and the
implant model can use them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from sim_scanner.physics.grid import rotate_zyx

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


def phantom_params(anatomy: Anatomy) -> dict[str, Any]:
    """JSON-able summary of a subject: its drawn parameters and hip landmarks."""
    out: dict[str, Any] = {"seed": anatomy.seed, **anatomy.params}
    for side, h in anatomy.hips.items():
        for f in fields(h):
            val = getattr(h, f.name)
            out[f"hip_{side}_{f.name}"] = list(val) if isinstance(val, tuple) else val
    return out


def turned_landmarks(anatomy: Anatomy, angle_deg: float) -> Anatomy:
    """``anatomy`` with the points and directions of its hip landmarks turned by ``angle_deg``
    about the z axis through the origin (:func:`~sim_scanner.physics.grid.rotate_zyx`): the
    landmarks of a patient lying turned, in scanner coordinates, for the implant model
    (:func:`~sim_scanner.physics.implant.postop_labels`). Rasterise the anatomy itself with
    ``rasterize_anatomy(..., rotation_deg=angle_deg)``, never this. Angle 0: ``anatomy``."""
    if angle_deg == 0.0:
        return anatomy
    turn = lambda v: rotate_zyx(v, angle_deg)  # noqa: E731
    hips = {
        side: replace(h, head_centre_mm=turn(h.head_centre_mm),
                      acetabulum_axis=turn(h.acetabulum_axis), neck_axis=turn(h.neck_axis),
                      shaft_top_mm=turn(h.shaft_top_mm), shaft_axis=turn(h.shaft_axis))
        for side, h in anatomy.hips.items()
    }
    return replace(anatomy, hips=hips)
