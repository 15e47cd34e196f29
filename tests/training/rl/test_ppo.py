"""PPO: GAE against hand-computed cases, the clipped loss, action masking, a learning smoke run."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from masc_gadget.config import from_dict, to_dict
from masc_gadget.models.policy_net import (
    PolicyNet,
    PolicyNetConfig,
    masked_distribution,
    masked_logits,
)
from training.rl.ppo import (
    PPOConfig,
    collect_rollout,
    compute_gae,
    greedy_actions,
    make_optimizer,
    ppo_loss,
    ppo_update,
    run_ppo,
)

N_PE = 16
GOOD = (1, 4, 11, 14)  # the hidden "good" lines of the fake environment
INITIAL = (7, 8)
BUDGET = 4
TINY = PolicyNetConfig(channels=(4, 8), hidden=32, pool_size=4)


@dataclass
class Obs:
    image: torch.Tensor  # (B, H, W) float32
    mask: torch.Tensor  # (B, PE) bool
    steps_left: torch.Tensor  # (B,) long


class GoodLinesEnv:
    """B episodes of ``BUDGET`` steps on N_PE lines (INITIAL acquired at the start); reward 1
    for choosing a line of the hidden GOOD set, else 0. Auto-resets finished episodes. Choosing
    an acquired line is an error, so any masking failure shows. The image is the mask's rows
    times a fixed pattern (it carries no extra information)."""

    def __init__(self, num_envs: int = 8) -> None:
        self.num_envs = num_envs
        self.budget = BUDGET
        self.good = torch.zeros(N_PE, dtype=torch.bool)
        self.good[list(GOOD)] = True
        self.pattern = torch.linspace(0.5, 2.0, N_PE)[None, :].expand(N_PE, N_PE)
        self.acquired_choices = 0

    def _fresh(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.zeros(n, N_PE, dtype=torch.bool)
        mask[:, list(INITIAL)] = True
        return mask, torch.full((n,), BUDGET, dtype=torch.long)

    def _obs(self) -> Obs:
        image = 100.0 * self.mask.float()[:, :, None] * self.pattern
        return Obs(image.float(), self.mask.clone(), self.steps_left.clone())

    def reset(self) -> Obs:
        self.mask, self.steps_left = self._fresh(self.num_envs)
        return self._obs()

    def step(self, actions: torch.Tensor):
        rows = torch.arange(self.num_envs)
        if self.mask[rows, actions].any():
            raise ValueError(f"acquired line chosen: {actions.tolist()}")
        reward = self.good[actions].float()
        self.mask[rows, actions] = True
        self.steps_left -= 1
        terminated = self.steps_left == 0
        if terminated.any():
            n = int(terminated.sum())
            self.mask[terminated], self.steps_left[terminated] = self._fresh(n)
        return self._obs(), reward, terminated, {}


def make_net(seed: int = 0, cfg: PolicyNetConfig = TINY) -> PolicyNet:
    return PolicyNet(N_PE, N_PE, N_PE, cfg, generator=torch.Generator().manual_seed(seed))


# --- GAE -----------------------------------------------------------------------------------------


def _gae_case():
    # env 0 terminates after step 1 (its step 2 is the first of a new episode); env 1 runs on
    rewards = torch.tensor([[1.0, 0.5], [2.0, 0.0], [0.5, 1.0]])
    values = torch.tensor([[0.4, 0.1], [0.3, 0.2], [0.6, 0.7]])
    terminated = torch.tensor([[False, False], [True, False], [False, False]])
    last_value = torch.tensor([0.8, 0.9])
    return rewards, values, terminated, last_value


def test_gae_hand_computed_discounted():
    rewards, values, terminated, last_value = _gae_case()
    g, lam = 0.99, 0.95
    gl = g * lam
    # env 0: step 2 bootstraps from last_value; step 1 ends the episode (no bootstrap, no carry)
    d02 = 0.5 + g * 0.8 - 0.6
    d01 = 2.0 - 0.3
    d00 = 1.0 + g * 0.3 - 0.4
    a0 = [d00 + gl * d01, d01, d02]
    # env 1: no termination, plain GAE
    d12 = 1.0 + g * 0.9 - 0.7
    d11 = 0.0 + g * 0.7 - 0.2
    d10 = 0.5 + g * 0.2 - 0.1
    a1 = [d10 + gl * (d11 + gl * d12), d11 + gl * d12, d12]
    expected = torch.tensor([[a0[t], a1[t]] for t in range(3)])
    adv, ret = compute_gae(rewards, values, terminated, last_value, g, lam)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + values)


def test_gae_gamma1_lambda1_returns_are_reward_to_go():
    rewards, values, terminated, last_value = _gae_case()
    _, ret = compute_gae(rewards, values, terminated, last_value, 1.0, 1.0)
    expected = torch.tensor([
        [1.0 + 2.0, 0.5 + 0.0 + 1.0 + 0.9],  # env 0: to the end of its episode; env 1: + bootstrap
        [2.0, 0.0 + 1.0 + 0.9],
        [0.5 + 0.8, 1.0 + 0.9],
    ])
    torch.testing.assert_close(ret, expected)


def test_gae_rejects_bad_shapes():
    rewards, values, terminated, last_value = _gae_case()
    with pytest.raises(ValueError, match="last_value must be"):
        compute_gae(rewards, values, terminated, last_value[:1], 1.0, 1.0)
    with pytest.raises(ValueError, match=r"must all be \(T, B\)"):
        compute_gae(rewards, values[:2], terminated, last_value, 1.0, 1.0)


# --- loss ------------------------------------------------------------------------------------------


def test_ppo_loss_ratio_one():
    logp = torch.log(torch.tensor([0.2, 0.5, 0.3, 0.9]))
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    value = torch.tensor([0.0, 1.0, 2.0, 3.0])
    ret = torch.tensor([1.0, 1.0, 1.0, 1.0])
    entropy = torch.tensor([1.0, 1.2, 0.8, 1.0])
    loss, stats = ppo_loss(logp, logp, adv, value, ret, entropy, 0.2, 0.5, 0.01)
    assert float(stats["losses/policy_loss"]) == pytest.approx(-float(adv.mean()))
    assert float(stats["losses/value_loss"]) == pytest.approx(0.5 * (1 + 0 + 1 + 4) / 4)
    assert float(stats["losses/entropy"]) == pytest.approx(1.0)
    assert float(stats["losses/clipfrac"]) == 0.0
    assert float(stats["losses/approx_kl"]) == 0.0
    assert float(loss) == pytest.approx(-float(adv.mean()) - 0.01 * 1.0 + 0.5 * 0.75)
    assert set(stats) == {"losses/policy_loss", "losses/value_loss", "losses/entropy",
                          "losses/approx_kl", "losses/clipfrac"}


def test_ppo_loss_clips_large_ratio_with_positive_advantage():
    old = torch.zeros(2)
    new = torch.tensor([math.log(1.5), math.log(1.1)], requires_grad=True)  # ratios 1.5, 1.1
    adv = torch.tensor([2.0, 1.0])
    zeros = torch.zeros(2)
    loss, stats = ppo_loss(new, old, adv, zeros, zeros, zeros, 0.2, 0.5, 0.0)
    # the first ratio is clipped to 1.2 (no gradient), the second is inside the range
    assert float(stats["losses/policy_loss"]) == pytest.approx(-(2.0 * 1.2 + 1.0 * 1.1) / 2)
    assert float(stats["losses/clipfrac"]) == pytest.approx(0.5)
    ratio = torch.tensor([1.5, 1.1])
    assert float(stats["losses/approx_kl"]) == pytest.approx(float(((ratio - 1) - ratio.log()).mean()))
    loss.backward()
    assert new.grad[0] == 0.0
    assert new.grad[1] == pytest.approx(-1.0 * 1.1 / 2)


# --- masking ---------------------------------------------------------------------------------------


def test_masked_distribution_zero_probability_on_acquired_lines():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0], [0.0, 0.0, 30.0, 0.0]])
    acquired = torch.tensor([[True, False, True, False], [False, False, True, True]])
    dist = masked_distribution(logits, acquired)
    assert torch.all(dist.probs[acquired] == 0.0)
    torch.testing.assert_close(dist.probs.sum(1), torch.ones(2))
    torch.testing.assert_close(dist.probs[0, [1, 3]], torch.softmax(torch.tensor([1.0, -1.0]), 0))
    entropy = dist.entropy()
    assert torch.isfinite(entropy).all()
    torch.testing.assert_close(entropy[1], torch.tensor(math.log(2.0)))
    logp = dist.log_prob(torch.tensor([0, 2]))
    assert torch.isfinite(logp).all() and torch.all(logp < -1e30)
    assert torch.equal(masked_logits(logits, acquired)[acquired],
                       torch.full((4,), torch.finfo(torch.float32).min))
    with pytest.raises(ValueError, match="shape of the logits"):
        masked_logits(logits, acquired[:, :3])


def test_policy_net_shapes_init_and_config():
    net = make_net()
    image = torch.rand(3, N_PE, N_PE) * 1e4  # any intensity units
    mask = torch.zeros(3, N_PE, dtype=torch.bool)
    logits, value = net(image, mask, torch.tensor([1.0, 0.5, 0.0]))
    assert logits.shape == (3, N_PE) and value.shape == (3,)
    assert logits.abs().max() < 1.0  # actor head std 0.01: a near-uniform initial policy
    # the per-image quantile normalisation makes the output independent of intensity units
    logits2, value2 = net(image * 37.0, mask, torch.tensor([1.0, 0.5, 0.0]))
    torch.testing.assert_close(logits2, logits)
    torch.testing.assert_close(value2, value)
    cfg = PolicyNetConfig()
    assert from_dict(PolicyNetConfig, to_dict(cfg), "policy_net") == cfg
    assert PolicyNetConfig(channels=[8, 16]).channels == (8, 16)
    with pytest.raises(ValueError, match="channels must be"):
        PolicyNetConfig(channels=())
    with pytest.raises(ValueError, match="scale_quantile"):
        PolicyNetConfig(scale_quantile=0.0)
    with pytest.raises(ValueError, match="n_pe must equal the image height"):
        PolicyNet(16, 20, 16, TINY)
    with pytest.raises(ValueError, match="image must be"):
        net(torch.rand(3, N_PE, N_PE + 1), mask, torch.ones(3))


def test_policy_net_init_reproducible_and_global_rng_untouched(global_rng_guard):
    a, b = make_net(3), make_net(3)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(make_net(4).actor.weight, a.actor.weight)
    # re-initialising the built (channels-last) network reproduces the fresh one
    c = make_net(4)
    c.reset_parameters(torch.Generator().manual_seed(3))
    for pa, pc in zip(a.parameters(), c.parameters()):
        assert torch.equal(pa, pc)


def test_update_recomputes_logprob_with_masks():
    """The update's masked recomputation gives the rollout's own log-probs (ratio 1 on the
    first minibatch) and a finite entropy, although most lines are acquired."""
    env = GoodLinesEnv(4)
    net = make_net()
    rollout = collect_rollout(env, net, 8, torch.Generator().manual_seed(0))
    b_images, b_masks = rollout.images.flatten(0, 1), rollout.masks.flatten(0, 1)
    frac = rollout.steps_left.flatten(0, 1).float() / rollout.budget
    with torch.no_grad():
        logits, _ = net(b_images, b_masks, frac)
    dist = masked_distribution(logits, b_masks)
    torch.testing.assert_close(dist.log_prob(rollout.actions.flatten()), rollout.logprobs.flatten())
    assert torch.isfinite(dist.entropy()).all()
    initial_line = torch.full_like(rollout.actions.flatten(), INITIAL[0])  # always acquired
    assert torch.all(dist.log_prob(initial_line) < -1e30)
    cfg = PPOConfig(rollout_steps=32, epochs=1, minibatch_size=32, lr=1e-3)
    stats = ppo_update(net, make_optimizer(net, cfg), rollout, cfg, torch.Generator().manual_seed(1))
    assert stats["losses/approx_kl"] == pytest.approx(0.0, abs=1e-6)  # one minibatch: ratio 1
    assert stats["losses/clipfrac"] == 0.0
    assert all(math.isfinite(v) for v in stats.values())


# --- rollouts and learning -------------------------------------------------------------------------


def test_collect_rollout_never_samples_acquired_lines(global_rng_guard):
    env = GoodLinesEnv(8)
    net = make_net()
    with torch.no_grad():  # the network strongly prefers the (always acquired) initial lines
        net.actor.bias[list(INITIAL)] = 50.0
    gen = torch.Generator().manual_seed(0)
    rollout = collect_rollout(env, net, 24, gen)  # the env also raises on an acquired line
    chosen_was_acquired = rollout.masks.gather(2, rollout.actions.unsqueeze(2)).squeeze(2)
    assert not chosen_was_acquired.any()
    assert rollout.images.shape == (24, 8, N_PE, N_PE)
    assert rollout.masks.shape == (24, 8, N_PE) and rollout.masks.dtype == torch.bool
    assert rollout.terminated.sum() == 24 * 8 // BUDGET  # every 4th step of every env
    assert rollout.episode_returns.shape == (24 * 8 // BUDGET,)
    assert torch.all(rollout.episode_lengths == BUDGET)
    assert torch.all(rollout.logprobs > -1e30)
    # continuing from the cursor: the episodes go on where they stopped
    more = collect_rollout(env, net, 2, gen, rollout.cursor)
    assert torch.equal(more.masks[0], rollout.cursor.obs.mask)


def test_rollout_and_update_on_device(device):
    """The network on ``device`` (CUDA when present) with CPU-side env and generator."""
    env = GoodLinesEnv(4)
    net = make_net().to(device)
    gen = torch.Generator().manual_seed(0)
    rollout = collect_rollout(env, net, 8, gen)
    assert rollout.images.device.type == device.type
    cfg = PPOConfig(rollout_steps=32, minibatch_size=16, epochs=2)
    stats = ppo_update(net, make_optimizer(net, cfg), rollout, cfg, gen)
    assert all(math.isfinite(v) for v in stats.values())
    assert greedy_actions(net, env.reset(), BUDGET).device.type == device.type


def test_greedy_actions_pick_free_argmax():
    net = make_net()
    with torch.no_grad():
        net.actor.bias.copy_(torch.arange(N_PE, dtype=torch.float32) * 10.0)  # prefers high lines
    env = GoodLinesEnv(2)
    obs = env.reset()
    obs.mask[0, N_PE - 1] = True
    assert greedy_actions(net, obs, BUDGET).tolist() == [N_PE - 2, N_PE - 1]


def _train(seed: int, iterations: int):
    env = GoodLinesEnv(8)
    net = make_net(seed)
    cfg = PPOConfig(rollout_steps=64, lr=3e-3, minibatch_size=32, epochs=4, gamma=1.0, gae_lambda=0.95)
    history = run_ppo(env, net, cfg, make_optimizer(net, cfg), torch.Generator().manual_seed(seed), iterations)
    return net, history


def test_ppo_learns_fake_env(global_rng_guard, one_thread):
    """12 rollouts of 64 transitions (768 steps, ~1 s on one CPU thread)."""
    net, history = _train(0, 12)
    random_return = BUDGET * len(GOOD) / (N_PE - len(INITIAL))  # 1.14 expected good lines
    first = history[0]["charts/episodic_return"]
    last = sum(h["charts/episodic_return"] for h in history[-3:]) / 3
    assert first < 2.0
    assert last > random_return + 1.5, [h["charts/episodic_return"] for h in history]
    env = GoodLinesEnv(4)
    obs = env.reset()
    total = torch.zeros(4)
    for _ in range(BUDGET):  # the greedy policy picks the good lines
        obs, reward, _, _ = env.step(greedy_actions(net, obs, BUDGET))
        total += reward
    assert total.min() >= 3.0
    assert all(k in history[-1] for k in ("losses/approx_kl", "losses/clipfrac",
                                          "charts/explained_variance", "charts/episodic_return"))


def test_ppo_deterministic_with_same_seed(one_thread):
    net_a, hist_a = _train(5, 2)
    net_b, hist_b = _train(5, 2)
    assert hist_a == hist_b
    for pa, pb in zip(net_a.parameters(), net_b.parameters()):
        assert torch.equal(pa, pb)
    _, hist_c = _train(6, 2)
    assert hist_c != hist_a


def test_ppo_config_validation():
    assert PPOConfig().steps_per_env(8) == 64
    with pytest.raises(ValueError, match="multiple of the number of environments"):
        PPOConfig().steps_per_env(3)
    with pytest.raises(ValueError, match="clip must be > 0"):
        PPOConfig(clip=0.0)
    with pytest.raises(ValueError, match="gamma must be in"):
        PPOConfig(gamma=1.5)
    cfg = PPOConfig()
    assert from_dict(PPOConfig, to_dict(cfg), "ppo") == cfg
    assert (cfg.lr, cfg.rollout_steps, cfg.epochs, cfg.clip, cfg.ent_coef) == (3e-4, 512, 4, 0.2, 0.01)
