"""One MAR fine-tuning recipe for every method: a network fine-tuned to the line sets a policy plays.

A recipe (config section ``finetune``; ``finetune_joint`` holds the co-adaptive loop's settings)
says which masks of each training slice's episode the network learns from (``served``: the final
mask, the one the gadget serves; ``pre-action``: the masks before each action, initial to
initial + budget - 1 lines, what the co-adaptive loop fine-tunes on), and the optimiser, learning
rate, loss, batch, budget (passes or steps) and clean anchors. Selection is on the validation
split: the SSIM of the served image under the masks the policy plays there
(:func:`training.scoring.score_masks`), measured before any step (the network as given may be
kept) and every ``val_every`` steps.

``masc train fixed-order`` fine-tunes its network with it; ``masc train finetune --policy CKPT``
fine-tunes a pre-trained network to the lines of any trained policy (MASC, the fixed order, DQN,
SS-DDQN, the learned mask) and writes a checkpoint of that policy with the new network, served
and scored like the original. :func:`finetune_mar` is the recipe's optimisation step loop, which
the co-adaptive loop calls after every rollout.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from masc_gadget.config import to_dict
from masc_gadget.core.kspace import zero_filled
from masc_gadget.core.metrics import scale_by_target
from training.data import SliceSet
from training.distributed import Dist
from training.mar import acquisition_noise, check_snr_range, mar_loss
from training.run import RUN_KEYS, Checkpoints, RunSettings, Trainer, TrainingRun
from training.scoring import score_masks

__all__ = ["FinetuneConfig", "JointFinetuneConfig", "center_out_masks", "episode_pairs", "finetune_mar",
           "finetune_to_masks"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinetuneConfig:
    """A MAR fine-tuning recipe (config sections ``finetune`` and ``finetune_joint``)."""

    masks: Literal["served", "pre-action"] = "served"
    """Which masks of each training slice's episode the network learns from: ``served`` (the
    final one) or ``pre-action`` (before each action: initial to initial + budget - 1 lines)."""
    epochs: int = 3
    """Passes over the (slice, mask) pairs, when ``steps`` is 0."""
    steps: int = 0
    """Optimisation steps (0: ``epochs`` passes)."""
    val_every: int = 0
    """Steps between two validations (0: after every pass)."""
    lr: float = 1e-4
    """Adam learning rate."""
    loss: Literal["pretrain", "mse"] = "pretrain"
    """``pretrain``: the pre-training loss ``L1 + lambda_ssim (1 - SSIM)``; ``mse`` (the paper's
    co-adaptive loss)."""
    lambda_ssim: float = 1.0
    """The weight of (1 - SSIM) in the ``pretrain`` loss."""
    batch_size: int = 16
    """Pairs per step."""
    clean_fraction: float = 0.0
    """Share of the pairs built from the clean k-space (the do-no-harm anchors)."""
    anchor_snr: tuple[float, float] = (0.0, 0.0)
    """The anchors' acquisition noise: an SNR drawn uniformly from this range per pair, the
    target noiseless (:func:`training.mar.acquisition_noise`); (0, 0): noiseless anchors."""
    identity_fraction: float = 0.0
    """Share of the clean anchors given fully sampled, every line acquired: the identity pairs
    (the clean image in, the same image out; with ``anchor_snr``, noisy in and noiseless out)
    that the identity and noise promises of ``masc check mar`` test. 0: every anchor has the
    pair's mask."""
    fallback_fraction: float = 0.0
    """Share of the pairs given centre-out's lines instead of their own (as many lines): the
    deadline fallback's mask, which the centre-out promise of ``masc check mar`` tests."""
    run: RunSettings = field(default_factory=RunSettings)
    """Seed, device and slice caps (:class:`training.run.RunSettings`; the seed of the shuffles and
    the clean anchors' draws; ``masc train finetune --device`` overrides the device)."""
    FLAT_KEYS: ClassVar[dict[str, str]] = RUN_KEYS
    """The run keys written flat before 0.3, read under ``run``."""

    def __post_init__(self) -> None:
        for name in ("epochs", "steps", "val_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.batch_size < 1 or not self.lr > 0:
            raise ValueError(f"batch_size must be >= 1 and lr > 0, got {self.batch_size}, {self.lr}")
        for name in ("clean_fraction", "identity_fraction", "fallback_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.lambda_ssim < 0:
            raise ValueError(f"lambda_ssim must be >= 0, got {self.lambda_ssim}")
        check_snr_range(self.anchor_snr)

    def total_steps(self, pairs: int) -> int:
        """The recipe's budget in steps for ``pairs`` (slice, mask) pairs."""
        return self.steps or self.epochs * math.ceil(pairs / self.batch_size)


@dataclass(frozen=True)
class JointFinetuneConfig(FinetuneConfig):
    """Recipe B, the co-adaptive loop's MAR fine-tuning run offline (config section
    ``finetune_joint``): the pre-action masks of the policy's episodes, Adam 1e-5, 32 pairs a
    step, the paper's MSE, about as many steps as 100 rollouts take (``masc_train``'s
    ``mar_lr``, ``mar_batch_size`` and ``mar_loss``)."""

    masks: Literal["served", "pre-action"] = "pre-action"
    steps: int = 1100
    val_every: int = 110
    lr: float = 1e-5
    loss: Literal["pretrain", "mse"] = "mse"
    batch_size: int = 32


def episode_pairs(lines: np.ndarray, n_pe: int, initial: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (slice, mask) pairs of episodes: ``lines`` (N, initial + budget) is each slice's
    acquisition in order. ``served``: one pair per slice, every line; ``pre-action``: ``budget``
    pairs per slice, the first ``initial + t`` lines for t = 0 .. budget - 1. Returns slice
    indices (P,) int64 and masks (P, n_pe) bool."""
    lines = np.asarray(lines, dtype=np.int64)
    n, total = lines.shape
    if kind == "served":
        counts = [total]
    elif kind == "pre-action":
        counts = list(range(initial, total))
    else:
        raise ValueError(f"masks must be 'served' or 'pre-action', got {kind!r}")
    masks = np.zeros((len(counts), n, n_pe), dtype=bool)
    for j, count in enumerate(counts):
        masks[j, np.arange(n)[:, None], lines[:, :count]] = True
    slices = np.tile(np.arange(n), len(counts))
    return torch.from_numpy(slices), torch.from_numpy(masks.reshape(-1, n_pe))


def center_out_masks(counts: torch.Tensor, n_pe: int) -> torch.Tensor:
    """(B, n_pe) bool: centre-out's first ``counts[b]`` lines (the deadline fallback's mask of
    as many lines as a pair's own)."""
    from masc_gadget.acquisition.policies import center_out_rank

    rank = torch.from_numpy(center_out_rank(n_pe))
    return rank[None, :] < counts.cpu()[:, None]


def _batches(count: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Minibatches of indices into ``count`` pairs, pass after pass, each pass shuffled when it
    starts."""
    while True:
        order = torch.randperm(count, generator=generator)
        for start in range(0, count, batch_size):
            yield order[start:start + batch_size]


def finetune_mar(mar: torch.nn.Module, optimizer: torch.optim.Optimizer, kspace: torch.Tensor,
                 target: torch.Tensor, slices: torch.Tensor, masks: torch.Tensor, epochs: int,
                 batch_size: int, generator: torch.Generator,
                 lambda_ssim: float | None = None, dist: Dist = Dist(),
                 clean_kspace: torch.Tensor | None = None, clean_fraction: float = 0.0,
                 steps: int = 0, batches: Iterator[torch.Tensor] | None = None,
                 anchor_snr: tuple[float, float] = (0.0, 0.0), identity_fraction: float = 0.0,
                 fallback_fraction: float = 0.0) -> float:
    """Fine-tuning of ``mar`` on the zero-filled images of (slice, mask) pairs, both images
    scaled by the target's maximum: MSE (paper), or with ``lambda_ssim`` the pre-training loss
    ``L1 + lambda_ssim (1 - SSIM)``. ``epochs`` passes over the pairs, or ``steps`` steps taken
    from ``batches`` (an iterator of :func:`_batches` kept between calls). BatchNorm statistics
    stay frozen (eval mode): the network is well initialised and only needs mild correction.
    With ``clean_kspace`` and a ``clean_fraction`` > 0, that fraction of the pairs is built from
    the clean k-space instead (the do-no-harm anchors), with acquisition noise at an SNR drawn
    from ``anchor_snr`` when it is not (0, 0), and ``identity_fraction`` of those anchors fully
    sampled (the identity pairs); ``fallback_fraction`` of all pairs get centre-out's lines
    instead of their mask (as many). Returns the mean loss."""
    mar.eval()
    total, count = 0.0, 0
    device = next(mar.parameters()).device
    if batches is None:
        batches = _batches(len(slices), batch_size, generator)
        steps = epochs * math.ceil(len(slices) / batch_size)
    for _ in range(steps):
        idx = next(batches)
        s = slices[idx].to(kspace.device)
        k = kspace[s]
        if clean_kspace is not None and clean_fraction > 0:
            pick = (torch.rand(len(idx), generator=generator) < clean_fraction).to(k.device)
            anchor = clean_kspace[s]
            if tuple(anchor_snr) != (0.0, 0.0):
                snr = anchor_snr[0] + (anchor_snr[1] - anchor_snr[0]) * torch.rand(len(idx), generator=generator)
                anchor = anchor + acquisition_noise(anchor, snr, generator)
            k = torch.where(pick[:, None, None], anchor, k)
        mask = masks[idx].to(kspace.device)
        if fallback_fraction > 0:
            swap = (torch.rand(len(idx), generator=generator) < fallback_fraction).to(k.device)
            mask = torch.where(swap[:, None], center_out_masks(mask.sum(dim=1), mask.shape[1]).to(k.device), mask)
        if clean_kspace is not None and clean_fraction > 0 and identity_fraction > 0:
            full = pick & (torch.rand(len(idx), generator=generator) < identity_fraction).to(k.device)
            mask = mask | full[:, None]
        inputs = zero_filled(k, mask).to(device)
        if lambda_ssim is None:
            pred, tgt = scale_by_target(mar(inputs), target[s].to(device))
            loss = torch.mean((pred - tgt) ** 2)
        else:
            loss = mar_loss(mar(inputs), target[s].to(device), lambda_ssim)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        dist.average_gradients(mar)  # under torchrun: every rank fine-tunes on its own rollout
        optimizer.step()
        total += float(loss.detach()) * len(idx)
        count += len(idx)
    return total / max(count, 1)


@dataclass(eq=False)
class _FinetuneTrainer(Trainer):
    """A recipe's fine-tuning as the shared loop (:meth:`~training.run.TrainingRun.loop`) drives
    it: a period is the steps between two validations (``val_every``, or a pass)."""

    recipe: FinetuneConfig
    mar: torch.nn.Module
    train: SliceSet
    pairs: tuple[torch.Tensor, torch.Tensor]
    val: SliceSet
    val_masks: torch.Tensor | np.ndarray
    run: TrainingRun
    modules: dict[str, Any]
    """What the checkpoints hold: the state dicts kept beside the network, and the network."""
    meta: dict[str, Any]
    done: int = 0
    loss: float | str = ""
    """The last period's mean loss ("" before any step)."""
    name = "fine-tune MAR"
    unit = "step"
    clock = None

    @property
    def per_pass(self) -> int:
        return math.ceil(len(self.pairs[0]) / self.recipe.batch_size)

    @property
    def total(self) -> int:
        return self.recipe.total_steps(len(self.pairs[0]))

    @property
    def epoch(self) -> int | float:
        """The passes over the pairs so far (a whole number when it is one)."""
        epoch = self.done / self.per_pass
        return int(epoch) if float(epoch).is_integer() else round(epoch, 3)

    def row(self) -> dict[str, Any]:
        """The CSV row's training columns."""
        return {"epoch": self.epoch, "step": self.done, "loss": self.loss}

    @cached_property
    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.mar.parameters(), lr=self.recipe.lr)

    @cached_property
    def generator(self) -> torch.Generator:
        """The shuffles' and the anchors' stream."""
        return torch.Generator().manual_seed(self.recipe.run.seed)

    @cached_property
    def batches(self) -> Iterator[torch.Tensor]:
        return _batches(len(self.pairs[0]), self.recipe.batch_size, self.generator)

    @cached_property
    def kspace(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The training slices' metal k-space, targets and (for the anchors) clean k-space, on
        the network's device (copied at the first step)."""
        device = next(self.mar.parameters()).device
        clean = self.train.kspace_clean.to(device) if self.recipe.clean_fraction > 0 else None
        return self.train.kspace_metal.to(device), self.train.target.to(device), clean

    def train_period(self, bar: Any) -> dict[str, Any]:
        recipe = self.recipe
        n = min(self.recipe.val_every or self.per_pass, self.total - self.done)
        kspace, target, clean = self.kspace
        self.loss = finetune_mar(self.mar, self.optimizer, kspace, target, *self.pairs, 0, recipe.batch_size,
                                 self.generator, recipe.lambda_ssim if recipe.loss == "pretrain" else None,
                                 clean_kspace=clean, clean_fraction=recipe.clean_fraction, steps=n,
                                 batches=self.batches, anchor_snr=recipe.anchor_snr,
                                 identity_fraction=recipe.identity_fraction,
                                 fallback_fraction=recipe.fallback_fraction)
        self.done += n
        return self.row()

    def validate(self) -> dict[str, float]:
        return score_masks(self.val, self.val_masks, self.mar, metrics=("ssim", "psnr")).mean()

    def checkpoints(self, metrics: dict[str, float]) -> Checkpoints:
        modules = {**self.modules, "mar": self.mar}
        where = {"epoch": self.epoch, "step": self.done}
        return Checkpoints(where, modules, modules, {**self.meta, **where, "val": {**metrics, "loss": self.loss}}, {})

    def columns(self, metrics: dict[str, float]) -> dict[str, Any]:
        return {"val_ssim": metrics["ssim"], "val_psnr": metrics["psnr"]}

    def fields(self, row: dict[str, Any]) -> list[str]:
        return ["epoch", "step", "val_ssim", "val_psnr", "loss"]

    def report(self, row: dict[str, Any], metrics: dict[str, float], improved: bool) -> None:
        loss = self.loss
        log.info("step %d (pass %s): loss %s, val SSIM %.4f, PSNR %.2f%s", self.done, self.epoch,
                 loss if isinstance(loss, str) else f"{loss:.4f}", metrics["ssim"], metrics["psnr"],
                 " *best*" if improved else "")

    def postfix(self, row: dict[str, Any]) -> dict[str, str]:
        return {"best_ssim": f"{self.run.best['ssim']:.4f}"}


def finetune_to_masks(mar: torch.nn.Module, recipe: FinetuneConfig, train: SliceSet,
                      pairs: tuple[torch.Tensor, torch.Tensor], val: SliceSet, val_masks: torch.Tensor | np.ndarray,
                      out: str | Path, metadata: dict[str, Any], progress: bool = True,
                      keep: dict[str, dict[str, Any]] | None = None,
                      data_dir: str | Path | list[str | Path] | None = None) -> dict[str, Any]:
    """Fine-tune ``mar`` (in place) by ``recipe`` on the (slice, mask) ``pairs`` of ``train``
    (:func:`episode_pairs`), selecting on the served image's SSIM on ``val`` under ``val_masks``
    (N_val, n_pe). The best network goes to ``out`` (as ``mar``, beside the state dicts of
    ``keep``, e.g. a policy's, with ``metadata`` plus the step, validation metrics and recipe), the
    latest to ``<out>.last.pt``, a row per validation to ``<out>.csv``. Returns the best validation metrics (with ``epoch`` and
    ``step``). ``data_dir``: where ``train`` and ``val`` come from, for the provenance
    (:meth:`~training.run.TrainingRun.describe`)."""
    run = TrainingRun(out, "ssim", higher_is_better=True)
    if data_dir is not None:
        run.describe(data_dir, train=train, val=val)
    trainer = _FinetuneTrainer(recipe, mar, train, pairs, val, val_masks, run, dict(keep or {}),
                               {**metadata, "finetune": to_dict(recipe)})
    started = time.perf_counter()
    run.end_period(trainer, trainer.row())  # the network as given: selection keeps it when fine-tuning does not help
    run.best["seconds"] = run.loop(trainer, progress=progress, started=started)
    return run.best
