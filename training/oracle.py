"""The greedy one-step oracle: the yardstick of line choice (not deployable: it reads the clean
ground truth).

At every step it scores every line not acquired yet, for every slice, by the quality the image
would have with that line added, ``Q = l_ssim * SSIM + l_nmse * (1 - NMSE)`` of ``g(I)`` (the MAR
network in use) or of ``I`` (without MAR) against the clean fully sampled image, and acquires the
best. Candidates of many slices run in chunks of one batched recon + MAR forward each. With a
region of interest (``roi``), ``Q`` is scored there (:func:`masc_gadget.core.metrics.quality`).

:class:`BeamOracle` is the stronger yardstick where the greedy one falls short: a beam search
over line sets that keeps the greedy path among its beams, so it is never below greedy on the
score it maximises.

:class:`ReacquireOracle` is the greedy oracle when acquisitions can come back corrupted
(:mod:`training.rl.corruption`): at every step it scores every free line (its first attempt) and
every acquired line again (its next attempt, which replaces the last, :func:`kspace_of`), on the
clean image; it knows the outcome of each draw, so it is a yardstick, as the oracle is without
corruption.
"""

from __future__ import annotations

from typing import Callable

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
        recon: the image of a k-space and its line mask, ``(B, PE, RO), (B, PE) -> (B, H, W)``
            (default :func:`~masc_gadget.core.kspace.zero_filled`, the product's), before MAR.
    """

    name = NAME

    def __init__(self, l_ssim: float = 0.5, l_nmse: float = 0.5, chunk: int = 256,
                 recon: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = zero_filled) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1 candidate image, got {chunk}")
        self.l_ssim, self.l_nmse, self.chunk, self.recon = float(l_ssim), float(l_nmse), int(chunk), recon

    @torch.no_grad()
    def scores(self, episodes: EpisodeBatch, kspace: torch.Tensor, target: torch.Tensor,
               mar: torch.nn.Module | None, roi: torch.Tensor | None = None) -> np.ndarray:
        """(B, n_pe) float64: Q after acquiring each line next (-inf for acquired lines).

        kspace: (B, n_pe, n_readout) complex; target: (B, H, W) clean images; roi: None or
        (B, H, W) bool, where Q is scored; all on the episodes' device."""
        masks = episodes.masks
        rows, lines = np.nonzero(~masks)  # every (slice, free line) candidate
        out = np.full(masks.shape, -np.inf)
        out[rows, lines] = self.score_masks(_with_line(masks[rows], lines), rows, kspace, target, mar, roi)
        return out

    @torch.no_grad()
    def score_masks(self, masks: np.ndarray, rows: np.ndarray, kspace: torch.Tensor, target: torch.Tensor,
                    mar: torch.nn.Module | None, roi: torch.Tensor | None = None) -> np.ndarray:
        """(M,) float64: Q of M candidate line sets ``masks`` (M, n_pe) bool, candidate m on
        slice ``rows[m]`` of ``kspace`` / ``target`` / ``roi``; in chunks of ``chunk``."""
        out = np.empty(len(rows))
        for start in range(0, len(rows), self.chunk):
            part = slice(start, start + self.chunk)
            r_t = torch.from_numpy(np.asarray(rows[part])).to(kspace.device)
            image = self.recon(kspace[r_t], torch.from_numpy(masks[part]).to(kspace.device))
            if mar is not None:
                image = mar(image)
            q = quality(image, target[r_t], self.l_ssim, self.l_nmse, None if roi is None else roi[r_t])
            out[part] = q.double().cpu().numpy()
        return out

    def choose(self, episodes: EpisodeBatch, kspace: torch.Tensor, target: torch.Tensor,
               mar: torch.nn.Module | None, roi: torch.Tensor | None = None) -> np.ndarray:
        """(B,) int64: the best next line of every episode (ties: the lowest line)."""
        return self.scores(episodes, kspace, target, mar, roi).argmax(axis=1).astype(np.int64)


def _with_line(masks: np.ndarray, lines: np.ndarray) -> np.ndarray:
    """A copy of ``masks`` (M, n_pe) with line ``lines[m]`` added to row m."""
    out = masks.copy()
    out[np.arange(len(lines)), lines] = True
    return out


class BeamOracle(GreedyOracle):
    """Beam search over line sets on the true image: at every step each of ``width`` beams is
    extended by every free line, and the ``width`` best distinct line sets by Q survive, plus the
    greedy path (the best extension of the previous greedy set), so the final Q is never below
    :class:`GreedyOracle`'s. Costs about ``width`` times the greedy oracle. ``width`` 1 is the
    greedy oracle.

    Args:
        width: beams kept per slice (>= 1).
        l_ssim, l_nmse, chunk, recon: as :class:`GreedyOracle`.
    """

    def __init__(self, width: int = 4, l_ssim: float = 0.5, l_nmse: float = 0.5, chunk: int = 256,
                 recon: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = zero_filled) -> None:
        super().__init__(l_ssim, l_nmse, chunk, recon)
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"the beam width must be an int >= 1, got {width!r}")
        self.width = width
        self.name = NAME if width == 1 else f"{NAME}-beam{width}"

    @torch.no_grad()
    def plan(self, start: np.ndarray, budget: int, kspace: torch.Tensor, target: torch.Tensor,
             mar: torch.nn.Module | None, roi: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Search ``budget`` lines for every slice from the line sets ``start`` (B, n_pe) bool.

        Returns ``(lines, q)``: (B, budget) int64, the best beam's lines in the order it acquired
        them, and (B,) float64, its final Q."""
        n = len(start)
        lines = np.zeros((n, budget), dtype=np.int64)
        final = np.full(n, -np.inf)
        for b in range(n):
            beams = start[b][None].copy()          # (k, n_pe) line sets
            paths = np.zeros((1, 0), dtype=np.int64)  # (k, t) the lines each beam added
            q = np.full(1, -np.inf)                  # beam 0 is the greedy path
            for _ in range(budget):
                src, add = np.nonzero(~beams)
                cand = _with_line(beams[src], add)
                _, first = np.unique(cand, axis=0, return_index=True)  # one score per distinct set
                first.sort()
                src, add, cand = src[first], add[first], cand[first]
                scores = self.score_masks(cand, np.full(len(src), b), kspace, target, mar, roi)
                greedy = int(np.flatnonzero(src == 0)[np.argmax(scores[src == 0])])
                # beam 0 stays the greedy path; with it, the width best sets (width + 1 beams
                # when the greedy set is not among them)
                keep = [greedy] + [int(i) for i in np.argsort(-scores, kind="stable")[:self.width]
                                   if i != greedy]
                beams = cand[keep]
                paths = np.concatenate([paths[src[keep]], add[keep, None]], axis=1)
                q = scores[keep]
            best = int(np.argmax(q))
            lines[b], final[b] = paths[best], q[best]
        return lines, final


def kspace_of(attempt_kspace: torch.Tensor, count: np.ndarray) -> torch.Tensor:
    """(B, PE, RO): each acquired line's latest attempt (``count`` (B, PE) int, acquisitions
    of each line so far; a line never acquired takes attempt 0, masked out by the caller)."""
    b, a, n_pe, _ = attempt_kspace.shape
    latest = torch.from_numpy(np.clip(count - 1, 0, a - 1)).to(attempt_kspace.device)
    index = latest[:, None, :, None].expand(b, 1, n_pe, attempt_kspace.shape[-1])
    return attempt_kspace.gather(1, index)[:, 0]


class ReacquireOracle:
    """Greedy oracle over new lines and re-acquisitions (module docstring).

    Args:
        l_ssim, l_nmse: the weights of Q.
        chunk: candidate images per forward pass.
    """

    name = "oracle-reacquire"

    def __init__(self, l_ssim: float = 0.5, l_nmse: float = 0.5, chunk: int = 256) -> None:
        self.l_ssim, self.l_nmse, self.chunk = float(l_ssim), float(l_nmse), int(chunk)

    @torch.no_grad()
    def plan(self, attempt_kspace: torch.Tensor, start: np.ndarray, budget: int, target: torch.Tensor,
             mar: torch.nn.Module | None, roi: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Spend ``budget`` acquisitions on every slice from the initial lines ``start`` (B, PE)
        bool (acquired once each).

        Returns ``(actions, count)``: (B, budget) int64, the line of each acquisition (a line
        that appears twice was re-acquired), and (B, PE) int, acquisitions of each line at the
        end (the k-space served is :func:`kspace_of` that)."""
        b, attempts, n_pe, _ = attempt_kspace.shape
        count = start.astype(np.int64)
        actions = np.zeros((b, budget), dtype=np.int64)
        for step in range(budget):
            rows, lines = np.nonzero(count < attempts)  # a line with attempts left: new or again
            cand = count[rows].copy()
            cand[np.arange(len(rows)), lines] += 1
            scores = np.full((b, n_pe), -np.inf)
            for s in range(0, len(rows), self.chunk):
                part = slice(s, s + self.chunk)
                r = torch.from_numpy(rows[part]).to(attempt_kspace.device)
                k = kspace_of(attempt_kspace[r], cand[part])
                image = zero_filled(k, torch.from_numpy(cand[part] > 0).to(k.device))
                if mar is not None:
                    image = mar(image)
                q = quality(image, target[r], self.l_ssim, self.l_nmse, None if roi is None else roi[r])
                scores[rows[part], lines[part]] = q.double().cpu().numpy()
            actions[:, step] = scores.argmax(axis=1)
            count[np.arange(b), actions[:, step]] += 1
        return actions, count
