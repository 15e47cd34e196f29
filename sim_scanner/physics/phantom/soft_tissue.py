"""Painting soft tissue into a slab: body outline, skin and subcutaneous fat, the pelvic
cavity, muscle groups (a labelled Voronoi partition with fat planes), pelvic organs and
vessels. All of it is evaluated at the warped coordinates."""

from __future__ import annotations

import numpy as np

from sim_scanner.physics.phantom.chunk import Chunk
from sim_scanner.physics.phantom.layout import PhantomLayout
from sim_scanner.physics.phantom.shapes import (
    FAR,
    Box,
    capsule_sdf,
    ellipse2_sdf,
    ellipsoid_sdf,
    points_box,
    smooth_min,
)
from sim_scanner.physics.phantom.skeleton import femur_axis_point
from sim_scanner.physics.tissues import Tissue


def paint_body(ch: Chunk, lay: PhantomLayout) -> np.ndarray:
    """Skin and subcutaneous fat; returns the mask of the space inside the fat.

    The outline's cross-section profiles are looked up at the plane's own z; the deformation
    moves the outline within the plane.
    """
    _, yw, xw = ch.warped
    z = ch.z.astype(np.float64)
    a, ba, bp = lay.trunk(z)
    a3 = a.astype(np.float32)[:, None, None]
    b3 = np.where(yw < 0, np.float32(ba)[:, None, None], np.float32(bp)[:, None, None])
    body = ellipse2_sdf(xw, yw, a3, b3)
    cap = (lay.trunk_bottom - z).astype(np.float32)[:, None, None]
    body = np.maximum(body, cap)
    sel = np.nonzero(z < lay.thigh_top + 20.0)[0]
    if sel.size:
        zs = slice(int(sel[0]), int(sel[-1]) + 1)
        for side in ("left", "right"):
            xc, rx, yc, ry = lay.thigh_at(side, z[zs])
            f32 = lambda v: np.asarray(v, np.float32)[:, None, None]  # noqa: E731
            th = ellipse2_sdf(xw[zs] - f32(xc), yw[zs] - f32(yc), f32(rx), f32(ry))
            th = np.maximum(th, f32(z[zs] - lay.thigh_top))
            body[zs] = smooth_min(body[zs], th, 18.0)
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


def cavity_mask(ch: Chunk, lay: PhantomLayout, env: np.ndarray) -> np.ndarray:
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
    inplane = ch.inplane_slices(ylo, yhi, -amax, amax)
    if inplane is None:
        return cav
    sl = (zs, *inplane)
    _, yw, xw = (c[sl] for c in ch.warped)
    dy = yw - f32(ym)
    b = np.where(dy < 0, f32(hf), f32(hb))
    d = ellipse2_sdf(xw, dy, f32(a), b)
    cav[sl] = (d < 0) & env[sl]
    return cav


# -- muscles -----------------------------------------------------------------------------------


def _chain_box(chain, pad: float) -> Box:
    pts = [q for q, _ in chain]
    rmax = max(r for _, r in chain)
    return points_box(pts, rmax + pad)


def paint_muscles(ch: Chunk, lay: PhantomLayout, env: np.ndarray, cav: np.ndarray) -> None:
    """Labelled Voronoi partition of the space inside the fat into muscle groups."""
    m1 = np.full(ch.shape, FAR, np.float32)
    m2 = np.full(ch.shape, FAR, np.float32)
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
                d = capsule_sdf(q, pa, pb, ra, rb)
                dist = d if dist is None else np.minimum(dist, d, out=dist)
        dist[dist >= grp.margin] = FAR
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
            fx = np.array([femur_axis_point(h, float(zz))[2] for zz in ch.z[s]], np.float32)
            fy = np.array([femur_axis_point(h, float(zz))[1] for zz in ch.z[s]], np.float32)
            _, yw, xw = (c[s] for c in ch.warped)
            band = ((depth[s] < 0) & (depth[s] > -2.0) & (sig * (xw - fx[:, None, None]) > 15.0)
                    & (np.abs(yw - fy[:, None, None]) < 30.0))
            ch.labels[s][band] = Tissue.TENDON


# -- pelvic organs -----------------------------------------------------------------------------


def paint_pelvic_organs(ch: Chunk, lay: PhantomLayout, cav: np.ndarray) -> None:
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
        sl = ch.slices(points_box([pa, pb], r), warped=True)
        if sl is None:
            continue
        q = ch.coords(sl, warped=True)
        inside = (capsule_sdf(q, pa, pb, r, r) < 0) & cav[sl]
        ch.paint(sl, inside, Tissue.BOWEL)
    for pa, pb, r in lay.bowel_gas:  # gas pockets inside their loops (a void of air's susceptibility)
        sl = ch.slices(points_box([pa, pb], r), warped=True)
        if sl is None:
            continue
        q = ch.coords(sl, warped=True)
        ch.paint(sl, (capsule_sdf(q, pa, pb, r, r) < 0) & cav[sl], Tissue.AIR)
    _paint_chain(ch, lay.sigmoid, Tissue.BOWEL, wall=(Tissue.MUSCLE, 2.0), within=cav)
    # rectum and anal canal: muscular wall, lumen
    outer = [(q, ro) for q, ro, _ in lay.rectum]
    inner = [(q, ri) for q, _, ri in lay.rectum]
    _paint_chain(ch, outer, Tissue.MUSCLE)
    _paint_chain(ch, inner, Tissue.BOWEL)
    # urinary bladder: detrusor wall around urine
    c, (rz, ry, rx) = lay.bladder
    wall = 2.5
    sl = ch.slices(points_box([c], max(rz, ry, rx) + wall), warped=True)
    if sl is not None:
        q = ch.coords(sl, warped=True)
        d = ellipsoid_sdf(q, c, (rz + wall, ry + wall, rx + wall))
        ch.paint(sl, d < 0, Tissue.MUSCLE)
        d = ellipsoid_sdf(q, c, (rz, ry, rx))
        ch.paint(sl, d < 0, Tissue.URINE)


def _paint_chain(ch: Chunk, chain, label: Tissue, wall=None, within=None) -> None:
    """Paint a chain of tapered capsules [(point, radius), ...] (warped coordinates)."""
    extra = wall[1] if wall else 0.0
    sl = ch.slices(_chain_box(chain, extra), warped=True)
    if sl is None:
        return
    q = ch.coords(sl, warped=True)
    d = None
    for (pa, ra), (pb, rb) in zip(chain[:-1], chain[1:]):
        di = capsule_sdf(q, pa, pb, ra, rb)
        d = di if d is None else np.minimum(d, di)
    lim = within[sl] if within is not None else True
    if wall:
        ch.paint(sl, (d < extra) & lim, wall[0])
    ch.paint(sl, (d < 0) & lim, label)


def paint_vessels(ch: Chunk, lay: PhantomLayout) -> None:
    for pts, r, sheath in lay.vessels:
        chain = [(q, r) for q in pts]
        _paint_chain(ch, chain, Tissue.BLOOD, wall=(Tissue.FAT, sheath))
