"""Scoring a line set's served image: the one measurement every trainer and study calls.

A slice acquired with the lines of a mask is reconstructed (zero-filled, or ``recon``), corrected
by the MAR network, turned into the pixels the gadget serves
(:func:`masc_gadget.core.served.served_images`: float32, non-finite output replaced, the OOD rule
when given, clamped at 0) and scored against the clean fully sampled image
(:func:`masc_gadget.core.metrics.slice_metrics`), over the whole image and, with a region,
inside it (:func:`~masc_gadget.core.metrics.roi_metrics`). The served zero-filled image is scored
beside it.

* :func:`score_batch`: B slices whose images are already reconstructed (the acquisition
  environment's final step, ``masc eval``'s per-line curves);
* :func:`score_masks`: every slice of a :class:`~training.data.SliceSet` under masks, in batches
  (validation of every trainer, ``masc check mar``, ``masc check headroom``, the fixed order);
* :func:`line_masks`: the masks of the protocol's initial centre lines plus chosen lines;
* :func:`harmed`: the one definition of harm, a served image below doing nothing
  (:func:`do_nothing`, the zero-filled image of centre-out's lines with the same line count),
  used by ``masc check mar``, its ROC and the calibration of the OOD rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from masc_gadget.acquisition.episode import initial_lines
from masc_gadget.core.kspace import zero_filled as zero_filled_recon
from masc_gadget.core.metrics import METRICS, roi_metrics, slice_metrics
from masc_gadget.core.ood import GIVEN_SCORES, Initial, OodCalibration, given_image, initial_image, ood_score
from masc_gadget.core.served import ServedImages, served_images
from training.data import SliceSet

__all__ = ["BatchScores", "SliceScores", "center_out_masks", "do_nothing", "harmed", "line_masks", "score_batch",
           "score_masks"]

Recon = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(kspace (B, PE, RO) complex, mask (B, PE) bool) -> (B, H, W) real image."""


class BatchScores(NamedTuple):
    """The scores of B slices (tensors on the images' device)."""

    served: ServedImages
    """The served pixels."""
    image: dict[str, torch.Tensor]
    """metric -> (B,): the served image against the target."""
    zero_filled: dict[str, torch.Tensor]
    """metric -> (B,): the served zero-filled image against the target."""
    roi: dict[str, torch.Tensor]
    """ssim, psnr, nmse (those of ``metrics``) -> (B,): the served image in the region (empty
    without one)."""
    ood: dict[str, torch.Tensor]
    """score kind -> (B,): the OOD scores asked for (``kinds``) of the MAR output."""


def score_batch(zero_filled: torch.Tensor, corrected: torch.Tensor | None, target: torch.Tensor, *,
                roi: torch.Tensor | None = None, ood: OodCalibration | None = None, mask: torch.Tensor | None = None,
                mar: Callable[[torch.Tensor], torch.Tensor] | None = None, metrics: Sequence[str] = METRICS,
                kinds: Sequence[str] = (), switched: torch.Tensor | None = None,
                early_score: torch.Tensor | None = None, given: Mapping[str, Initial] | None = None) -> BatchScores:
    """Score B slices' served images.

    Args:
        zero_filled: (B, H, W) real, the reconstruction of the acquired lines.
        corrected: (B, H, W) the MAR network's output for it, or None (MAR off).
        target: (B, H, W) the clean fully sampled images.
        roi: (B, H, W) bool, the region also scored, or None.
        ood: the OOD rule applied to the served image, or None.
        mask: (B, PE) bool, the acquired lines (the ``consistency`` score needs them).
        mar: the MAR network (the ``flip`` score runs it again).
        metrics: the whole-image metrics kept (of :data:`~masc_gadget.core.metrics.METRICS`).
        kinds: OOD score kinds computed for every slice, whatever the rule (``masc check mar``).
        given: per score of :data:`~masc_gadget.core.ood.GIVEN_SCORES` among ``kinds``, the image
            of the lines it gives the network and their mask (:func:`~masc_gadget.core.ood.initial_of`).
        switched, early_score: (B,) with an early rule, its verdicts
            (:func:`masc_gadget.core.served.served_images`).
    """
    served = served_images(zero_filled, corrected, ood=ood, mask=mask, mar=mar, switched=switched,
                           early_score=early_score)
    whole = slice_metrics(served.image, target)
    plain = slice_metrics(served.zero_filled, target)
    local = {} if roi is None else {k: v for k, v in roi_metrics(served.image, target, roi).items() if k in metrics}
    scores = {}
    if kinds and corrected is not None:
        with torch.no_grad():
            scores = {kind: ood_score(kind, zero_filled, corrected, mask, mar, (given or {}).get(kind))
                      for kind in kinds}
    return BatchScores(served, {k: whole[k] for k in metrics}, {k: plain[k] for k in metrics}, local, scores)


def _numpy(values: dict[str, list[torch.Tensor]]) -> dict[str, np.ndarray]:
    return {k: torch.cat(v).detach().double().cpu().numpy() for k, v in values.items()}


