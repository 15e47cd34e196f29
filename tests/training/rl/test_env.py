"""The acquisition environment: batched MDP (training.rl.env) and its Gymnasium view (training.rl.gym_env)."""

import warnings

import gymnasium
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from masc_gadget.acquisition.episode import AcquisitionConfig, initial_lines
from masc_gadget.config import ConfigError, build_config
from masc_gadget.core.kspace import zero_filled
from masc_gadget.core.metrics import quality
from masc_gadget.models.unet import MarModelConfig, build_mar
from training.data import load_split
from training.rl.env import BatchedAcquisitionEnv, EnvConfig, Observation
from training.rl.gym_env import ENV_ID, ActiveAcquisitionEnv, FreeLineSpace, episode_config

from tests.conftest import CONFIGS

INITIAL, BUDGET = 2, 5


def _perturbed_mar(seed: int) -> torch.nn.Module:
    """A width-4 MAR network moved off the identity (global RNG left alone: tests guard it)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        model = build_mar(MarModelConfig(width=4))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def data(tiny_dataset):
    return load_split(tiny_dataset, "train")


@pytest.fixture(scope="module")
def mar():
    return _perturbed_mar(0)


def _env(data, mar=None, initial=INITIAL, budget=BUDGET, seed=0, **cfg):
    cfg.setdefault("n_envs", 3)
    return BatchedAcquisitionEnv(data, EnvConfig(**cfg), initial, budget, mar=mar, seed=seed)


def _random_actions(obs: Observation, rng: np.random.Generator) -> torch.Tensor:
    return torch.tensor([int(rng.choice(np.flatnonzero(~m.numpy()))) for m in obs.mask])


def _reward_image(kspace, mask, mar, use_mar):
    """Independent reference: the image Q is computed on, from scratch."""
    with torch.no_grad():
        zf = zero_filled(kspace, mask)
        return mar(zf) if (mar is not None and use_mar) else zf


def _q(data, index, mask, mar, use_mar=True, kspace="metal", cfg=None):
    cfg = cfg or EnvConfig()
    k = (data.kspace_metal if kspace == "metal" else data.kspace_clean)[index][None]
    image = _reward_image(k, torch.as_tensor(mask)[None], mar, use_mar)
    return float(quality(image, data.target[index][None], cfg.l_ssim, cfg.l_nmse)[0])


def _initial_mask(n_pe, initial=INITIAL):
    mask = torch.zeros(n_pe, dtype=torch.bool)
    mask[initial_lines(n_pe, initial)] = True
    return mask


# ---------------------------------------------------------------------------- config


def test_config_defaults_follow_the_paper_and_validate():
    cfg = EnvConfig()
    assert (cfg.alpha, cfg.l_ssim, cfg.l_nmse, cfg.kspace) == (100.0, 0.5, 0.5, "metal")
    assert cfg.observe_mar and cfg.reward_mar
    for bad in ({"alpha": 0.0}, {"alpha": float("nan")}, {"l_ssim": -1.0}, {"l_ssim": 0.0, "l_nmse": 0.0},
                {"kspace": "both"}, {"n_envs": 0}, {"observe_mar": 1}):
        with pytest.raises((ValueError, TypeError)):
            EnvConfig(**bad)
    built = build_config({"env": {"alpha": 10, "kspace": "clean"}}, sections={"env": EnvConfig})
    assert built["env"] == EnvConfig(alpha=10.0, kspace="clean")
    with pytest.raises(ConfigError, match="env.kspace"):
        build_config({"env": {"kspace": "both"}}, sections={"env": EnvConfig})


def test_the_corruption_is_one_nested_section_and_a_bare_number_is_its_probability():
    from training.evaluation.headroom.config import HeadroomConfig, corruption_of
    from training.rl.corruption import CorruptionModel

    sections = {"env": EnvConfig, "headroom": HeadroomConfig}
    nested = build_config({"env": {"corruption": {"probability": 0.3, "kind": "spike", "attempts": 2}},
                           "headroom": {"corruption": 0.3}}, sections=sections)
    assert nested["env"].corruption == CorruptionModel(0.3, "spike", attempts=2)
    assert nested["headroom"].corruption == CorruptionModel(0.3) and nested["headroom"].corruption.enabled
    assert not EnvConfig().corruption.enabled and HeadroomConfig().env_config().corruption == CorruptionModel()
    assert HeadroomConfig(corruption=CorruptionModel(0.2, seed=5)).env_config().corruption.seed == 5
    flat = build_config({"env": {"corruption": 0.3, "corruption_kind": "spike", "corruption_seed": 2}},
                        sections=sections)  # the keys of earlier configs, read where they now live
    assert flat["env"].corruption == CorruptionModel(0.3, "spike", seed=2)
    with pytest.raises(ConfigError, match="env.attempts and env.corruption.attempts are one setting"):
        build_config({"env": {"corruption": {"attempts": 2}, "attempts": 3}}, sections=sections)
    with pytest.raises(ConfigError, match=r"headroom.corruption.probability: must be a number"):
        build_config({"headroom": {"corruption": "often"}}, sections=sections)
    with pytest.raises(ConfigError, match="attempts must be an integer >= 1"):
        build_config({"env": {"corruption": {"attempts": 0}}}, sections=sections)
    # a report written before the section was nested reads as it was measured
    old = {"corruption": 0.1, "corruption_kind": "spike", "attempts": 2, "detection": 1.0, "false_alarm": 0.0,
           "seed": 3, "folds": 2}
    assert corruption_of(old) == CorruptionModel(0.1, "spike", attempts=2, detection=1.0, false_alarm=0.0, seed=3)
    assert HeadroomConfig.from_settings(old).corruption == corruption_of(old)
    assert corruption_of({"folds": 2}) == CorruptionModel()


def test_episode_config_reads_paths_mappings_and_dataclasses():
    acq, env = episode_config(CONFIGS / "tiny.yaml")
    assert (acq.initial, acq.budget) == (1, 2) and env == EnvConfig(n_envs=4)  # tiny.yaml sets n_envs
    acq, env = episode_config({"acquisition": {"initial": 3, "budget": 4}, "env": {"reward_mar": False}})
    assert (acq.initial, acq.budget, env.reward_mar) == (3, 4, False)
    acq, env = episode_config({"acquisition": AcquisitionConfig(initial=2, budget=3), "env": EnvConfig(alpha=1.0)})
    assert (acq.budget, env.alpha) == (3, 1.0)
    with pytest.raises(ConfigError, match="unknown key env.alpah"):
        episode_config({"env": {"alpah": 1}})


# ---------------------------------------------------------------------------- episodes


def test_episodes_never_reacquire_and_end_after_budget(data, mar, global_rng_guard):
    env = _env(data, mar)
    rng = np.random.default_rng(1)
    obs = env.reset()
    assert obs.image.shape == (3, *env.image_shape) and obs.image.dtype == torch.float32
    assert obs.mask.shape == (3, env.n_pe) and obs.mask.dtype == torch.bool
    assert obs.steps_left.dtype == torch.long and obs.steps_left.tolist() == [BUDGET] * 3
    assert torch.equal(obs.mask, _initial_mask(env.n_pe).expand(3, -1))
    finished = 0
    for t in range(4 * BUDGET):
        before = obs.mask
        actions = _random_actions(obs, rng)
        assert not before.gather(1, actions[:, None]).any()
        obs, rewards, terminated, info = env.step(actions)
        assert rewards.shape == (3,) and terminated.dtype == torch.bool
        expect_done = (t + 1) % BUDGET == 0
        assert terminated.tolist() == [expect_done] * 3
        # the mask the action produced: exactly one more line, the chosen one
        assert torch.equal(info["final_mask"].sum(1), before.sum(1) + 1)
        assert info["final_mask"].gather(1, actions[:, None]).all()
        if expect_done:
            finished += 3
            assert info["final_mask"].sum(1).tolist() == [INITIAL + BUDGET] * 3
            assert torch.isfinite(info["final_quality"]).all() and torch.isfinite(info["episode_return"]).all()
            # auto-reset: the returned observation starts the next episode
            assert torch.equal(obs.mask, _initial_mask(env.n_pe).expand(3, -1))
            assert obs.steps_left.tolist() == [BUDGET] * 3
        else:
            assert torch.isnan(info["final_quality"]).all() and torch.isnan(info["episode_return"]).all()
            assert obs.steps_left.tolist() == [BUDGET - (t + 1) % BUDGET] * 3
    assert finished == 12


@pytest.mark.parametrize("reward_mar", [True, False])
def test_rewards_telescope_to_the_quality_gain(data, mar, reward_mar, global_rng_guard):
    cfg = EnvConfig(n_envs=3, reward_mar=reward_mar, l_ssim=0.3, l_nmse=0.7, alpha=50.0)
    env = BatchedAcquisitionEnv(data, cfg, INITIAL, BUDGET, mar=mar, seed=3)
    rng = np.random.default_rng(2)
    obs = env.reset()
    slices = env.slice_index
    sums = torch.zeros(3)
    checked = 0
    for _ in range(2 * BUDGET):
        obs, rewards, terminated, info = env.step(_random_actions(obs, rng))
        sums += rewards
        assert torch.equal(info["slice_index"], slices)
        if terminated.all():
            torch.testing.assert_close(info["episode_return"], sums, rtol=0, atol=1e-4)
            for b in range(3):
                i = int(slices[b])
                q_final = _q(data, i, info["final_mask"][b], mar, reward_mar, cfg=cfg)
                q_initial = _q(data, i, _initial_mask(env.n_pe), mar, reward_mar, cfg=cfg)
                assert float(info["final_quality"][b]) == pytest.approx(q_final, abs=1e-5)
                assert float(sums[b]) == pytest.approx(cfg.alpha * (q_final - q_initial), abs=1e-4)
                checked += 1
            sums.zero_()
            slices = env.slice_index
    assert checked == 6


def test_observe_and_reward_images_follow_the_config(data, mar):
    index = [0, 5, 7]
    mask0 = _initial_mask(data.n_pe)
    zf = zero_filled(data.kspace_metal[index], mask0)
    with torch.no_grad():
        corrected = mar(zf)
    assert not torch.allclose(zf, corrected, atol=1e-3)  # the perturbed MAR is not the identity
    q_zf = quality(zf, data.target[index])
    q_mar = quality(corrected, data.target[index])
    for observe_mar in (True, False):
        for reward_mar in (True, False):
            env = _env(data, mar, observe_mar=observe_mar, reward_mar=reward_mar)
            obs = env.reset(indices=index)
            torch.testing.assert_close(obs.image, corrected if observe_mar else zf, rtol=0, atol=1e-5)
            torch.testing.assert_close(env.current_quality, q_mar if reward_mar else q_zf, rtol=0, atol=1e-6)
    # without a MAR network both fall back to the zero-filled image
    env = _env(data, None)
    obs = env.reset(indices=index)
    torch.testing.assert_close(obs.image, zf, rtol=0, atol=1e-5)  # to_hybrid: float rounding
    torch.testing.assert_close(env.current_quality, q_zf, rtol=0, atol=1e-6)


def test_clean_kspace_fully_acquired_is_perfect_and_metal_is_not(data):
    n_pe = data.n_pe
    initial = 1
    cfg = {"l_ssim": 0.25, "l_nmse": 0.75, "n_envs": 2}
    for kspace in ("clean", "metal"):
        env = _env(data, None, initial=initial, budget=n_pe - initial, kspace=kspace, **cfg)
        obs = env.reset(indices=[1, 6])
        torch.testing.assert_close(
            obs.image, zero_filled((data.kspace_clean if kspace == "clean" else data.kspace_metal)[[1, 6]],
                                   _initial_mask(n_pe, initial)))
        for _ in range(n_pe - initial):
            free = torch.stack([torch.nonzero(~m)[0, 0] for m in obs.mask])
            obs, _, terminated, info = env.step(free)
        assert terminated.all() and info["final_mask"].all()
        if kspace == "clean":
            torch.testing.assert_close(info["final_quality"], torch.full((2,), 1.0), rtol=0, atol=1e-5)
        else:
            assert (info["final_quality"] < 0.999).all()


def test_batched_env_equals_single_envs(data, mar, global_rng_guard):
    index = [2, 0, 7, 2]
    rng = np.random.default_rng(4)
    batched = _env(data, mar, n_envs=4)
    singles = [_env(data, mar, n_envs=1) for _ in index]
    obs = batched.reset(indices=index)
    single_obs = [env.reset(indices=[i]) for env, i in zip(singles, index, strict=True)]
    for _ in range(BUDGET):
        for b, o in enumerate(single_obs):
            torch.testing.assert_close(obs.image[b], o.image[0], rtol=0, atol=1e-5)
            assert torch.equal(obs.mask[b], o.mask[0])
        actions = _random_actions(obs, rng)
        obs, rewards, terminated, info = batched.step(actions)
        outs = [env.step(actions[b:b + 1]) for b, env in enumerate(singles)]
        single_obs = [o[0] for o in outs]
        torch.testing.assert_close(rewards, torch.cat([o[1] for o in outs]), rtol=0, atol=1e-4)
        torch.testing.assert_close(info["final_image"], torch.cat([o[3]["final_image"] for o in outs]),
                                   rtol=0, atol=1e-5)
        assert torch.equal(terminated, torch.cat([o[2] for o in outs]))
    assert terminated.all()
    torch.testing.assert_close(info["final_quality"], torch.cat([o[3]["final_quality"] for o in outs]),
                               rtol=0, atol=1e-6)


def test_one_mar_forward_per_step(data, global_rng_guard):
    mar = _perturbed_mar(1)
    calls = []
    handle = mar.register_forward_hook(lambda module, inputs, output: calls.append(inputs[0].shape[0]))
    try:
        env = _env(data, mar, n_envs=4)
        rng = np.random.default_rng(5)
        obs = env.reset()
        assert calls == [4]
        for _ in range(2 * BUDGET + 1):
            calls.clear()
            obs, _, terminated, _ = env.step(_random_actions(obs, rng))
            # one forward; at the end of an episode it also covers the new episodes' first images
            assert calls == [8 if terminated.all() else 4]
        calls.clear()
        env.evaluate(lambda o: _lowest_free(o), indices=[0, 1, 2], batch_size=8)
        assert calls == [3] * (BUDGET + 1)
        calls.clear()
        plain = _env(data, mar, observe_mar=False, reward_mar=False)
        obs = plain.reset()
        plain.step(_random_actions(obs, rng))
        assert calls == []
    finally:
        handle.remove()


def test_mar_runs_in_eval_mode_and_keeps_its_mode(data):
    mar = _perturbed_mar(2).train()
    running = [b.clone() for b in mar.buffers()]
    env = _env(data, mar)
    obs = env.reset(indices=[0, 1, 2])
    with torch.no_grad():
        expected = mar.eval()(zero_filled(data.kspace_metal[[0, 1, 2]], _initial_mask(data.n_pe)))
    mar.train()
    env.step(_random_actions(obs, np.random.default_rng(0)))
    assert mar.training
    assert all(torch.equal(a, b) for a, b in zip(running, mar.buffers(), strict=True))  # BatchNorm stats untouched
    torch.testing.assert_close(obs.image, expected, rtol=0, atol=1e-6)
    assert not obs.image.requires_grad


def test_invalid_actions_raise_and_leave_the_state(data, mar):
    env = _env(data, mar)
    obs = env.reset(indices=[0, 1, 2])
    centre = int(initial_lines(env.n_pe, INITIAL)[0])
    free = _lowest_free(obs)
    bad = free.clone()
    bad[1] = centre
    with pytest.raises(ValueError, match=rf"env 1: line {centre} is already acquired"):
        env.step(bad)
    bad = free.clone()
    bad[2] = env.n_pe
    with pytest.raises(ValueError, match=rf"env 2: action \(PE line\) must be in \[0, {env.n_pe}\), got {env.n_pe}"):
        env.step(bad)
    with pytest.raises(ValueError, match="one per env"):
        env.step(free[:2])
    with pytest.raises(ValueError, match="integer"):
        env.step(free.float())
    assert torch.equal(env.observation.mask, obs.mask)  # nothing was acquired
    obs, *_ = env.step(free)
    with pytest.raises(ValueError, match="env 0: line"):
        env.step(free)  # the same lines again
    with pytest.raises(ValueError, match="budget must be >= 1"):
        _env(data, mar, budget=0)
    with pytest.raises(ValueError, match="initial \\+ budget must be <="):
        _env(data, mar, budget=data.n_pe)


def _lowest_free(obs: Observation) -> torch.Tensor:
    """A greedy deterministic policy: the first line not yet acquired."""
    return (~obs.mask).float().argmax(dim=1)


def _brightest_free(obs: Observation) -> torch.Tensor:
    """A greedy image-dependent policy: the free row with the most image energy."""
    energy = obs.image.square().sum(dim=-1)
    return energy.masked_fill(obs.mask, -1.0).argmax(dim=1)


def test_evaluate_is_deterministic_and_consistent(data, mar, global_rng_guard):
    env = _env(data, mar, seed=9)
    obs = env.reset()
    slices = env.slice_index
    first = env.evaluate(_brightest_free, batch_size=3)
    second = env.evaluate(_brightest_free, batch_size=5)
    n = len(data)
    assert first["index"].tolist() == list(range(n))
    for key in ("final_quality", "initial_quality", "returns", "images", "masks", "lines"):
        torch.testing.assert_close(first[key], second[key], rtol=0, atol=1e-5)
    assert first["images"].shape == (n, *env.image_shape) and first["masks"].shape == (n, env.n_pe)
    assert first["lines"].shape == (n, BUDGET) and (first["masks"].sum(1) == INITIAL + BUDGET).all()
    for key in ("ssim", "psnr", "nmse"):
        assert first["metrics"][key].shape == (n,)
    torch.testing.assert_close(first["returns"], env.cfg.alpha * (first["final_quality"] - first["initial_quality"]),
                               rtol=0, atol=1e-4)
    for i in (0, n - 1):
        mask = first["masks"][i]
        assert mask[first["lines"][i]].all()
        expected = _reward_image(data.kspace_metal[i][None], mask[None], mar, True)[0].clamp_min(0)  # as served
        torch.testing.assert_close(first["images"][i], expected, rtol=0, atol=1e-5)
        assert float(first["final_quality"][i]) == pytest.approx(_q(data, i, mask, mar), abs=1e-5)
    # the running episodes are untouched, and so is the slice stream
    assert torch.equal(env.observation.image, obs.image) and torch.equal(env.slice_index, slices)
    twin = _env(data, mar, seed=9)
    twin.reset()
    twin.reset()
    env.reset()
    assert torch.equal(env.slice_index, twin.slice_index)
    subset = env.evaluate(_brightest_free, indices=[n - 1, 0])
    torch.testing.assert_close(subset["final_quality"], first["final_quality"][[n - 1, 0]], rtol=0, atol=1e-6)


def test_evaluate_reports_mar_images_even_when_rewards_use_zero_filled(data, mar):
    env = _env(data, mar, observe_mar=False, reward_mar=False)
    out = env.evaluate(_lowest_free, indices=[3])
    mask = out["masks"][0]
    served = _reward_image(data.kspace_metal[3][None], mask[None], mar, True)[0].clamp_min(0)
    torch.testing.assert_close(out["images"][0], served, rtol=0, atol=1e-5)
    assert float(out["final_quality"][0]) == pytest.approx(_q(data, 3, mask, mar, use_mar=False), abs=1e-5)


def test_slice_draws_are_seeded(data, global_rng_guard):
    a, b, c = _env(data, seed=1, n_envs=8), _env(data, seed=1, n_envs=8), _env(data, seed=2, n_envs=8)
    draws = [torch.cat([e.reset() and e.slice_index for _ in range(4)]) for e in (a, b, c)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert set(draws[0].tolist()) == set(range(len(data)))


def test_set_mar_recomputes_observations(data, mar):
    other = _perturbed_mar(7)
    env = _env(data, mar)
    index = [4, 2, 0]
    obs = env.reset(indices=index)
    rng = np.random.default_rng(3)
    obs, *_ = env.step(_random_actions(obs, rng))
    zf = zero_filled(data.kspace_metal[index], obs.mask)
    env.set_mar(other)
    with torch.no_grad():
        expected = other(zf)
    torch.testing.assert_close(env.observation.image, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(env.current_quality, quality(expected, data.target[index]), rtol=0, atol=1e-6)
    assert torch.equal(env.observation.mask, obs.mask)
    # the next reward compares two states under the new network
    q_before = env.current_quality
    _, rewards, _, _ = env.step(_random_actions(env.observation, rng))
    torch.testing.assert_close(rewards, env.cfg.alpha * (env.current_quality - q_before), rtol=0, atol=1e-4)
    # an in-place weight update of the same module is picked up by set_mar(same module)
    with torch.no_grad():
        next(other.residual.head.parameters()).mul_(3.0)
    stale = env.observation.image
    env.set_mar(other)
    assert not torch.allclose(env.observation.image, stale, atol=1e-6)
    env.set_mar(None)
    torch.testing.assert_close(env.observation.image, zero_filled(data.kspace_metal[index], env.observation.mask))
    with pytest.raises(TypeError):
        env.set_mar("mar")


# ---------------------------------------------------------------------------- Gymnasium


def test_gymnasium_make_and_env_checker(tiny_dataset):
    import training.rl.gym_env  # noqa: F401  (registers ENV_ID, also done by `import training`)

    assert ENV_ID == "masc/ActiveAcquisition-v0" and ENV_ID in gymnasium.registry
    env = gymnasium.make(ENV_ID, data_dir=str(tiny_dataset), split="train", config=str(CONFIGS / "tiny.yaml"))
    unwrapped = env.unwrapped
    assert isinstance(unwrapped, ActiveAcquisitionEnv)
    assert isinstance(env.action_space, FreeLineSpace) and env.action_space.n == unwrapped.batched.n_pe
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the checker's warnings too
        check_env(unwrapped)
    env.close()


def test_gymnasium_checker_with_mar(data, mar):
    env = gymnasium.make(ENV_ID, data=data, config={"acquisition": {"initial": 2, "budget": 4}}, mar=mar,
                         render_mode="rgb_array").unwrapped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # g(I) is unbounded, so the image Box is -inf..inf, which the checker flags
        warnings.filterwarnings("ignore", message=".*observation space m(in|ax)imum value is -?infinity")
        check_env(env)
    obs, _ = env.reset(seed=0)
    frame = env.render()
    assert frame.shape == (*obs["image"].shape, 3) and frame.dtype == np.uint8
    space = env.observation_space["image"]
    assert np.all(space.low == -np.inf) and np.all(space.high == np.inf) and space.contains(obs["image"])


def test_gymnasium_episode(data, mar, global_rng_guard):
    cfg = {"acquisition": {"initial": INITIAL, "budget": BUDGET}, "env": {"alpha": 20.0, "n_envs": 7}}
    env = ActiveAcquisitionEnv(data=data, config=cfg, mar=mar)
    assert env.observation_space["mask"].n == data.n_pe
    obs, info = env.reset(seed=11)
    same, info_same = env.reset(seed=11)
    assert info["slice_index"] == info_same["slice_index"] and np.array_equal(obs["image"], same["image"])
    obs, info = env.reset(options={"index": 5})
    assert info["slice_index"] == 5
    assert obs["mask"].dtype == np.int8 and obs["steps_left"].tolist() == [BUDGET]
    assert obs in env.observation_space
    rng = np.random.default_rng(6)
    total = 0.0
    q_initial = _q(data, 5, _initial_mask(data.n_pe), mar)
    assert info["quality"] == pytest.approx(q_initial, abs=1e-5)
    for t in range(BUDGET):
        allowed = env.action_masks()
        assert allowed.dtype == bool and np.array_equal(allowed, obs["mask"] == 0)
        action = int(rng.choice(np.flatnonzero(allowed)))
        obs, reward, terminated, truncated, info = env.step(action)
        assert isinstance(reward, float) and truncated is False
        assert terminated == (t == BUDGET - 1)
        assert obs["mask"][action] == 1 and obs["steps_left"].tolist() == [BUDGET - t - 1]
        total += reward
    assert obs["mask"].sum() == INITIAL + BUDGET and not env.action_masks().any()
    q_final = _q(data, 5, torch.from_numpy(obs["mask"].astype(bool)), mar)
    assert total == pytest.approx(20.0 * (q_final - q_initial), abs=1e-4)
    assert info["final_quality"] == pytest.approx(q_final, abs=1e-5)
    assert info["episode_return"] == pytest.approx(total, abs=1e-4)
    with pytest.raises(ValueError, match="terminated"):
        env.step(0)


def test_gymnasium_invalid_actions(data):
    env = ActiveAcquisitionEnv(data=data, config={"acquisition": {"initial": INITIAL, "budget": BUDGET}})
    with pytest.raises(RuntimeError, match="reset"):
        env.step(0)
    env.reset(options={"index": 0})
    centre = int(initial_lines(data.n_pe, INITIAL)[0])
    with pytest.raises(ValueError, match=f"line {centre} is already acquired"):
        env.step(centre)
    with pytest.raises(ValueError, match="must be in"):
        env.step(data.n_pe)
    with pytest.raises(ValueError, match="options"):
        env.reset(options={"index": len(data)})
    with pytest.raises(ValueError, match="exactly one of"):
        ActiveAcquisitionEnv()
    # the space's own sample() only draws free lines
    env.action_space.seed(0)
    for _ in range(50):
        assert env.action_masks()[env.action_space.sample()]
    assert env.action_space.contains(centre)  # acquired lines are still in the space


def test_runs_on_the_device_like_on_cpu(data, mar, device):
    import copy

    index, actions = [1, 3], [[0, 31], [5, 6], [30, 2]]
    runs = []
    for dev in ("cpu", device):
        model = copy.deepcopy(mar).to(dev)
        env = BatchedAcquisitionEnv(data, EnvConfig(n_envs=2), INITIAL, 3, mar=model, device=dev)
        obs = env.reset(indices=index)
        images, rewards = [obs.image.cpu()], []
        for a in actions:
            obs, r, _, _ = env.step(torch.tensor(a, device=dev))
            assert obs.image.device.type == torch.device(dev).type and r.device.type == torch.device(dev).type
            images.append(obs.image.cpu())
            rewards.append(r.cpu())
        runs.append((torch.stack(images), torch.stack(rewards)))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=1e-3)


def test_mar_on_another_device_is_refused(data):
    with torch.random.fork_rng(devices=[]):
        model = build_mar(MarModelConfig(width=4)).to("meta")
    with pytest.raises(ValueError, match="mar has parameters on meta but the env runs on cpu"):
        _env(data, model)


# ---------------------------------------------------------------------------- corruption


def test_a_flagged_line_may_be_acquired_again_and_its_new_acquisition_is_served(data, mar, global_rng_guard):
    from training.oracle import kspace_of
    from training.rl.corruption import CorruptionModel, draw_flagged

    cfg = dict(n_envs=3, corruption=CorruptionModel(0.5, "spike", detection=1.0, false_alarm=0.0, attempts=2))
    env = _env(data, mar, seed=1, **cfg)
    obs = env.reset()
    assert obs.repeatable is not None and not (obs.repeatable & ~obs.mask).any()
    repeats = checked = 0
    for _ in range(2 * BUDGET):
        episodes = env._episodes
        before = episodes.counts.copy()
        rep = obs.repeatable
        acquired_unflagged = obs.mask & ~rep
        if acquired_unflagged.any():  # an acquired line whose acquisition was not flagged is refused
            row = int(acquired_unflagged.any(dim=1).float().argmax())
            bad = torch.full((3,), -1, dtype=torch.long)
            for b in range(3):
                bad[b] = int(np.flatnonzero(~obs.mask[b].numpy())[0])
            bad[row] = int(np.flatnonzero(acquired_unflagged[row].numpy())[0])
            with pytest.raises(ValueError, match="only a flagged line"):
                env.step(bad)
            assert np.array_equal(episodes.counts, before)
        # repeat a flagged line where there is one, else the lowest free line
        actions = torch.where(rep.any(dim=1), rep.float().argmax(dim=1), _lowest_free(obs))
        steps_left = obs.steps_left.clone()
        obs, rewards, terminated, info = env.step(actions)
        for b in range(3):
            line = int(actions[b])
            if rep[b, line]:
                repeats += 1
                assert int(info["final_mask"][b].sum()) == int((before[b] > 0).sum())  # no new line
            if not terminated[b]:
                assert int(obs.steps_left[b]) == int(steps_left[b]) - 1
                checked += 1
    assert repeats > 0 and checked > 0
    # evaluate replays the draws masc headroom makes: the same attempts and flags per slice
    played = env.evaluate(lambda o: torch.where(o.repeatable.any(dim=1), o.repeatable.float().argmax(dim=1),
                                                _lowest_free(o)))
    counts = played["counts"].numpy()
    assert (counts.sum(axis=1) == INITIAL + BUDGET).all() and (counts <= 2).all() and (counts == 2).any()
    attempts, corrupted, flagged = draw_flagged(data.kspace_metal, data.slices, env.cfg.corruption, 2,
                                                env.cfg.corruption.seed)
    assert np.array_equal(flagged, corrupted)  # detection 1, no false alarm
    served = zero_filled(kspace_of(attempts, counts), torch.from_numpy(counts > 0))
    with torch.no_grad():
        expected = mar(served.float()).clamp(min=0)
    torch.testing.assert_close(played["images"], expected, rtol=0, atol=1e-4)
    again = env.evaluate(lambda o: torch.where(o.repeatable.any(dim=1), o.repeatable.float().argmax(dim=1),
                                               _lowest_free(o)), batch_size=2)
    assert torch.equal(again["counts"], played["counts"]) and torch.equal(again["images"], played["images"])
    with pytest.raises(ValueError, match="one line per decision"):
        BatchedAcquisitionEnv(data, EnvConfig(corruption=CorruptionModel(0.1)), INITIAL, BUDGET, lines_per_decision=2)
    with pytest.raises(ValueError, match="detection"):
        EnvConfig(corruption=CorruptionModel(0.1, detection=1.5))
