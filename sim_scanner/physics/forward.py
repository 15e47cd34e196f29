"""MR physics of the simulator: the forward model's settings (:class:`PhysicsConfig`), the TSE
signal, and k-space synthesis with metal-induced slice bending and readout displacement.
The off-resonance maps it consumes come from :mod:`sim_scanner.physics.field`.

All heavy steps run in torch on the configured device (CUDA when asked and present, else CPU);
inputs and outputs are numpy arrays. Volumes are [z, y, x] in the conventions of
:mod:`sim_scanner.physics.grid`.

Forward model (per axial slice, spin echo, so off-resonance dephasing is refocused and the
phase-encoding direction is undistorted):

* a spin at (x, y, z) with off-resonance df (Hz) is excited by the slice-selective pulse as if it
  sat at ``z_eff = z + df * thickness / rf_bw`` (slice-select gradient = rf_bw / thickness Hz/mm),
  weighted by the RF slice profile at ``z_eff - z_slice``;
* the frequency encoding maps it to ``x_eff = x + df / bw_per_pixel * pixel_x``;
* its signal is deposited at (x_eff, y) on a grid finer than the image by ``inplane_oversampling``
  (linear splatting, so intensities pile up where spins converge and leave voids where they
  diverge), the fine image is band-limited by keeping the central ``matrix`` of its k-space
  (what sampling a finite k-space does: Gibbs ringing included), and that is the slice's k-space.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from masc_gadget.device import resolve_device
from masc_gadget.core.kspace import fft2c
from sim_scanner.physics.grid import Grid
from sim_scanner.physics.sequence import SequenceConfig

log = logging.getLogger(__name__)

FAT_CHEMICAL_SHIFT_PPM = -3.4
"""Main methylene resonance of fat relative to water (ppm)."""


@dataclass(frozen=True)
class PhysicsConfig:
    """Numerical settings of the forward model (config section ``physics``)."""

    inplane_oversampling: int = 2
    """Object grid points per image pixel along x and y (sub-voxel sampling of the spins)."""
    z_samples_per_slice: int = 4
    """Object planes per slice thickness (the object's z spacing is thickness / this)."""
    z_margin_mm: float = 40.0
    """Object extent beyond the slice stack along z; farther spins are not simulated even if
    their off-resonance would move them into a slice."""
    readout_margin_mm: float = 60.0
    """Object extent beyond the FOV along the readout, so that spins displaced into the FOV from
    outside it are simulated (signal displaced out of the FOV is filtered out, as by the ADC)."""
    field_padding: float = 0.25
    """Zero padding of the susceptibility map on each side, as a fraction of its extent, for the
    Fourier dipole convolution (limits wrap-around of the periodic convolution; for a sphere
    filling a quarter of the grid the largest error is ~0.5 % of the peak at 0.25, 0.2 % at 0.5)."""
    slice_profile_transition: float = 0.2
    """Width of the raised-cosine edges of the slice profile, as a fraction of the thickness."""
    shim: Literal["none", "f0", "linear"] = "linear"
    """Scanner shim applied to both partners: fit over the tissue of the metal-free field map
    ("f0": frequency offset only; "linear": offset + linear gradients) and remove it."""
    fat_chemical_shift: bool = True
    """Add fat's -3.4 ppm chemical shift to its off-resonance (to both partners)."""
    snr: float = 0.0
    """Image SNR (mean tissue signal / noise std) of complex Gaussian k-space noise; 0 = none."""
    noise_in_clean: bool = False
    """Also add (the same) noise to the clean partner; by default the ground truth is noiseless."""
    device: str = "cpu"
    """Torch device for field maps and k-space synthesis: "cpu", "cuda", "cuda:N" or "auto"."""
    coils: int = 1
    """Receive coils of the metal scan as the scanner sends it (its ISMRMRD group): 1, or a body
    array of this many elements around the pelvis (:mod:`sim_scanner.physics.coils`). Training
    reads the single-coil k-space either way."""
    coil_correlation: float = 0.0
    """Noise correlation of neighbouring coils of the array (0 = independent; falls off as
    ``correlation ** ring distance``)."""

    def __post_init__(self) -> None:
        if isinstance(self.coils, bool) or not isinstance(self.coils, int) or not 1 <= self.coils <= 128:
            raise ValueError(f"coils must be an integer in [1, 128], got {self.coils!r}")
        if not 0 <= self.coil_correlation < 1:
            raise ValueError(f"coil_correlation must be in [0, 1), got {self.coil_correlation}")
        if self.inplane_oversampling < 1:
            raise ValueError(f"inplane_oversampling must be >= 1, got {self.inplane_oversampling}")
        if self.z_samples_per_slice < 1:
            raise ValueError(f"z_samples_per_slice must be >= 1, got {self.z_samples_per_slice}")
        if self.z_margin_mm < 0 or self.readout_margin_mm < 0:
            raise ValueError("z_margin_mm and readout_margin_mm must be >= 0")
        if self.field_padding < 0:
            raise ValueError(f"field_padding must be >= 0, got {self.field_padding}")
        if not 0 <= self.slice_profile_transition <= 1:
            raise ValueError(
                f"slice_profile_transition must be in [0, 1], got {self.slice_profile_transition}"
            )
        if self.snr < 0:
            raise ValueError(f"snr must be >= 0 (0 = no noise), got {self.snr}")


# --------------------------------------------------------------------------- signal


def tse_signal(pd: np.ndarray, t1_ms: np.ndarray, t2_ms: np.ndarray, tr_ms: float, te_ms: float) -> np.ndarray:
    """Spin-echo magnitude ``PD (1 - exp(-TR/T1)) exp(-TE/T2)`` at the effective echo time."""
    t1 = np.maximum(t1_ms, 1e-3)
    t2 = np.maximum(t2_ms, 1e-3)
    return (pd * (1.0 - np.exp(-tr_ms / t1)) * np.exp(-te_ms / t2)).astype(np.float32)


def slice_profile(u: torch.Tensor, transition: float) -> torch.Tensor:
    """RF slice profile at ``u`` = (z - z_slice) / thickness: flat top, raised-cosine edges of
    width ``transition``; its integral over u is 1 and its samples at any spacing that divides
    the thickness sum to thickness / spacing."""
    a = torch.abs(u)
    if transition <= 0:
        return (a < 0.5).to(u.dtype)
    inner = 0.5 - transition / 2
    edge = 0.5 * (1 + torch.cos(math.pi * (a - inner) / transition))
    return torch.where(a <= inner, torch.ones_like(u), torch.where(a < 0.5 + transition / 2, edge, torch.zeros_like(u)))


# --------------------------------------------------------------------------- k-space


def object_grid(seq: SequenceConfig, physics: PhysicsConfig, fov_centre_mm: tuple[float, float],
                stack_centre_z_mm: float) -> Grid:
    """The grid on which the object is sampled for a scan of ``seq``.

    In-plane spacing is the pixel size / ``inplane_oversampling``; the grid is shifted by half a
    pixel minus half a fine step, so that the centred FFT of the fine grid and of the image grid
    share their origin (image pixel centres then sit at ``fov_centre + (j - (n - 1) / 2) * pixel``).
    Along x the grid extends ``readout_margin_mm`` beyond the FOV; along y it spans the FOV.
    Along z it spans the stack plus ``z_margin_mm`` with thickness / ``z_samples_per_slice``.
    """
    s = physics.inplane_oversampling
    px, py = seq.pixel_mm
    dz = seq.slice_thickness_mm / physics.z_samples_per_slice
    margin_cols = int(math.ceil(physics.readout_margin_mm / (px / s)))
    nx = seq.n_readout * s + 2 * margin_cols
    ny = seq.n_pe * s
    offsets = seq.slice_offsets_mm()
    half_span = (offsets[-1] - offsets[0]) / 2 + seq.slice_thickness_mm / 2 + physics.z_margin_mm
    nz_half = int(math.ceil(half_span / dz))
    # slice centres are k * slice_spacing from the stack centre; put planes on a lattice that
    # contains them when the spacing is a multiple of dz, else centre-aligned
    nz = 2 * nz_half + 1
    cy, cx = fov_centre_mm
    shift_x = px / 2 - px / (2 * s)
    shift_y = py / 2 - py / (2 * s)
    return Grid((nz, ny, nx), (dz, py / s, px / s), (stack_centre_z_mm, cy + shift_y, cx + shift_x))


def synthesize_kspace(
    signal: np.ndarray,
    offres_hz: np.ndarray,
    grid: Grid,
    seq: SequenceConfig,
    physics: PhysicsConfig,
    slice_centres_mm: list[float],
    progress=None,
) -> np.ndarray:
    """k-space [slice, pe, ro] (complex64) of the object ``signal`` with off-resonance ``offres_hz``.

    ``signal`` and ``offres_hz`` live on ``grid`` (from :func:`object_grid`); ``slice_centres_mm``
    are the slice centres along z. ``progress``, if given, is called once per slice.
    """
    if signal.shape != grid.shape or offres_hz.shape != grid.shape:
        raise ValueError(
            f"signal {signal.shape} and off-resonance {offres_hz.shape} must match the grid {grid.shape}"
        )
    s = physics.inplane_oversampling
    dev = resolve_device(physics.device)
    n_ro, n_pe = seq.n_readout, seq.n_pe
    nz, ny, nx = grid.shape
    th = seq.slice_thickness_mm
    dz = grid.voxel_mm[0]

    iz, iy, ix = np.nonzero(signal > 0)
    sig = torch.as_tensor(signal[iz, iy, ix], device=dev)
    df = torch.as_tensor(offres_hz[iz, iy, ix], device=dev)
    z = torch.as_tensor(grid.axis_mm(0)[iz], device=dev) + df * (th / seq.rf_bw_hz)
    # fractional fine-column of the displaced spin
    col = torch.as_tensor(ix.astype(np.float32), device=dev) + df * (s / seq.readout_bw_hz_per_px)
    row = torch.as_tensor(iy.astype(np.int64), device=dev)
    del iz, iy, ix
    order = torch.argsort(z)
    z, sig, col, row = z[order], sig[order], col[order], row[order]

    margin = (nx - n_ro * s) // 2
    half_support = th * (0.5 + physics.slice_profile_transition / 2)
    kspace = np.zeros((len(slice_centres_mm), n_pe, n_ro), dtype=np.complex64)
    lo_k = (n_pe * s) // 2 - n_pe // 2
    lo_x = (n_ro * s) // 2 - n_ro // 2
    for k, zc in enumerate(slice_centres_mm):
        bounds = torch.tensor([zc - half_support, zc + half_support], device=dev, dtype=z.dtype)
        a, b = torch.searchsorted(z, bounds).tolist()
        image = torch.zeros(ny * nx, dtype=torch.float32, device=dev)
        if b > a:
            w = sig[a:b] * slice_profile((z[a:b] - zc) / th, physics.slice_profile_transition) * (dz / th)
            c = col[a:b]
            c0 = torch.floor(c)
            frac = c - c0
            c0 = c0.to(torch.int64)
            r = row[a:b]
            for cols, weights in ((c0, w * (1 - frac)), (c0 + 1, w * frac)):
                keep = (cols >= 0) & (cols < nx)
                image.index_add_(0, r[keep] * nx + cols[keep], weights[keep])
        image = image.view(ny, nx)[:, margin : margin + n_ro * s]
        spectrum = fft2c(image.to(torch.complex64))
        kspace[k] = (spectrum[lo_k : lo_k + n_pe, lo_x : lo_x + n_ro] / s).cpu().numpy()
        if progress is not None:
            progress()
    return kspace
