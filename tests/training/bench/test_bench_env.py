"""``masc bench env``: the environment and PPO throughput benchmarks run and report what they
document. No timing assertions here (speed targets belong to benchmark runs, not tests)."""

import argparse
import json

import pytest
import torch

from masc_gadget.models.policy_net import PolicyNetConfig
from training.bench import cli as bench
from training.bench import env as bench_env_module
from training.bench.env import (
    ENV_KEYS,
    PPO_KEYS,
    bench_env,
    bench_ppo,
    format_env_table,
    seeded_mar,
)
from training.rl.ppo import PPOConfig

from tests.conftest import CONFIGS  # noqa: E402
TINY_POLICY = PolicyNetConfig(channels=(8, 16), hidden=32, pool_size=4)
TINY_PPO = PPOConfig(rollout_steps=8, minibatch_size=4, epochs=1)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny_train(tiny_dataset):
    from training.data import load_split

    return load_split(tiny_dataset, "train")


def _parser() -> argparse.ArgumentParser:
    from masc_gadget.cli import common_options

    parser = argparse.ArgumentParser(prog="masc")
    bench.register(parser.add_subparsers(dest="command"), common_options())
    return parser


def test_random_free_lines_picks_only_free_lines():
    gen = torch.Generator().manual_seed(0)
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[0, :9] = True  # one free line: 9
    mask[1, ::2] = True  # odd lines free
    picks = torch.stack([bench_env_module._random_free_lines(mask, gen) for _ in range(50)])
    assert (picks[:, 0] == 9).all()
    assert (picks[:, 1] % 2 == 1).all()
    assert len(set(picks[:, 2].tolist())) > 1  # random, not always the same line


def test_seeded_mar_is_reproducible_and_zero_means_none(global_rng_guard):
    assert seeded_mar(0) is None
    a, b = seeded_mar(4, seed=3), seeded_mar(4, seed=3)
    assert not a.training and a.config.width == 4
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    with pytest.raises(ValueError, match="MAR width must be an integer >= 0"):
        seeded_mar(-1)


def test_bench_env_tiny(tiny_train, global_rng_guard):
    mar = seeded_mar(4, device="cpu")
    result = bench_env(tiny_train, 1, 2, n_envs=4, steps=8, mar=mar, device="cpu")
    assert set(result) == set(ENV_KEYS)
    assert result["total_steps"] == 32 and result["n_envs"] == 4 and result["steps_per_env"] == 8
    assert (result["initial"], result["budget"], result["warmup_steps"]) == (1, 2, 2)
    assert result["image_shape"] == [32, 32] and result["n_pe"] == 32
    assert result["mar_width"] == 4 and result["mar_params"] > 0
    for name in ("batched", "single", "gym"):
        assert result[f"{name}_s"] > 0 and result[f"{name}_steps_per_s"] > 0
        assert result[f"{name}_steps_per_s"] == pytest.approx(32 / result[f"{name}_s"])
    assert result["speedup"] == pytest.approx(result["batched_steps_per_s"] / result["single_steps_per_s"])
    assert result["speedup_vs_gym"] == pytest.approx(result["batched_steps_per_s"] / result["gym_steps_per_s"])
    json.dumps(result)
    assert "Gymnasium env" in format_env_table(result)


def test_bench_env_without_mar_or_gym(tiny_train):
    result = bench_env(tiny_train, 1, 2, n_envs=2, steps=3, mar=None, device="cpu", gym=False, warmup=0)
    assert result["mar_width"] == 0 and result["mar_params"] == 0
    assert result["gym_s"] is None and result["gym_steps_per_s"] is None and result["speedup_vs_gym"] is None
    assert result["batched_steps_per_s"] > 0 and result["single_steps_per_s"] > 0
    assert "Gymnasium" not in format_env_table(result)


