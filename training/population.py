"""The population-greedy fixed order: a learned but non-adaptive baseline for line choice.

Greedy on a population instead of on one slice: after the initial centre lines, every step adds
the line that maximises the *mean* quality ``Q`` (the oracle's score, under the MAR network in
use) over a set of training slices that all share the same mask. The result is one fixed order
per (initial, budget) setting, which a :class:`~masc_gadget.acquisition.policies.FixedOrder`
then plays on every slice. It is computed from the training split only: it is what a
non-adaptive schedule can learn from the same data as MASC, and the bar an adaptive policy must
clear to show that it adapts. ``masc train masc`` can also start its policy from it
(``policy_net.prior_weight``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from masc_gadget.acquisition.episode import EpisodeBatch
from training.data import SliceSet
from training.oracle import GreedyOracle

NAME = "population"
"""Its method name in ``masc eval``."""

log = logging.getLogger(__name__)


@torch.no_grad()
def population_order(data: SliceSet, initial: int, budget: int, mar: torch.nn.Module | None,
                     device: torch.device, batch_size: int = 32,
                     oracle: GreedyOracle | None = None, progress: bool = False,
                     roi: torch.Tensor | None = None) -> np.ndarray:
    """(budget,) int64: the population-greedy order of ``data`` (module docstring).

    ``roi``: None, or (N, H, W) bool, one region of interest per slice of ``data`` where Q is
    scored (the order that is best on average there). Every step scores every free line on every slice of ``data`` (``budget * n_free * len(data)``
    recon + MAR forwards, batched); ties go to the lowest line."""
    if len(data) == 0:
        raise ValueError("the population order needs at least one training slice")
    from tqdm.auto import tqdm

    oracle = oracle or GreedyOracle()
    n_pe = data.n_pe
    order: list[int] = []
    for step in tqdm(range(budget), desc="population order", unit="line", disable=not progress):
        total = np.zeros(n_pe)
        for start in range(0, len(data), batch_size):
            index = list(range(start, min(start + batch_size, len(data))))
            episodes = EpisodeBatch(n_pe, initial, budget, len(index), device)
            for line in order:
                episodes.acquire(np.full(len(index), line, dtype=np.int64))
            total += oracle.scores(episodes, data.kspace_metal[index].to(device),
                                   data.target[index].to(device), mar,
                                   None if roi is None else roi[index].to(device)).sum(axis=0)
        order.append(int(np.argmax(total)))
        log.debug("population order step %d: line %d (mean Q %.4f)", step, order[-1],
                  total[order[-1]] / len(data))
    log.info("population order (%d + %d of %d lines, %d training slices): %s", initial, budget,
             n_pe, len(data), order)
    return np.asarray(order, dtype=np.int64)
