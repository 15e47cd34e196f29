"""The image a slice is served as: the one path from a reconstruction to the returned pixels.

The gadget returns, per finished slice, a zero-filled image and (with a MAR network) the MAR
image, tagged ``IMTYPE_MAGNITUDE``. :func:`served_images` is the only place that turns the
reconstructions into those pixels, and every score of a final image is computed on its output:
the engine's :class:`~masc_gadget.acquisition.engine.SliceResult`, ``masc eval``'s rows and
curves, the training environment's final metrics and ``masc scan``'s scanner-side images. What
it does, in order:

1. dtype: both images as float32 (a half-precision MAR network's output is promoted);
2. a zero-filled pixel that is not finite becomes 0 (impossible within the engine's sample
   limit; a last resort);
3. a slice whose MAR output is not finite everywhere gets its zero-filled image instead
   (``mar_used`` False);
4. out of distribution: with an end-of-scan OOD rule
   (:class:`~masc_gadget.core.ood.OodCalibration`, the network's own calibration unless
   ``gadget.mar_fallback`` says otherwise), each slice's score is computed
   (:func:`~masc_gadget.core.ood.ood_score`) and a slice scoring above the threshold gets its
   zero-filled image (``mar_used`` False): the network is outside what it was trained for and
   would more likely harm the image than help it. With an early rule the decision was taken at
   the policy's first decision (:func:`~masc_gadget.core.ood.early_switch`): a switched slice
   (``switched``, acquired with centre-out's lines since) gets its zero-filled image, and the
   score reported is the early one;
5. clamping: a magnitude is never negative, so both images are clamped at 0 (the MAR network's
   residual can dip below zero on dark pixels).

No scaling: pixels keep the k-space's units (metrics scale by the target themselves,
:func:`masc_gadget.core.metrics.slice_metrics`).

What a policy *observes* while it decides (the unclamped MAR output, or the zero-filled image)
is not this: it is what the policy was trained on, and the engine and ``masc eval`` build it the
same way from the same networks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from masc_gadget.core.ood import OodCalibration, ood_score

__all__ = ["ServedImages", "served_images"]


class ServedImages(NamedTuple):
    """The served pixels of B slices."""

    zero_filled: torch.Tensor
    """(B, H, W) float32, finite, >= 0: the zero-filled image (coils combined)."""
    image: torch.Tensor
    """(B, H, W) float32, finite, >= 0: the MAR image where ``mar_used``, else the zero-filled one."""
    mar_used: torch.Tensor
    """(B,) bool: whether ``image`` is the MAR network's (False without a network, where its
    output is not finite, or where the OOD score passed the threshold)."""
    ood_score: torch.Tensor
    """(B,) float32: each slice's OOD score (NaN without an OOD rule)."""


def _finite_rows(images: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(images.reshape(images.shape[0], -1)).all(dim=1)


def served_images(zero_filled: torch.Tensor, corrected: torch.Tensor | None = None, *,
                  ood: OodCalibration | None = None, mask: torch.Tensor | None = None,
                  mar: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  switched: torch.Tensor | None = None, early_score: torch.Tensor | None = None) -> ServedImages:
    """The pixels served for B slices (module docstring).

    Args:
        zero_filled: (B, H, W) real, the zero-filled magnitude images of the acquired lines.
        corrected: (B, H, W) real, the MAR network's output for ``zero_filled``, or None (MAR off).
        ood: the OOD rule (score and threshold), or None (no score, never replaced).
        mask: (B, H) bool, the acquired lines (the ``consistency`` score needs them).
        mar: the MAR network (the ``flip`` score runs it once more).
        switched: (B,) bool, with an early rule: the slices its switch flagged.
        early_score: (B,) float, with an early rule: their early scores (NaN where not scored).

    Returns:
        :class:`ServedImages` on the inputs' device.
    """
    if zero_filled.ndim != 3 or zero_filled.is_complex():
        raise ValueError(f"zero_filled must be real (B, H, W) images, got {zero_filled.dtype} "
                         f"{tuple(zero_filled.shape)}")
    zf = torch.nan_to_num(zero_filled.float(), nan=0.0, posinf=0.0, neginf=0.0).clamp_min(0.0)
    score = torch.full((zf.shape[0],), float("nan"), device=zf.device)
    if corrected is None:
        return ServedImages(zf, zf, torch.zeros(zf.shape[0], dtype=torch.bool, device=zf.device), score)
    if corrected.shape != zero_filled.shape:
        raise ValueError(f"corrected must have the zero-filled images' shape {tuple(zero_filled.shape)}, "
                         f"got {tuple(corrected.shape)}")
    out = corrected.float()
    ok = _finite_rows(out)
    if ood is not None and ood.stage == "early":
        if switched is None or early_score is None:
            raise ValueError("an early OOD rule needs the switched slices and their early scores")
        switched = torch.as_tensor(switched, dtype=torch.bool, device=zf.device).reshape(-1)
        if switched.shape[0] != zf.shape[0]:
            raise ValueError(f"switched must be ({zf.shape[0]},) bool, got {tuple(switched.shape)}")
        ok = ok & ~switched
        score = torch.as_tensor(early_score, dtype=torch.float32, device=zf.device).reshape(-1)
    elif ood is not None:
        if ood.score == "consistency" and (mask is None or mask.shape != zf.shape[:2]):
            raise ValueError(f"the consistency score needs the (B, H) line mask of the {tuple(zf.shape)} images")
        with torch.no_grad():
            score = ood_score(ood.score, zero_filled.float(), out, mask, mar)
        ok = ok & ~(score > ood.threshold)
    image = torch.where(ok[:, None, None], out, zf).clamp_min(0.0)
    return ServedImages(zf, image, ok, score)
