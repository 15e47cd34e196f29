"""Susceptibility field maps: the Fourier dipole kernel and the off-resonance of a
susceptibility map (:func:`dipole_field_hz`), the analytic field of a uniform sphere and a
partial-volume sphere phantom to check it against, and the scanner shim fit (:func:`fit_shim`).

The dipole convolution runs in torch on the requested device (CUDA when asked and present, else
CPU); inputs and outputs are numpy arrays. Volumes are [z, y, x] in the conventions of
:mod:`sim_scanner.physics.grid`, B0 along z (axis 0).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from masc_gadget.device import resolve_device
from sim_scanner.physics.grid import Grid
from sim_scanner.physics.sequence import GAMMA_BAR_HZ_PER_T


def _good_fft_size(n: int) -> int:
    """Smallest 2^a 3^b 5^c >= n."""
    best = None
    p2 = 1
    while p2 < 2 * n:
        p3 = p2
        while p3 < 2 * n:
            p5 = p3
            while p5 < 2 * n:
                if p5 >= n and (best is None or p5 < best):
                    best = p5
                p5 *= 5
            p3 *= 3
        p2 *= 2
    return best if best is not None else n


def dipole_kernel(shape: tuple[int, int, int], voxel_mm: tuple[float, float, float],
                  device: torch.device) -> torch.Tensor:
    """Fourier dipole kernel D(k) = 1/3 - kz^2 / |k|^2 (B0 along z, axis 0), D(0) = 0.

    Shape (nz, ny, nx // 2 + 1) for use with ``rfftn``; includes the Lorentz-sphere correction,
    so a uniform sphere sees no shift inside and the classic dipole field outside.
    """
    kz2 = torch.fft.fftfreq(shape[0], d=voxel_mm[0], device=device, dtype=torch.float64) ** 2
    ky2 = torch.fft.fftfreq(shape[1], d=voxel_mm[1], device=device, dtype=torch.float64) ** 2
    kx2 = torch.fft.rfftfreq(shape[2], d=voxel_mm[2], device=device, dtype=torch.float64) ** 2
    # float32 in place: the padded grid of a paper-scale subject has ~10^8 frequencies
    kernel = (ky2[:, None] + kx2[None, :]).to(torch.float32).expand(shape[0], -1, -1).clone()
    kz2_32 = kz2.to(torch.float32)[:, None, None]
    kernel += kz2_32
    kernel[0, 0, 0] = 1.0
    torch.div(kz2_32.expand_as(kernel), kernel, out=kernel)
    kernel.neg_().add_(1.0 / 3.0)
    kernel[0, 0, 0] = 0.0
    return kernel


def dipole_field_hz(
    delta_chi_ppm: np.ndarray | list[np.ndarray],
    voxel_mm: tuple[float, float, float],
    b0_t: float,
    padding: float = 0.5,
    device: str | torch.device = "cpu",
) -> np.ndarray | list[np.ndarray]:
    """Off-resonance (Hz) of susceptibility maps (ppm, relative to the surroundings, [z, y, x]).

    ``df = gamma_bar * B0 * IFFT(D(k) * FFT(chi))`` on a grid zero-padded by ``padding`` of its
    extent on each side. Zero padding means "the rest of the world has chi = 0": pass
    ``chi - chi_outside``. A list of maps is computed in one pass (same grid) and returned as a list.
    """
    maps = delta_chi_ppm if isinstance(delta_chi_ppm, list) else [delta_chi_ppm]
    shape = maps[0].shape
    if len(shape) != 3 or any(m.shape != shape for m in maps):
        raise ValueError(f"susceptibility maps must be 3D and of one shape, got {[m.shape for m in maps]}")
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    dev = resolve_device(device) if isinstance(device, str) else device
    padded = tuple(_good_fft_size(int(math.ceil(n * (1 + 2 * padding)))) for n in shape)
    kernel = dipole_kernel(padded, voxel_mm, dev)
    scale = GAMMA_BAR_HZ_PER_T * b0_t * 1e-6
    out = []
    for chi in maps:
        vol = torch.zeros(padded, dtype=torch.float32, device=dev)
        vol[: shape[0], : shape[1], : shape[2]] = torch.as_tensor(
            np.ascontiguousarray(chi, dtype=np.float32), device=dev
        )
        spec = torch.fft.rfftn(vol)
        del vol
        spec *= kernel
        field = torch.fft.irfftn(spec, s=padded)
        del spec
        out.append((field[: shape[0], : shape[1], : shape[2]] * scale).cpu().numpy())
    return out if isinstance(delta_chi_ppm, list) else out[0]


def sphere_field_analytic_hz(
    z_mm: np.ndarray, y_mm: np.ndarray, x_mm: np.ndarray, radius_mm: float, chi_ppm: float, b0_t: float
) -> np.ndarray:
    """Exact field of a uniformly magnetised sphere centred at the origin, B0 along z.

    Outside: ``gamma_bar B0 chi/3 (a/r)^3 (3 cos^2(theta) - 1)``; inside: 0 (Lorentz-corrected),
    valid for |chi| << 1.
    """
    r2 = z_mm**2 + y_mm**2 + x_mm**2
    r = np.sqrt(r2)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos2 = np.where(r2 > 0, z_mm**2 / np.where(r2 > 0, r2, 1.0), 0.0)
        outside = (chi_ppm * 1e-6 / 3.0) * (radius_mm / np.where(r > 0, r, 1.0)) ** 3 * (3 * cos2 - 1)
    return (GAMMA_BAR_HZ_PER_T * b0_t * np.where(r > radius_mm, outside, 0.0)).astype(np.float32)


def sphere_susceptibility(grid: Grid, radius_mm: float, chi_ppm: float, subsamples: int = 4) -> np.ndarray:
    """Sphere at the grid centre with partial-volume (sub-voxel) occupancy times ``chi_ppm``."""
    z, y, x = grid.axes_mm()
    z, y, x = z - grid.centre_mm[0], y - grid.centre_mm[1], x - grid.centre_mm[2]
    offsets = [((i + 0.5) / subsamples - 0.5) for i in range(subsamples)]
    occ = np.zeros(grid.shape, dtype=np.float32)
    for oz in offsets:
        for oy in offsets:
            for ox in offsets:
                zz = z + oz * grid.voxel_mm[0]
                yy = y + oy * grid.voxel_mm[1]
                xx = x + ox * grid.voxel_mm[2]
                occ += (zz**2 + yy**2 + xx**2 <= radius_mm**2).astype(np.float32)
    return occ * (chi_ppm / subsamples**3)


def fit_shim(field_hz: np.ndarray, mask: np.ndarray, grid: Grid, order: str) -> np.ndarray:
    """Least-squares shim (0th or 0th + 1st order) of ``field_hz`` over ``mask``; returns the
    shim field on the whole grid (subtract it)."""
    if order == "none" or not mask.any():
        return np.zeros(grid.shape, dtype=np.float32)
    values = field_hz[mask].astype(np.float64)
    if order == "f0":
        return np.full(grid.shape, np.float32(values.mean()))
    if order != "linear":
        raise ValueError(f"shim must be 'none', 'f0' or 'linear', got {order!r}")
    z, y, x = grid.axes_mm()
    zz, yy, xx = np.nonzero(mask)
    design = np.stack(
        [np.ones(len(zz)), grid.axis_mm(0)[zz], grid.axis_mm(1)[yy], grid.axis_mm(2)[xx]], axis=1
    ).astype(np.float64)
    coef, *_ = np.linalg.lstsq(design, values, rcond=None)
    return (coef[0] + coef[1] * z + coef[2] * y + coef[3] * x).astype(np.float32)
