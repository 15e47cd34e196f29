"""``masc train finetune``: a pre-trained MAR network fine-tuned, by one recipe, to the lines a
trained policy plays.

The policy of ``--policy CKPT`` (any kind: MASC, the fixed order, DQN, SS-DDQN, the learned
mask) plays every training and validation slice as ``masc eval`` and the gadget play it (greedy,
under its own MAR network, seed 0). Its episodes give the (slice, mask) pairs of the recipe
(:func:`training.finetune.episode_pairs`: the served masks, or the pre-action ones), and the
served masks of the validation slices select the network. The pre-trained network of ``--mar``
is fine-tuned by the recipe of the config section ``--recipe`` (``finetune`` or
``finetune_joint``), and the output is the policy's checkpoint with that network in place of its
own: served by the gadget and scored by ``masc eval --checkpoint`` like the original. So two
policies are compared under one recipe, and one policy under two recipes, from the same
pre-trained network (docs/training.md, the fair comparison).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from masc_gadget.config import Config, to_dict
from masc_gadget.device import resolve_device
from masc_gadget.models.checkpoint import load_checkpoint, load_mar
from masc_gadget import __version__
from training.data import data_dirs, load_split
from training.evaluation.evaluate import run_method
from training.finetune import FinetuneConfig, episode_pairs, finetune_to_masks

__all__ = ["RECIPES", "finetune_policy"]

log = logging.getLogger(__name__)

RECIPES = ("finetune", "finetune_joint")
"""The config sections that hold a recipe."""


def finetune_policy(config: Config, data_dir: str | Path, policy_path: str | Path, mar_path: str | Path,
                    out: str | Path, recipe_name: str = "finetune", device: str | None = None,
                    progress: bool = True, select_on: str | Path | None = None) -> dict[str, Any]:
    """The module's command; returns the best validation metrics. ``select_on``: the folder(s)
    whose validation split selects the network (default ``data_dir``), e.g. the simulation
    alone, so that real volumes of ``data_dir``'s validation split choose nothing they are
    later scored on."""
    from masc_gadget.acquisition.learned import load_learned

    if recipe_name not in RECIPES:
        raise ValueError(f"--recipe must name a recipe section ({', '.join(RECIPES)}), got {recipe_name!r}")
    recipe: FinetuneConfig = config[recipe_name]
    acq = config["acquisition"]
    dev = resolve_device(device or recipe.run.device)
    policy, own_mar, _ = load_learned(policy_path, dev)
    train = load_split(data_dir, "train", recipe.run.max_train_slices)
    val = load_split(select_on or data_dir, "val", recipe.run.max_val_slices)
    acq.check(train.n_pe)
    k = acq.lines_per_decision
    mar, mar_meta = load_mar(mar_path, dev)
    with torch.no_grad():  # a policy without a network of its own (DQN) plays under the pre-trained one
        played = {name: run_method(policy, data, acq.initial, acq.budget, mar if own_mar is None else own_mar, seed=0, batch_size=32,
                                   device=dev, progress=progress, lines_per_decision=k, score=False).lines
                  for name, data in (("train", train), ("val", val))}
    sets = {name: len({tuple(sorted(row)) for row in lines.tolist()}) for name, lines in played.items()}
    log.info("%s plays %d distinct line sets on %d training slices, %d on %d validation slices",
             policy_path, sets["train"], len(train), sets["val"], len(val))
    pairs = episode_pairs(played["train"], train.n_pe, acq.initial, recipe.masks)
    val_masks = episode_pairs(played["val"], val.n_pe, acq.initial, "served")[1]
    source = load_checkpoint(policy_path)
    keep = {name: state for name, state in source.state_dicts.items() if name != "mar"}
    metadata = {**{key: value for key, value in source.metadata.items()
                   if key not in ("ood", "val", "best_val", "epoch", "step")},
                "mar_model": mar_meta["mar_model"], "mar_pretrained": str(mar_path),
                "mar_pretrained_epoch": mar_meta.get("epoch"), "masks_from": str(policy_path),
                "code_version": __version__, "recipe": recipe_name, "line_sets": sets, "data": str(data_dir),
                "selected_on": str(select_on or data_dir),
                "finetune_config": {"acquisition": to_dict(acq), recipe_name: to_dict(recipe)}}
    log.info("fine-tuning %s to %d (slice, mask) pairs (%s masks) by recipe %s: %d steps", mar_path,
             len(pairs[0]), recipe.masks, recipe_name, recipe.total_steps(len(pairs[0])))
    folders = list(dict.fromkeys(data_dirs(data_dir) + data_dirs(select_on or data_dir)))
    best = finetune_to_masks(mar, recipe, train, pairs, val, val_masks, out, metadata, progress, keep=keep,
                             data_dir=folders)
    best["line_sets"] = sets
    return best
