"""The sb3-contrib side of ``masc bench env --sb3``: ``MaskablePPO`` on the Gymnasium
acquisition environment, timed for the same number of environment steps as our PPO
(:func:`training.bench.env.bench_ppo`). sb3-contrib is optional (the ``bench`` extra)."""

from __future__ import annotations

import importlib.util
import random
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from masc_gadget.acquisition.episode import AcquisitionConfig
from masc_gadget.models.policy_net import PolicyNet, PolicyNetConfig
from training.bench.common import device_sync
from training.data import SliceSet
from training.rl.env import EnvConfig
from training.rl.ppo import PPOConfig



def sb3_available() -> bool:
    """True when sb3-contrib (MaskablePPO) can be imported."""
    return importlib.util.find_spec("sb3_contrib") is not None


class _GlobalRngGuard:
    """Saves and restores Python's, numpy's and torch's (CPU and CUDA) global RNG states:
    stable-baselines3 seeds them all."""

    def __enter__(self) -> None:
        self._py, self._np = random.getstate(), np.random.get_state()
        self._torch = torch.random.fork_rng(devices=list(range(torch.cuda.device_count())))
        self._torch.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._torch.__exit__(*exc)
        random.setstate(self._py)
        np.random.set_state(self._np)


def _policy_net_extractor(policy_cfg: PolicyNetConfig, budget: int) -> type:
    """An sb3 features extractor that is our PolicyNet's encoder and trunk (its actor and critic
    heads are sb3's ``action_net`` / ``value_net`` on top, with ``net_arch=[]``), so both sides
    of the comparison train the same network."""
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

    class PolicyNetFeatures(BaseFeaturesExtractor):
        def __init__(self, observation_space: Any) -> None:
            h, w = observation_space["image"].shape
            super().__init__(observation_space, features_dim=policy_cfg.hidden)
            self.net = PolicyNet(int(observation_space["mask"].n), int(h), int(w), policy_cfg)
            del self.net.actor, self.net.critic  # sb3's heads replace them

        def forward(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.net.features(obs["image"], obs["mask"] > 0.5, obs["steps_left"][:, 0] / budget)

    return PolicyNetFeatures


def time_sb3(data: SliceSet, initial: int, budget: int, total: int, mar: nn.Module | None,
              device: torch.device, env_cfg: EnvConfig, cfg: PPOConfig, seed: int,
              sb3_policy: str = "mlp", policy_cfg: PolicyNetConfig | None = None
              ) -> tuple[float, int, str]:
    """(seconds of ``MaskablePPO.learn(total)``, policy parameters, sb3-contrib version)."""
    import sb3_contrib
    from sb3_contrib import MaskablePPO

    from training.rl.gym_env import ActiveAcquisitionEnv

    config = {"acquisition": AcquisitionConfig(initial=initial, budget=budget), "env": env_cfg}
    env = ActiveAcquisitionEnv(data=data, config=config, mar=mar, device=device)
    policy_kwargs: dict[str, Any] = {}
    if sb3_policy == "ours":
        policy_kwargs = {"features_extractor_class": _policy_net_extractor(policy_cfg or PolicyNetConfig(), budget),
                         "net_arch": [], "share_features_extractor": True,
                         # PolicyNet initialises itself (CleanRL's orthogonal init, as sb3's)
                         "ortho_init": False}
    with _GlobalRngGuard():
        model = MaskablePPO(
            "MultiInputPolicy", env, policy_kwargs=policy_kwargs, learning_rate=cfg.lr, n_steps=cfg.rollout_steps,
            batch_size=cfg.minibatch_size, n_epochs=cfg.epochs, gamma=cfg.gamma,
            gae_lambda=cfg.gae_lambda, clip_range=cfg.clip, normalize_advantage=cfg.norm_adv,
            ent_coef=cfg.ent_coef, vf_coef=cfg.vf_coef, max_grad_norm=cfg.max_grad_norm,
            target_kl=cfg.target_kl or None, seed=seed, device=device, verbose=0,
        )
        params = sum(p.numel() for p in model.policy.parameters())
        device_sync(device)
        t0 = time.perf_counter()
        model.learn(total_timesteps=total)
        device_sync(device)
        elapsed = time.perf_counter() - t0
    env.close()
    return elapsed, params, sb3_contrib.__version__
