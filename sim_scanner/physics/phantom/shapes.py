"""Small vector helpers and implicit shapes (approximate signed distances in mm, negative inside)
evaluated on voxel centres, plus axis-aligned world boxes.

Layout maths runs in float64 on single points; voxel maths in float32 on broadcast coordinate
arrays ``q = (z, y, x)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FAR = np.float32(1e6)
"""Stand-in for +infinity in distance accumulators (inf * 0 would give NaN in smooth unions)."""


def vec3(z: float, y: float, x: float) -> np.ndarray:
    return np.array([z, y, x], dtype=np.float64)


def unit3(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def smooth_step(t: np.ndarray | float) -> np.ndarray | float:
    t = np.clip(t, 0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def smooth_min(a: np.ndarray, b: np.ndarray, k: float) -> np.ndarray:
    """Polynomial smooth minimum (blend radius ``k`` mm) of two distance fields."""
    if k <= 0:
        return np.minimum(a, b)
    h = np.clip(0.5 + (0.5 / k) * (b - a), 0.0, 1.0)
    return b + (a - b) * h - k * h * (1.0 - h)


def segment_distance(q, a: np.ndarray, b: np.ndarray):
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


def capsule_sdf(q, a, b, r0: float, r1: float) -> np.ndarray:
    """Tapered capsule (radius r0 at a, r1 at b): approximate signed distance."""
    d, t = segment_distance(q, a, b)
    t *= r1 - r0
    t += r0
    d -= t
    return d


def sphere_sdf(q, c, r: float) -> np.ndarray:
    qz, qy, qx = q
    dz, dy, dx = qz - float(c[0]), qy - float(c[1]), qx - float(c[2])
    return np.sqrt(dz * dz + dy * dy + dx * dx) - r


def ellipsoid_sdf(q, c, radii) -> np.ndarray:
    """Axis-aligned ellipsoid, semi-axes (rz, ry, rx): approximate signed distance."""
    qz, qy, qx = q
    rz, ry, rx = (float(r) for r in radii)
    uz, uy, ux = (qz - float(c[0])) / rz, (qy - float(c[1])) / ry, (qx - float(c[2])) / rx
    k0 = np.sqrt(uz * uz + uy * uy + ux * ux)
    k1 = np.sqrt((uz / rz) ** 2 + (uy / ry) ** 2 + (ux / rx) ** 2)
    eps = 1e-3
    return (k0 - 1.0) * (k0 + eps) / (k1 + eps / min(rz, ry, rx))


def ellipse2_sdf(x, y, a, b) -> np.ndarray:
    """Ellipse with semi-axes a (x) and b (y) in the xy plane: approximate signed distance."""
    X, Y = x / a, y / b
    rho = np.sqrt(X * X + Y * Y)
    g = np.sqrt((X / a) ** 2 + (Y / b) ** 2)
    eps = 1e-3
    return (rho - 1.0) * (rho + eps) / (g + eps / np.minimum(a, b))


def dot3(q, c, d) -> np.ndarray:
    """(q - c) . d for points q (tuple of arrays)."""
    return ((q[0] - float(c[0])) * float(d[0]) + (q[1] - float(c[1])) * float(d[1])
            + (q[2] - float(c[2])) * float(d[2]))


Box = tuple[float, float, float, float, float, float]
"""(zlo, zhi, ylo, yhi, xlo, xhi) in mm."""


def points_box(points: Sequence[np.ndarray], pad: float) -> Box:
    arr = np.asarray(points, dtype=np.float64)
    lo, hi = arr.min(axis=0) - pad, arr.max(axis=0) + pad
    return (lo[0], hi[0], lo[1], hi[1], lo[2], hi[2])
