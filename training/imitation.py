"""Imitation of the greedy oracle: a warm start for the policy before co-adaptive PPO.

PPO from scratch has to discover, from a reward of a few hundredths of SSIM per line, which
lines help a given slice. The greedy oracle (:mod:`training.oracle`) knows: with the
clean image it scores every free line. On training slices only, :func:`oracle_demonstrations`
runs the oracle under the pre-trained MAR network and records, at every step, what the policy
would observe (the MAR image, the mask, the steps left) with the oracle's score of *every* free
line; :func:`imitate` then fits the actor to the softmax of those scores (a soft target: lines
almost as good as the best one are not counted as wrong) and the critic to the oracle's return
to go. PPO with the MAR fine-tuning (the paper's method) continues from there.

The demonstrations depend only on the data, the pre-trained MAR network and the episode size;
:func:`load_or_make_demonstrations` keeps them in a file so that several training seeds share
them.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from masc_gadget.acquisition.episode import EpisodeBatch
from masc_gadget.core.kspace import zero_filled
from masc_gadget.core.metrics import quality
from masc_gadget.models.policy_net import PolicyNet, masked_logits
from training.data import SliceSet, spread_subset
from training.oracle import GreedyOracle
from training.rl.env import EnvConfig

log = logging.getLogger(__name__)

DEMOS_FORMAT = 1
"""Version of the demonstrations file."""


@dataclass(frozen=True)
class ImitationConfig:
    """Imitation of the greedy oracle before PPO (config section ``imitation``)."""

    slices: int = 0
    """Training slices the oracle demonstrates on, evenly spread over the split (0 = no
    imitation: PPO starts from a random policy, as in the paper). The oracle scores every free
    line at every step: ``slices x budget x n_pe`` MAR forwards, once."""
    epochs: int = 30
    """Passes over the demonstrations."""
    lr: float = 1e-3
    """Adam learning rate."""
    batch_size: int = 64
    """States per step."""
    temperature: float = 0.0
    """0: the target is the oracle's choice (one-hot). > 0: the soft target
    ``softmax(alpha * Q_line / temperature)`` over the free lines (alpha: the reward scale, so 1
    is one reward unit). On the small configuration the lines' scores differ by well under one
    reward unit, so temperature 1 gives a nearly uniform target that teaches nothing."""
    value_weight: float = 0.05
    """Weight of the critic's regression on the oracle's return to go (small: the returns are of
    order alpha x 0.1, and the critic shares the actor's trunk)."""

    def __post_init__(self) -> None:
        if self.slices < 0:
            raise ValueError(f"slices must be >= 0 (0 = no imitation), got {self.slices}")
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0 (0 = one-hot), got {self.temperature}")
        if self.value_weight < 0:
            raise ValueError(f"value_weight must be >= 0, got {self.value_weight}")


@dataclass
class Demonstrations:
    """M oracle states (every step of every demonstrated slice) and what the oracle saw."""

    images: torch.Tensor
    """(M, H, W) float32: what the policy observes (the MAR image, or the zero-filled one)."""
    masks: torch.Tensor
    """(M, n_pe) bool: acquired lines."""
    steps_left: torch.Tensor
    """(M,) long: choices left, ``budget`` at the first step."""
    scores: torch.Tensor
    """(M, n_pe) float32: ``alpha * Q`` after acquiring each line (-inf for acquired lines)."""
    returns: torch.Tensor
    """(M,) float32: the oracle's return to go, ``alpha * (Q_final - Q_t)``."""
    budget: int
    meta: dict[str, Any]

    def __len__(self) -> int:
        return int(self.masks.shape[0])


@torch.no_grad()
def oracle_demonstrations(data: SliceSet, ecfg: EnvConfig, initial: int, budget: int,
                          mar: torch.nn.Module | None, device: torch.device,
                          batch_size: int = 16, progress: bool = True) -> Demonstrations:
    """Run the greedy oracle on every slice of ``data`` (training slices only!) and record the
    states it visits, as the policy would observe them (``ecfg.observe_mar``), with the scores
    of every free line under the reward's image (``ecfg.reward_mar``)."""
    from tqdm.auto import tqdm

    oracle = GreedyOracle(ecfg.l_ssim, ecfg.l_nmse)
    reward_mar = mar if ecfg.reward_mar else None
    observe_mar = mar if ecfg.observe_mar else None
    kspace_all = data.kspace_clean if ecfg.kspace == "clean" else data.kspace_metal
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("images", "masks", "steps", "scores", "q")}
    bar = tqdm(total=len(data), desc="oracle demonstrations", unit="slice", disable=not progress)
    for start in range(0, len(data), batch_size):
        index = list(range(start, min(start + batch_size, len(data))))
        kspace, target = kspace_all[index].to(device), data.target[index].to(device)
        episodes = EpisodeBatch(data.n_pe, initial, budget, len(index), device)
        zf = zero_filled(kspace, episodes.mask).float()
        first = reward_mar(zf) if reward_mar is not None else zf
        qs = [quality(first, target, ecfg.l_ssim, ecfg.l_nmse).double().cpu()]
        for t in range(budget):
            zf = zero_filled(kspace, episodes.mask).float()
            scores = oracle.scores(episodes, kspace, target, reward_mar)
            chosen = scores.argmax(axis=1)
            parts["images"].append((observe_mar(zf).float() if observe_mar is not None else zf).cpu())
            parts["masks"].append(episodes.mask.cpu())
            parts["steps"].append(torch.full((len(index),), budget - t, dtype=torch.long))
            parts["scores"].append(torch.from_numpy(ecfg.alpha * scores).float())
            qs.append(torch.from_numpy(scores[np.arange(len(index)), chosen]))  # Q after the oracle's line
            episodes.acquire(chosen)
        q = torch.stack(qs, dim=1).float()  # (b, budget + 1)
        parts["q"].append(ecfg.alpha * (q[:, -1:] - q[:, :-1]))  # return to go per step
        bar.update(len(index))
    bar.close()
    steps = torch.cat(parts["steps"])
    returns = torch.cat([r.T.reshape(-1) for r in parts["q"]])  # the states' order: batch, step, slice
    demos = Demonstrations(torch.cat(parts["images"]), torch.cat(parts["masks"]), steps,
                           torch.cat(parts["scores"]), returns, budget,
                           {"n_slices": len(data), "initial": initial, "budget": budget,
                            "slices": [data.label(i) for i in range(len(data))]})
    log.info("oracle demonstrations: %d slices x %d steps, mean oracle episode return %.3f", len(data),
             budget, float(returns[steps == budget].mean()))
    return demos


