"""Coil combination: one magnitude image from the k-space of several receive coils.

Every clinical scanner sends one k-space per receive channel. The MAR network and the policies
read one magnitude image, so the channels are combined first:

* ``rss``: root-sum-of-squares of the coil images, ``sqrt(sum_c |I_c|^2)``;
* ``sensitivity``: an adaptive combine with coil sensitivities estimated from the acquired lines
  of the k-space centre: the low-resolution coil images of the contiguous run of acquired lines
  around the centre, ``s_c = L_c / sqrt(sum_c |L_c|^2)``, then ``|sum_c conj(s_c) I_c|``. It
  uses the coils' phases, so noise adds less than in RSS where a coil sees little signal. A
  slice whose centre line ``PE // 2`` has not arrived yet has no calibration lines: it is
  combined by ``rss`` until the centre line is in (scanners stream linear, reverse and
  centre-last orders), then by its sensitivities. The image of the same acquired lines is the
  same whatever order they came in.

With one coil both return the zero-filled magnitude image. Where the coils' sensitivities are
uniform with ``sum_c |a_c|^2 = 1`` both equal the single-coil image.

Shapes: k-space ``(B, C, PE, RO)`` complex (C coils), masks ``(B, PE)`` bool (the same lines for
every coil), images ``(B, PE, RO)`` float.
"""

from __future__ import annotations

import torch

from masc_gadget.core.kspace import apply_line_mask, ifft2c, zero_filled

__all__ = ["COMBINES", "calibration_rows", "coil_combine", "rss", "sensitivities"]

COMBINES = ("rss", "sensitivity")
"""The coil-combination methods."""


def _check(kspace: torch.Tensor, mask: torch.Tensor) -> None:
    if kspace.dim() != 4 or not kspace.is_complex():
        raise ValueError(f"kspace must be complex (B, coils, PE, RO), got {kspace.dtype} {tuple(kspace.shape)}")
    if mask.dim() != 2 or mask.shape[0] != kspace.shape[0] or mask.shape[1] != kspace.shape[2]:
        raise ValueError(f"mask must be (B, PE) = ({kspace.shape[0]}, {kspace.shape[2]}), got {tuple(mask.shape)}")


def rss(coil_images: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) complex coil images -> (B, H, W) root-sum-of-squares magnitude, scaled by
    each pixel's largest coil magnitude first, so that squares of large samples (1e20) do not
    overflow float32 where the result itself fits."""
    magnitude = coil_images.abs()
    scale = magnitude.amax(dim=1, keepdim=True)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.sqrt(((magnitude / scale) ** 2).sum(dim=1, keepdim=True)) * scale).squeeze(1)


def calibration_rows(mask: torch.Tensor) -> torch.Tensor:
    """(B, PE) bool: the contiguous run of acquired lines around the centre line ``PE // 2``
    (empty where the centre line is not acquired)."""
    mask = mask.bool()
    b, n = mask.shape
    centre = n // 2
    out = torch.zeros_like(mask)
    for i in range(b):  # B is small (the slices deciding at once); runs are short
        if not mask[i, centre]:
            continue
        lo = centre
        while lo > 0 and mask[i, lo - 1]:
            lo -= 1
        hi = centre
        while hi < n - 1 and mask[i, hi + 1]:
            hi += 1
        out[i, lo:hi + 1] = True
    return out


def sensitivities(kspace: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(B, C, H, W) complex sensitivity estimates from the calibration lines of ``mask`` (the
    acquired centre run, :func:`calibration_rows`), normalised to ``sum_c |s_c|^2 = 1`` where the
    centre has signal (``eps`` of the largest root-sum-of-squares keeps empty pixels finite);
    exactly 0, never NaN, for a slice without calibration lines."""
    _check(kspace, mask)
    low = ifft2c(apply_line_mask(kspace, calibration_rows(mask)[:, None, :].expand(-1, kspace.shape[1], -1)))
    norm = rss(low)
    floor = eps * norm.flatten(1).amax(dim=1)[:, None, None]
    denom = torch.maximum(norm, floor)
    # no calibration line (or no signal in it): low is 0 there, and so is the estimate
    return low / torch.where(denom > 0, denom, torch.ones_like(denom))[:, None]


def coil_combine(kspace: torch.Tensor, mask: torch.Tensor, method: str = "rss") -> torch.Tensor:
    """(B, PE, RO) magnitude image of the acquired lines of every coil (module docstring).
    One coil: exactly :func:`~masc_gadget.core.kspace.zero_filled` of it."""
    if method not in COMBINES:
        raise ValueError(f"coil combine must be one of {', '.join(COMBINES)}, got {method!r}")
    _check(kspace, mask)
    if kspace.shape[1] == 1:
        return zero_filled(kspace[:, 0], mask)
    images = ifft2c(apply_line_mask(kspace, mask[:, None, :].expand(-1, kspace.shape[1], -1)))
    if method == "rss":
        return rss(images)
    calibrated = mask.bool()[:, mask.shape[1] // 2]  # (B,) the centre line is in
    if not calibrated.any():
        return rss(images)
    combined = (sensitivities(kspace, mask).conj() * images).sum(dim=1).abs()
    return torch.where(calibrated[:, None, None], combined, rss(images))
