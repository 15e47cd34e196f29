"""Rasterising an anatomy: :func:`rasterize_anatomy` paints a label volume slab by slab, from
the outside in (soft tissue, then bones and hip joints)."""

from __future__ import annotations

import numpy as np

from sim_scanner.physics.grid import Grid
from sim_scanner.physics.phantom.bones import paint_hip_joint, paint_pelvis_side
from sim_scanner.physics.phantom.chunk import Chunk
from sim_scanner.physics.phantom.config import PhantomConfig
from sim_scanner.physics.phantom.layout import PhantomLayout
from sim_scanner.physics.phantom.muscles import muscle_groups
from sim_scanner.physics.phantom.records import Anatomy
from sim_scanner.physics.phantom.soft_tissue import (
    cavity_mask,
    paint_body,
    paint_muscles,
    paint_pelvic_organs,
    paint_vessels,
)


def rasterize_anatomy(anatomy: Anatomy, grid: Grid, cfg: PhantomConfig,
                      rotation_deg: float = 0.0) -> np.ndarray:
    """Label volume (uint8 [z, y, x], values of :class:`~sim_scanner.physics.tissues.Tissue`) of ``anatomy`` on ``grid``.

    Deterministic: the same anatomy, grid and config give bit-identical labels. Works in z slabs
    of about ``cfg.chunk_voxels`` voxels. ``rotation_deg``: the patient lies turned by this
    angle about the z axis through the origin (:func:`~sim_scanner.physics.grid.rotate_zyx`);
    every shape is evaluated at the voxel centres turned back, so the turned anatomy is exact.
    """
    lay = PhantomLayout(anatomy, cfg)
    lay.groups = muscle_groups(lay)
    nz, ny, nx = grid.shape
    out = np.empty(grid.shape, dtype=np.uint8)
    step = max(1, int(cfg.chunk_voxels) // (ny * nx))
    for z0 in range(0, nz, step):
        z1 = min(nz, z0 + step)
        chunk = Chunk(grid.zslab(z0, z1), lay, rotation_deg)
        _rasterize_chunk(chunk, lay)
        out[z0:z1] = chunk.labels
    return out


def _rasterize_chunk(ch: Chunk, lay: PhantomLayout) -> None:
    env = paint_body(ch, lay)
    cav = cavity_mask(ch, lay, env)
    paint_muscles(ch, lay, env, cav)
    paint_pelvic_organs(ch, lay, cav)
    paint_vessels(ch, lay)
    for side in ("left", "right"):
        paint_pelvis_side(ch, lay, side)
    for side in ("left", "right"):
        paint_hip_joint(ch, lay, side)
