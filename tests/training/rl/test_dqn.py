"""DQN and SS-DDQN: targets by hand, masked choices, the replay memory's bound, training on the
tiny dataset, checkpoints that masc eval and the gadget play."""

import numpy as np
import pytest
import torch

from masc_gadget.acquisition.learned import LearnedPolicy, load_learned, load_masc
from masc_gadget.config import load_config
from masc_gadget.models.checkpoint import load_checkpoint
from masc_gadget.models.q_net import QNet, QNetConfig, masked_q
from masc_gadget.serving.gadget import GadgetSettings
from masc_gadget.serving.models import ModelCache, load_models
from training.evaluation.evaluate import evaluate
from training.rl.dqn import DQNConfig, MaskReplay, explore, td_targets, train_dqn

from tests.conftest import CONFIGS


def test_dqn_and_double_dqn_targets_by_hand():
    # two transitions over 3 lines; in the next state line 0 is acquired in both
    rewards = torch.tensor([1.0, 0.5])
    done = torch.tensor([False, True])
    next_masks = torch.tensor([[True, False, False], [True, False, False]])
    q_target = torch.tensor([[100.0, 2.0, 3.0], [100.0, 7.0, 1.0]])  # line 0 is acquired: never counts
    q_online = torch.tensor([[50.0, 4.0, 1.0], [0.0, 0.0, 9.0]])
    # DQN: r + gamma * max over free lines of the target net = 1 + 0.9 * 3; terminal: r
    dqn = td_targets(rewards, done, next_masks, q_target, None, gamma=0.9)
    assert torch.allclose(dqn, torch.tensor([1.0 + 0.9 * 3.0, 0.5]))
    # Double DQN: the online net picks line 1 (4 > 1; line 0's 50 is acquired), the target values it (2)
    ddqn = td_targets(rewards, done, next_masks, q_target, q_online, gamma=0.9)
    assert torch.allclose(ddqn, torch.tensor([1.0 + 0.9 * 2.0, 0.5]))


def test_masked_argmax_and_exploration_never_pick_an_acquired_line():
    gen = torch.Generator().manual_seed(0)
    net = QNet(16, 16, 12, QNetConfig(channels=(4,), hidden=8, pool_size=2), spectral=True)
    mask = torch.rand(64, 16, generator=gen) < 0.8
    mask[:, 3] = False  # at least one free line per row
    q = net(torch.rand(64, 16, 12, generator=gen), mask, torch.full((64,), 0.5))
    q = q + 1e6 * mask  # the acquired lines have by far the largest raw Q
    greedy = masked_q(q, mask).argmax(dim=1)
    assert not mask[torch.arange(64), greedy].any()
    for epsilon in (0.0, 0.5, 1.0):
        actions = explore(greedy, mask, epsilon, gen)
        assert not mask[torch.arange(64), actions].any()
    assert not torch.equal(explore(greedy, mask, 1.0, gen), greedy)


def test_replay_stores_masks_not_images_within_its_bound():
    n_pe = 200
    replay = MaskReplay(1000, n_pe)
    # the whole memory is allocated up front: capacity x (ceil(n_pe / 8) + 12) bytes
    assert replay.nbytes == 1000 * MaskReplay.bytes_per_transition(n_pe) == 1000 * 37
    # the paper-scale bound: 1e6 transitions at 200 lines take 37 MB, images (2 x 256 x 200 float32) 410 GB
    assert MaskReplay.bytes_per_transition(200) * 1_000_000 < 24e9 / 500
    gen = torch.Generator().manual_seed(1)
    masks = torch.rand(1500, n_pe, generator=gen) < 0.3
    actions = torch.tensor([int(torch.nonzero(~m)[0]) for m in masks])
    slices = torch.arange(1500)
    replay.add(slices[:700], masks[:700], actions[:700], torch.arange(700.0), torch.full((700,), 3))
    replay.add(slices[700:], masks[700:], actions[700:], torch.arange(700.0, 1500.0), torch.ones(800, dtype=torch.long))
    assert len(replay) == 1000  # the oldest 500 were dropped
    batch = replay.sample(256, gen)
    s = batch["slices"]
    assert (s >= 500).all()  # only the newest 1000 remain
    assert torch.equal(batch["masks"], masks[s])
    assert torch.equal(batch["actions"], actions[s])
    assert torch.equal(batch["rewards"], s.float())
    assert batch["next_masks"][torch.arange(256), batch["actions"]].all()
    assert (batch["next_masks"].sum(1) == batch["masks"].sum(1) + 1).all()
    assert torch.equal(batch["done"], s >= 700)  # one line left before the action: the episode ends
    restored = MaskReplay(1000, n_pe)
    restored.load_state_dict(replay.state_dict())
    again = restored.sample(256, torch.Generator().manual_seed(5))
    assert torch.equal(again["masks"], masks[again["slices"]])


