"""Environments, PPO, co-adaptive training, baselines, evaluation and figures."""
