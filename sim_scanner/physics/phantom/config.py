"""Per-subject parameter ranges of the phantom: :class:`PhantomConfig` (config section
``phantom``) and its validation."""

from __future__ import annotations

import math
from dataclasses import dataclass


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
    bowel_gas_fraction: tuple[float, float] = (0.0, 0.0)
    """Share of the small-bowel loops that hold a gas pocket, drawn per subject (0 = no gas, the
    default). A pocket is a signal void, concentric with its loop, of 40-80 % of its radius; its
    susceptibility (air, +0.36 ppm against about -9 ppm for tissue) bends the field around it: a
    second, weaker off-resonance source beside the implant that moves from subject to subject."""
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
            "bowel_gas_fraction": (0.0, 1.0),
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