def imitation_loss(net: PolicyNet, images: torch.Tensor, masks: torch.Tensor, steps_left: torch.Tensor,
                   scores: torch.Tensor, returns: torch.Tensor, budget: int, temperature: float,
                   value_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy of the masked actor against the oracle's soft (or, temperature 0, one-hot)
    target, plus ``value_weight`` x MSE of the critic against the oracle's return to go."""
    logits, value = net(images, masks, steps_left.float() / budget)
    logp = F.log_softmax(masked_logits(logits, masks), dim=1)
    if temperature > 0:
        target = torch.softmax(scores / temperature, dim=1)
    else:
        target = F.one_hot(scores.argmax(dim=1), scores.shape[1]).float()
    free = ~masks
    policy_loss = -(target * logp.masked_fill(~free, 0.0)).sum(dim=1).mean()
    value_loss = F.mse_loss(value, returns)
    agree = (logp.argmax(dim=1) == scores.argmax(dim=1)).float().mean()
    stats = {"imitation/policy_loss": float(policy_loss.detach()), "imitation/value_loss": float(value_loss.detach()),
             "imitation/agreement": float(agree)}
    return policy_loss + value_weight * value_loss, stats


def imitate(net: PolicyNet, demos: Demonstrations, cfg: ImitationConfig, generator: torch.Generator,
            progress: bool = True) -> list[dict[str, float]]:
    """Fit ``net`` to the demonstrations (:func:`imitation_loss`, Adam, ``cfg.epochs`` passes in
    minibatches shuffled by ``generator``). Returns one stats dict per epoch (means over it)."""
    from tqdm.auto import tqdm

    device = next(net.parameters()).device
    optimizer = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    history = []
    net.train()
    bar = tqdm(range(cfg.epochs), desc="imitate oracle", unit="epoch", disable=not progress)
    for epoch in bar:
        order = torch.randperm(len(demos), generator=generator)
        sums: dict[str, float] = {}
        for start in range(0, len(order), cfg.batch_size):
            idx = order[start:start + cfg.batch_size]
            loss, stats = imitation_loss(
                net, demos.images[idx].to(device), demos.masks[idx].to(device), demos.steps_left[idx].to(device),
                demos.scores[idx].to(device), demos.returns[idx].to(device), demos.budget, cfg.temperature,
                cfg.value_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value * len(idx)
        history.append({"epoch": epoch + 1, **{k: v / len(demos) for k, v in sums.items()}})
        bar.set_postfix(agree=f"{history[-1]['imitation/agreement']:.2f}")
    net.eval()
    log.info("imitation: %d epochs on %d oracle states, final agreement %.3f, policy loss %.3f", cfg.epochs,
             len(demos), history[-1]["imitation/agreement"], history[-1]["imitation/policy_loss"])
    return history


def _fingerprint(mar: torch.nn.Module | None) -> str:
    """A digest of the MAR network's weights (which network the oracle ran under)."""
    digest = hashlib.sha256()
    if mar is not None:
        for name, tensor in sorted(mar.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def load_or_make_demonstrations(path: str | Path | None, train: SliceSet, cfg: ImitationConfig,
                                ecfg: EnvConfig, initial: int, budget: int, mar: torch.nn.Module | None,
                                device: torch.device, progress: bool = False) -> Demonstrations:
    """The demonstrations on ``cfg.slices`` spread training slices: read from ``path`` when it
    holds those of the same slices, episode size, environment and MAR weights; else computed
    (and written to ``path`` when given)."""
    data = spread_subset(train, cfg.slices)
    key = {"format": DEMOS_FORMAT, "slices": [data.label(i) for i in range(len(data))], "initial": initial,
           "budget": budget, "mar": _fingerprint(mar), "kspace": ecfg.kspace, "alpha": ecfg.alpha,
           "l_ssim": ecfg.l_ssim, "l_nmse": ecfg.l_nmse, "observe_mar": ecfg.observe_mar,
           "reward_mar": ecfg.reward_mar}
    if path is not None and Path(path).exists():
        stored = torch.load(path, map_location="cpu", weights_only=True)
        if stored.get("key") == key:
            log.info("oracle demonstrations read from %s", path)
            return Demonstrations(**stored["tensors"], budget=budget, meta=stored["meta"])
        log.warning("%s holds demonstrations of other slices, settings or MAR weights: recomputing", path)
    demos = oracle_demonstrations(data, ecfg, initial, budget, mar, device, progress=progress)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tensors = {name: getattr(demos, name) for name in ("images", "masks", "steps_left", "scores", "returns")}
        tmp = Path(str(path) + ".tmp")
        torch.save({"key": key, "tensors": tensors, "meta": demos.meta}, tmp)
        tmp.replace(path)
        log.info("oracle demonstrations written to %s", path)
    return demos
