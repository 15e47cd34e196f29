"""A receive array around the pelvis: coil sensitivities and correlated noise.

Clinical hip scans use a body array: elements on the anterior and posterior surfaces. Each
element is a small loop whose sensitivity falls off with distance from it, ``1 / (1 +
(d / d0)^2)^(3/2)`` (the on-axis field of a loop of radius ``d0``), with a phase that turns with
its position around the body. The elements sit evenly on an ellipse around the field of view.
The sensitivities are normalised to a root-sum-of-squares of 1 at every pixel, so the
root-sum-of-squares image of the array is the single-coil image (the receive shading of the
``variation`` section stays in the object). Noise is correlated between neighbouring
elements: ``Psi_ij = rho ^ (ring distance of i and j)``, drawn as ``L z`` with ``Psi = L L^H``.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["body_array", "correlated_noise", "noise_covariance"]


def body_array(n_coils: int, shape: tuple[int, int], fov_mm: tuple[float, float]) -> np.ndarray:
    """(C, H, W) complex64 sensitivities of ``n_coils`` elements on an ellipse around an (H, W)
    image of ``fov_mm`` (y, x), normalised to ``sum_c |s_c|^2 = 1``."""
    if n_coils < 1:
        raise ValueError(f"n_coils must be >= 1, got {n_coils}")
    h, w = shape
    y = (np.arange(h) - h / 2 + 0.5) * fov_mm[0] / h
    x = (np.arange(w) - w / 2 + 0.5) * fov_mm[1] / w
    yy, xx = np.meshgrid(y, x, indexing="ij")
    ry, rx = 0.42 * fov_mm[0], 0.48 * fov_mm[1]  # the body surface, about
    d0 = 0.2 * min(fov_mm)
    sens = []
    for c in range(n_coils):
        angle = 2 * math.pi * (c + 0.5) / n_coils
        cy, cx = ry * math.sin(angle), rx * math.cos(angle)
        d = np.hypot(yy - cy, xx - cx)
        sens.append((1.0 + (d / d0) ** 2) ** -1.5 * np.exp(1j * (angle + 0.002 * (xx * math.cos(angle)
                                                                                    + yy * math.sin(angle)))))
    sens = np.stack(sens)
    return (sens / np.sqrt((np.abs(sens) ** 2).sum(axis=0))).astype(np.complex64)


def noise_covariance(n_coils: int, correlation: float) -> np.ndarray:
    """(C, C) noise covariance of unit variance, ``correlation ** ring distance`` off the diagonal."""
    if not 0 <= correlation < 1:
        raise ValueError(f"correlation must be in [0, 1), got {correlation}")
    i = np.arange(n_coils)
    ring = np.minimum(np.abs(i[:, None] - i[None, :]), n_coils - np.abs(i[:, None] - i[None, :]))
    return correlation ** ring.astype(np.float64)


def correlated_noise(shape: tuple[int, ...], covariance: np.ndarray, sigma: float,
                     rng: np.random.Generator) -> np.ndarray:
    """Complex Gaussian noise of ``shape`` = (..., C, PE, RO)... with coil axis ``-3``: per sample
    covariance ``sigma^2 covariance`` across the coils."""
    n = covariance.shape[0]
    if shape[-3] != n:
        raise ValueError(f"the coil axis (-3) of shape {shape} must have {n} coils")
    chol = np.linalg.cholesky(covariance)
    z = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)) * (sigma / math.sqrt(2))
    return np.einsum("ij,...jab->...iab", chol, z)