@dataclass(frozen=True)
class SliceScores:
    """Per-slice scores of N slices (float64 arrays)."""

    image: dict[str, np.ndarray]
    """metric -> (N,): the served image."""
    zero_filled: dict[str, np.ndarray]
    """metric -> (N,): the served zero-filled image."""
    roi: dict[str, np.ndarray] = field(default_factory=dict)
    """ssim, psnr, nmse -> (N,): the served image in the region (empty without one)."""
    ood: dict[str, np.ndarray] = field(default_factory=dict)
    """score kind -> (N,): the OOD scores asked for."""
    mar_used: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    """(N,) bool: whether the served image is the MAR network's."""

    def __len__(self) -> int:
        return len(self.mar_used)

    def mean(self) -> dict[str, float]:
        """The mean of each whole-image metric of the served image."""
        return {k: float(v.mean()) for k, v in self.image.items()}

    def flat(self) -> dict[str, np.ndarray]:
        """The served image's metrics, and the region's as ``roi_<metric>``."""
        return {**self.image, **{f"roi_{k}": v for k, v in self.roi.items()}}


@torch.no_grad()
def score_masks(data: SliceSet, masks: np.ndarray | torch.Tensor, mar: torch.nn.Module | None, *,
                roi: torch.Tensor | None = None, ood: OodCalibration | None = None, recon: Recon = zero_filled_recon,
                metrics: Sequence[str] = METRICS, kinds: Sequence[str] = (), batch_size: int = 32,
                device: torch.device | str | None = None, initial: int | None = None) -> SliceScores:
    """The served image of every slice of ``data`` (its metal k-space) acquired with the lines
    ``masks`` (N, PE) bool, scored against ``data.target`` (:func:`score_batch`); in batches of
    ``batch_size`` on ``device`` (default: the network's, else the CPU). ``mar`` is put in eval
    mode; None scores the zero-filled image alone. ``initial``: the protocol's initial line
    count, from which the scores among ``kinds`` that give the network some of the lines
    (:data:`~masc_gadget.core.ood.GIVEN_SCORES`) take them."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    masks = torch.as_tensor(masks)
    if masks.shape != (len(data), data.n_pe):
        raise ValueError(f"masks must be ({len(data)}, {data.n_pe}) bool, one row per slice, got {tuple(masks.shape)}")
    if device is None:
        device = next(mar.parameters()).device if mar is not None else torch.device("cpu")
    if mar is not None:
        mar.eval()
    parts: dict[str, dict[str, list[torch.Tensor]]] = {k: {} for k in ("image", "zero_filled", "roi", "ood")}
    used: list[torch.Tensor] = []
    for start in range(0, len(data), batch_size):
        index = list(range(start, min(start + batch_size, len(data))))
        mask = masks[index].to(device)
        kspace = data.kspace_metal[index].to(device)
        zf = recon(kspace, mask)
        wanted = [kind for kind in kinds if kind in GIVEN_SCORES]
        if wanted and initial is None:
            raise ValueError(f"the {wanted[0]} score needs the protocol's initial line count (initial=)")
        given = {kind: initial_image(kspace, initial, recon) if kind == "holdout"
                 else given_image(kspace, mask, initial, recon) for kind in wanted}
        scores = score_batch(zf, None if mar is None else mar(zf), data.target[index].to(device),
                             roi=None if roi is None else roi[index].to(device), ood=ood, mask=mask, mar=mar,
                             metrics=metrics, kinds=kinds, given=given)
        for name in parts:
            for key, value in getattr(scores, name).items():
                parts[name].setdefault(key, []).append(value)
        used.append(scores.served.mar_used)
    return SliceScores(**{name: _numpy(values) for name, values in parts.items()},
                       mar_used=torch.cat(used).cpu().numpy())


def center_out_masks(n: int, n_pe: int, initial: int, budget: int) -> np.ndarray:
    """(n, n_pe) bool: centre-out's ``initial + budget`` lines on every slice, what the scanner
    plays when the gadget misses its deadline."""
    from masc_gadget.acquisition.policies import make_policy, run_episode

    lines = run_episode(make_policy("center-out"), n_pe, initial, budget, np.random.default_rng(0))
    return line_masks(n, n_pe, initial, np.asarray(lines, dtype=np.int64))


def do_nothing(data: SliceSet, initial: int, budget: int, metrics: Sequence[str] = ("ssim", "psnr"),
               batch_size: int = 32) -> dict[str, np.ndarray]:
    """Per slice: the metrics of doing nothing, the zero-filled image of centre-out's lines with
    the same line count: the reference of :func:`harmed`."""
    return score_masks(data, center_out_masks(len(data), data.n_pe, initial, budget), None, metrics=metrics,
                       batch_size=batch_size).image


def harmed(served_ssim: np.ndarray, nothing_ssim: np.ndarray) -> np.ndarray:
    """(N,) bool: the one definition of harm. A served image harms its slice when it scores below
    doing nothing (:func:`do_nothing`: centre-out's zero-filled image with as many lines), not
    below the zero-filled image of the lines the policy chose (for scattered lines that one is
    far worse, and beating it proves nothing)."""
    return np.asarray(served_ssim) < np.asarray(nothing_ssim)


def line_masks(n: int, n_pe: int, initial: int, lines: np.ndarray | Sequence[int]) -> np.ndarray:
    """(n, n_pe) bool: the protocol's ``initial`` centre lines and ``lines`` ((n, k): per slice,
    or (k,): on every slice)."""
    out = np.zeros((n, n_pe), dtype=bool)
    out[:, initial_lines(n_pe, initial)] = True
    lines = np.asarray(lines, dtype=np.int64)
    if lines.size:
        lines = np.broadcast_to(lines, (n, lines.shape[-1]))
        out[np.arange(n)[:, None], lines] = True
    return out
