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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from training.run import TrainingRun, seeded
from training.data import SliceSet, load_split
from training.distributed import setup, shard
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
    max_train_slices: int = 0
    """Use only the first N training slices (0 = all)."""
    max_val_slices: int = 0
    """Use only the first N validation slices (0 = all)."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""
    seed: int = 0
    """Seed of the logits' init, the MAR init (without --mar), the mask draws and the shuffling."""

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


def _validate(mar: torch.nn.Module, mask: LoupeMask, val: SliceSet, lambda_ssim: float, batch_size: int,
              device: torch.device) -> dict[str, float]:
    masks = mask.mask().cpu().expand(len(val), -1).clone()
    return validate(mar, val, "undersampled", masks, lambda_ssim, batch_size, device)


def train_loupe(config: Config, data_dir: str | Path, mar_path: str | Path | None, out: str | Path,
                resume: str | Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Learn the fixed mask and its MAR network; the best (validation SSIM of the deployed mask)
    goes to ``out``, the latest to ``<out>.last.pt``, the per-epoch log to ``<out>.csv`` (its
    ``seconds`` per epoch, as the MAR pre-training's).
    Returns the best validation metrics."""
    from tqdm.auto import tqdm

    cfg: LoupeConfig = config["loupe"]
    acq = config["acquisition"]
    lambda_ssim = config["mar_train"].lambda_ssim
    dist = setup()
    device = resolve_device(dist.device(cfg.device))
    run = TrainingRun(out, "ssim", higher_is_better=True, main=dist.main, resume=resume, kind=LOUPE,
                      map_location=device)
    train = load_split(data_dir, "train", cfg.max_train_slices)
    val = load_split(data_dir, "val", cfg.max_val_slices)
    run.describe(data_dir, train=train, val=val)
    acq.check(train.n_pe)
    gen = torch.Generator().manual_seed(cfg.seed)
    if mar_path:
        mar, mar_meta = load_mar(mar_path, device)
    else:
        mar, mar_meta = seeded(cfg.seed, lambda: build_mar(config["mar_model"]).to(device)), {}
    mask = LoupeMask(train.n_pe, acq.initial, acq.budget, cfg.slope, cfg.temperature, generator=gen).to(device)
    optimizer = torch.optim.Adam([{"params": mask.parameters(), "lr": cfg.lr_mask},
                                  {"params": mar.parameters(), "lr": cfg.lr_mar}])
    start = 0
    if run.checkpoint is not None:
        ck = run.checkpoint
        mask.load_state_dict(ck.state_dicts["mask"])
        mar.load_state_dict(ck.state_dicts["mar"])
        optimizer.load_state_dict(ck.extra["optimizer"])
        gen.set_state(ck.extra["generator"])
        start = int(ck.metadata["epoch"])
        log.info("resumed from %s after epoch %d", resume, start)
    hybrid = to_hybrid(train.kspace_metal.to(device))
    target = train.target.to(device)

    def metadata(epoch: int, val_metrics: dict[str, float]) -> dict[str, Any]:
        return loupe_metadata(mask, mar, epoch=epoch, val=val_metrics, best_val=run.best, code_version=__version__,
                              data=str(data_dir), mar_pretrained=str(mar_path) if mar_path else None,
                              mar_pretrained_epoch=mar_meta.get("epoch"),
                              config={k: to_dict(config[k]) for k in ("acquisition", "loupe", "mar_model")})

    log.info("learned mask: %d train / %d val slices, %d + %d of %d lines, %d epochs, MAR %s, on %s",
             len(train), len(val), acq.initial, acq.budget, train.n_pe, cfg.epochs,
             "from " + str(mar_path) if mar_path else "from scratch", device)
    t0 = time.perf_counter()
    bar = tqdm(range(start, cfg.epochs), desc="train loupe", unit="epoch", disable=not (progress and dist.main),
               initial=start, total=cfg.epochs)
    for epoch in bar:
        t_epoch = time.perf_counter()
        mar.train()
        perm = torch.randperm(len(train), generator=gen)
        losses = []
        for i in range(0, len(perm), cfg.batch_size):
            batch = perm[i:i + cfg.batch_size]
            if len(batch) < dist.world:
                continue  # every rank needs a slice
            weights = mask.sample(len(batch), gen)  # the global batch's draws, the same on every rank
            mine = shard(torch.arange(len(batch)), dist)  # under torchrun: this rank's share
            idx = batch[mine].to(device)
            loss = mar_loss(mar(soft_zero_filled(hybrid[idx], weights[mine.to(weights.device)])), target[idx],
                            lambda_ssim)
            optimizer.zero_grad(set_to_none=True)
            (loss * (len(mine) * dist.world / len(batch))).backward()
            dist.average_gradients(mask)
            dist.average_gradients(mar)
            optimizer.step()
            losses.append(dist.mean(float(loss.detach())))
        val_metrics = _validate(mar, mask, val, lambda_ssim, cfg.batch_size, device)
        p = mask.probabilities().detach()[~mask.fixed]
        row = {"epoch": epoch + 1, "train_loss": float(np.mean(losses)),
               "mask/entropy": float(-(p * p.clamp_min(1e-9).log() + (1 - p) * (1 - p).clamp_min(1e-9).log()).mean()),
               **{f"val_{k}": v for k, v in val_metrics.items() if not k.startswith("input_")},
               "seconds": time.perf_counter() - t_epoch}
        improved = run.record(val_metrics, {"epoch": epoch + 1}, {"mar": mar}, {"mar": mar, "mask": mask},
                              metadata(epoch + 1, val_metrics),
                              {"optimizer": optimizer.state_dict(), "generator": gen.get_state()}, row, dist=dist,
                              sync=mask)
        if dist.main:
            log.info("epoch %d: train loss %.4f, val SSIM %.4f, PSNR %.2f, lines %s%s", epoch + 1,
                     row["train_loss"], val_metrics["ssim"], val_metrics["psnr"], mask.order(),
                     " *best*" if improved else "")
        bar.set_postfix(loss=f"{row['train_loss']:.4f}", val_ssim=f"{val_metrics['ssim']:.4f}")
    bar.close()
    run.best["seconds"] = time.perf_counter() - t0
    run.finish({"mar": mar}, metadata(cfg.epochs, run.best))
    return run.best
