"""Echo trains in training: the environment steps k lines at once, PPO samples and scores trains
without replacement, MASC trains and evaluates with k > 1."""

import math

import numpy as np
import pytest
import torch

from masc_gadget.acquisition.learned import load_masc
from masc_gadget.config import load_config
from training.coadapt import train_masc
from training.data import load_split
from training.evaluation.evaluate import evaluate
from training.rl.env import BatchedAcquisitionEnv, EnvConfig
from training.rl.ppo import sample_trains, train_log_prob

from tests.conftest import CONFIGS


def test_train_log_prob_by_hand():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    acquired = torch.tensor([[False, False, False, True]])
    trains = torch.tensor([[2, 0, -1]])
    p = torch.softmax(logits[0, :3], 0)
    expected = math.log(p[2]) + math.log(p[0] / (p[0] + p[1]))
    assert float(train_log_prob(logits, acquired, trains)[0]) == pytest.approx(expected, rel=1e-6)


def test_sampled_trains_are_distinct_free_lines_drawn_by_the_policy():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[3.0, 1.0, 0.0, 0.0, -2.0]]).repeat(4000, 1)
    mask = torch.zeros_like(logits, dtype=torch.bool)
    mask[:, 2] = True
    from masc_gadget.models.policy_net import masked_logits

    trains = sample_trains(masked_logits(logits, mask), torch.full((4000,), 2), 3, g)
    assert (trains[:, 2] == -1).all() and (trains[:, 0] != trains[:, 1]).all()
    assert not (trains[:, :2] == 2).any()
    first = torch.bincount(trains[:, 0], minlength=5).float() / 4000
    expected = torch.softmax(masked_logits(logits[:1], mask[:1]), 1)[0]
    assert torch.allclose(first, expected, atol=0.03)


def test_env_steps_whole_trains(tiny_dataset):
    data = load_split(tiny_dataset, "train")
    env = BatchedAcquisitionEnv(data, EnvConfig(observe_mar=False, reward_mar=False, n_envs=2), 1, 5,
                                lines_per_decision=2)
    obs = env.reset(indices=[0, 1])
    q0 = env.current_quality
    total = torch.zeros(2)
    for train in ([[3, 4], [5, 6]], [[7, 8], [9, 10]], [[11, -1], [12, -1]]):
        obs, reward, done, info = env.step(torch.tensor(train))
        total += reward
    assert done.all() and torch.allclose(total, 100 * (info["final_quality"] - q0), atol=1e-4)
    assert int(info["final_mask"][0].sum()) == 6
    env.reset(indices=[0, 1])
    with pytest.raises(ValueError, match="lines first, then -1"):
        env.step(torch.tensor([[3, -1], [5, 6]]))
    with pytest.raises(ValueError, match=r"\(2, 2\) trains"):
        env.step(torch.tensor([3, 4]))


def test_masc_trains_and_evaluates_with_echo_trains(tiny_dataset, tmp_path, global_rng_guard):
    settings = ["masc_train.mar_mode=none", "masc_train.rollouts=3", "masc_train.val_every=3",
                "acquisition.budget=5", "acquisition.lines_per_decision=2", "eval.accelerations={10x: [1, 5]}",
                "policy_net.prior_weight=4.0", "masc_train.prior_slices=4"]
    config = load_config(CONFIGS / "tiny.yaml", settings)
    out = tmp_path / "k2.pt"
    best = train_masc(config, tiny_dataset, None, out, progress=False)
    assert np.isfinite(best["ssim"])
    policy, _, meta = load_masc(out, "cpu")
    assert meta["prior_train"] == 2 and policy.net.prior_train == 2
    results, _ = evaluate(config, tiny_dataset, "test", ["masc", "center-out"], None, progress=False, checkpoint=out)
    block = results["accelerations"]["10x"]
    assert block["lines_per_decision"] == 2
    for row in block["rows"]:
        lines = np.array(row["lines"])
        assert lines.shape[1] == 6 and all(len(set(r)) == 6 for r in lines.tolist())
        assert len(row["curves"]["ssim"]["mean"]) == 6  # one point per line, trains or not
