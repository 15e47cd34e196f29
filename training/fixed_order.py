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

``masc train refit CKPT --data NEW`` learns the order again for another population or protocol (the
config's acquisition section) under the checkpoint's network, and with ``--finetune`` co-adapts
the network to the new order too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from masc_gadget.acquisition.episode import AcquisitionConfig, initial_lines
from masc_gadget.config import Config, to_dict
from masc_gadget.device import resolve_device
from masc_gadget.models.checkpoint import load_checkpoint, load_mar
from training.finetune import FinetuneConfig, episode_pairs, finetune_to_masks
from training.data import load_split, spread_subset
from training.population import population_order
from training.scoring import line_masks

__all__ = ["FixedOrderConfig", "KIND", "refit_fixed_order", "train_fixed_order"]

log = logging.getLogger(__name__)

KIND = "fixed-order"
"""The checkpoint kind and the policy name."""


@dataclass(frozen=True)
class FixedOrderConfig:
    """``masc train fixed-order`` and ``masc train refit`` (config section ``fixed_order``; the MAR
    network's fine-tuning is the shared recipe, section ``finetune``)."""

    population_slices: int = 32
    """Training slices the order is learned on (spread over the subjects; 0 = all)."""
    device: str = "auto"
    """Where the order is learned and the network fine-tuned (the fine-tuning's seed and slice
    caps are the recipe's, ``finetune.run``)."""

    def __post_init__(self) -> None:
        if self.population_slices < 0:
            raise ValueError(f"population_slices must be >= 0, got {self.population_slices}")


def _fit(config: Config, data_dir: str | Path, mar: torch.nn.Module, out: str | Path, device: torch.device,
         finetune: bool, metadata: dict[str, Any], progress: bool, order: np.ndarray | None = None) -> dict[str, Any]:
    """Learn the order under ``mar`` (or take ``order``), fine-tune ``mar`` to its lines by the
    shared recipe (section ``finetune``; none without ``finetune``), save the best checkpoint
    (``metadata`` carries the network's ``mar_model`` section)."""
    fcfg: FixedOrderConfig = config["fixed_order"]
    acq: AcquisitionConfig = config["acquisition"]
    recipe: FinetuneConfig = config["finetune"]
    if not finetune:
        recipe = replace(recipe, epochs=0, steps=0)
    train = load_split(data_dir, "train", recipe.run.max_train_slices)
    val = load_split(data_dir, "val", recipe.run.max_val_slices)
    acq.check(train.n_pe)
    if order is None:
        subset = spread_subset(train, fcfg.population_slices) if fcfg.population_slices else train
        order = population_order(subset, acq.initial, acq.budget, mar, device, progress=progress)
    log.info("fixed order %s; fine-tuning the MAR network to its lines (%s masks)", order.tolist(), recipe.masks)
    lines = np.concatenate([initial_lines(train.n_pe, acq.initial), np.asarray(order, dtype=np.int64)])
    meta = {**metadata, "kind": KIND, "n_pe": int(train.n_pe), "order": [int(x) for x in order],
            "initial": acq.initial, "budget": acq.budget, "data": str(data_dir),
            "config": {"acquisition": to_dict(acq), "fixed_order": to_dict(fcfg), "finetune": to_dict(recipe)}}
    return finetune_to_masks(mar, recipe, train, episode_pairs(np.tile(lines, (len(train), 1)), train.n_pe,
                                                               acq.initial, recipe.masks),
                             val, line_masks(len(val), val.n_pe, acq.initial, order), out, meta, progress,
                             data_dir=data_dir)


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
    return _fit(config, data_dir, mar, out, device, True, extra, progress, order)


def refit_fixed_order(config: Config, checkpoint: str | Path, data_dir: str | Path, out: str | Path,
                      finetune: bool = False, progress: bool = True) -> dict[str, Any]:
    """``masc train refit``: the order of ``checkpoint`` (kind fixed-order, or any checkpoint with a MAR
    network) learned again on ``data_dir`` for the config's protocol; with ``finetune`` the
    network is co-adapted to the new order too, else kept as it is."""
    fcfg: FixedOrderConfig = config["fixed_order"]
    device = resolve_device(fcfg.device)
    mar, previous = load_mar(checkpoint, device)
    return _fit(config, data_dir, mar, out, device, finetune,
                {"refit_from": str(checkpoint), "previous_order": previous.get("order"),
                 "mar_model": previous["mar_model"]}, progress)
