"""Smooth random fields defined in mm (so they do not depend on the grid): the value-noise
texture on proton density and T2, and the plane-wave deformation ``p + u(p)`` of soft tissue."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim_scanner.physics.grid import Grid, unrotate_yx


def _hash_uniform(seed: int, i: np.ndarray, j: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Deterministic uniform values in [-1, 1) for integer lattice nodes (broadcast i, j, k)."""
    with np.errstate(over="ignore"):
        h = (i.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             ^ j.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
             ^ k.astype(np.uint64) * np.uint64(0x165667B19E3779F9)
             ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * np.uint64(0x27D4EB2F165667C5))
        # splitmix64 finaliser
        h ^= h >> np.uint64(30)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(27)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    return ((h >> np.uint64(11)).astype(np.float64) * (2.0 / 2**53) - 1.0).astype(np.float32)


def _lattice_weights(coord: np.ndarray, spacing: float):
    """Lattice node indices and smoothstep weights of 1D coordinates (mm)."""
    u = coord.astype(np.float64) / spacing
    i0 = np.floor(u).astype(np.int64)
    w = u - i0
    w = w * w * (3.0 - 2.0 * w)
    return i0, w.astype(np.float32)


def _value_noise(seed: int, grid: Grid, spacing: float, z_slice: slice) -> np.ndarray:
    """Smooth value noise (node values uniform in [-1, 1)) on planes ``z_slice`` of ``grid``.

    Lattice nodes sit at integer multiples of ``spacing`` mm in patient coordinates, so the
    field does not depend on the grid. Separable smoothstep interpolation between nodes.
    """
    iz, wz = _lattice_weights(grid.axis_mm(0)[z_slice], spacing)
    iy, wy = _lattice_weights(grid.axis_mm(1), spacing)
    ix, wx = _lattice_weights(grid.axis_mm(2), spacing)
    lz = np.arange(iz.min(), iz.max() + 2)
    ly = np.arange(iy.min(), iy.max() + 2)
    lx = np.arange(ix.min(), ix.max() + 2)
    nodes = _hash_uniform(seed, lz[:, None, None], ly[None, :, None], lx[None, None, :])
    # interpolate along x, then y, then z
    jx = ix - lx[0]
    a = nodes[:, :, jx] * (1.0 - wx) + nodes[:, :, jx + 1] * wx
    jy = iy - ly[0]
    a = a[:, jy, :] * (1.0 - wy)[None, :, None] + a[:, jy + 1, :] * wy[None, :, None]
    jz = iz - lz[0]
    return a[jz] * (1.0 - wz)[:, None, None] + a[jz + 1] * wz[:, None, None]


def _value_noise_turned(seed: int, grid: Grid, spacing: float, z_slice: slice,
                        rotation_deg: float) -> np.ndarray:
    """:func:`_value_noise` of a patient turned by ``rotation_deg`` about z
    (:func:`~sim_scanner.physics.grid.rotate_zyx`): the noise is evaluated at the anatomical
    coordinates of the voxel centres, so it turns with the anatomy (bilinear in the plane)."""
    iz, wz = _lattice_weights(grid.axis_mm(0)[z_slice], spacing)
    ya, xa = unrotate_yx(grid.axis_mm(1)[:, None], grid.axis_mm(2)[None, :], rotation_deg)
    iy, wy = _lattice_weights(ya, spacing)
    ix, wx = _lattice_weights(xa, spacing)
    lz = np.arange(iz.min(), iz.max() + 2)
    ly = np.arange(iy.min(), iy.max() + 2)
    lx = np.arange(ix.min(), ix.max() + 2)
    nodes = _hash_uniform(seed, lz[:, None, None], ly[None, :, None], lx[None, None, :])
    jy, jx = iy - ly[0], ix - lx[0]
    a = ((nodes[:, jy, jx] * (1.0 - wx) + nodes[:, jy, jx + 1] * wx) * (1.0 - wy)
         + (nodes[:, jy + 1, jx] * (1.0 - wx) + nodes[:, jy + 1, jx + 1] * wx) * wy)
    jz = iz - lz[0]
    return a[jz] * (1.0 - wz)[:, None, None] + a[jz + 1] * wz[:, None, None]


def texture_field(seed: int, grid: Grid, spacing: float, z_slice: slice,
             rotation_deg: float = 0.0) -> np.ndarray:
    """Two octaves of value noise, unit-ish standard deviation, on planes ``z_slice`` of
    ``grid``, of a patient turned by ``rotation_deg`` about z."""
    if rotation_deg == 0.0:
        coarse = _value_noise(seed, grid, spacing, z_slice)
        fine = _value_noise(seed + 7919, grid, spacing / 2.5, z_slice)
    else:
        coarse = _value_noise_turned(seed, grid, spacing, z_slice, rotation_deg)
        fine = _value_noise_turned(seed + 7919, grid, spacing / 2.5, z_slice, rotation_deg)
    return (coarse + 0.5 * fine) * np.float32(1.6)


@dataclass(frozen=True)
class _Deformation:
    """Smooth random displacement ``u(p)`` of soft tissue: a sum of a few plane waves in mm."""

    amp: float
    """Peak displacement per axis, mm (0: no deformation)."""
    wave_k: np.ndarray
    """Wave vectors, rad / mm, (n, 3) in z, y, x."""
    wave_phase: np.ndarray
    """Phase of each wave, rad, (n,)."""
    wave_amp: np.ndarray
    """Amplitude of each displacement component of each wave, mm, (component, wave);
    ``|u_c| <= amp``."""


def draw_deformation(seed: int, amp: float) -> _Deformation:
    """The deformation of a subject, drawn from a generator seeded with ``[seed, 0]``."""
    rng = np.random.default_rng([seed, 0])
    n = 6
    dirs = rng.normal(size=(n, 3))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    wavelength = rng.uniform(100.0, 260.0, size=n)
    wave_k = 2.0 * np.pi * dirs / wavelength[:, None]  # rad / mm, (n, 3) in z, y, x
    wave_phase = rng.uniform(0.0, 2.0 * np.pi, size=n)
    amps = rng.normal(size=(3, n))
    amps /= np.abs(amps).sum(axis=1, keepdims=True)
    return _Deformation(amp=amp, wave_k=wave_k, wave_phase=wave_phase,
                        wave_amp=amps * amp)  # (component, wave); |u_c| <= amp


def warped_coords(deform: _Deformation, z3: np.ndarray, y3: np.ndarray, x3: np.ndarray,
                   shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Warped coordinates ``p + u(p)`` (float32 [z, y, x] each) of the points with coordinates
    z3, y3, x3 (float32 arrays that broadcast to ``shape``, e.g. (nz,1,1), (1,ny,1), (1,1,nx))."""
    uz = np.zeros(shape, np.float32)
    uy = np.zeros(shape, np.float32)
    ux = np.zeros(shape, np.float32)
    if deform.amp > 0:
        for i in range(deform.wave_k.shape[0]):
            kz, ky, kx = (np.float32(c) for c in deform.wave_k[i])
            th = (z3 * kz + np.float32(deform.wave_phase[i])) + y3 * ky + x3 * kx
            sn = np.sin(th)
            uz += np.float32(deform.wave_amp[0, i]) * sn
            uy += np.float32(deform.wave_amp[1, i]) * sn
            ux += np.float32(deform.wave_amp[2, i]) * sn
    uz += z3
    uy += y3
    ux += x3
    return uz, uy, ux
