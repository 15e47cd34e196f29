"""The population-greedy fixed order: learned on the training split only, greedy on the mean
oracle score, played as a FixedOrder; and the tables' gain over the best baseline."""

import json

import numpy as np
import pytest
import torch

from masc_gadget.acquisition.episode import EpisodeBatch
from masc_gadget.acquisition.policies import FixedOrder, run_episode
from masc_gadget.cli import main
from masc_gadget.models.checkpoint import load_mar
from tests.conftest import CONFIGS
from training.data import load_split, spread_subset
from training.oracle import GreedyOracle
from training.population import population_order
from training.evaluation.tables import oracle_gain

CPU = torch.device("cpu")


def test_fixed_order_follows_its_order_and_skips_acquired_lines():
    assert run_episode(FixedOrder([0, 9, 2, 5]), 10, 2, 3).tolist() == [4, 5, 0, 9, 2]
    # all of the order acquired: the farthest free line from every acquired one
    assert run_episode(FixedOrder([6]), 10, 2, 2).tolist() == [4, 5, 6, 0]
    for bad in ([], [1, 1], [-1, 2]):
        with pytest.raises(ValueError, match="distinct non-negative"):
            FixedOrder(bad)


def test_population_order_is_greedy_on_the_mean_score(tiny_dataset, perturbed_mar):
    train = load_split(tiny_dataset, "train")
    mar = load_mar(perturbed_mar, "cpu")[0].eval()
    order = population_order(train, 1, 3, mar, CPU, batch_size=3)
    assert order.shape == (3,) and len(set(order.tolist())) == 3
    # brute force: the first line maximises the mean Q over the training slices
    episodes = EpisodeBatch(train.n_pe, 1, 3, len(train), CPU)
    with torch.no_grad():
        scores = GreedyOracle().scores(episodes, train.kspace_metal, train.target, mar)
    assert order[0] == int(np.argmax(scores.mean(axis=0)))
    assert order[0] not in episodes.initial_lines


def test_spread_subset_covers_the_split(tiny_dataset):
    train = load_split(tiny_dataset, "train")
    sub = spread_subset(train, 3)
    assert len(sub) == 3 and sub.label(0) == train.label(0) and sub.label(2) == train.label(len(train) - 1)
    assert spread_subset(train, 0) is train and spread_subset(train, 10_000) is train


def test_eval_learns_the_population_order_on_the_training_split_only(tiny_dataset, perturbed_mar, tmp_path):
    args = ["eval", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset),
            "--methods", "random,center-out,population,oracle", "--mar", str(perturbed_mar)]
    runs = {}
    for split in ("test", "val"):
        assert main([*args, "--split", split, "--out", str(tmp_path / split)]) == 0
        runs[split] = json.loads((tmp_path / split / "results.json").read_text())
    record = runs["test"]["population"]
    train_labels = {load_split(tiny_dataset, "train").label(i) for i in range(record["n_slices"])}
    assert record["split"] == "train" and set(record["slices"]) <= train_labels
    assert record["orders"] == runs["val"]["population"]["orders"]  # whatever split is evaluated
    for acc, block in runs["test"]["accelerations"].items():
        rows = {row["key"]: row for row in block["rows"]}
        initial = block["initial"]
        assert all(lines[initial:] == record["orders"][acc] for lines in rows["population"]["lines"])
        best = oracle_gain(block, "best")
        ssim = {k: r["summary"]["ssim"]["mean"] for k, r in rows.items()}
        base = max(ssim[k] for k in ("random", "center-out", "population"))
        if ssim["oracle"] > base:
            assert best["oracle"] == pytest.approx(1.0)
            assert max(best[k] for k in ("random", "center-out", "population")) == pytest.approx(0.0)
    assert "Population order (fixed, learned on train)" in (tmp_path / "test" / "table.md").read_text()
