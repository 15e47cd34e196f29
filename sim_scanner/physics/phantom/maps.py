"""Tissue property maps: :func:`tissue_maps` turns a label volume into proton density, T1, T2
and susceptibility maps (:class:`TissueMaps`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim_scanner.physics.grid import Grid
from sim_scanner.physics.phantom.config import PhantomConfig
from sim_scanner.physics.phantom.records import Anatomy
from sim_scanner.physics.phantom.texture import texture_field
from sim_scanner.physics.tissues import tissue_properties


@dataclass
class TissueMaps:
    """MR property maps on the phantom grid, each float32 [z, y, x]."""

    pd: np.ndarray
    """Relative proton density (0..1)."""
    t1_ms: np.ndarray
    t2_ms: np.ndarray
    chi_ppm: np.ndarray
    """Volume susceptibility, ppm (SI); not textured."""


def tissue_maps(labels: np.ndarray, anatomy: Anatomy, grid: Grid, b0_t: float,
                cfg: PhantomConfig, rotation_deg: float = 0.0) -> TissueMaps:
    """PD, T1, T2 and susceptibility maps (float32 [z, y, x]) of a label volume.

    Properties come from :func:`~sim_scanner.physics.tissues.tissue_properties` at ``b0_t``, varied per
    subject and tissue by ``cfg.property_variation`` (deterministic from ``anatomy.seed``); PD
    (and, less, T2) carry a smooth multiplicative texture defined in mm. Susceptibility is not
    textured. Unknown label values raise ValueError. ``rotation_deg``: the patient lies turned
    by this angle about z (as passed to :func:`~sim_scanner.physics.phantom.rasterize_anatomy`),
    and the texture turns with it.
    """
    if labels.shape != grid.shape:
        raise ValueError(f"labels shape {labels.shape} does not match grid shape {grid.shape}")
    if labels.dtype != np.uint8:
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"labels must be an integer (uint8) array, got {labels.dtype}")
        if labels.size and (labels.min() < 0 or labels.max() > 255):
            bad = int(labels.min()) if labels.min() < 0 else int(labels.max())
            raise ValueError(f"labels contain values with no tissue properties: [{bad}]")
        labels = labels.astype(np.uint8)
    props = tissue_properties(b0_t)
    known = np.zeros(256, dtype=bool)
    for t in props:
        known[int(t)] = True
    present = np.flatnonzero(np.bincount(labels.ravel(), minlength=256))
    unknown = [int(v) for v in present if not known[v]]
    if unknown:
        raise ValueError(f"labels contain values with no tissue properties: {unknown} "
                         f"(known: {sorted(int(t) for t in props)})")
    rng = np.random.default_rng([anatomy.seed, 2])
    v = float(cfg.property_variation)
    pd_t = np.zeros(256, np.float32)
    t1_t = np.ones(256, np.float32)
    t2_t = np.ones(256, np.float32)
    chi_t = np.zeros(256, np.float32)
    for t in sorted(props, key=int):
        pr = props[t]
        f = 1.0 + v * np.clip(rng.normal(size=3), -2.5, 2.5)
        pd_t[int(t)] = min(1.0, pr.pd * f[0])
        t1_t[int(t)] = pr.t1_ms * f[1]
        t2_t[int(t)] = pr.t2_ms * f[2]
        chi_t[int(t)] = pr.chi_ppm
    amp = float(anatomy.params.get("texture_amplitude", 0.0))
    out = TissueMaps(
        pd=np.empty(grid.shape, np.float32), t1_ms=np.empty(grid.shape, np.float32),
        t2_ms=np.empty(grid.shape, np.float32), chi_ppm=np.empty(grid.shape, np.float32),
    )
    nz, ny, nx = grid.shape
    step = max(1, int(cfg.chunk_voxels) // (ny * nx))
    seed_pd = (anatomy.seed * 2 + 1) & 0x7FFFFFFF
    seed_t2 = (anatomy.seed * 2 + 2) & 0x7FFFFFFF
    for z0 in range(0, nz, step):
        zs = slice(z0, min(nz, z0 + step))
        lab = labels[zs]
        pd = pd_t[lab]
        t2 = t2_t[lab]
        if amp > 0:
            scale = cfg.texture_scale_mm
            pd *= 1.0 + np.float32(amp) * texture_field(seed_pd, grid, scale, zs, rotation_deg)
            t2 *= 1.0 + np.float32(0.5 * amp) * texture_field(seed_t2, grid, scale, zs, rotation_deg)
        np.clip(pd, 0.0, 1.0, out=pd)
        out.pd[zs] = pd
        out.t1_ms[zs] = t1_t[lab]
        out.t2_ms[zs] = t2
        out.chi_ppm[zs] = chi_t[lab]
    return out
