"""A 2D metal-artifact model for real images (the paper's cross-dataset set, after Kwon et al. 2018).

Real clinical images have no implant; this adds one, in the image domain, with the physics of
the two artifacts a spin-echo sequence shows:

1. **Off-resonance.** A simplified implant, an ellipse of susceptibility ``chi_ppm`` (relative to
   tissue) that extends through the slice, is placed in the image; its field is the dipole field
   of a z-invariant object with B0 in the image plane (along the phase-encoding axis y),
   ``dB/B0 = F^-1[ chi(k) (1/3 - ky^2 / |k|^2) ]``, and the frequency offset ``df = gamma-bar B0
   dB/B0``.
2. **In-plane displacement with pile-up and voids.** Along the readout (x) each pixel's signal
   lands ``dx = df / BW_px`` pixels away. Signal is moved, not made: every source pixel's signal
   is split linearly between the two output pixels around ``x + dx``, so the output intensity is
   the source intensity divided by the Jacobian ``|1 + d(dx)/dx|`` of the displacement where
   the mapping is one to one: pile-up where spins converge, voids where they spread.
3. **Through-plane signal loss.** Off-resonant spins are excited away from the slice: the signal
   of a pixel is weighted by the slice profile at its offset, a Gaussian RF profile of full
   width at half maximum ``rf_fwhm_hz`` (paper: 2.25 kHz).

The implant itself holds no protons: it is a void in both images. The clean image is the source
image with that void; the metal image adds the field. Each draw places the implant with a random
rotation (+-``rotation_deg``) and a random shift (+-``shift_fraction`` of the image) about the
image centre, like the paper's +-45 deg and +-80 px at 320 px.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GAMMA_BAR_HZ_PER_T = 42.577478518e6
"""Proton gyromagnetic ratio / 2 pi, Hz / T."""


@dataclass(frozen=True)
class Artifact2DConfig:
    """The 2D artifact model (config section ``artifact2d``)."""

    b0_t: float = 3.0
    """Field strength, tesla."""
    readout_bw_hz_per_px: float = 710.0
    """Readout bandwidth per pixel, Hz (the displacement is df / this)."""
    rf_fwhm_hz: float = 2250.0
    """Full width at half maximum of the Gaussian slice profile, Hz (paper: 2.25 kHz)."""
    chi_ppm: float = 900.0
    """Susceptibility of the implant relative to tissue, ppm (CoCr about 900, titanium 182)."""
    semi_axes_fraction: tuple[float, float] = (0.04, 0.025)
    """Semi-axes of the elliptical implant as fractions of the image width."""
    rotation_deg: float = 45.0
    """The implant's orientation is drawn uniformly in +- this, degrees."""
    shift_fraction: float = 0.25
    """The implant's centre is drawn uniformly within +- this fraction of the image size of the
    centre (80 px at 320 px: 0.25)."""
    snr: float = 0.0
    """Complex Gaussian noise added to both k-spaces, as the mean signal over the noise sd (0 = none)."""

    def __post_init__(self) -> None:
        for name in ("b0_t", "readout_bw_hz_per_px", "rf_fwhm_hz"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not math.isfinite(self.chi_ppm):
            raise ValueError(f"chi_ppm must be finite, got {self.chi_ppm!r}")
        axes = tuple(self.semi_axes_fraction)
        if len(axes) != 2 or not all(0 < a < 0.5 for a in axes):
            raise ValueError(f"semi_axes_fraction must be two fractions in (0, 0.5), got {self.semi_axes_fraction!r}")
        object.__setattr__(self, "semi_axes_fraction", axes)
        if not 0 <= self.rotation_deg <= 180 or not 0 <= self.shift_fraction < 0.5:
            raise ValueError("rotation_deg must be in [0, 180] and shift_fraction in [0, 0.5)")
        if self.snr < 0:
            raise ValueError(f"snr must be >= 0 (0 = no noise), got {self.snr}")


def ellipse_mask(shape: tuple[int, int], centre: tuple[float, float], semi_axes: tuple[float, float],
                 angle_rad: float) -> np.ndarray:
    """(H, W) bool: pixels whose centre lies in the ellipse (centre (y, x), semi-axes (a along the
    rotated x, b along the rotated y) in pixels, rotated by ``angle_rad``)."""
    y, x = np.mgrid[: shape[0], : shape[1]].astype(np.float64)
    dy, dx = y - centre[0], x - centre[1]
    c, s = math.cos(angle_rad), math.sin(angle_rad)
    u, v = c * dx + s * dy, -s * dx + c * dy
    return (u / semi_axes[0]) ** 2 + (v / semi_axes[1]) ** 2 <= 1.0


def field_ppm(chi: np.ndarray, pad: int = 2) -> np.ndarray:
    """(H, W) relative field dB/B0 in ppm of a z-invariant susceptibility map ``chi`` (ppm),
    B0 along y (image rows): the 2D dipole kernel ``1/3 - ky^2 / |k|^2`` on a grid padded ``pad``
    times (the field of an isolated object; periodic copies are far)."""
    h, w = chi.shape
    big = np.zeros((pad * h, pad * w))
    big[:h, :w] = chi
    ky = np.fft.fftfreq(pad * h)[:, None]
    kx = np.fft.fftfreq(pad * w)[None, :]
    k2 = kx**2 + ky**2
    with np.errstate(invalid="ignore", divide="ignore"):
        kernel = 1.0 / 3.0 - np.where(k2 > 0, ky**2 / k2, 0.0)
    kernel[0, 0] = 0.0  # the mean field (Lorentz sphere) is the scanner's reference frequency
    return np.real(np.fft.ifft2(np.fft.fft2(big) * kernel))[:h, :w]


def displace_readout(image: np.ndarray, shift_px: np.ndarray) -> np.ndarray:
    """Move each pixel's signal ``shift_px`` pixels along x (columns), split linearly between
    the two pixels around its new position; signal leaving the image is lost. The sum over a
    row is conserved for signal that stays in the image."""
    h, w = image.shape
    x = np.arange(w)[None, :] + shift_px
    left = np.floor(x).astype(np.int64)
    frac = x - left
    out = np.zeros((h, w + 2))
    rows = np.repeat(np.arange(h)[:, None], w, axis=1)
    for offset, weight in ((0, 1.0 - frac), (1, frac)):
        col = left + offset
        keep = (col >= 0) & (col < w)
        np.add.at(out, (rows[keep], col[keep]), (image * weight)[keep])
    return out[:, :w]


def rf_weight(df_hz: np.ndarray, fwhm_hz: float) -> np.ndarray:
    """The Gaussian slice profile at frequency offset ``df_hz``: 1 on resonance, 1/2 at +-FWHM/2."""
    return np.exp(-4.0 * math.log(2.0) * (df_hz / fwhm_hz) ** 2)


@dataclass
class ArtifactResult:
    clean: np.ndarray  # (H, W) the source with the implant's void
    metal: np.ndarray  # (H, W) with the implant's field
    implant: np.ndarray  # (H, W) bool
    field_hz: np.ndarray  # (H, W) off-resonance
    params: dict  # the draw: centre, semi-axes, angle


def add_implant(image: np.ndarray, cfg: Artifact2DConfig, rng: np.random.Generator) -> ArtifactResult:
    """Draw an implant pose and apply the model (module docstring) to a magnitude image."""
    image = np.asarray(image, dtype=np.float64)
    if image.ndim != 2 or min(image.shape) < 8:
        raise ValueError(f"image must be 2D, at least 8 x 8, got shape {image.shape}")
    if not np.isfinite(image).all():
        raise ValueError("image has NaN or infinite pixels")
    h, w = image.shape
    centre = (h / 2 + rng.uniform(-1, 1) * cfg.shift_fraction * h, w / 2 + rng.uniform(-1, 1) * cfg.shift_fraction * w)
    angle = math.radians(rng.uniform(-cfg.rotation_deg, cfg.rotation_deg))
    axes = (cfg.semi_axes_fraction[0] * w, cfg.semi_axes_fraction[1] * w)
    implant = ellipse_mask((h, w), centre, axes, angle)
    clean = np.where(implant, 0.0, image)
    df = GAMMA_BAR_HZ_PER_T * cfg.b0_t * field_ppm(implant * cfg.chi_ppm) * 1e-6
    weighted = clean * rf_weight(df, cfg.rf_fwhm_hz)
    metal = displace_readout(weighted, df / cfg.readout_bw_hz_per_px)
    params = {"centre_px": [float(c) for c in centre], "semi_axes_px": [float(a) for a in axes],
              "angle_deg": math.degrees(angle), "chi_ppm": cfg.chi_ppm, "b0_t": cfg.b0_t,
              "readout_bw_hz_per_px": cfg.readout_bw_hz_per_px, "rf_fwhm_hz": cfg.rf_fwhm_hz}
    return ArtifactResult(clean, metal, implant, df, params)
