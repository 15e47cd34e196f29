"""Skeleton landmarks derived from the drawn hips, shared by the drawing and the rasteriser:
the pelvic frame (:class:`PelvisFrame`, with the ilium wing and sacrum profiles), femur parts,
and the spheres of bone + muscle that the body outline must contain."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from sim_scanner.physics.phantom.records import HipJoint
from sim_scanner.physics.phantom.shapes import unit3, vec3


class PelvisFrame:
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
        return vec3(self.pivot[0] + self.c * dz - self.s * dy,
                  self.pivot[1] + self.s * dz + self.c * dy, q[2])

    def to_pelvic(self, w: np.ndarray) -> np.ndarray:
        dz, dy = w[0] - self.pivot[0], w[1] - self.pivot[1]
        return vec3(self.c * dz + self.s * dy, -self.s * dz + self.c * dy, w[2])

    def coords(self, z, y):
        """Pelvic-frame (zp, yp) of world coordinates (z, y) (arrays broadcast)."""
        dz, dy = z - float(self.pivot[0]), y - float(self.pivot[1])
        return self.c * dz + self.s * dy, -self.s * dz + self.c * dy

    # landmarks in the pelvic frame --------------------------------------------------------
    def rel(self, side: str, dz: float, dy: float, dx: float) -> np.ndarray:
        """Pelvic-frame point offset from the hip centre (dx > 0 lateral), scaled."""
        sig = 1.0 if side == "left" else -1.0
        h = self.hp[side]
        return vec3(h[0] + dz * self.scale, h[1] + dy * self.scale, h[2] + sig * dx * self.scale)

    def mid(self, dz: float, dy: float) -> np.ndarray:
        """Pelvic-frame midline point relative to the mean hip centre, scaled."""
        hz = 0.5 * (self.hp["left"][0] + self.hp["right"][0])
        hy = 0.5 * (self.hp["left"][1] + self.hp["right"][1])
        return vec3(hz + dz * self.scale, hy + dy * self.scale, 0.0)

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
        return vec3(self.hp[side][0] + zr, py, px)

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


def femur_parts(h: HipJoint) -> dict[str, Any]:
    """Derived femur geometry (world frame)."""
    sig = 1.0 if h.side == "left" else -1.0
    head, shaft, top = np.array(h.head_centre_mm), np.array(h.shaft_axis), np.array(h.shaft_top_mm)
    r_meta = 1.6 * h.shaft_radius_mm
    # lateral direction perpendicular to the shaft, in the coronal plane
    lat = unit3(vec3(-abs(shaft[2]), 0.0, sig * abs(shaft[0])))
    gt = top - 17.0 * shaft + 0.45 * r_meta * lat + vec3(0.0, 5.0, 0.0)
    gt_radii = (22.0, 18.0, 13.0)
    pm = unit3(-0.6 * lat + vec3(0.0, 0.8, 0.0))
    lt = top + 38.0 * shaft + 1.15 * h.shaft_radius_mm * pm
    return {
        "sigma": sig, "head": head, "shaft": shaft, "top": top, "lat": lat,
        "r_meta": r_meta, "gt": gt, "gt_radii": gt_radii, "lt": lt, "lt_radius": 9.0,
        "r_neck": 0.62 * h.head_radius_mm,
    }


def femur_axis_point(h: HipJoint, z: float) -> np.ndarray:
    """Point of the shaft axis at world height z."""
    top, shaft = np.array(h.shaft_top_mm), np.array(h.shaft_axis)
    return top + (z - top[0]) / shaft[0] * shaft


def required_spheres(
    hips: dict[str, HipJoint], p: dict[str, Any]
) -> list[tuple[np.ndarray, float]]:
    """Spheres (bone + the least muscle around it) that must lie inside the subcutaneous fat."""
    pel = PelvisFrame(hips, p)
    s = pel.scale
    out: list[tuple[np.ndarray, float]] = []
    for side, h in hips.items():
        fp = femur_parts(h)
        out.append((fp["head"], h.head_radius_mm + 40.0))
        out.append((fp["gt"], fp["gt_radii"][2] + 12.0))
        out.append((fp["top"], fp["r_meta"] + 15.0))
        for z in (-60.0, -100.0):
            out.append((femur_axis_point(h, z), h.shaft_radius_mm + 28.0))
        out.append((pel.to_world(pel.rel(side, -50.0, 44.0, -31.0)), 13.0 * s + 30.0))
        out.append((pel.to_world(pel.rel(side, 0.0, 25.0, -5.0)), 14.0 * s + 38.0))
        out.append((pel.to_world(pel.wing_point(side, 0.5, pel.wing_phi0(0.5), 0.0)), 16.0))
        out.append((pel.to_world(pel.wing_point(side, 0.85, pel.wing_phi0(0.85) + 10.0, 0.0)),
                    20.0))
        sig = 1.0 if side == "left" else -1.0
        sym = pel.mid(-24.0, -46.0) + vec3(0.0, 0.0, sig * 11.0 * s)
        out.append((pel.to_world(sym), 10.0 * s + 10.0))
    zk, w, d, yc, _ = pel.sacrum_profile()
    z70 = float(zk[-2])
    out.append((pel.to_world(pel.mid(0.0, 0.0) + vec3(z70, float(yc[-2] + d[-2]), 0.0)), 15.0))
    return out
