"""``masc bench env``: acquisition-environment steps per second, batched (:func:`bench_env`: one
:class:`~training.rl.env.BatchedAcquisitionEnv` stepping ``n_envs`` slices together) against one
slice at a time (a one-env batched env and the Gymnasium env), and end-to-end PPO training
throughput (:func:`bench_ppo`: our batched PPO, :func:`~training.rl.ppo.run_ppo`, against
sb3-contrib's MaskablePPO on the Gymnasium env, :mod:`training.bench.sb3`, the optional ``bench``
extra). :func:`format_env_table` prints the results.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
from torch import nn

from masc_gadget.acquisition.episode import AcquisitionConfig
from masc_gadget.core.seeding import isolated_rng
from masc_gadget.device import resolve_device
from masc_gadget.models.policy_net import PolicyNet, PolicyNetConfig
from masc_gadget.models.unet import MarModelConfig, MarNet, build_mar
from training.bench.common import device_sync, steps_per_s
from training.bench.names import SB3_HINT, SB3_POLICIES
from training.bench.sb3 import time_sb3, sb3_available
from training.data import SliceSet
from training.rl.env import BatchedAcquisitionEnv, EnvConfig
from training.rl.ppo import PPOConfig, make_optimizer, run_ppo

log = logging.getLogger("masc.bench")

ENV_KEYS = (
    "device",  # e.g. "cpu", "cuda:0"
    "n_envs",  # B, slices stepped together by the batched env
    "steps_per_env",  # timed steps of each of the B envs
    "total_steps",  # n_envs * steps_per_env: environment steps of every timed loop
    "warmup_steps",  # untimed steps per env before each timed loop
    "initial",  # centre lines acquired at the start of an episode
    "budget",  # lines chosen per episode (episode length)
    "n_pe",  # PE lines (actions)
    "image_shape",  # [H, W]
    "n_slices",  # slices the episodes are drawn from
    "mar_width",  # width of the MAR network; 0 = none, None = not a MarNet
    "mar_params",  # its number of parameters (0 without)
    "batched_s",  # seconds of the timed loop: B envs together, steps_per_env batched steps
    "batched_steps_per_s",  # total_steps / batched_s
    "single_s",  # one-env BatchedAcquisitionEnv stepped total_steps times
    "single_steps_per_s",
    "gym_s",  # the Gymnasium ActiveAcquisitionEnv stepped total_steps times
    "gym_steps_per_s",
    "speedup",  # batched_steps_per_s / single_steps_per_s
    "speedup_vs_gym",  # batched_steps_per_s / gym_steps_per_s
)

PPO_KEYS = (
    "device",
    "n_envs",  # environments of our batched PPO (sb3 steps one Gymnasium env)
    "total_steps",  # environment steps of each training run (a multiple of rollout_steps)
    "rollout_steps",  # transitions per rollout (both)
    "minibatch_size",  # both
    "epochs",  # both
    "mar_width",
    "ours_s",  # seconds of run_ppo (collect_rollout + ppo_update) over total_steps
    "ours_steps_per_s",  # total_steps / ours_s
    "ours_policy_params",  # PolicyNet parameters
    "sb3_status",  # "ok", or "skipped: ..." when not asked for or sb3-contrib is missing
    "sb3_version",  # sb3-contrib version, None when skipped
    "sb3_s",  # seconds of MaskablePPO.learn(total_steps)
    "sb3_steps_per_s",
    "sb3_policy_params",  # MultiInputPolicy parameters
    "sb3_policy",  # "mlp": sb3's default MLP over the flattened observation; "ours": our PolicyNet
    "speedup",  # ours_steps_per_s / sb3_steps_per_s; None when skipped
)


def seeded_mar(width: int, cfg: MarModelConfig | None = None, seed: int = 0,
               device: str | torch.device = "cpu") -> MarNet | None:
    """The MAR network both sides of a comparison share: ``cfg`` (depth, scale quantile) at
    ``width`` with seeded weights, in eval mode on ``device``; None when ``width`` is 0.
    Leaves the global RNG state alone."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"MAR width must be an integer >= 0 (0 = no MAR network), got {width!r}")
    if width == 0:
        return None
    cfg = dataclasses.replace(cfg or MarModelConfig(), width=width)
    with isolated_rng(seed):
        mar = build_mar(cfg)
    return mar.to(resolve_device(device)).eval()


