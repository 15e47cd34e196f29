"""Muscle groups of the phantom: per side, about 20 groups, each a chain of tapered capsules
placed relative to the pelvis, the femur and the body outline (:func:`muscle_groups`).

The painter (:func:`~sim_scanner.physics.phantom.soft_tissue.paint_muscles`) turns them into a
labelled Voronoi partition, so the order of the groups matters: it is left then right, and
within a side gluteal / hip flexor, thigh, deep rotator and trunk groups, as listed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sim_scanner.physics.phantom.records import HipJoint
from sim_scanner.physics.phantom.shapes import vec3
from sim_scanner.physics.phantom.skeleton import femur_axis_point

if TYPE_CHECKING:
    from sim_scanner.physics.phantom.layout import PhantomLayout


@dataclass
class _Group:
    """A muscle group: polylines of (point, radius) and how far past them it may grow."""

    name: str
    chains: list[list[tuple[np.ndarray, float]]]
    margin: float


class _SideFrame:
    """Landmarks and point builders of one side, in the world frame, for the muscle tables."""

    def __init__(self, lay: PhantomLayout, side: str, h: HipJoint):
        pel, s = lay.pel, lay.scale
        self.pel, self.s, self.yh, self.k = pel, s, lay.yh, lay.bulk
        self.side, self.h = side, h
        self.szk, _, self.sd, self.syc, self.z_s1 = pel.sacrum_profile()
        self.mid0 = pel.mid(0.0, 0.0)
        self.sig = sig = 1.0 if side == "left" else -1.0
        self.fp = fp = lay.fem[side]
        self.xh = abs(h.head_centre_mm[2])
        self.T, self.G = fp["top"], fp["gt"]
        self.gt_lat = sig * self.G[2] + fp["gt_radii"][2]
        a_ab, ba_ab, _ = lay.trunk(np.array([100.0, 160.0, 30.0]))
        self.y_wall = -ba_ab + lay.skin + lay.fat * (1.0 + lay.fat_ant) + 7.0
        self.x_flank = a_ab - lay.skin - lay.fat - 9.0

    def sac_back(self, zs: float) -> float:
        """World y of the back of the sacrum at (unscaled) height ``zs``."""
        pel, s = self.pel, self.s
        zp = zs * s
        return pel.to_world(self.mid0 + vec3(zp, float(np.interp(zp, self.szk, self.syc + self.sd)),
                                           0.0))[1]

    def P(self, dz, dy, dx):
        """Pelvic-frame offset from the hip centre -> world."""
        return self.pel.to_world(self.pel.rel(self.side, dz, dy, dx))

    def Wg(self, zf, phi, off):
        """Point on / off the ilium wing -> world."""
        return self.pel.to_world(self.pel.wing_point(self.side, zf, phi, off))

    def F(self, z, dy, dx):
        """Point beside the femoral shaft axis at height z."""
        a = femur_axis_point(self.h, z)
        return a + vec3(0.0, dy, self.sig * dx)

    def X(self, z, y, x):
        """Absolute z / y, lateral x."""
        return vec3(z, y, self.sig * x)

    def b(self, r):
        """Radius ``r`` scaled by the subject's muscle bulk."""
        return r * self.k


def muscle_groups(lay: PhantomLayout) -> list[_Group]:
    """All muscle groups of the subject, left side first (the order sets Voronoi ties)."""
    groups: list[_Group] = []
    for side, h in lay.hips.items():
        f = _SideFrame(lay, side, h)
        groups += _gluteal_groups(f)
        groups += _thigh_groups(f)
        groups += _deep_rotator_groups(f)
        groups += _trunk_groups(f)
    return groups


