"""A regular 3D sampling grid in patient coordinates.

Conventions used by every module of the simulator:

* volumes are numpy arrays indexed ``[z, y, x]``;
* patient axes follow DICOM LPS: +x towards the patient's left, +y posterior, +z superior
  (head); B0 points along z (supine, head first), so axial slices are planes of constant z;
* coordinates are millimetres of voxel *centres*, ``axis_mm(i) = centre + (i - (n - 1) / 2) * d``;
* readout (frequency encoding) runs along x, phase encoding along y;
* a patient lying rotated on the table (:func:`rotate_zyx`) is turned about the z axis through
  the origin, positive angles from +x (left) towards +y (posterior), i.e. right-handed about +z.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def rotate_zyx(v: Sequence[float], angle_deg: float) -> tuple[float, float, float]:
    """A point or direction (z, y, x) turned by ``angle_deg`` about the z axis through the
    origin, from +x towards +y; z is unchanged."""
    c, s = math.cos(math.radians(angle_deg)), math.sin(math.radians(angle_deg))
    z, y, x = (float(a) for a in v)
    return (z, s * x + c * y, c * x - s * y)


def unrotate_yx(y: np.ndarray, x: np.ndarray, angle_deg: float) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`rotate_zyx` in the plane for broadcastable float32 arrays: the (y, x)
    a point had before the turn by ``angle_deg`` that brought it to (y, x); shape of y + x."""
    c = np.float32(math.cos(math.radians(angle_deg)))
    s = np.float32(math.sin(math.radians(angle_deg)))
    return c * y - s * x, c * x + s * y


@dataclass(frozen=True)
class Grid:
    """Voxel-centred grid: ``shape`` (nz, ny, nx), ``voxel_mm`` (dz, dy, dx), ``centre_mm`` (z, y, x)."""

    shape: tuple[int, int, int]
    voxel_mm: tuple[float, float, float]
    centre_mm: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def __post_init__(self) -> None:
        if len(self.shape) != 3 or min(self.shape) < 1:
            raise ValueError(f"grid shape must be three positive sizes, got {self.shape}")
        if len(self.voxel_mm) != 3 or min(self.voxel_mm) <= 0:
            raise ValueError(f"grid voxel_mm must be three positive sizes, got {self.voxel_mm}")

    def axis_mm(self, axis: int) -> np.ndarray:
        """Voxel-centre coordinates (mm, float32) along ``axis`` (0 = z, 1 = y, 2 = x)."""
        n = self.shape[axis]
        return (
            self.centre_mm[axis] + (np.arange(n, dtype=np.float64) - (n - 1) / 2) * self.voxel_mm[axis]
        ).astype(np.float32)

    def axes_mm(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(z, y, x) coordinate vectors shaped (nz,1,1), (1,ny,1), (1,1,nx) for broadcasting."""
        z = self.axis_mm(0)[:, None, None]
        y = self.axis_mm(1)[None, :, None]
        x = self.axis_mm(2)[None, None, :]
        return z, y, x

    def index_of(self, point_mm: tuple[float, float, float]) -> tuple[float, float, float]:
        """Fractional (z, y, x) voxel index of a point given in mm (z, y, x)."""
        return tuple(
            (point_mm[a] - self.centre_mm[a]) / self.voxel_mm[a] + (self.shape[a] - 1) / 2
            for a in range(3)
        )

    def zslab(self, start: int, stop: int) -> "Grid":
        """The sub-grid of planes ``start:stop`` along z (for chunked rasterisation)."""
        if not 0 <= start < stop <= self.shape[0]:
            raise ValueError(f"z slab {start}:{stop} outside grid of {self.shape[0]} planes")
        z = self.axis_mm(0)
        centre_z = float((z[start] + z[stop - 1]) / 2)
        return Grid(
            (stop - start, self.shape[1], self.shape[2]),
            self.voxel_mm,
            (centre_z, self.centre_mm[1], self.centre_mm[2]),
        )