def _mar_width(mar: nn.Module | None) -> int | None:
    """0 without a MAR network, its ``config.width`` (a :class:`MarNet`), else None (unknown)."""
    if mar is None:
        return 0
    width = getattr(getattr(mar, "config", None), "width", None)
    return None if width is None else int(width)


def _random_free_lines(mask: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """mask: (B, PE) bool, True = acquired -> (B,) long: argmax of uniform random scores over
    the free lines (a uniformly random free line). Scores are drawn on the generator's device."""
    scores = torch.rand(mask.shape, generator=generator, device=generator.device).to(mask.device)
    return scores.masked_fill(mask, -1.0).argmax(dim=1)


def _time_batched(env: BatchedAcquisitionEnv, steps: int, warmup: int,
                  generator: torch.Generator) -> float:
    """Seconds of ``steps`` random valid steps of every env (after ``warmup`` untimed ones)."""
    obs = env.reset()
    for _ in range(warmup):
        obs = env.step(_random_free_lines(obs.mask, generator))[0]
    device_sync(env.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        obs = env.step(_random_free_lines(obs.mask, generator))[0]
    device_sync(env.device)
    return time.perf_counter() - t0


def _time_gym(env: Any, steps: int, warmup: int, generator: torch.Generator, seed: int) -> float:
    """Seconds of ``steps`` random valid steps of a Gymnasium env with ``action_masks()``
    (reset when an episode terminates, inside the timed loop as the batched env does)."""
    env.reset(seed=seed)

    def one_step() -> None:
        allowed = torch.from_numpy(env.action_masks())
        action = int(_random_free_lines(~allowed[None], generator)[0])
        _, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            env.reset()

    for _ in range(warmup):
        one_step()
    device = env.batched.device
    device_sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    device_sync(device)
    return time.perf_counter() - t0


def bench_env(
    data: SliceSet,
    initial: int,
    budget: int,
    n_envs: int = 64,
    steps: int = 20,
    mar: nn.Module | None = None,
    device: str | torch.device = "auto",
    env_cfg: EnvConfig | None = None,
    warmup: int | None = None,
    seed: int = 0,
    gym: bool = True,
) -> dict[str, Any]:
    """Environment steps per second, batched against one slice at a time, same process.

    Three timed loops make the same number of environment steps, ``n_envs * steps``, with the
    same MAR network ``mar`` (None: reconstruction only) and random valid actions (argmax of
    uniform scores over the free lines, from a seeded ``torch.Generator``):

    * batched: one :class:`BatchedAcquisitionEnv` with ``n_envs`` slices, ``steps`` steps;
    * single: a one-env :class:`BatchedAcquisitionEnv`, ``n_envs * steps`` steps;
    * gym: the Gymnasium :class:`~training.rl.gym_env.ActiveAcquisitionEnv` (numpy observations,
      ``action_masks()``), ``n_envs * steps`` steps (skipped with ``gym=False``: None values).

    Finished episodes restart inside the timed loops (auto-reset, or ``reset()`` for the
    Gymnasium env). Each loop first makes ``warmup`` untimed steps per env (default: one
    episode, ``budget``).

    data: the slices; initial, budget: the episode (``initial + budget <= PE``);
    env_cfg: reward and observation settings (``n_envs`` is replaced); device: cpu, cuda,
    cuda:N or auto; ``mar`` must be on it.
    Returns a dict with the keys :data:`ENV_KEYS`. The global RNG state is left alone.
    """
    from training.rl.gym_env import ActiveAcquisitionEnv

    for name, value in (("n_envs", n_envs), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    warmup = budget if warmup is None else warmup
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    device = resolve_device(device)
    env_cfg = env_cfg or EnvConfig()
    total = n_envs * steps
    gen = torch.Generator().manual_seed(seed)

    batched = BatchedAcquisitionEnv(data, dataclasses.replace(env_cfg, n_envs=n_envs), initial, budget,
                                    mar=mar, device=device, seed=seed)
    log.info("batched env: %d envs x %d steps", n_envs, steps)
    batched_s = _time_batched(batched, steps, warmup, gen)
    del batched
    single = BatchedAcquisitionEnv(data, dataclasses.replace(env_cfg, n_envs=1), initial, budget,
                                   mar=mar, device=device, seed=seed)
    log.info("one-env batched env: %d steps", total)
    single_s = _time_batched(single, total, warmup, gen)
    del single
    gym_s = None
    if gym:
        config = {"acquisition": AcquisitionConfig(initial=initial, budget=budget), "env": env_cfg}
        env = ActiveAcquisitionEnv(data=data, config=config, mar=mar, device=device)
        log.info("Gymnasium env: %d steps", total)
        gym_s = _time_gym(env, total, warmup, gen, seed)
        env.close()

    return _env_result(data, initial, budget, n_envs, steps, warmup, mar, device, batched_s, single_s, gym_s)


def _env_result(data: SliceSet, initial: int, budget: int, n_envs: int, steps: int, warmup: int,
                mar: nn.Module | None, device: torch.device, batched_s: float, single_s: float,
                gym_s: float | None) -> dict[str, Any]:
    """:func:`bench_env`'s result (the keys :data:`ENV_KEYS`) from the three timings."""
    total = n_envs * steps
    batched_rate = steps_per_s(total, batched_s)
    single_rate = steps_per_s(total, single_s)
    gym_rate = None if gym_s is None else steps_per_s(total, gym_s)
    return {
        "device": str(device),
        "n_envs": n_envs,
        "steps_per_env": steps,
        "total_steps": total,
        "warmup_steps": warmup,
        "initial": int(initial),
        "budget": int(budget),
        "n_pe": data.n_pe,
        "image_shape": [int(d) for d in data.target.shape[1:]],
        "n_slices": len(data),
        "mar_width": _mar_width(mar),
        "mar_params": 0 if mar is None else sum(p.numel() for p in mar.parameters()),
        "batched_s": batched_s,
        "batched_steps_per_s": batched_rate,
        "single_s": single_s,
        "single_steps_per_s": single_rate,
        "gym_s": gym_s,
        "gym_steps_per_s": gym_rate,
        "speedup": batched_rate / single_rate,
        "speedup_vs_gym": None if gym_rate is None else batched_rate / gym_rate,
    }


def _time_ours(data: SliceSet, initial: int, budget: int, n_envs: int, total: int,
               mar: nn.Module | None, device: torch.device, env_cfg: EnvConfig, cfg: PPOConfig,
               policy_cfg: PolicyNetConfig, seed: int) -> tuple[float, int]:
    """(seconds of :func:`run_ppo` over ``total`` environment steps, PolicyNet parameters);
    network and environment construction are not timed, the first reset is."""
    env = BatchedAcquisitionEnv(data, dataclasses.replace(env_cfg, n_envs=n_envs), initial, budget,
                                mar=mar, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    net = PolicyNet(data.n_pe, *[int(d) for d in data.target.shape[1:]], policy_cfg,
                    generator=torch.Generator().manual_seed(seed)).to(device)
    optimizer = make_optimizer(net, cfg)
    device_sync(device)
    t0 = time.perf_counter()
    run_ppo(env, net, cfg, optimizer, gen, total // cfg.rollout_steps)
    device_sync(device)
    return time.perf_counter() - t0, sum(p.numel() for p in net.parameters())


def bench_ppo(
    data: SliceSet,
    initial: int,
    budget: int,
    n_envs: int = 64,
    total_steps: int = 2048,
    mar: nn.Module | None = None,
    device: str | torch.device = "auto",
    env_cfg: EnvConfig | None = None,
    ppo_cfg: PPOConfig | None = None,
    policy_cfg: PolicyNetConfig | None = None,
    sb3: bool = True,
    seed: int = 0,
    sb3_policy: str = "mlp",
) -> dict[str, Any]:
    """End-to-end PPO training throughput (environment steps per second, updates included).

    Ours: :func:`~training.rl.ppo.run_ppo` (collect_rollout + ppo_update) of a
    :class:`PolicyNet` on a :class:`BatchedAcquisitionEnv` with ``n_envs`` slices. sb3-contrib:
    ``MaskablePPO("MultiInputPolicy")`` (its default MLP over the flattened observation, action
    masks from ``action_masks()``) on the Gymnasium env, one episode at a time. Both use
    ``ppo_cfg``'s rollout size (``n_steps`` for sb3), minibatch size, epochs, learning rate,
    gamma, GAE lambda, clip and loss weights, the same MAR network and the same number of
    environment steps, ``total_steps`` rounded up to a multiple of ``rollout_steps`` (which must
    be a multiple of ``n_envs``). Network construction is not timed; the first rollout is.

    sb3: also time MaskablePPO (ImportError naming :data:`SB3_HINT` when sb3-contrib is not
    installed); without it the ``sb3_*`` values are None and ``sb3_status`` says "skipped".
    sb3_policy: MaskablePPO's network, ``mlp`` (its default) or ``ours`` (our PolicyNet's encoder
    and trunk as its features extractor, so both sides train the same network).
    Returns a dict with the keys :data:`PPO_KEYS`. The global RNG states are left alone
    (stable-baselines3 seeds them; they are restored).
    """
    if sb3_policy not in SB3_POLICIES:
        raise ValueError(f"sb3_policy must be one of {', '.join(SB3_POLICIES)}, got {sb3_policy!r}")
    if sb3 and not sb3_available():
        raise ImportError(f"the MaskablePPO comparison needs sb3-contrib: {SB3_HINT}")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be an integer >= 1, got {total_steps!r}")
    device = resolve_device(device)
    env_cfg = env_cfg or EnvConfig()
    cfg = ppo_cfg or PPOConfig()
    cfg.steps_per_env(n_envs)  # rollout_steps must be a multiple of n_envs
    policy_cfg = policy_cfg or PolicyNetConfig()
    total = -(-total_steps // cfg.rollout_steps) * cfg.rollout_steps

    log.info("our PPO: %d envs, %d steps", n_envs, total)
    ours_s, ours_params = _time_ours(data, initial, budget, n_envs, total, mar, device, env_cfg,
                                     cfg, policy_cfg, seed)
    out: dict[str, Any] = dict.fromkeys(PPO_KEYS)
    out.update(device=str(device), n_envs=n_envs, total_steps=total, rollout_steps=cfg.rollout_steps,
               minibatch_size=cfg.minibatch_size, epochs=cfg.epochs, mar_width=_mar_width(mar),
               ours_s=ours_s, ours_steps_per_s=steps_per_s(total, ours_s),
               ours_policy_params=ours_params, sb3_status="skipped: not asked for", sb3_policy=sb3_policy)
    if sb3:
        log.info("sb3-contrib MaskablePPO: 1 Gymnasium env, %d steps", total)
        sb3_s, sb3_params, version = time_sb3(data, initial, budget, total, mar, device, env_cfg,
                                               cfg, seed, sb3_policy, policy_cfg)
        out.update(sb3_status="ok", sb3_version=version, sb3_s=sb3_s,
                   sb3_steps_per_s=steps_per_s(total, sb3_s), sb3_policy_params=sb3_params)
        out["speedup"] = out["ours_steps_per_s"] / out["sb3_steps_per_s"]
    return out


def format_env_table(env_result: dict[str, Any], ppo_result: dict[str, Any] | None = None) -> str:
    """Plain-text table of :func:`bench_env` (and :func:`bench_ppo`) results."""
    r = env_result
    lines = [f"{'environment':<50} {'steps':>7} {'seconds':>9} {'steps/s':>10} {'batched/this':>12}",
             "-" * 92]
    rows = [(f"batched, {r['n_envs']} envs x {r['steps_per_env']} steps", r["batched_s"],
             r["batched_steps_per_s"], 1.0),
            ("one env at a time (BatchedAcquisitionEnv B=1)", r["single_s"], r["single_steps_per_s"],
             r["speedup"])]
    if r["gym_s"] is not None:
        rows.append(("one env at a time (Gymnasium env)", r["gym_s"], r["gym_steps_per_s"],
                     r["speedup_vs_gym"]))
    for name, seconds, rate, ratio in rows:
        lines.append(f"{name:<50} {r['total_steps']:>7} {seconds:>9.3f} {rate:>10.1f} {ratio:>12.2f}")
    if ppo_result is not None:
        p = ppo_result
        header = (f"{'PPO training (rollouts + updates)':<50} {'steps':>7} {'seconds':>9} "
                  f"{'steps/s':>10} {'ours/this':>12}")
        lines += ["", header, "-" * 92]
        lines.append(f"{'ours, batched env, ' + str(p['n_envs']) + ' envs, PolicyNet':<50} "
                     f"{p['total_steps']:>7} {p['ours_s']:>9.3f} {p['ours_steps_per_s']:>10.1f} {1.0:>12.2f}")
        if p["sb3_status"] == "ok":
            net = "PolicyNet" if p["sb3_policy"] == "ours" else "MLP"
            lines.append(f"{'sb3-contrib MaskablePPO ' + p['sb3_version'] + ', Gym env, ' + net:<50} "
                         f"{p['total_steps']:>7} {p['sb3_s']:>9.3f} {p['sb3_steps_per_s']:>10.1f} "
                         f"{p['speedup']:>12.2f}")
        else:
            lines.append(f"{'sb3-contrib MaskablePPO':<50} {p['sb3_status']}")
    return "\n".join(lines)
