"""The greedy one-step oracle: the yardstick of line choice (not deployable: it reads the clean
ground truth).

At every step it scores every line not acquired yet, for every slice, by the quality the image
would have with that line added, ``Q = l_ssim * SSIM + l_nmse * (1 - NMSE)`` of ``g(I)`` (the MAR
network in use) or of ``I`` (without MAR) against the clean fully sampled image, and acquires the
best. Candidates of many slices run in chunks of one batched recon + MAR forward each.
"""

from __future__ import annotations

import numpy as np
import torch

from masc_gadget.acquisition.episode import EpisodeBatch
from masc_gadget.core.kspace import zero_filled
from masc_gadget.core.metrics import quality

NAME = "oracle"
"""Its method name in ``masc eval`` (not a registry policy: it needs the ground truth)."""


class GreedyOracle:
    """Greedy one-step lookahead on the true image (module docstring).

    Args:
        l_ssim, l_nmse: the weights of Q (the environment's reward; paper 0.5 / 0.5).
        chunk: candidate images per forward pass.
    """

    name = NAME

    def __init__(self, l_ssim: float = 0.5, l_nmse: float = 0.5, chunk: int = 256) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1 candidate image, got {chunk}")
        self.l_ssim, self.l_nmse, self.chunk = float(l_ssim), float(l_nmse), int(chunk)

    @torch.no_grad()
    def scores(self, episodes: EpisodeBatch, kspace: torch.Tensor, target: torch.Tensor,
               mar: torch.nn.Module | None) -> np.ndarray:
        """(B, n_pe) float64: Q after acquiring each line next (-inf for acquired lines).

        kspace: (B, n_pe, n_readout) complex; target: (B, H, W) clean images; both on the
        episodes' device."""
        masks = episodes.masks
        rows, lines = np.nonzero(~masks)  # every (slice, free line) candidate
        out = np.full(masks.shape, -np.inf)
        for start in range(0, rows.size, self.chunk):
            r, k = rows[start:start + self.chunk], lines[start:start + self.chunk]
            cand = masks[r].copy()
            cand[np.arange(r.size), k] = True
            r_t = torch.from_numpy(r).to(kspace.device)
            image = zero_filled(kspace[r_t], torch.from_numpy(cand).to(kspace.device))
            if mar is not None:
                image = mar(image)
            q = quality(image, target[r_t], self.l_ssim, self.l_nmse)
            out[r, k] = q.double().cpu().numpy()
        return out

    def choose(self, episodes: EpisodeBatch, kspace: torch.Tensor, target: torch.Tensor,
               mar: torch.nn.Module | None) -> np.ndarray:
        """(B,) int64: the best next line of every episode (ties: the lowest line)."""
        return self.scores(episodes, kspace, target, mar).argmax(axis=1).astype(np.int64)
