"""Imitation of the greedy oracle: demonstrations are the oracle's own choices on training
slices, the imitated policy agrees with them, and training keeps / shares the demonstrations."""

import csv

import numpy as np
import pytest
import torch

from masc_gadget.config import load_config
from masc_gadget.models.checkpoint import load_checkpoint, load_mar
from masc_gadget.models.policy_net import PolicyNet
from tests.conftest import CONFIGS
from training.coadapt import train_masc
from training.data import load_split
from training.evaluation.evaluate import run_method
from training.oracle import GreedyOracle
from training.imitation import (
    ImitationConfig,
    imitate,
    load_or_make_demonstrations,
    oracle_demonstrations,
)
from training.rl.env import EnvConfig

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setting(tiny_dataset, perturbed_mar):
    train = load_split(tiny_dataset, "train")
    mar = load_mar(perturbed_mar, "cpu")[0].eval()
    return train, mar


def test_demonstrations_follow_the_oracle(setting):
    train, mar = setting
    demos = oracle_demonstrations(train, EnvConfig(), 1, 2, mar, CPU, batch_size=3)
    assert len(demos) == 2 * len(train) and demos.images.shape[1:] == train.target.shape[1:]
    assert sorted(set(demos.steps_left.tolist())) == [1, 2]
    with torch.no_grad():
        traj = run_method(GreedyOracle(), train, 1, 2, mar, 0, 8, CPU)
    first = demos.steps_left == 2  # the states of the first choice, in slice order
    assert np.array_equal(demos.scores[first].argmax(dim=1).numpy(), traj.lines[:, 1])
    assert torch.isinf(demos.scores[demos.masks]).all() and torch.isfinite(demos.scores[~demos.masks]).all()
    # return to go of the first state = alpha * (Q_final - Q_initial) along the oracle's path
    q = 0.5 * traj.curves[True]["ssim"] + 0.5 * (1 - traj.curves[True]["nmse"])
    assert np.allclose(demos.returns[first].numpy(), 100 * (q[:, -1] - q[:, 0]), atol=2e-3)


def test_imitation_learns_the_oracle_choices(setting):
    train, mar = setting
    demos = oracle_demonstrations(train, EnvConfig(), 1, 2, mar, CPU)
    torch.manual_seed(0)
    net = PolicyNet(train.n_pe, *train.target.shape[1:], load_config(CONFIGS / "tiny.yaml")["policy_net"])
    cfg = ImitationConfig(slices=len(train), epochs=60, lr=3e-3, batch_size=8, temperature=0.0, value_weight=0.0)
    history = imitate(net, demos, cfg, torch.Generator().manual_seed(0), progress=False)
    assert history[-1]["imitation/policy_loss"] < 0.5 * history[0]["imitation/policy_loss"]
    assert history[-1]["imitation/agreement"] >= 0.5  # chance: 1 in 30 free lines


def test_demonstrations_are_kept_and_matched(setting, tmp_path, caplog):
    train, mar = setting
    path = tmp_path / "demos.pt"
    cfg = ImitationConfig(slices=3)
    a = load_or_make_demonstrations(path, train, cfg, EnvConfig(), 1, 2, mar, CPU)
    assert path.exists() and a.meta["n_slices"] == 3
    b = load_or_make_demonstrations(path, train, cfg, EnvConfig(), 1, 2, mar, CPU)
    assert torch.equal(a.scores, b.scores) and torch.equal(a.images, b.images)
    other = load_or_make_demonstrations(path, train, cfg, EnvConfig(), 2, 1, mar, CPU)  # other episode size
    assert "recomputing" in caplog.text and len(other) == 3


def test_train_masc_warm_starts_from_the_oracle(tiny_dataset, perturbed_mar, tmp_path):
    config = load_config(CONFIGS / "tiny.yaml", ["imitation.slices=4", "imitation.epochs=3",
                                                 "masc_train.rollouts=2", "masc_train.val_every=2"])
    out = tmp_path / "m.pt"
    train_masc(config, tiny_dataset, perturbed_mar, out, progress=False, demos=tmp_path / "d.pt")
    assert (tmp_path / "d.pt").exists()
    with open(out.with_name("m.imitation.csv")) as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3] and "imitation/agreement" in rows[0]
    assert rows[-1]["val/ssim"] and not rows[0]["val/ssim"]  # the imitated policy, validated (rollout 0)
    with open(out.with_suffix(".csv")) as fh:
        log_rows = list(csv.DictReader(fh))
    assert [int(r["rollout"]) for r in log_rows] == [1, 2] and all(None not in r for r in log_rows)
    assert load_checkpoint(out.with_name("m.last.pt")).metadata["rollout"] == 2
    assert out.with_suffix(".png").stat().st_size > 10_000  # the training curves, imitation included


@pytest.mark.parametrize("bad", ["imitation.slices=-1", "imitation.temperature=-1", "imitation.epochs=0"])
def test_imitation_config_is_checked(bad):
    with pytest.raises(ValueError, match=bad.split(".")[1].split("=")[0]):
        load_config(CONFIGS / "tiny.yaml", [bad])