def _gluteal_groups(f: _SideFrame) -> list[_Group]:
    """Glutei, tensor fasciae latae and iliopsoas."""
    side, pel, s, h, fp = f.side, f.pel, f.s, f.h, f.fp
    P, Wg, F, X, b, sac_back = f.P, f.Wg, f.F, f.X, f.b, f.sac_back
    sig, yh, G, gt_lat, mid0, z_s1 = f.sig, f.yh, f.G, f.gt_lat, f.mid0, f.z_s1
    return [
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
            (G + vec3(18.0, 0.0, sig * 6.0), b(9.0)),
        ]], 40.0),
        _Group(f"{side}_gluteus_minimus", [[
            (Wg(0.6, 25.0, 7.0), b(6.0)),
            (Wg(0.25, 20.0, 8.0), b(9.0)),
            (G + vec3(14.0, -8.0, -sig * 4.0), b(6.0)),
        ]], 15.0),
        _Group(f"{side}_tensor_fasciae_latae", [[
            (Wg(0.5, pel.wing_phi0(0.5), 10.0), b(6.0)),
            (X(-5.0, yh - 42.0, gt_lat + 8.0), b(10.0)),
            (X(-60.0, femur_axis_point(h, -60.0)[1] - 22.0, gt_lat + 10.0), b(6.0)),
        ]], 15.0),
        _Group(f"{side}_iliopsoas", [
            [(pel.to_world(mid0 + vec3(z_s1 + 60.0, 30.0 * s, sig * 35.0 * s)), b(18.0)),
             (pel.to_world(mid0 + vec3(z_s1, 22.0 * s, sig * 45.0 * s)), b(19.0)),
             (P(45.0, -5.0, -32.0), b(19.0)),
             (P(15.0, -32.0, -16.0), b(17.0))],
            [(Wg(0.85, 35.0, -16.0), b(11.0)),
             (Wg(0.5, 25.0, -18.0), b(15.0)),
             (P(15.0, -32.0, -16.0), b(17.0)),
             (P(-5.0, -(h.head_radius_mm + 16.0) / s, -8.0), b(15.0)),
             (F(-40.0, -12.0, -22.0), b(11.0)),
             (fp["lt"], b(6.0))],
        ], 30.0),
    ]


def _thigh_groups(f: _SideFrame) -> list[_Group]:
    """Sartorius, quadriceps, adductors, pectineus and hamstrings."""
    side, pel, s, fp = f.side, f.pel, f.s, f.fp
    P, Wg, F, X, b = f.P, f.Wg, f.F, f.X, f.b
    yh, xh, T = f.yh, f.xh, f.T
    return [
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
    ]


def _deep_rotator_groups(f: _SideFrame) -> list[_Group]:
    """Obturators, quadratus femoris and piriformis."""
    side, pel, s = f.side, f.pel, f.s
    P, F, b = f.P, f.F, f.b
    sig, T, G, mid0 = f.sig, f.T, f.G, f.mid0
    return [
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
            (pel.to_world(mid0 + vec3(40.0 * s, 55.0 * s, sig * 28.0 * s)), b(8.0)),
            (P(18.0, 52.0, -12.0), b(10.0)),
            (G + vec3(16.0, 6.0, -sig * 6.0), b(5.0)),
        ]], 12.0),
    ]


def _trunk_groups(f: _SideFrame) -> list[_Group]:
    """Rectus abdominis, abdominal obliques and erector spinae."""
    side, pel, s = f.side, f.pel, f.s
    Wg, X, b, sac_back = f.Wg, f.X, f.b, f.sac_back
    sig, yh, z_s1, y_wall, x_flank = f.sig, f.yh, f.z_s1, f.y_wall, f.x_flank
    return [
        _Group(f"{side}_rectus_abdominis", [[
            (X(300.0, y_wall[1], 40.0), b(8.0)),
            (X(100.0, y_wall[0], 38.0), b(8.0)),
            (X(30.0, y_wall[2], 30.0), b(7.0)),
            (pel.to_world(pel.mid(-2.0, -58.0)) + vec3(0.0, 0.0, sig * 14.0), b(5.0)),
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
