"""One z slab of the volume being rasterised (:class:`_Chunk`): its axes, labels, warped
soft-tissue coordinates and box-to-slice lookups."""

from __future__ import annotations

import numpy as np

from sim_scanner.physics.grid import Grid
from sim_scanner.physics.phantom.layout import _Layout
from sim_scanner.physics.phantom.shapes import Box
from sim_scanner.physics.phantom.texture import _warped_coords
from sim_scanner.physics.tissues import Tissue


class _Chunk:
    """One z slab: axes, labels and warped coordinates."""

    def __init__(self, grid: Grid, lay: _Layout):
        self.z = grid.axis_mm(0)
        self.y = grid.axis_mm(1)
        self.x = grid.axis_mm(2)
        self.shape = grid.shape
        self.labels = np.zeros(grid.shape, dtype=np.uint8)
        self.body_depth: np.ndarray | None = None  # signed distance past the subcutaneous fat
        self.pad = lay.amp
        self.warped = _warped_coords(lay.deform, self.z, self.y, self.x, grid.shape)

    def slices(self, box: Box, warped: bool):
        pad = self.pad if warped else 0.0
        out = []
        for axis, (lo, hi) in zip((self.z, self.y, self.x), ((box[0], box[1]), (box[2], box[3]),
                                                             (box[4], box[5]))):
            i0 = int(np.searchsorted(axis, lo - pad, side="left"))
            i1 = int(np.searchsorted(axis, hi + pad, side="right"))
            if i1 <= i0:
                return None
            out.append(slice(i0, i1))
        return tuple(out)

    def coords(self, sl, warped: bool):
        if warped:
            return tuple(c[sl] for c in self.warped)
        return (self.z[sl[0]][:, None, None], self.y[sl[1]][None, :, None],
                self.x[sl[2]][None, None, :])

    def paint(self, sl, mask, label: Tissue) -> None:
        view = self.labels[sl]
        view[mask] = np.uint8(label)
