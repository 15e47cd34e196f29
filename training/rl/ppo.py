"""PPO with invalid-action masking for the acquisition policy, written like CleanRL's ``ppo.py``
but as importable functions: :func:`collect_rollout` -> :func:`compute_gae` -> :func:`ppo_update`
(minibatch epochs over :func:`ppo_loss`), chained by :func:`ppo_rounds`, one rollout and update
after another: :func:`run_ppo` runs them with an ``on_rollout`` hook (the benchmark), co-adaptive
training takes one round per period of the shared trainer loop (:mod:`training.run`).

Paper ("Training Configuration"): Adam, learning rate 3e-4, rollouts of 512 steps, 4 epochs per
update, clip range 0.2, entropy coefficient 0.01, GAE (Schulman et al. 2016).

The environment is batched (B episodes in lockstep, see :class:`BatchedEnv`) and resets
finished episodes itself. Acquired lines are masked out of the policy with
:func:`~masc_gadget.models.policy_net.masked_distribution`, both when sampling and when the
update recomputes log-probabilities, so the ratio compares the same masked distributions.

Randomness is explicit: sampling and minibatch shuffling draw only from the ``torch.Generator``
passed in; the global RNGs are never used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from masc_gadget.models.policy_net import PolicyNet, blocked, masked_distribution, masked_logits
from training.distributed import Dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PPOConfig:
    """PPO hyper-parameters (config section ``ppo``); defaults from the paper where it gives them,
    else CleanRL's."""

    lr: float = 3e-4
    """Adam learning rate of the policy (paper: 3e-4)."""
    rollout_steps: int = 512
    """Transitions per rollout, all environments together (paper: 512); a multiple of the number
    of environments, each of which steps ``rollout_steps / num_envs`` times."""
    epochs: int = 4
    """Optimisation epochs over each rollout (paper: 4)."""
    minibatch_size: int = 64
    """Transitions per gradient step."""
    clip: float = 0.2
    """Clip range of the probability ratio (paper: 0.2)."""
    ent_coef: float = 0.01
    """Weight of the entropy bonus (paper: 0.01)."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    gamma: float = 1.0
    """Discount. Episodes are finite (``budget`` steps, then the episode terminates), so the
    undiscounted return, the total image improvement of the episode, is well defined; 1.0
    optimises it exactly."""
    gae_lambda: float = 0.95
    """GAE lambda: 1 gives Monte-Carlo returns, 0 one-step TD."""
    max_grad_norm: float = 0.5
    """Global gradient norm clip."""
    norm_adv: bool = True
    """Normalise advantages per minibatch (zero mean, unit std)."""
    target_kl: float = 0.0
    """Stop the epochs of an update early once the approximate KL exceeds this (0 = off)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        for name in ("rollout_steps", "epochs", "minibatch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.clip > 0:
            raise ValueError(f"clip must be > 0, got {self.clip}")
        for name in ("ent_coef", "vf_coef", "target_kl"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("gamma", "gae_lambda"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")

    def steps_per_env(self, num_envs: int) -> int:
        """Steps of each environment per rollout: ``rollout_steps / num_envs``."""
        if num_envs < 1 or self.rollout_steps % num_envs:
            raise ValueError(
                f"rollout_steps ({self.rollout_steps}) must be a multiple of the number of "
                f"environments ({num_envs})"
            )
        return self.rollout_steps // num_envs


class ObservationLike(Protocol):
    """What a batched environment shows the agent (the interface of ``training.rl.env.Observation``)."""

    image: torch.Tensor  # (B, H, W) float32 current image
    mask: torch.Tensor  # (B, n_pe) bool, True = acquired
    steps_left: torch.Tensor  # (B,) long, lines the agent may still choose
    # with corruption also ``repeatable`` (B, n_pe) bool: flagged lines that may be acquired again


class BatchedEnv(Protocol):
    """B acquisition episodes in lockstep (``training.rl.env``). ``step`` resets the episodes that
    terminate, so the observation it returns for them is the first of a new episode."""

    budget: int

    def reset(self) -> ObservationLike: ...

    def step(
        self, actions: torch.Tensor
    ) -> tuple[ObservationLike, torch.Tensor, torch.Tensor, dict[str, Any]]: ...


@dataclass
class Cursor:
    """Where the environments are between two rollouts: the next observation and the running
    return and length of each unfinished episode (so episodes may span rollouts)."""

    obs: ObservationLike
    episode_return: torch.Tensor  # (B,) float32
    episode_length: torch.Tensor  # (B,) long


@dataclass
class Rollout:
    """T steps of B environments (CleanRL's storage tensors), on the network's device."""

    images: torch.Tensor  # (T, B, H, W) float32 observed images
    masks: torch.Tensor  # (T, B, n_pe) bool acquired lines when the action was chosen
    steps_left: torch.Tensor  # (T, B) long
    actions: torch.Tensor  # (T, B) long chosen lines, or (T, B, k) trains (-1 padded) with echo trains
    logprobs: torch.Tensor  # (T, B) log-probability of the action under the sampling policy
    values: torch.Tensor  # (T, B) critic values
    rewards: torch.Tensor  # (T, B) float32
    terminated: torch.Tensor  # (T, B) bool: the episode ended after step t
    last_value: torch.Tensor  # (B,) value of the observation after the last step
    budget: int
    """Steps per episode; steps_left / budget is the network's steps-left input."""
    episode_returns: torch.Tensor  # (n_finished,) returns of the episodes finished in the rollout
    episode_lengths: torch.Tensor  # (n_finished,) their lengths
    cursor: Cursor
    """Pass to the next :func:`collect_rollout` to continue where this one stopped."""
    repeatable: torch.Tensor | None = None
    """(T, B, n_pe) bool flagged lines that could be acquired again (environments with
    corruption), else None."""

    @property
    def num_envs(self) -> int:
        return self.actions.shape[1]


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    terminated: torch.Tensor,
    last_value: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016).

    rewards, values: (T, B); terminated: (T, B) bool, True when the episode ended *after* step t
    (the environment then resets, so step t + 1 belongs to a new episode and nothing is
    bootstrapped across); last_value: (B,) value of the observation after step T - 1.

        delta_t = r_t + gamma * V_{t+1} * (1 - term_t) - V_t
        A_t     = delta_t + gamma * lam * (1 - term_t) * A_{t+1}

    Returns (advantages (T, B), returns = advantages + values (T, B)), the critic's targets.
    """
    if not (rewards.shape == values.shape == terminated.shape) or rewards.dim() != 2:
        raise ValueError(
            "rewards, values and terminated must all be (T, B), got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(terminated.shape)}"
        )
    if tuple(last_value.shape) != (rewards.shape[1],):
        raise ValueError(f"last_value must be (B,) = ({rewards.shape[1]},), got {tuple(last_value.shape)}")
    advantages = torch.zeros_like(values)
    nonterminal = 1.0 - terminated.to(values.dtype)
    last_gae = torch.zeros_like(last_value)
    next_value = last_value
    for t in reversed(range(rewards.shape[0])):
        delta = rewards[t] + gamma * next_value * nonterminal[t] - values[t]
        last_gae = delta + gamma * lam * nonterminal[t] * last_gae
        advantages[t] = last_gae
        next_value = values[t]
    return advantages, advantages + values


def ppo_loss(
    new_logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    new_value: torch.Tensor,
    returns: torch.Tensor,
    entropy: torch.Tensor,
    clip: float,
    vf_coef: float,
    ent_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO clipped objective, CleanRL's form (all inputs (N,); advantages already
    normalised if wanted):

        ratio = exp(new_logprob - old_logprob)
        policy_loss = mean(max(-A ratio, -A clamp(ratio, 1 - clip, 1 + clip)))
        value_loss  = 0.5 mean((V - returns)^2)
        loss = policy_loss - ent_coef mean(entropy) + vf_coef value_loss

    Returns (loss, stats): detached scalars ``losses/policy_loss``, ``losses/value_loss``,
    ``losses/entropy``, ``losses/approx_kl`` (mean of (ratio - 1) - log ratio, Schulman's
    low-variance estimator of KL(old || new)) and ``losses/clipfrac`` (fraction of ratios
    outside [1 - clip, 1 + clip]).
    """
    log_ratio = new_logprob - old_logprob
    ratio = log_ratio.exp()
    policy_loss = torch.max(
        -advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    ).mean()
    value_loss = 0.5 * (new_value - returns).pow(2).mean()
    entropy_mean = entropy.mean()
    loss = policy_loss - ent_coef * entropy_mean + vf_coef * value_loss
    with torch.no_grad():
        stats = {
            "losses/policy_loss": policy_loss.detach(),
            "losses/value_loss": value_loss.detach(),
            "losses/entropy": entropy_mean.detach(),
            "losses/approx_kl": ((ratio - 1.0) - log_ratio).mean(),
            "losses/clipfrac": ((ratio - 1.0).abs() > clip).float().mean(),
        }
    return loss, stats


def start(env: BatchedEnv, device: torch.device | str = "cpu") -> Cursor:
    """Reset the environment: a :class:`Cursor` at the first step of B new episodes."""
    obs = env.reset()
    b = obs.mask.shape[0]
    return Cursor(obs, torch.zeros(b, device=device), torch.zeros(b, dtype=torch.long, device=device))


def _forward(net: nn.Module, image: torch.Tensor, mask: torch.Tensor, frac: torch.Tensor,
             repeatable: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The network's (logits, value), with the flagged lines when the environment has them."""
    if repeatable is None:
        return net(image, mask, frac)
    return net(image, mask, frac, repeatable)


def _device(net: nn.Module) -> torch.device:
    return next(net.parameters()).device


def train_sizes(steps_left: torch.Tensor, k: int) -> torch.Tensor:
    """(B,) lines in each episode's next train: ``min(k, steps_left)``."""
    return steps_left.clamp(max=k)


def sample_trains(masked: torch.Tensor, sizes: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """(B, k) long: ``sizes[i]`` lines drawn without replacement from the masked logits
    ``masked`` (B, n_pe) in draw order (Gumbel top-k: a Plackett-Luce sample), -1 beyond; the
    noise is drawn with ``generator`` on its device."""
    u = torch.rand(masked.shape, generator=generator, device=generator.device).to(masked.device)
    gumbel = -torch.log(-torch.log(u.clamp(1e-10, 1 - 1e-7)))
    order = (masked + gumbel).topk(k, dim=1).indices
    keep = torch.arange(k, device=masked.device)[None] < sizes[:, None]
    return torch.where(keep, order, torch.full_like(order, -1))


def train_log_prob(logits: torch.Tensor, acquired: torch.Tensor, trains: torch.Tensor) -> torch.Tensor:
    """(B,) log-probability of drawing the trains (B, k) (-1 padded) in their order without
    replacement from the policy over the free lines of ``acquired``: the sum over the train of
    ``log softmax`` of each pick among the lines still free (Plackett-Luce)."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    total = torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device)
    taken = acquired.bool()
    for j in range(trains.shape[1]):
        line = trains[:, j]
        valid = line >= 0
        logp = torch.log_softmax(masked_logits(logits, taken), dim=1)[rows, line.clamp(min=0)]
        total = total + torch.where(valid, logp, torch.zeros_like(logp))
        taken = taken.clone()
        taken[rows[valid], line[valid]] = True
    return total


def _sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(B, n) probabilities -> (B,) long indices, drawn on the generator's device."""
    on = probs.to(generator.device)
    return torch.multinomial(on, 1, generator=generator).squeeze(1).to(probs.device)


@torch.no_grad()
def collect_rollout(
    env: BatchedEnv,
    net: PolicyNet,
    n_steps_per_env: int,
    generator: torch.Generator,
    cursor: Cursor | None = None,
) -> Rollout:
    """Run the sampling policy for ``n_steps_per_env`` steps of every environment.

    Actions are drawn from :func:`masked_distribution` with ``torch.multinomial(...,
    generator=generator)`` (on the generator's device), so an acquired line is never chosen.
    The network sees ``steps_left / env.budget``. ``cursor``: where the previous rollout
    stopped (``rollout.cursor``); None resets the environment.
    """
    if n_steps_per_env < 1:
        raise ValueError(f"n_steps_per_env must be >= 1, got {n_steps_per_env}")
    budget = int(env.budget)
    k = int(getattr(env, "lines_per_decision", 1))
    device = _device(net)
    if cursor is None:
        cursor = start(env, device)
    obs, ep_return, ep_length = cursor.obs, cursor.episode_return.clone(), cursor.episode_length.clone()
    buf = _buffers(n_steps_per_env, obs, k, device)
    finished_returns, finished_lengths = [], []

    for t in range(n_steps_per_env):
        action = _act(net, obs, buf, t, budget, k, generator, device)
        obs, reward, term, _info = env.step(action.to(obs.mask.device))
        buf.rewards[t] = reward.to(device)
        buf.terminated[t] = term.to(device)
        ep_return += buf.rewards[t]
        ep_length += 1
        if buf.terminated[t].any():
            finished_returns.append(ep_return[buf.terminated[t]])
            finished_lengths.append(ep_length[buf.terminated[t]])
            ep_return = ep_return.masked_fill(buf.terminated[t], 0.0)
            ep_length = ep_length.masked_fill(buf.terminated[t], 0)

    rep = getattr(obs, "repeatable", None)
    _, last_value = _forward(net, obs.image.to(device), obs.mask.to(device),
                             obs.steps_left.to(device).float() / budget, None if rep is None else rep.to(device))
    empty = torch.zeros(0, device=device)
    return Rollout(
        images=buf.images, masks=buf.masks, steps_left=buf.steps_left, actions=buf.actions, logprobs=buf.logprobs,
        values=buf.values, rewards=buf.rewards, terminated=buf.terminated, last_value=last_value, budget=budget,
        episode_returns=torch.cat(finished_returns) if finished_returns else empty,
        episode_lengths=torch.cat(finished_lengths) if finished_lengths else empty.long(),
        cursor=Cursor(obs, ep_return, ep_length), repeatable=buf.repeats,
    )


class _Buffers(NamedTuple):
    """A rollout's (T, B, ...) tensors, filled step by step by :func:`collect_rollout`."""

    images: torch.Tensor
    masks: torch.Tensor
    steps_left: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor
    terminated: torch.Tensor
    repeats: torch.Tensor | None


def _buffers(steps: int, obs: Any, k: int, device: torch.device) -> _Buffers:
    """Zeroed buffers for ``steps`` steps of the batch ``obs`` comes from (``k`` lines a step)."""
    b, n_pe = obs.mask.shape
    h, w = obs.image.shape[1:]
    return _Buffers(
        images=torch.zeros((steps, b, h, w), dtype=torch.float32, device=device),
        masks=torch.zeros((steps, b, n_pe), dtype=torch.bool, device=device),
        steps_left=torch.zeros((steps, b), dtype=torch.long, device=device),
        actions=torch.zeros((steps, b) if k == 1 else (steps, b, k), dtype=torch.long, device=device),
        logprobs=torch.zeros((steps, b), device=device),
        values=torch.zeros((steps, b), device=device),
        rewards=torch.zeros((steps, b), device=device),
        terminated=torch.zeros((steps, b), dtype=torch.bool, device=device),
        repeats=(torch.zeros((steps, b, n_pe), dtype=torch.bool, device=device)
                 if getattr(obs, "repeatable", None) is not None else None),
    )


def _act(net: PolicyNet, obs: Any, buf: _Buffers, t: int, budget: int, k: int, generator: torch.Generator,
         device: torch.device) -> torch.Tensor:
    """Step ``t``: store the observation, sample the action (a line, or an echo train of ``k``
    lines without replacement from one forward pass) with its log-probability and value."""
    buf.images[t] = obs.image.to(device)
    buf.masks[t] = obs.mask.to(device)
    buf.steps_left[t] = obs.steps_left.to(device)
    rep = None
    if buf.repeats is not None:
        buf.repeats[t] = obs.repeatable.to(device)
        rep = buf.repeats[t]
    logits, value = _forward(net, buf.images[t], buf.masks[t], buf.steps_left[t].float() / budget, rep)
    policy = masked_distribution(logits, blocked(buf.masks[t], rep))
    if k == 1:
        action = _sample(policy.probs, generator)
        logprob = policy.log_prob(action)
    else:
        action = sample_trains(policy.logits, train_sizes(buf.steps_left[t], k), k, generator)
        logprob = train_log_prob(logits, buf.masks[t], action)
    buf.actions[t], buf.logprobs[t], buf.values[t] = action, logprob, value
    return action


def explained_variance(predicted: torch.Tensor, target: torch.Tensor) -> float:
    """1 - Var(target - predicted) / Var(target); NaN when the target is constant."""
    var_y = target.var()
    if var_y == 0:
        return float("nan")
    return float(1.0 - (target - predicted).var() / var_y)


def ppo_update(
    net: PolicyNet,
    optimizer: torch.optim.Optimizer,
    rollout: Rollout,
    cfg: PPOConfig,
    generator: torch.Generator,
    dist: Dist = Dist(),
) -> dict[str, float]:
    """One PPO update on a rollout: GAE -> flatten -> ``cfg.epochs`` epochs of shuffled
    minibatches (permutations from ``generator``). Each minibatch recomputes the logits of the
    stored observations and masks them with the *same* acquired masks, giving new
    log-probabilities and entropies -> :func:`ppo_loss` -> backward -> gradient norm clip ->
    optimizer step. Stops early when ``cfg.target_kl > 0`` and an epoch's approximate KL
    exceeds it.

    Returns the mean of each loss statistic over the minibatches, plus
    ``charts/explained_variance`` (of the returns by the rollout's values), ``charts/epochs``
    (epochs run) and ``charts/grad_norm`` (mean norm before clipping).

    Under ``torchrun`` (``dist``) every rank updates on its own rollout and the gradients of
    each minibatch are averaged over the ranks before the step; the early stop on the KL uses
    its mean over the ranks, so they all run the same epochs.
    """
    batch = _flat_batch(rollout, cfg)
    batch_size = batch.actions.shape[0]
    minibatch_size = min(cfg.minibatch_size, batch_size)
    device = batch.actions.device

    net.train()
    sums: dict[str, torch.Tensor] = {}
    grad_norms = []
    n_minibatches = epochs_run = 0
    for _epoch in range(cfg.epochs):
        order = torch.randperm(batch_size, generator=generator, device=generator.device).to(device)
        epoch_kl = []
        for start in range(0, batch_size, minibatch_size):
            stats, grad_norm = _minibatch_step(net, optimizer, batch, order[start : start + minibatch_size], cfg, dist)
            grad_norms.append(grad_norm)
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value
            epoch_kl.append(stats["losses/approx_kl"])
            n_minibatches += 1
        epochs_run += 1
        if cfg.target_kl > 0 and dist.mean(float(torch.stack(epoch_kl).mean())) > cfg.target_kl:
            break

    out = {key: float(value) / n_minibatches for key, value in sums.items()}
    out["charts/explained_variance"] = explained_variance(rollout.values.flatten(), batch.returns)
    out["charts/epochs"] = float(epochs_run)
    out["charts/grad_norm"] = float(torch.stack(grad_norms).mean())
    return out

class _Batch(NamedTuple):
    """A rollout's (T, B) steps flattened to N, with their advantages and returns."""

    images: torch.Tensor
    masks: torch.Tensor
    repeats: torch.Tensor | None
    frac: torch.Tensor
    actions: torch.Tensor
    """(N,) lines, or (N, k) trains."""
    logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


def _flat_batch(rollout: Rollout, cfg: PPOConfig) -> _Batch:
    """GAE over ``rollout`` and its steps flattened (:class:`_Batch`)."""
    advantages, returns = compute_gae(
        rollout.rewards, rollout.values, rollout.terminated, rollout.last_value,
        cfg.gamma, cfg.gae_lambda,
    )
    return _Batch(
        images=rollout.images.flatten(0, 1),
        masks=rollout.masks.flatten(0, 1),
        repeats=None if rollout.repeatable is None else rollout.repeatable.flatten(0, 1),
        frac=rollout.steps_left.flatten(0, 1).float() / rollout.budget,
        actions=rollout.actions.flatten(0, 1),
        logprobs=rollout.logprobs.flatten(0, 1),
        advantages=advantages.flatten(0, 1),
        returns=returns.flatten(0, 1),
    )


def _minibatch_step(net: PolicyNet, optimizer: torch.optim.Optimizer, batch: _Batch, idx: torch.Tensor,
                    cfg: PPOConfig, dist: Dist) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One minibatch ``idx`` of :func:`ppo_update`: the logits of the stored observations masked
    with the same acquired masks -> :func:`ppo_loss` -> backward -> gradients averaged over the
    ranks -> norm clip -> step. Returns (the loss statistics, the gradient norm before clipping)."""
    rep = None if batch.repeats is None else batch.repeats[idx]
    logits, new_value = _forward(net, batch.images[idx], batch.masks[idx], batch.frac[idx], rep)
    policy = masked_distribution(logits, blocked(batch.masks[idx], rep))
    mb_adv = batch.advantages[idx]
    if cfg.norm_adv and mb_adv.numel() > 1:
        mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
    new_logprob = (policy.log_prob(batch.actions[idx]) if batch.actions.dim() == 1
                   else train_log_prob(logits, batch.masks[idx], batch.actions[idx]))
    loss, stats = ppo_loss(
        new_logprob, batch.logprobs[idx], mb_adv, new_value,
        batch.returns[idx], policy.entropy(), cfg.clip, cfg.vf_coef, cfg.ent_coef,
    )
    optimizer.zero_grad()
    loss.backward()
    dist.average_gradients(net)
    grad_norm = nn.utils.clip_grad_norm_(net.parameters(), cfg.max_grad_norm)
    optimizer.step()
    return stats, grad_norm



@torch.no_grad()
def greedy_actions(net: PolicyNet, obs: ObservationLike, budget: int, k: int = 1) -> torch.Tensor:
    """(B,) long: the most probable free line of each observation (argmax of the masked
    logits, no sampling; ties go to the lowest line). ``k`` > 1: (B, k) trains, the top
    ``min(k, lines left)`` free lines, -1 beyond."""
    device = _device(net)
    mask = obs.mask.to(device)
    rep = getattr(obs, "repeatable", None)
    rep = None if rep is None else rep.to(device)
    logits, _ = _forward(net, obs.image.to(device), mask, obs.steps_left.to(device).float() / budget, rep)
    masked = masked_logits(logits, blocked(mask, rep))
    if k == 1:
        return masked.argmax(dim=1)
    order = masked.topk(k, dim=1).indices
    keep = torch.arange(k, device=device)[None] < train_sizes(obs.steps_left.to(device), k)[:, None]
    return torch.where(keep, order, torch.full_like(order, -1))


def make_optimizer(net: nn.Module, cfg: PPOConfig) -> torch.optim.Adam:
    """Adam over the network's parameters, ``lr = cfg.lr``, ``eps = 1e-5`` (CleanRL)."""
    return torch.optim.Adam(net.parameters(), lr=cfg.lr, eps=1e-5)


RolloutHook = Callable[[int, Rollout, dict[str, float]], None]
"""``on_rollout(iteration, rollout, stats)`` of :func:`run_ppo`."""


def _mean_or_nan(values: torch.Tensor) -> float:
    return float(values.float().mean()) if values.numel() else float("nan")


def run_ppo(
    env: BatchedEnv,
    net: PolicyNet,
    cfg: PPOConfig,
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
    iterations: int,
    *,
    on_rollout: RolloutHook | None = None,
    start_iteration: int = 1,
    dist: Dist = Dist(),
) -> list[dict[str, float]]:
    """The PPO loop (CleanRL's main loop): ``iterations`` rounds of

        rollout  :func:`collect_rollout`, ``cfg.rollout_steps`` transitions of all environments
        update   :func:`ppo_update`: GAE, then ``cfg.epochs`` epochs of shuffled minibatches

    starting with a reset of ``env``; each rollout continues the episodes where the previous one
    stopped (``rollout.cursor``). Sampling and minibatch shuffling draw only from ``generator``.

    ``on_rollout(iteration, rollout, stats)`` runs after each update, iteration counting from
    ``start_iteration`` (a resumed run passes where it stopped + 1): logging, checkpoints,
    validation, or work of its own between two rollouts. It
    may add entries to ``stats``, and may replace ``rollout.cursor.obs`` when it changed what the
    environment shows (the next rollout starts from ``rollout.cursor``).

    Returns one stats dict per iteration (the same dicts the hook saw): the update's
    ``losses/...`` and ``charts/...`` plus ``charts/episodic_return``, the mean return of the
    episodes that finished in the rollout (NaN when none did).
    """
    if iterations < 0:
        raise ValueError(f"iterations must be >= 0, got {iterations}")
    history: list[dict[str, float]] = []
    rounds = ppo_rounds(env, net, cfg, optimizer, generator, dist)
    for iteration in range(start_iteration, start_iteration + iterations):
        rollout, stats = next(rounds)
        if on_rollout is not None:
            on_rollout(iteration, rollout, stats)
        history.append(stats)
    return history


def ppo_rounds(env: BatchedEnv, net: PolicyNet, cfg: PPOConfig, optimizer: torch.optim.Optimizer,
               generator: torch.Generator, dist: Dist = Dist()) -> Iterator[tuple[Rollout, dict[str, float]]]:
    """PPO's rounds, one per ``next``: a rollout (:func:`collect_rollout`, ``cfg.rollout_steps``
    transitions of all environments) and its update (:func:`ppo_update`), yielded with the
    update's stats and ``charts/episodic_return`` (the mean return of the episodes that finished
    in the rollout, NaN when none did). ``env`` is reset at the first round; each round continues
    the episodes from the previous one's ``rollout.cursor``, which the caller may update between
    two rounds (when it changed what the environment shows)."""
    cursor = start(env, _device(net))
    n_steps = cfg.steps_per_env(cursor.obs.mask.shape[0])
    while True:
        net.eval()
        rollout = collect_rollout(env, net, n_steps, generator, cursor)
        stats = ppo_update(net, optimizer, rollout, cfg, generator, dist)
        stats["charts/episodic_return"] = _mean_or_nan(rollout.episode_returns)
        yield rollout, stats
        cursor = rollout.cursor