def test_config_is_checked():
    with pytest.raises(ValueError, match="eps_fraction"):
        DQNConfig(eps_fraction=0.0)
    with pytest.raises(ValueError, match="replay_size"):
        DQNConfig(replay_size=0)
    assert DQNConfig(steps=100, eps_fraction=0.5).epsilon(25) == pytest.approx(1.0 - 0.5 * 0.95)


DQN_SETTINGS = ["dqn.steps=384", "dqn.learning_starts=32", "dqn.val_every=192", "dqn.target_update=64",
                "dqn.run.device=cpu", "dqn.lr=0.001", "q_net.channels=[8, 16]", "q_net.hidden=32", "q_net.pool_size=4"]


def test_dqn_learns_and_its_checkpoint_plays_in_eval_and_the_gadget(tiny_dataset, tmp_path, perturbed_mar,
                                                                    global_rng_guard):
    config = load_config(CONFIGS / "tiny.yaml", DQN_SETTINGS)
    out = tmp_path / "dqn.pt"
    best = train_dqn(config, tiny_dataset, None, out, variant="dqn", progress=False)
    assert np.isfinite(best["ssim"])
    rows = (tmp_path / "dqn.csv").read_text().splitlines()
    assert rows[0].startswith("transitions,charts/epsilon") and len(rows) == 3
    returns = [float(r.split(",")[2]) for r in rows[1:]]
    assert returns[1] > returns[0], returns  # greedier and trained: better episodes
    policy, mar, meta = load_learned(out, "cpu")
    assert isinstance(policy, LearnedPolicy) and policy.name == "dqn" and mar is None
    assert meta["kind"] == "dqn" and meta["spectral"] is False and meta["observes_mar"] is False
    with pytest.raises(ValueError, match="not a masc policy checkpoint"):
        load_masc(out, "cpu")
    results, _ = evaluate(config, tiny_dataset, "test", ["dqn", "random"], perturbed_mar, progress=False,
                          checkpoint=str(out))
    block = results["accelerations"]["10x"]
    keys = [r["key"] for r in block["rows"]]
    assert keys[:2] == ["dqn+nomar", "dqn"]
    lines = np.array(block["rows"][0]["lines"])
    assert all(len(set(row)) == len(row) for row in lines.tolist())
    # the gadget serves it as policy dqn; a dqn checkpoint is refused as masc
    models = load_models(GadgetSettings(policy="dqn", policy_checkpoint=str(out), device="cpu"), ModelCache())
    assert models.policy.name == "dqn"
    with pytest.raises(ValueError, match="not a masc policy checkpoint"):
        load_models(GadgetSettings(policy="masc", policy_checkpoint=str(out), device="cpu"), ModelCache())


def test_ss_ddqn_through_a_frozen_mar_resumes(tiny_dataset, tmp_path, perturbed_mar):
    short = load_config(CONFIGS / "tiny.yaml", [*DQN_SETTINGS, "dqn.steps=192"])
    out = tmp_path / "ss.pt"
    train_dqn(short, tiny_dataset, perturbed_mar, out, variant="ss-ddqn", progress=False)
    last = load_checkpoint(tmp_path / "ss.last.pt")
    assert last.metadata["transitions"] == 192 and len(last.extra["replay"]["slices"]) == 192
    before = load_checkpoint(perturbed_mar).state_dicts["mar"]
    longer = load_config(CONFIGS / "tiny.yaml", DQN_SETTINGS)
    best = train_dqn(longer, tiny_dataset, perturbed_mar, out, variant="ss-ddqn", resume=tmp_path / "ss.last.pt",
                     progress=False)
    assert np.isfinite(best["ssim"])
    last = load_checkpoint(tmp_path / "ss.last.pt")
    assert last.metadata["transitions"] == 384 and len(last.extra["replay"]["slices"]) == 384
    assert len((tmp_path / "ss.csv").read_text().splitlines()) == 3  # one row per validation, across the resume
    policy, mar, meta = load_learned(out, "cpu", kind="ss-ddqn")
    assert meta["spectral"] is True and meta["observes_mar"] is True and policy.net.spectral
    assert mar is None  # the MAR network stays frozen: not part of the baseline's checkpoint
    assert all(torch.equal(before[k], load_checkpoint(perturbed_mar).state_dicts["mar"][k]) for k in before)
    with pytest.raises(ValueError, match="not a 'dqn' one"):
        train_dqn(longer, tiny_dataset, perturbed_mar, tmp_path / "x.pt", variant="dqn",
                  resume=tmp_path / "ss.last.pt", progress=False)
