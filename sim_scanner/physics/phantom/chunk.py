"""One z slab of the volume being rasterised (:class:`Chunk`): its axes, labels, warped
soft-tissue coordinates and box-to-slice lookups.

A patient turned by ``rotation_deg`` about z (:func:`~sim_scanner.physics.grid.rotate_zyx`) is
rasterised by evaluating every shape at the *anatomical* coordinates of the voxel centres (the
grid turned back by the angle), so the anatomy is exact at any angle; boxes given in
anatomical coordinates map to the grid's index ranges through their turned bounding box.
"""

from __future__ import annotations

import math

import numpy as np

from sim_scanner.physics.grid import Grid, unrotate_yx
from sim_scanner.physics.phantom.layout import PhantomLayout
from sim_scanner.physics.phantom.shapes import Box
from sim_scanner.physics.phantom.texture import warped_coords
from sim_scanner.physics.tissues import Tissue


class Chunk:
    """One z slab: axes, labels and warped coordinates.

    ``z``, ``y``, ``x`` are the grid's (scanner) axes; ``ya``, ``xa`` the anatomical in-plane
    coordinates of the voxel centres, (1, ny, 1) and (1, 1, nx) when the patient is not
    turned, both (1, ny, nx) when it is.
    """

    def __init__(self, grid: Grid, lay: PhantomLayout, rotation_deg: float = 0.0):
        self.z = grid.axis_mm(0)
        self.y = grid.axis_mm(1)
        self.x = grid.axis_mm(2)
        self.shape = grid.shape
        self.labels = np.zeros(grid.shape, dtype=np.uint8)
        self.body_depth: np.ndarray | None = None  # signed distance past the subcutaneous fat
        self.pad = lay.amp
        self.rotation_deg = float(rotation_deg)
        if self.rotation_deg == 0.0:
            self.ya, self.xa = self.y[None, :, None], self.x[None, None, :]
        else:
            self.ya, self.xa = unrotate_yx(self.y[None, :, None], self.x[None, None, :],
                                           self.rotation_deg)
        self.warped = warped_coords(lay.deform, self.z[:, None, None], self.ya, self.xa, grid.shape)

    def inplane_slices(self, ylo: float, yhi: float, xlo: float, xhi: float):
        """(y slice, x slice) of the voxels whose anatomical (y, x) may lie in the rectangle
        [ylo, yhi] x [xlo, xhi] mm (exactly those when the patient is not turned; the turned
        rectangle's bounding box when it is), or None when they miss the grid."""
        if self.rotation_deg != 0.0:
            angle = math.radians(self.rotation_deg)
            c, s = math.cos(angle), math.sin(angle)
            corners = [(y, x) for y in (ylo, yhi) for x in (xlo, xhi)]
            ys = [s * x + c * y for y, x in corners]
            xs = [c * x - s * y for y, x in corners]
            ylo, yhi, xlo, xhi = min(ys), max(ys), min(xs), max(xs)
        out = []
        for axis, lo, hi in ((self.y, ylo, yhi), (self.x, xlo, xhi)):
            i0 = int(np.searchsorted(axis, lo, side="left"))
            i1 = int(np.searchsorted(axis, hi, side="right"))
            if i1 <= i0:
                return None
            out.append(slice(i0, i1))
        return tuple(out)

    def slices(self, box: Box, warped: bool):
        """Index slices (z, y, x) of the voxels that may lie in ``box`` (anatomical mm; padded
        by the deformation amplitude when ``warped``), or None."""
        pad = self.pad if warped else 0.0
        i0 = int(np.searchsorted(self.z, box[0] - pad, side="left"))
        i1 = int(np.searchsorted(self.z, box[1] + pad, side="right"))
        if i1 <= i0:
            return None
        inplane = self.inplane_slices(box[2] - pad, box[3] + pad, box[4] - pad, box[5] + pad)
        if inplane is None:
            return None
        return (slice(i0, i1), *inplane)

    def coords(self, sl, warped: bool):
        """Anatomical (z, y, x) coordinates of the voxels ``sl``, broadcastable to its shape."""
        if warped:
            return tuple(c[sl] for c in self.warped)
        if self.rotation_deg == 0.0:
            return (self.z[sl[0]][:, None, None], self.y[sl[1]][None, :, None],
                    self.x[sl[2]][None, None, :])
        return (self.z[sl[0]][:, None, None], self.ya[:, sl[1], sl[2]], self.xa[:, sl[1], sl[2]])

    def paint(self, sl, mask, label: Tissue) -> None:
        view = self.labels[sl]
        view[mask] = np.uint8(label)
