"""Layout: every point, radius and profile the rasteriser paints, derived deterministically
from an :class:`~sim_scanner.physics.phantom.records.Anatomy` (body outline, thighs, pelvic
cavity, organs, vessels; muscle groups come from
:mod:`sim_scanner.physics.phantom.muscles`)."""

from __future__ import annotations

import math

import numpy as np

from sim_scanner.physics.phantom.config import PhantomConfig
from sim_scanner.physics.phantom.records import Anatomy
from sim_scanner.physics.phantom.shapes import smooth_step, vec3
from sim_scanner.physics.phantom.skeleton import (
    femur_axis_point,
    femur_parts,
    PelvisFrame,
    required_spheres,
)
from sim_scanner.physics.phantom.texture import draw_deformation


class PhantomLayout:
    """Every point, radius and profile the rasteriser paints, derived from one Anatomy.

    Pure function of the anatomy (and of ``cfg.fat_plane_mm``): texture, deformation and bowel
    loops come from generators seeded with ``anatomy.seed``.
    """

    def __init__(self, anatomy: Anatomy, cfg: PhantomConfig):
        p = anatomy.params
        self.p = p
        self.hips = anatomy.hips
        self.pel = PelvisFrame(anatomy.hips, p)
        self.fem = {side: femur_parts(h) for side, h in anatomy.hips.items()}
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
        self.deform = draw_deformation(anatomy.seed, self.amp)
        self._body_profile()
        self._thigh_profiles()
        self._cavity_profile()
        self._organs(anatomy.seed, cfg.bowel_gas_fraction)
        self._vessels()
        self.groups: list = []
        """The muscle groups, placed from this layout (:func:`~sim_scanner.physics.phantom.
        muscles.muscle_groups`; the rasteriser sets them, so that the muscle tables depend on
        the layout and not the other way round)."""

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
        spheres = required_spheres(self.hips, self.p)
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
                fpt = femur_axis_point(h, float(z))
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
            wt = smooth_step((zk + 110.0) / 30.0)  # 0 below -110, 1 above -80
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
            zp = pel.to_pelvic(vec3(z, yh, 0.0))[0] - pel.mid(0.0, 0.0)[0]
            if zp < szk[0]:
                y_back[i] = yh + 55.0 * s
            elif zp > z_s1:
                y_back[i] = pel.to_world(pel.mid(0.0, 0.0) + vec3(zp, 25.0 * s - 3.0, 0.0))[1]
            else:
                front = float(np.interp(zp, szk, syc - sd)) - 3.0
                y_back[i] = pel.to_world(pel.mid(0.0, 0.0) + vec3(zp, front, 0.0))[1]
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
    def _organs(self, seed: int, gas_fraction: tuple[float, float] = (0.0, 0.0)) -> None:
        pel, s, yh = self.pel, self.scale, self.yh
        xh = self.xh
        # bladder
        R = float(self.p["bladder_radius_mm"])
        sym_back = pel.to_world(pel.mid(-24.0, -36.0))[1]
        rx = min(1.15 * R, max(self.cav_a[3] - 3.0, 12.0))
        ry, rz = 0.85 * R, 0.8 * R
        z_neck = pel.to_world(pel.mid(-28.0, -36.0))[0]
        self.bladder = (vec3(z_neck + rz, sym_back + ry + 5.0, float(self.p["bladder_x_mm"])),
                        (rz, ry, rx))
        # rectum / anal canal: along the front of the sacrum
        szk, sw, sd, syc, _ = pel.sacrum_profile()

        def pre_sacral(zs: float, gap: float) -> np.ndarray:
            zp = zs * s
            front = float(np.interp(zp, szk, syc - sd))
            return pel.to_world(pel.mid(0.0, 0.0) + vec3(zp, front - gap, 0.0))

        self.rectum = [
            (pre_sacral(45.0, 17.0) + vec3(0, 0, 6.0), 15.0, 12.0),
            (pre_sacral(15.0, 18.0), 17.0, 14.0),
            (pre_sacral(-15.0, 18.0), 16.0, 13.0),
            (vec3(-38.0 * s, yh + 45.0 * s, 0.0), 12.0, 6.0),
            (vec3(-58.0 * s, yh + 40.0 * s, 0.0), 10.0, 3.0),
            (vec3(-85.0, yh + 38.0 * s, 0.0), 9.0, 2.0),
        ]
        # sigmoid colon from the left iliac fossa to the top of the rectum
        self.sigmoid = [
            (vec3(75.0, yh - 5.0, xh - 42.0 * s), 13.0),
            (vec3(58.0, yh + 15.0, xh - 60.0 * s), 13.0),
            (self.rectum[0][0] + vec3(4.0, 0.0, 2.0), 13.0),
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
            c = vec3(zc, yc, xc)
            loops.append((c - half * d, c + half * d, r))
        self.bowel = loops
        # gas pockets in some loops: a stream of their own, so the loops stay as without gas
        gas_rng = np.random.default_rng([seed, 4])
        lo, hi = gas_fraction
        share = gas_rng.uniform(lo, hi) if hi > 0 else 0.0
        self.bowel_gas = [(pa, pb, r * gas_rng.uniform(0.4, 0.8))
                          for pa, pb, r in loops if share > 0 and gas_rng.random() < share]

    # -- vessels --------------------------------------------------------------------------------
    def _vessels(self) -> None:
        yh, s = self.yh, self.scale
        self.vessels = []  # (chain of points, radius, sheath)
        for side, h in self.hips.items():
            sig = 1.0 if side == "left" else -1.0
            xh, r_h = abs(h.head_centre_mm[2]), h.head_radius_mm
            hz = h.head_centre_mm[0]
            f50, f100, f180 = (femur_axis_point(h, z) for z in (-50.0, -100.0, -180.0))
            art = [
                vec3(125.0, yh + 22.0 * s, sig * 20.0),
                vec3(85.0, yh + 8.0 * s, sig * 36.0 * s),
                vec3(45.0, yh - 22.0 * s, sig * (xh - 38.0 * s)),
                vec3(hz + 12.0, yh - r_h - 24.0, sig * (xh - 16.0 * s)),
                vec3(hz - 15.0, yh - r_h - 22.0, sig * (xh - 15.0 * s)),
                vec3(-50.0, f50[1] - 42.0, sig * (xh - 20.0 * s)),
                vec3(-100.0, f100[1] - 32.0, f100[2] - sig * 36.0),
                vec3(-180.0, f180[1] - 20.0, f180[2] - sig * 34.0),
            ]
            vein = [q + (vec3(0.0, 5.0, -sig * 13.0) if q[0] > -40.0 else vec3(0.0, 11.0, -sig * 7.0))
                    for q in art]
            self.vessels.append((art, 4.0, 1.5))
            self.vessels.append((vein, 5.5, 1.5))
            prof = [art[5] + vec3(5.0, 0.0, 0.0), vec3(-110.0, f100[1] + 4.0, f100[2] - sig * 26.0)]
            self.vessels.append((prof, 3.0, 1.0))
