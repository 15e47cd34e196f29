"""The fixed order as a first-class method: one population order per protocol, learned from a
data set under a MAR network, and that network co-adapted to the order's lines.

``masc train fixed-order`` learns the population-greedy order (:func:`training.population.
population_order`) of the protocol's ``initial + budget`` lines on ``fixed_order.population_slices``
training slices under the pre-trained MAR network, then fine-tunes the network on the zero-filled
images of those lines (every training slice, the pre-training loss, ``mar_train.clean_fraction``
of clean anchors), keeping the epoch with the best validation SSIM of the served image. The
checkpoint (kind ``fixed-order``: the order in its metadata, the network) is served like any
policy (``policy: fixed-order``, ``policy_checkpoint``) and scored by ``masc eval --methods
fixed-order --checkpoint CKPT``.

``masc refit CKPT --data NEW`` learns the order again for another population or protocol (the
config's acquisition section) under the checkpoint's network, and with ``--finetune`` co-adapts
the network to the new order too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from masc_gadget.acquisition.episode import AcquisitionConfig
from masc_gadget.config import Config, to_dict
from masc_gadget.device import resolve_device
from masc_gadget.models.checkpoint import load_checkpoint, load_mar
from training.coadapt import finetune_mar
from training.data import SliceSet, load_split, spread_subset
from training.population import population_order
from training.run import TrainingRun
from training.scoring import line_masks, score_masks

__all__ = ["FixedOrderConfig", "KIND", "order_masks", "refit_fixed_order", "train_fixed_order"]

log = logging.getLogger(__name__)

KIND = "fixed-order"
"""The checkpoint kind and the policy name."""


@dataclass(frozen=True)
class FixedOrderConfig:
    """``masc train fixed-order`` and ``masc refit`` (config section ``fixed_order``)."""

    population_slices: int = 32
    """Training slices the order is learned on (spread over the subjects; 0 = all)."""
    epochs: int = 3
    """Epochs of co-adapting the MAR network to the order's lines (0: the order only)."""
    lr: float = 1e-4
    """Learning rate of that fine-tuning."""
    batch_size: int = 16
    lambda_ssim: float = 1.0
    """The pre-training loss ``L1 + lambda_ssim (1 - SSIM)``."""
    max_val_slices: int = 0
    """Validation slices scored after each epoch (0 = all)."""
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("population_slices", "epochs", "max_val_slices", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.batch_size < 1 or not self.lr > 0:
            raise ValueError(f"batch_size must be >= 1 and lr > 0, got {self.batch_size}, {self.lr}")


def order_masks(n: int, n_pe: int, initial: int, order: np.ndarray) -> torch.Tensor:
    """(n, n_pe) bool: the protocol's initial centre lines and ``order``, on every slice."""
    return torch.from_numpy(line_masks(n, n_pe, initial, order))


def served_metrics(mar: torch.nn.Module, data: SliceSet, masks: torch.Tensor, batch_size: int = 32) -> dict[str, float]:
    """Mean SSIM and PSNR of the served image of ``data`` under ``masks``
    (:func:`training.scoring.score_masks`)."""
    return score_masks(data, masks, mar, metrics=("ssim", "psnr"), batch_size=batch_size).mean()


def _fit(config: Config, data_dir: str | Path, mar: torch.nn.Module, out: str | Path, device: torch.device,
         epochs: int, metadata: dict[str, Any], progress: bool, order: np.ndarray | None = None) -> dict[str, Any]:
    """Learn the order under ``mar`` (or take ``order``), co-adapt ``mar`` for ``epochs``, save the
    best checkpoint (``metadata`` carries the network's ``mar_model`` section)."""
    fcfg: FixedOrderConfig = config["fixed_order"]
    acq: AcquisitionConfig = config["acquisition"]
    train = load_split(data_dir, "train")
    val = load_split(data_dir, "val", fcfg.max_val_slices)
    acq.check(train.n_pe)
    if order is None:
        subset = spread_subset(train, fcfg.population_slices) if fcfg.population_slices else train
        order = population_order(subset, acq.initial, acq.budget, mar, device, progress=progress)
    run = TrainingRun(out, "ssim", higher_is_better=True)
    val_masks = order_masks(len(val), val.n_pe, acq.initial, order)
    meta = {**metadata, "kind": KIND, "n_pe": int(train.n_pe), "order": [int(x) for x in order],
            "initial": acq.initial, "budget": acq.budget, "data": str(data_dir),
            "config": {"acquisition": to_dict(acq), "fixed_order": to_dict(fcfg)}}
    val_metrics = served_metrics(mar, val, val_masks)
    run.improved(val_metrics, epoch=0)
    run.save(True, {"mar": mar}, {"mar": mar}, {**meta, "epoch": 0, "val": val_metrics, "best_val": run.best}, {})
    run.log_row({"epoch": 0, "val_ssim": val_metrics["ssim"], "val_psnr": val_metrics["psnr"], "loss": ""})
    log.info("fixed order %s: val SSIM %.4f before co-adapting the MAR network", order.tolist(), val_metrics["ssim"])
    if epochs:
        generator = torch.Generator().manual_seed(fcfg.seed)
        optimizer = torch.optim.Adam(mar.parameters(), lr=fcfg.lr)
        masks = order_masks(len(train), train.n_pe, acq.initial, order)
        clean = train.kspace_clean if config["mar_train"].clean_fraction > 0 else None
        for epoch in range(1, epochs + 1):
            loss = finetune_mar(mar, optimizer, train.kspace_metal, train.target, torch.arange(len(train)), masks,
                                1, fcfg.batch_size, generator, lambda_ssim=fcfg.lambda_ssim, clean_kspace=clean,
                                clean_fraction=config["mar_train"].clean_fraction)
            val_metrics = served_metrics(mar, val, val_masks)
            better = run.improved(val_metrics, epoch=epoch)
            run.save(better, {"mar": mar}, {"mar": mar},
                     {**meta, "epoch": epoch, "val": {**val_metrics, "loss": loss}, "best_val": run.best}, {})
            run.log_row({"epoch": epoch, "val_ssim": val_metrics["ssim"], "val_psnr": val_metrics["psnr"], "loss": loss})
            log.info("epoch %d: loss %.4f, val SSIM %.4f%s", epoch, loss, val_metrics["ssim"], " *best*" if better else "")
    return run.best


def train_fixed_order(config: Config, data_dir: str | Path, mar_path: str | Path, out: str | Path,
                      progress: bool = True, order_from: str | Path | None = None) -> dict[str, Any]:
    """``masc train fixed-order`` (module docstring); returns the best validation metrics.
    ``order_from``: an earlier fixed-order checkpoint whose order is taken instead of learned
    again (it must have been learned for this protocol; recorded in the metadata)."""
    fcfg: FixedOrderConfig = config["fixed_order"]
    acq: AcquisitionConfig = config["acquisition"]
    device = resolve_device(fcfg.device)
    mar, meta = load_mar(mar_path, device)
    extra: dict[str, Any] = {"mar_pretrained": str(mar_path), "mar_model": meta["mar_model"]}
    order = None
    if order_from is not None:
        earlier = load_checkpoint(order_from).metadata
        if earlier.get("kind") != KIND:
            raise ValueError(f"{order_from} is a {earlier.get('kind')!r} checkpoint, not a {KIND} one")
        if (earlier.get("initial"), earlier.get("budget")) != (acq.initial, acq.budget):
            raise ValueError(f"{order_from} holds an order of {earlier.get('initial')} + {earlier.get('budget')} lines, "
                             f"the protocol has {acq.initial} + {acq.budget}")
        if earlier.get("mar_pretrained") not in (None, str(mar_path)):
            log.warning("%s learned its order under %s, not %s", order_from, earlier["mar_pretrained"], mar_path)
        order = np.asarray(earlier["order"], dtype=np.int64)
        extra["order_from"] = str(order_from)
        log.info("order %s taken from %s", order.tolist(), order_from)
    return _fit(config, data_dir, mar, out, device, fcfg.epochs, extra, progress, order)


def refit_fixed_order(config: Config, checkpoint: str | Path, data_dir: str | Path, out: str | Path,
                      finetune: bool = False, progress: bool = True) -> dict[str, Any]:
    """``masc refit``: the order of ``checkpoint`` (kind fixed-order, or any checkpoint with a MAR
    network) learned again on ``data_dir`` for the config's protocol; with ``finetune`` the
    network is co-adapted to the new order too, else kept as it is."""
    fcfg: FixedOrderConfig = config["fixed_order"]
    device = resolve_device(fcfg.device)
    mar, previous = load_mar(checkpoint, device)
    return _fit(config, data_dir, mar, out, device, fcfg.epochs if finetune else 0,
                {"refit_from": str(checkpoint), "previous_order": previous.get("order"),
                 "mar_model": previous["mar_model"]}, progress)
