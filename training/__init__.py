"""Environments, PPO, co-adaptive training, baselines, evaluation and figures."""

import gymnasium as _gymnasium

if "masc/ActiveAcquisition-v0" not in _gymnasium.registry:
    _gymnasium.register(id="masc/ActiveAcquisition-v0", entry_point="training.rl.gym_env:ActiveAcquisitionEnv")
