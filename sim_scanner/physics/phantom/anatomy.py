"""Drawing one subject: :func:`draw_anatomy` draws every per-subject parameter (skeleton,
hips, body habitus, soft tissue) from a seeded generator and returns an
:class:`~sim_scanner.physics.phantom.records.Anatomy`."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from sim_scanner.physics.phantom.config import PhantomConfig
from sim_scanner.physics.phantom.records import Anatomy, HipJoint
from sim_scanner.physics.phantom.shapes import unit3, vec3
from sim_scanner.physics.phantom.skeleton import required_spheres

logger = logging.getLogger(__name__)


def _uniform(rng: np.random.Generator, r: Sequence[float]) -> float:
    return float(rng.uniform(float(r[0]), float(r[1]))) if r[1] > r[0] else float(r[0])


def _jitter(rng: np.random.Generator, amount: float) -> float:
    return float(rng.uniform(-amount, amount)) if amount > 0 else 0.0


def _hip_joint(side: str, p: dict[str, Any], y_shift: float) -> HipJoint:
    """The landmarks of one hip from the drawn parameters (``p``), y moved by ``y_shift``."""
    sigma = 1.0 if side == "left" else -1.0
    g = lambda name: float(p[f"{side}_{name}"])  # noqa: E731
    head = vec3(g("head_z_mm"), g("head_dy_mm") + y_shift, sigma * g("head_lateral_mm"))
    r_h = g("head_radius_mm")
    cart = float(p["cartilage_thickness_mm"])
    r_acet = r_h + 2.0 * cart + float(p["joint_fluid_mm"])
    # Acetabular axis: radiographic inclination / anteversion in the pelvic frame, then tilted.
    incl, av = math.radians(g("acetabular_inclination_deg")), math.radians(
        g("acetabular_anteversion_deg"))
    a_pel = vec3(-math.cos(av) * math.cos(incl), -math.sin(av), sigma * math.cos(av) * math.sin(incl))
    axis = unit3(_pelvic_to_world_dir(a_pel, float(p["pelvic_tilt_deg"])))
    # Femur: shaft tilted medially downwards; neck at the neck-shaft angle from the shaft,
    # rotated posteriorly (head -> shaft) by the anteversion.
    tilt = math.radians(g("shaft_tilt_deg"))
    shaft = vec3(-math.cos(tilt), 0.0, -sigma * math.sin(tilt))
    lateral = vec3(-math.sin(tilt), 0.0, sigma * math.cos(tilt))  # perpendicular to the shaft
    ant = math.radians(g("anteversion_deg"))
    m = math.cos(ant) * lateral + math.sin(ant) * vec3(0.0, 1.0, 0.0)
    beta = math.radians(180.0 - g("neck_shaft_angle_deg"))
    neck = unit3(math.cos(beta) * shaft + math.sin(beta) * m)
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
    return vec3(c * v[0] - s * v[1], s * v[0] + c * v[1], v[2])


def draw_anatomy(cfg: PhantomConfig, rng: np.random.Generator) -> Anatomy:
    """Draw one subject: skeleton, hips, body habitus and soft-tissue parameters.

    Only ``rng`` is used (never the global numpy state). ``Anatomy.seed`` (drawn from ``rng``)
    drives the texture, deformation and bowel layout at rasterisation time.
    """
    p: dict[str, Any] = {}
    seed = int(rng.integers(0, 2**31 - 1))
    u = lambda r: _uniform(rng, r)  # noqa: E731
    _draw_skeleton(cfg, rng, p)
    _draw_habitus(cfg, rng, p)
    hips = {side: _hip_joint(side, p, p["head_y_mm"]) for side in ("left", "right")}

    # Soft tissue.
    p["bladder_radius_mm"] = u(cfg.bladder_radius_mm)
    p["bladder_x_mm"] = _jitter(rng, 6.0)
    p["thigh_gap_mm"] = u(cfg.thigh_gap_mm)
    p["muscle_bulk"] = u(cfg.muscle_bulk)
    p["texture_amplitude"] = u(cfg.texture_amplitude)
    return Anatomy(seed=seed, hips=hips, params=p)


def _draw_skeleton(cfg: PhantomConfig, rng: np.random.Generator, p: dict[str, Any]) -> None:
    """Pelvis and both hips into ``p``: shared draws, then independent left / right jitter."""
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


def _draw_habitus(cfg: PhantomConfig, rng: np.random.Generator, p: dict[str, Any]) -> None:
    """Body habitus into ``p``: skin, subcutaneous fat and body size, drawn so that skeleton +
    fat fit the body size ranges, and the antero-posterior position of the hips."""
    u = lambda r: _uniform(rng, r)  # noqa: E731
    p["skin_thickness_mm"] = u(cfg.skin_thickness_mm)
    p["fat_anterior_extra"] = u(cfg.fat_anterior_extra)
    p["fat_posterior_extra"] = u(cfg.fat_posterior_extra)
    hips0 = {side: _hip_joint(side, p, 0.0) for side in ("left", "right")}
    spheres = required_spheres(hips0, p)
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
