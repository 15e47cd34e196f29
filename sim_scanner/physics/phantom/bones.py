"""Painting bones and hip joints into a slab (unwarped, so the hip landmarks are exact):
each half-pelvis with the sacrum and lumbar column, and each hip joint with socket contents,
capsule, femur and cartilage."""

from __future__ import annotations

import math

import numpy as np

from sim_scanner.physics.phantom.chunk import Chunk
from sim_scanner.physics.phantom.layout import PhantomLayout
from sim_scanner.physics.phantom.shapes import (
    FAR,
    Box,
    capsule_sdf,
    dot3,
    ellipse2_sdf,
    ellipsoid_sdf,
    points_box,
    segment_distance,
    smooth_min,
    smooth_step,
    sphere_sdf,
    vec3,
)
from sim_scanner.physics.phantom.skeleton import PelvisFrame
from sim_scanner.physics.tissues import Tissue


def _paint_bone(ch: Chunk, sl, sdf: np.ndarray, cortex, marrow_label) -> None:
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

    def __init__(self, ch: Chunk, box: Box, warped: bool = False):
        self.ch = ch
        self.sl = ch.slices(box, warped)
        if self.sl is not None:
            self.d = np.full(tuple(s.stop - s.start for s in self.sl), FAR, np.float32)
            self.q = ch.coords(self.sl, warped)

    def add(self, dist: np.ndarray, k: float) -> None:
        self.d = smooth_min(self.d, dist, k)


def paint_pelvis_side(ch: Chunk, lay: PhantomLayout, side: str) -> None:
    """One half-pelvis (ilium, acetabulum, columns, pubis; socket carved), the sacrum / lumbar
    column in this half, and the symphysis and sacro-iliac cartilage."""
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
    # ilium wing
    wing = _ilium_wing(pel, s, side, zp, yp, xq)
    acc.add(wing, 0.0)
    # acetabular block (world frame; the socket is carved below)
    a = np.array(h.acetabulum_axis)
    r_acet = h.acetabulum_radius_mm
    lat = vec3(0.0, 0.0, sig)
    cblk = H + vec3(3.0, 3.0, 0.0) + 4.0 * lat
    qw = acc.q
    blk = np.maximum(sphere_sdf(qw, cblk, r_acet + 10.0), dot3(qw, H, a))
    acc.add(blk, 6.0)
    # posterior column, ischium, pubic rami (pelvic frame)
    R = lambda dz, dy, dx: pel.rel(side, dz, dy, dx)  # noqa: E731
    acc.add(capsule_sdf(qp, R(8.0, 24.0, -4.0), R(-40.0, 40.0, -28.0), 15.0 * s, 12.0 * s), 6.0)
    acc.add(ellipsoid_sdf(qp, R(-50.0, 44.0, -31.0), (15.0 * s, 13.0 * s, 12.0 * s)), 5.0)
    sym = pel.mid(-24.0, -46.0) + vec3(0.0, 0.0, sig * 11.0 * s)
    sym_top = pel.mid(-10.0, -44.0) + vec3(0.0, 0.0, sig * 16.0 * s)
    acc.add(capsule_sdf(qp, R(-4.0, -22.0, -14.0), sym_top, 11.0 * s, 9.0 * s), 5.0)
    acc.add(ellipsoid_sdf(qp, sym, (18.0 * s, 10.0 * s, 9.5 * s)), 4.0)
    sym_low = pel.mid(-36.0, -42.0) + vec3(0.0, 0.0, sig * 13.0 * s)
    acc.add(capsule_sdf(qp, sym_low, R(-52.0, 32.0, -36.0), 7.0 * s, 8.0 * s), 4.0)
    # carve the socket
    d_pel = np.maximum(acc.d, r_acet - (sphere_sdf(qw, H, 0.0)))
    # sacrum and coccyx (+ lumbar column above), midline, in this half
    sac, vb, phase = _sacrum_and_lumbar(pel, s, zp, yp, xq)
    # pubic symphysis disc
    symd = ellipsoid_sdf(qp, pel.mid(-24.0, -46.0), (16.0 * s, 8.0 * s, 3.0))
    if ch.rotation_deg != 0.0:
        # the box cuts this half at the midline; a turned patient's box reaches across it
        other = ~((xq >= 0.0) if sig > 0 else (xq <= -1e-3))
        d_pel, sac, vb, symd = (np.where(other, FAR, d) for d in (d_pel, sac, vb, symd))
    disc = vb < 0
    disc &= phase < 10.0
    # SI joint: a thin cartilage line where sacrum meets ilium
    sl = acc.sl
    _paint_bone(ch, sl, np.minimum(sac, np.where(phase >= 10.0, vb, FAR)), 1.5, Tissue.RED_MARROW)
    ch.paint(sl, disc, Tissue.CARTILAGE)
    ch.paint(sl, symd < 0, Tissue.CARTILAGE)
    _paint_bone(ch, sl, d_pel, 1.8, Tissue.RED_MARROW)
    si = (sac < 0) & (np.abs(wing) < 1.2)
    ch.paint(sl, si, Tissue.CARTILAGE)


