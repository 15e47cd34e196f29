"""The learned MASC policy: checkpoint round trips, free lines only, batched = per-state choices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from masc_gadget.acquisition import policies
from masc_gadget.acquisition.episode import AcquisitionState
from masc_gadget.models.checkpoint import save_checkpoint
from masc_gadget.acquisition.learned import (
    LearnedPolicy,
    load_masc,
    make_learned_policy,
    policy_metadata,
)
from masc_gadget.models.policy_net import PolicyNet, PolicyNetConfig
from masc_gadget.models.unet import MarModelConfig, build_mar

N_PE, WIDTH = 16, 12
CFG = PolicyNetConfig(channels=(4, 8), hidden=32, pool_size=4)


def _net(seed: int = 0) -> PolicyNet:
    return PolicyNet(N_PE, N_PE, WIDTH, CFG, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def net() -> PolicyNet:
    net = _net()
    with torch.no_grad():  # a spread of preferences, so argmax ties do not hide mistakes
        net.actor.bias.copy_(torch.randn(N_PE, generator=torch.Generator().manual_seed(1)))
    return net


@pytest.fixture
def checkpoint(tmp_path, net):
    path = tmp_path / "masc.pt"
    save_checkpoint(path, {"policy": net}, policy_metadata(net, observes_mar=False, epoch=3))
    return path


def _states(count: int, seed: int = 0, budget: int = 6) -> list[AcquisitionState]:
    rng = np.random.default_rng(seed)
    states = []
    for _ in range(count):
        state = AcquisitionState.initial(N_PE, 2, budget)
        for _ in range(int(rng.integers(0, budget))):
            state = state.after(int(rng.choice(state.free_lines())))
        image = rng.random((N_PE, WIDTH)).astype(np.float32) * 500.0
        states.append(AcquisitionState(state.mask, state.steps_left, state.step, image, 2))
    return states


def test_from_checkpoint_chooses_only_free_lines(checkpoint, global_rng_guard):
    policy = LearnedPolicy.from_checkpoint(checkpoint, device="cpu")
    assert policy.name == "masc" and policy.needs_image and policy.deterministic
    assert policy.observes_mar is False
    assert policy.metadata["epoch"] == 3
    favourite = int(torch.argmax(policy.net.actor.bias))
    for state in _states(30):
        line = policy.select(state)
        assert not state.mask[line]
    # even when the network's favourite line is acquired it is never chosen
    mask = np.zeros(N_PE, dtype=bool)
    mask[[favourite, 7, 8]] = True
    state = AcquisitionState(mask, 3, 1, np.ones((N_PE, WIDTH), np.float32), 2)
    assert policy.select(state) != favourite


def test_select_batch_equals_per_state_select(checkpoint, global_rng_guard):
    policy = LearnedPolicy.from_checkpoint(checkpoint, device="cpu")
    states = _states(12, seed=4)
    batch = policy.select_batch(states, [np.random.default_rng(i) for i in range(12)])
    assert batch.dtype == np.int64 and batch.shape == (12,)
    assert batch.tolist() == [policy.select(s) for s in states]
    assert policy.select_batch([]).shape == (0,)
    with pytest.raises(ValueError, match="one rng per state"):
        policy.select_batch(states, [None])


def test_steps_left_fraction_and_greedy_argmax(net, checkpoint):
    """The network sees steps_left / (step + steps_left) and the policy is the argmax of the
    masked logits."""
    policy = LearnedPolicy.from_checkpoint(checkpoint, device="cpu")
    states = _states(5, seed=2, budget=6)
    images = torch.from_numpy(np.stack([s.image for s in states]))
    masks = torch.from_numpy(np.stack([s.mask for s in states]))
    frac = torch.tensor([s.steps_left / 6 for s in states])
    with torch.no_grad():
        logits, _ = net(images, masks, frac)
    expected = logits.masked_fill(masks, -torch.inf).argmax(1)
    assert policy.select_batch(states).tolist() == expected.tolist()


def test_round_trip_without_mar(net, checkpoint):
    policy, mar, meta = load_masc(checkpoint, "cpu")
    assert mar is None
    assert meta["kind"] == "masc" and meta["policy_net"]["channels"] == [4, 8]
    assert policy.net.config == CFG
    for key, value in net.state_dict().items():
        assert torch.equal(policy.net.state_dict()[key], value)


def test_round_trip_with_mar(tmp_path, net, global_rng_guard):
    with torch.random.fork_rng(devices=[]):
        mar = build_mar(MarModelConfig(width=2, depth=2))
        with torch.no_grad():
            mar.residual.head.weight.normal_()  # not the identity, so the weights matter
    path = save_checkpoint(
        tmp_path / "masc_mar.pt", {"policy": net, "mar": mar}, policy_metadata(net, True, mar)
    )
    policy, loaded, meta = load_masc(path, "cpu")
    assert policy.observes_mar is True and meta["mar_model"]["width"] == 2
    assert loaded is not None and not loaded.training
    image = torch.rand(2, N_PE, WIDTH, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(image), mar.eval()(image))


def test_registry_factory(checkpoint, monkeypatch):
    with pytest.raises(ValueError, match=r"the masc policy needs a checkpoint \(policy_checkpoint / --checkpoint\)"):
        make_learned_policy()
    policy = make_learned_policy(checkpoint=str(checkpoint), device="cpu", unrelated_option=1)
    assert isinstance(policy, LearnedPolicy)
    monkeypatch.setitem(policies.POLICIES, "masc", make_learned_policy)
    assert isinstance(policies.make_policy("masc", checkpoint=str(checkpoint), device="cpu"), LearnedPolicy)


def test_on_device(checkpoint, device):
    policy = LearnedPolicy.from_checkpoint(checkpoint, device=device)
    assert next(policy.net.parameters()).device.type == device.type
    cpu = LearnedPolicy.from_checkpoint(checkpoint, device="cpu")
    states = _states(6, seed=9)
    assert policy.select_batch(states).tolist() == cpu.select_batch(states).tolist()


def test_error_messages(tmp_path, net):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LearnedPolicy.from_checkpoint(tmp_path / "missing.pt")
    mar = build_mar(MarModelConfig(width=2, depth=2))
    mar_only = save_checkpoint(tmp_path / "mar.pt", {"mar": mar}, {"kind": "mar", "mar_model": {"width": 2, "depth": 2}})
    with pytest.raises(ValueError, match=r"not a masc policy checkpoint \(metadata kind 'mar'"):
        load_masc(mar_only, "cpu")
    no_flag = {k: v for k, v in policy_metadata(net, True).items() if k != "observes_mar"}
    path = save_checkpoint(tmp_path / "no_flag.pt", {"policy": net}, no_flag)
    with pytest.raises(ValueError, match="lacks observes_mar"):
        LearnedPolicy.from_checkpoint(path, "cpu")
    wrong_size = {**policy_metadata(net, True), "n_pe": 20, "height": 20}
    path = save_checkpoint(tmp_path / "wrong.pt", {"policy": net}, wrong_size)
    with pytest.raises(ValueError, match="'policy' weights do not match"):
        LearnedPolicy.from_checkpoint(path, "cpu")
    policy = LearnedPolicy(net, observes_mar=True)
    state = AcquisitionState.initial(N_PE, 2, 4)
    with pytest.raises(ValueError, match="needs state.image"):
        policy.select(state)
    with pytest.raises(ValueError, match=r"trained on \(16, 12\) images"):
        policy.select_batch([AcquisitionState(state.mask, 4, 0, np.ones((N_PE, N_PE)), 2)])
    with pytest.raises(ValueError, match="no steps left"):
        policy.select(AcquisitionState(state.mask, 0, 4, np.ones((N_PE, WIDTH)), 2))
