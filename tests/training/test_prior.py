"""The population-order prior of the policy (policy_net.prior_weight): the bonus goes to the next
line of the order not yet acquired, a strong prior makes the untrained policy play the order,
the order travels in the checkpoint (and a bad one is refused), and masc train masc computes it
on the training split under the pre-trained MAR network."""

import pytest
import torch

from masc_gadget.acquisition.learned import load_masc, policy_metadata
from masc_gadget.config import load_config
from masc_gadget.models.checkpoint import save_checkpoint
from masc_gadget.models.policy_net import PolicyNet, PolicyNetConfig, masked_logits
from tests.conftest import CONFIGS
from training.coadapt import train_masc
from training.data import load_split, spread_subset
from training.population import population_order

N = 16


def _net(weight=20.0, lines=3):
    torch.manual_seed(0)
    return PolicyNet(N, N, 8, PolicyNetConfig(channels=(4,), hidden=8, pool_size=2, prior_weight=weight),
                     prior_lines=lines)


def test_bonus_is_on_the_next_free_line_of_the_order():
    net = _net()
    net.set_prior([9, 3, 12])
    mask = torch.zeros(4, N, dtype=torch.bool)
    mask[1, 9] = True  # order line 1 taken -> next is 3
    mask[2, [9, 3]] = True  # -> 12
    mask[3, [9, 3, 12]] = True  # order done -> no bonus
    bonus = net.prior_bonus(mask)
    assert bonus.sum(1).tolist() == [1, 1, 1, 0]
    assert [int(bonus[i].argmax()) for i in range(3)] == [9, 3, 12]


def test_strong_prior_plays_the_order_and_is_learnable():
    net = _net(weight=20.0)
    net.set_prior([9, 3, 12])
    mask = torch.zeros(1, N, dtype=torch.bool)
    mask[0, [7, 8]] = True
    image = torch.rand(1, N, 8)
    chosen = []
    for step in range(4):
        logits, _ = net(image, mask, torch.tensor([1.0 - step / 4]))
        line = int(masked_logits(logits, mask).argmax())
        chosen.append(line)
        mask[0, line] = True
    assert chosen[:3] == [9, 3, 12] and chosen[3] not in (7, 8, 9, 3, 12)
    logits, _ = net(image, torch.zeros(1, N, dtype=torch.bool), torch.tensor([1.0]))
    logits[0, 9].backward()
    assert net.prior_scale.grad is not None and float(net.prior_scale.grad) == pytest.approx(1.0)


def test_prior_validation():
    with pytest.raises(ValueError, match="prior_weight"):
        PolicyNetConfig(prior_weight=-1.0)
    net = _net()
    with pytest.raises(ValueError, match="3 lines"):
        net.set_prior([1, 2])
    with pytest.raises(ValueError, match="distinct"):
        net.set_prior([1, 1, 2])
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        net.set_prior([1, 2, 16])
    with pytest.raises(ValueError, match="without a prior"):
        _net(lines=0).set_prior([1])
    with pytest.raises(ValueError, match="prior_lines"):
        _net(lines=N + 1)


def test_checkpoint_keeps_the_order_and_refuses_a_bad_one(tmp_path):
    net = _net()
    net.set_prior([9, 3, 12])
    path = tmp_path / "p.pt"
    save_checkpoint(path, {"policy": net}, policy_metadata(net, observes_mar=False))
    policy, _, meta = load_masc(path, "cpu")
    assert meta["prior_lines"] == 3 and policy.net.prior_order.tolist() == [9, 3, 12]
    net.prior_order.copy_(torch.tensor([9, 3, 99]))  # as a hostile or damaged file would hold it
    bad = tmp_path / "bad.pt"
    save_checkpoint(bad, {"policy": net}, policy_metadata(net, observes_mar=False))
    with pytest.raises(ValueError, match=r"bad.pt.*\[0, 16\)"):
        load_masc(bad, "cpu")


def test_masc_train_starts_from_the_population_order(tiny_dataset, tmp_path, perturbed_mar):
    config = load_config(CONFIGS / "tiny.yaml", ["policy_net.prior_weight=8", "masc_train.rollouts=2",
                                                 "masc_train.val_every=2", "masc_train.prior_slices=4"])
    out = tmp_path / "prior.pt"
    best = train_masc(config, tiny_dataset, perturbed_mar, out, progress=False)
    policy, mar, meta = load_masc(out, "cpu")
    acq = config["acquisition"]
    assert meta["prior_lines"] == acq.budget
    from masc_gadget.models.checkpoint import load_mar

    pre, _ = load_mar(perturbed_mar, "cpu")
    train = spread_subset(load_split(tiny_dataset, "train"), 4)
    expected = population_order(train, acq.initial, acq.budget, pre, torch.device("cpu"), 32)
    assert policy.net.prior_order.tolist() == expected.tolist()
    assert best["rollout"] in (0, 2)  # the prior alone was validated as rollout 0