def paint_hip_joint(ch: Chunk, lay: PhantomLayout, side: str) -> None:
    """Socket contents, capsule, femur, femoral cartilage (unwarped, world frame)."""
    h = lay.hips[side]
    fp = lay.fem[side]
    H, n, a = np.array(h.head_centre_mm), np.array(h.neck_axis), np.array(h.acetabulum_axis)
    r_h, r_acet = h.head_radius_mm, h.acetabulum_radius_mm
    cart, fluid = lay.cart, lay.fluid
    # socket: acetabular cartilage, fluid film, fossa fat pad, labrum
    sl = ch.slices(points_box([H], r_acet + 6.0), warped=False)
    if sl is not None:
        q = ch.coords(sl, warped=False)
        r = sphere_sdf(q, H, 0.0)
        ax = dot3(q, H, a)
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
    sl = ch.slices(points_box([H, c_end], max(r0, r1) + 3.0), warped=False)
    if sl is not None:
        q = ch.coords(sl, warped=False)
        d = capsule_sdf(q, H, c_end, r0, r1)
        soft = np.isin(ch.labels[sl], (Tissue.FAT, Tissue.MUSCLE))
        outside_socket = dot3(q, H, a) > -2.0
        ch.paint(sl, soft & outside_socket & (d < 2.0), Tissue.TENDON)
        ch.paint(sl, soft & outside_socket & (d < 0), Tissue.SYNOVIAL_FLUID)
    # femur: head, neck, trochanters, shaft
    shaft = fp["shaft"]
    above, bottom = T - 12.0 * shaft, T + 3000.0 * shaft  # the shaft runs past any grid
    # bounding box: the proximal femur plus the part of the shaft level with this slab
    t_end = max(0.0, (float(ch.z[0]) - 1.0 - T[0]) / shaft[0]) + 20.0
    pts = [H, T, fp["gt"], fp["lt"], above, T + t_end * shaft]
    box = points_box(pts, max(r_h, fp["r_meta"], max(fp["gt_radii"])) + 3.0)
    acc = _Accum(ch, box)
    if acc.sl is None:
        return
    q = acc.q
    acc.add(sphere_sdf(q, H, r_h), 0.0)
    acc.add(capsule_sdf(q, H, T, fp["r_neck"], 0.75 * fp["r_meta"]), 5.0)
    ts = dot3(q, T, shaft)  # distance down the shaft from the shaft top
    ds, _ = segment_distance(q, above, bottom)
    r_sh = h.shaft_radius_mm + (fp["r_meta"] - h.shaft_radius_mm) * (1.0 - smooth_step(ts / 60.0))
    acc.add(ds - r_sh, 6.0)
    acc.add(ellipsoid_sdf(q, fp["gt"], fp["gt_radii"]), 7.0)
    acc.add(sphere_sdf(q, fp["lt"], fp["lt_radius"]), 5.0)
    cort_shaft = h.shaft_radius_mm - h.canal_radius_mm
    cortex = 1.8 + (cort_shaft - 1.8) * smooth_step((ts - 25.0) / 60.0)
    marrow = np.where(ts > 50.0, np.uint8(Tissue.YELLOW_MARROW), np.uint8(Tissue.RED_MARROW))
    _paint_bone(ch, acc.sl, acc.d, cortex, np.broadcast_to(marrow, acc.d.shape))
    # femoral head cartilage (not on the neck side)
    sl = ch.slices(points_box([H], r_h + cart + 1.0), warped=False)
    if sl is not None:
        q = ch.coords(sl, warped=False)
        r = sphere_sdf(q, H, 0.0)
        off_neck = dot3(q, H, n) < math.cos(math.radians(40.0)) * r
        ch.paint(sl, (r >= r_h) & (r < r_h + cart) & off_neck, Tissue.CARTILAGE)


def _ilium_wing(pel: PelvisFrame, s: float, side: str, zp, yp, xq) -> np.ndarray:
    """Signed distance of the ilium wing (a curved slab on an elliptic arc around an
    anteromedial centre) at pelvic-frame coordinates (zp, yp, xq)."""
    sig = 1.0 if side == "left" else -1.0
    hp = pel.hp[side]
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
    return np.maximum(np.maximum(d_perp - 0.5 * t, d_ang),
                      np.maximum(zr - np.float32(pel.crest), np.float32(0.03 * pel.crest) - zr))


def _sacrum_and_lumbar(pel: PelvisFrame, s: float, zp, yp, xq):
    """Signed distances of the sacrum / coccyx and of the lumbar column above S1 (midline), and
    the phase along the column (period 38 mm; below 10 mm is disc), at pelvic-frame (zp, yp, xq).
    """
    szk, sw, sd, syc, z_s1 = pel.sacrum_profile()
    m0 = pel.mid(0.0, 0.0)
    zm = zp - float(m0[0])
    w = np.asarray(np.interp(zm, szk, sw), np.float32)
    dd = np.asarray(np.interp(zm, szk, sd), np.float32)
    yc = np.asarray(np.interp(zm, szk, syc), np.float32) + np.float32(m0[1])
    sac = ellipse2_sdf(xq, yp - yc, w, dd)
    sac = np.maximum(sac, np.maximum(zm - np.float32(z_s1), np.float32(szk[0]) - zm))
    # lumbar vertebral bodies and discs above S1 (period 38 mm: 28 bone + 10 disc)
    vb = ellipse2_sdf(xq, yp - np.float32(m0[1] + 42.0 * s), np.float32(24.0 * s),
                   np.float32(17.0 * s))
    vb = np.maximum(vb, np.float32(z_s1) - zm)
    phase = np.mod(zm - np.float32(z_s1), np.float32(38.0))
    return sac, vb, phase
