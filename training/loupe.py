"""A learned fixed mask (LOUPE-style; Bahadir et al. 2020): ``masc train loupe``.

A non-adaptive baseline: one line mask for every slice, learned jointly with the MAR network at
the exact budget. Each free line (not among the ``initial`` centre lines) has a logit ``w``; its
selection probability is ``p = sigmoid(slope w)`` (LOUPE's slope). Each training image draws a
mask with a straight-through relaxed sampler:

    scores  = logit(p) + logistic noise                 (a relaxed Bernoulli draw per line)
    forward = the ``budget`` lines with the largest scores, exactly (k-hot)
    gradient= through sigmoid(scores / temperature)     (straight-through)

so every mask the reconstruction is trained on holds exactly ``initial + budget`` lines (LOUPE
renormalises the probabilities to the sparsity in expectation; a top-k keeps it per draw). The
image is the zero-filled reconstruction of the masked k-space, differentiable in the mask, and
the loss the MAR pre-training's ``L1 + lambda (1 - SSIM)``. Both the logits (Adam ``lr_mask``) and
the MAR network (Adam ``lr_mar``, from the pre-trained one when ``--mar`` is given) are trained.
Under ``torchrun`` the ranks share each global minibatch (the mask draws are the global batch's,
the same on every rank; gradients averaged), as ``masc train mar`` does.

The deployed mask is deterministic: the ``budget`` free lines of largest ``w``, played as a
fixed order (largest first) by ``masc eval`` and the gadget (policy ``loupe``), with the MAR
network trained beside it. Model selection: validation SSIM of that mask, every epoch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from masc_gadget import __version__
from masc_gadget.acquisition.episode import initial_lines
from masc_gadget.acquisition.learned import LOUPE
from masc_gadget.config import Config, to_dict
from masc_gadget.core.kspace import to_hybrid
from masc_gadget.device import resolve_device
from masc_gadget.models.checkpoint import load_mar
from masc_gadget.models.unet import build_mar
from training.run import RUN_KEYS, Checkpoints, RunSettings, Trainer, TrainingRun, seeded, snapshot
from training.data import SliceSet, load_split
from training.distributed import Dist, setup, shard
from training.mar import mar_loss, validate

log = logging.getLogger(__name__)

__all__ = ["LoupeConfig", "LoupeMask", "train_loupe", "soft_zero_filled"]


@dataclass(frozen=True)
class LoupeConfig:
    """Learned-mask training (config section ``loupe``)."""

    epochs: int = 20
    """Passes over the training slices."""
    batch_size: int = 16
    """Slices per gradient step (each draws its own mask)."""
    lr_mask: float = 0.01
    """Adam learning rate of the line logits."""
    lr_mar: float = 1e-4
    """Adam learning rate of the MAR network."""
    slope: float = 5.0
    """Slope of the sigmoid from logit to selection probability (LOUPE's)."""
    temperature: float = 0.5
    """Temperature of the relaxed sampler's gradient path."""
    run: RunSettings = field(default_factory=RunSettings)
    """Seed, device and slice caps (:class:`training.run.RunSettings`; the seed of the logits' init, the MAR init without --mar, the mask draws and the shuffling)."""
    FLAT_KEYS: ClassVar[dict[str, str]] = RUN_KEYS
    """The run keys written flat before 0.3, read under ``run``."""

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("lr_mask", "lr_mar", "slope", "temperature"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def soft_zero_filled(hybrid: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The zero-filled magnitude image of k-space ``hybrid`` (``to_hybrid`` form, (B, PE, RO))
    weighted by a real-valued line mask ``mask`` ((B, PE) or (PE,), centred line order):
    differentiable in the mask; equal to ``zero_filled_hybrid`` for a 0 / 1 mask."""
    weights = torch.fft.ifftshift(mask, dim=-1).unsqueeze(-1).to(hybrid.real.dtype)
    return torch.fft.ifft(hybrid * weights, dim=-2, norm="ortho").abs()


class LoupeMask(torch.nn.Module):
    """Line logits and the exact-budget straight-through sampler (module docstring).

    Args:
        n_pe: PE lines; initial: centre lines always acquired; budget: lines chosen.
        slope, temperature: as in :class:`LoupeConfig`.
        generator: the init's random stream (logits start at small random values).
    """

    def __init__(self, n_pe: int, initial: int, budget: int, slope: float = 5.0, temperature: float = 0.5,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if initial < 1 or budget < 1 or initial + budget > n_pe:
            raise ValueError(f"need initial >= 1, budget >= 1 and initial + budget <= n_pe ({n_pe}), "
                             f"got {initial} + {budget}")
        self.n_pe, self.initial, self.budget = n_pe, initial, budget
        self.slope, self.temperature = float(slope), float(temperature)
        fixed = torch.zeros(n_pe, dtype=torch.bool)
        fixed[torch.from_numpy(initial_lines(n_pe, initial))] = True
        self.register_buffer("fixed", fixed)
        self.logits = torch.nn.Parameter(0.1 * torch.randn(n_pe, generator=generator))

    def probabilities(self) -> torch.Tensor:
        """(n_pe,) selection probability of each line; 1 for the initial lines."""
        p = torch.sigmoid(self.slope * self.logits)
        return torch.where(self.fixed, torch.ones_like(p), p)

    def sample(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """(batch, n_pe) float masks with exactly ``initial + budget`` ones each (forward), the
        gradient of the relaxed draw (backward); the noise is drawn on the CPU from ``generator``."""
        z = self.slope * self.logits  # logit(p)
        u = torch.rand((batch, self.n_pe), generator=generator).clamp(1e-6, 1 - 1e-6).to(self.logits.device)
        scores = z + torch.log(u) - torch.log1p(-u)
        scores = scores.masked_fill(self.fixed, -math.inf)
        top = scores.topk(self.budget, dim=1).indices
        hard = torch.zeros_like(scores).scatter(1, top, 1.0)
        soft = torch.sigmoid(scores.masked_fill(self.fixed, 0.0) / self.temperature)
        chosen = hard + (soft - soft.detach())  # exactly k-hot forward, the relaxed gradient
        return torch.where(self.fixed, torch.ones_like(chosen), chosen)

    def order(self) -> list[int]:
        """The deployed fixed order: the ``budget`` free lines of largest logit, largest first."""
        z = self.logits.detach().masked_fill(self.fixed, -math.inf)
        return [int(i) for i in torch.argsort(z, descending=True, stable=True)[: self.budget]]

    def mask(self) -> torch.Tensor:
        """(n_pe,) bool: the deployed mask (initial lines + :meth:`order`)."""
        m = self.fixed.clone()
        m[self.order()] = True
        return m


def loupe_metadata(mask: LoupeMask, mar: torch.nn.Module, **extra: Any) -> dict[str, Any]:
    """Checkpoint metadata that :func:`masc_gadget.acquisition.learned.load_learned` reads."""
    return {"kind": LOUPE, "n_pe": mask.n_pe, "initial": mask.initial, "budget": mask.budget,
            "order": mask.order(), "probabilities": [round(float(p), 6) for p in mask.probabilities().detach()],
            "mar_model": to_dict(mar.config), **extra}


def mask_entropy(mask: LoupeMask) -> float:
    """The mean binary entropy of the free lines' selection probabilities (0: a settled mask)."""
    p = mask.probabilities().detach()[~mask.fixed]
    return float(-(p * p.clamp_min(1e-9).log() + (1 - p) * (1 - p).clamp_min(1e-9).log()).mean())


@dataclass(eq=False)
class _LoupeTrainer(Trainer):
    """The learned mask as the shared loop (:meth:`~training.run.TrainingRun.loop`) drives it:
    a period is an epoch of relaxed mask draws, validated with the deployed mask."""

    config: Config
    cfg: LoupeConfig
    total: int
    data_dir: str | Path
    mar_path: str | Path | None
    mar_meta: dict[str, Any]
    run: TrainingRun
    train: SliceSet
    val: SliceSet
    mask: LoupeMask
    mar: torch.nn.Module
    optimizer: torch.optim.Optimizer
    gen: torch.Generator
    device: torch.device
    dist: Dist
    hybrid: torch.Tensor
    """The training slices' metal k-space in ``to_hybrid`` form, on the device."""
    target: torch.Tensor
    done: int = 0
    name = "train loupe"
    unit = "epoch"

    def train_period(self, bar: Any) -> dict[str, Any]:
        cfg, dist, device, mask, mar = self.cfg, self.dist, self.device, self.mask, self.mar
        hybrid, target = self.hybrid, self.target
        mar.train()
        perm = torch.randperm(len(self.train), generator=self.gen)
        losses = []
        for i in range(0, len(perm), cfg.batch_size):
            batch = perm[i:i + cfg.batch_size]
            if len(batch) < dist.world:
                continue  # every rank needs a slice
            weights = mask.sample(len(batch), self.gen)  # the global batch's draws, the same on every rank
            mine = shard(torch.arange(len(batch)), dist)  # under torchrun: this rank's share
            idx = batch[mine].to(device)
            loss = mar_loss(mar(soft_zero_filled(hybrid[idx], weights[mine.to(weights.device)])), target[idx],
                            self.config["mar_train"].lambda_ssim)
            self.optimizer.zero_grad(set_to_none=True)
            (loss * (len(mine) * dist.world / len(batch))).backward()
            dist.average_gradients(mask)
            dist.average_gradients(mar)
            self.optimizer.step()
            losses.append(dist.mean(float(loss.detach())))
        self.done += 1
        return {"epoch": self.done, "train_loss": float(np.mean(losses)), "mask/entropy": mask_entropy(mask)}

    def validate(self) -> dict[str, float]:
        masks = self.mask.mask().cpu().expand(len(self.val), -1).clone()
        return validate(self.mar, self.val, "undersampled", masks, self.config["mar_train"].lambda_ssim,
                        self.cfg.batch_size, self.device)

    def metadata(self, epoch: int, val_metrics: dict[str, float]) -> dict[str, Any]:
        config = self.config
        return loupe_metadata(self.mask, self.mar, epoch=epoch, val=val_metrics, best_val=self.run.best,
                              code_version=__version__, data=str(self.data_dir),
                              mar_pretrained=str(self.mar_path) if self.mar_path else None,
                              mar_pretrained_epoch=self.mar_meta.get("epoch"),
                              config={k: to_dict(config[k]) for k in ("acquisition", "loupe", "mar_model")})

    def checkpoints(self, metrics: dict[str, float]) -> Checkpoints:
        return Checkpoints({"epoch": self.done}, {"mar": self.mar}, {"mar": self.mar, "mask": self.mask},
                           self.metadata(self.done, metrics),
                           snapshot({"optimizer": self.optimizer, "generator": self.gen}), sync=self.mask)

    def columns(self, metrics: dict[str, float]) -> dict[str, Any]:
        return {f"val_{k}": v for k, v in metrics.items() if not k.startswith("input_")}

    def report(self, row: dict[str, Any], metrics: dict[str, float], improved: bool) -> None:
        log.info("epoch %d: train loss %.4f, val SSIM %.4f, PSNR %.2f, lines %s%s", self.done, row["train_loss"],
                 metrics["ssim"], metrics["psnr"], self.mask.order(), " *best*" if improved else "")

    def postfix(self, row: dict[str, Any]) -> dict[str, str]:
        return {"loss": f"{row['train_loss']:.4f}", "val_ssim": f"{row['val_ssim']:.4f}"}


def _loupe_trainer(config: Config, data_dir: str | Path, mar_path: str | Path | None, run: TrainingRun,
                   dist: Dist, device: torch.device) -> _LoupeTrainer:
    """The learned mask's trainer: its splits, line logits, MAR network (pre-trained, or seeded
    from scratch) and optimizer, resumed from the run's last checkpoint when there is one."""
    cfg: LoupeConfig = config["loupe"]
    acq = config["acquisition"]
    train = load_split(data_dir, "train", cfg.run.max_train_slices)
    val = load_split(data_dir, "val", cfg.run.max_val_slices)
    run.describe(data_dir, train=train, val=val)
    acq.check(train.n_pe)
    gen = torch.Generator().manual_seed(cfg.run.seed)
    if mar_path:
        mar, mar_meta = load_mar(mar_path, device)
    else:
        mar, mar_meta = seeded(cfg.run.seed, lambda: build_mar(config["mar_model"]).to(device)), {}
    mask = LoupeMask(train.n_pe, acq.initial, acq.budget, cfg.slope, cfg.temperature, generator=gen).to(device)
    optimizer = torch.optim.Adam([{"params": mask.parameters(), "lr": cfg.lr_mask},
                                  {"params": mar.parameters(), "lr": cfg.lr_mar}])
    done = run.restore({"mask": mask, "mar": mar}, {"optimizer": optimizer, "generator": gen}, "epoch")
    return _LoupeTrainer(config, cfg, cfg.epochs, data_dir, mar_path, mar_meta, run, train, val, mask, mar, optimizer,
                         gen, device, dist, to_hybrid(train.kspace_metal.to(device)), train.target.to(device), done)


def train_loupe(config: Config, data_dir: str | Path, mar_path: str | Path | None, out: str | Path,
                resume: str | Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Learn the fixed mask and its MAR network; the best (validation SSIM of the deployed mask)
    goes to ``out``, the latest to ``<out>.last.pt``, the per-epoch log to ``<out>.csv`` (its
    ``seconds`` per epoch, as the MAR pre-training's).
    Returns the best validation metrics."""
    cfg: LoupeConfig = config["loupe"]
    acq = config["acquisition"]
    dist = setup()
    device = resolve_device(dist.device(cfg.run.device))
    run = TrainingRun(out, "ssim", higher_is_better=True, main=dist.main, resume=resume, kind=LOUPE,
                      map_location=device)
    trainer = _loupe_trainer(config, data_dir, mar_path, run, dist, device)
    log.info("learned mask: %d train / %d val slices, %d + %d of %d lines, %d epochs, MAR %s, on %s",
             len(trainer.train), len(trainer.val), acq.initial, acq.budget, trainer.train.n_pe, cfg.epochs,
             "from " + str(mar_path) if mar_path else "from scratch", device)
    run.best["seconds"] = run.loop(trainer, dist, progress)
    run.finish({"mar": trainer.mar}, trainer.metadata(cfg.epochs, run.best))
    return run.best