@pytest.mark.parametrize("kwargs, message", [
    ({"n_envs": 0}, "n_envs must be an integer >= 1"),
    ({"steps": 0}, "steps must be an integer >= 1"),
    ({"warmup": -1}, "warmup must be an integer >= 0"),
])
def test_bench_env_rejects_bad_sizes(tiny_train, kwargs, message):
    args = {"n_envs": 2, "steps": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        bench_env(tiny_train, 1, 2, device="cpu", **args)


def test_bench_ppo_ours_only(tiny_train, global_rng_guard):
    result = bench_ppo(tiny_train, 1, 2, n_envs=4, total_steps=10, mar=seeded_mar(4), device="cpu",
                       ppo_cfg=TINY_PPO, policy_cfg=TINY_POLICY, sb3=False)
    assert set(result) == set(PPO_KEYS)
    assert result["total_steps"] == 16  # rounded up to a multiple of rollout_steps (8)
    assert result["ours_s"] > 0 and result["ours_steps_per_s"] > 0 and result["ours_policy_params"] > 0
    assert result["sb3_status"].startswith("skipped")
    assert result["sb3_steps_per_s"] is None and result["speedup"] is None
    json.dumps(result)
    assert "skipped" in format_env_table(bench_env(tiny_train, 1, 2, 2, 1, device="cpu", gym=False), result)


def test_bench_ppo_rollout_must_be_a_multiple_of_n_envs(tiny_train):
    with pytest.raises(ValueError, match="must be a multiple of the number of environments"):
        bench_ppo(tiny_train, 1, 2, n_envs=3, total_steps=8, device="cpu", ppo_cfg=TINY_PPO,
                  policy_cfg=TINY_POLICY, sb3=False)


def test_bench_ppo_without_sb3_contrib_says_how_to_install(tiny_train, monkeypatch):
    monkeypatch.setattr(bench_env_module, "sb3_available", lambda: False)
    with pytest.raises(ImportError, match=r"pip install sb3-contrib \(or \.\[bench\]\)"):
        bench_ppo(tiny_train, 1, 2, n_envs=4, total_steps=8, device="cpu", ppo_cfg=TINY_PPO,
                  policy_cfg=TINY_POLICY, sb3=True)


def test_bench_ppo_against_maskable_ppo(tiny_train, global_rng_guard):
    pytest.importorskip("sb3_contrib")
    result = bench_ppo(tiny_train, 1, 2, n_envs=4, total_steps=8, mar=seeded_mar(4), device="cpu",
                       ppo_cfg=TINY_PPO, policy_cfg=TINY_POLICY, sb3=True)
    assert set(result) == set(PPO_KEYS)
    assert result["sb3_status"] == "ok" and result["sb3_version"]
    assert result["sb3_s"] > 0 and result["sb3_steps_per_s"] > 0 and result["sb3_policy_params"] > 0
    assert result["speedup"] == pytest.approx(result["ours_steps_per_s"] / result["sb3_steps_per_s"])
    assert result["sb3_policy"] == "mlp"
    json.dumps(result)


def test_bench_ppo_against_maskable_ppo_with_our_network(tiny_train, global_rng_guard):
    pytest.importorskip("sb3_contrib")
    result = bench_ppo(tiny_train, 1, 2, n_envs=4, total_steps=8, mar=None, device="cpu",
                       ppo_cfg=TINY_PPO, policy_cfg=TINY_POLICY, sb3=True, sb3_policy="ours")
    assert result["sb3_status"] == "ok" and result["sb3_policy"] == "ours"
    # the same network on both sides: our PolicyNet's encoder + trunk, sb3's own actor / critic heads
    assert result["sb3_policy_params"] == result["ours_policy_params"]
    with pytest.raises(ValueError, match="sb3_policy must be one of mlp, ours"):
        bench_ppo(tiny_train, 1, 2, n_envs=4, total_steps=8, device="cpu", ppo_cfg=TINY_PPO,
                  policy_cfg=TINY_POLICY, sb3=False, sb3_policy="cnn")


def test_bench_env_command(tiny_dataset, tmp_path, capsys, monkeypatch):
    from training.bench import sb3 as bench_sb3

    monkeypatch.setattr(bench_sb3, "sb3_available", lambda: False)  # the CLI's skip path (imported when run)
    out = tmp_path / "bench_env.json"
    parser = _parser()
    args = parser.parse_args(["bench", "env", "--config", str(CONFIGS / "tiny.yaml"), "--data",
                              str(tiny_dataset), "--device", "cpu", "--n-envs", "4", "--steps", "2",
                              "--mar-width", "4", "--sb3", "--ppo-steps", "8",
                              "--set", "ppo.rollout_steps=8", "--set", "ppo.epochs=1",
                              "--out", str(out)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "pip install sb3-contrib (or .[bench])" in text
    assert "steps/s" in text and "batched, 4 envs x 2 steps" in text
    data = json.loads(out.read_text())
    assert set(data) == {"command", "environment", "env", "ppo"}
    assert data["environment"]["device"] == "cpu" and data["environment"]["torch"] == torch.__version__
    assert len(data["environment"]["load_average"]) == len(data["environment"]["load_average_end"]) == 3
    assert data["environment"]["cpu_threads"] >= 1
    assert set(data["env"]) == set(ENV_KEYS) and data["env"]["mar_width"] == 4
    assert data["ppo"]["sb3_status"].startswith("skipped") and data["ppo"]["ours_steps_per_s"] > 0
    # the unet action is still there
    assert parser.parse_args(["bench", "unet", "--device", "cpu"]).func is bench.cmd_unet


def test_bench_env_command_needs_data():
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "env"])
