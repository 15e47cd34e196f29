"""Re-acquiring a flagged line: the policy network's third input and repeat bonus, MASC trained
on corrupted acquisitions, and the headroom judging it against the oracle and the gated order."""

import json

import numpy as np
import pytest
import torch

from masc_gadget.acquisition.learned import load_masc, policy_metadata
from masc_gadget.cli import main
from masc_gadget.config import load_config
from masc_gadget.models.checkpoint import save_checkpoint
from masc_gadget.models.policy_net import PolicyNet, PolicyNetConfig, blocked
from tests.conftest import CONFIGS
from training.coadapt import train_masc

N = 16
CORRUPTED = ["env.corruption.probability=0.5", "env.corruption.kind=spike", "policy_net.reacquire=true",
             "policy_net.repeat_weight=10"]


def _net(reacquire=True, repeat=10.0):
    torch.manual_seed(0)
    return PolicyNet(N, N, 8, PolicyNetConfig(channels=(4,), hidden=8, pool_size=2, reacquire=reacquire,
                                              repeat_weight=repeat))


def test_a_reacquiring_network_sees_the_flags_and_may_pick_a_flagged_line():
    net = _net()
    assert net.encoder[0].in_channels == 3 and _net(reacquire=False).encoder[0].in_channels == 2
    image, frac = torch.rand(2, N, 8), torch.ones(2)
    mask = torch.zeros(2, N, dtype=torch.bool)
    mask[:, [7, 8]] = True
    flagged = torch.zeros(2, N, dtype=torch.bool)
    flagged[1, 8] = True
    none, _ = net(image, mask, frac)
    zeros, _ = net(image, mask, frac, torch.zeros_like(flagged))
    assert torch.equal(none, zeros)  # no flags given = none flagged
    logits, _ = net(image, mask, frac, flagged)
    assert torch.equal(logits[0], none[0]) and not torch.equal(logits[1], none[1])
    scores = net.scores(image, mask, frac, flagged)
    assert int(scores[1].argmax()) == 8  # the repeat bonus makes the flagged line the greedy choice
    assert int(scores[0].argmax()) not in (7, 8)
    assert blocked(mask, flagged)[1].tolist() == [i == 7 for i in range(N)]
    logits[1, 8].backward()
    assert float(net.repeat_scale.grad) == pytest.approx(1.0)  # the bonus is learnt
    # a flag on a line not acquired means nothing
    stray = torch.zeros_like(flagged)
    stray[:, 3] = True
    assert torch.equal(net(image, mask, frac, stray)[0], none)
    with pytest.raises(ValueError, match="repeat_weight"):
        PolicyNetConfig(repeat_weight=-1.0)
    with pytest.raises(TypeError, match="reacquire"):
        PolicyNetConfig(reacquire="yes")


def test_the_checkpoint_keeps_the_repeat_bonus_and_the_gadget_says_it_serves_no_repeats(tmp_path, caplog):
    net = _net(repeat=3.0)
    with torch.no_grad():
        net.repeat_scale.fill_(5.5)
    path = tmp_path / "r.pt"
    save_checkpoint(path, {"policy": net}, policy_metadata(net, observes_mar=False))
    with caplog.at_level("WARNING", logger="masc_gadget.acquisition.learned"):
        policy, _, _ = load_masc(path, "cpu")
    assert policy.net.config.reacquire and float(policy.net.repeat_scale.detach()) == 5.5
    assert "no repeats" in caplog.text
    # the gadget's choice: never an acquired line, flagged or not (it receives no flags)
    mask = np.zeros(N, dtype=bool)
    mask[[7, 8]] = True
    from masc_gadget.acquisition.episode import AcquisitionState

    state = AcquisitionState(mask=mask, steps_left=2, step=0, image=np.random.default_rng(0).random((N, 8)),
                             n_initial=2)
    assert policy.select(state) not in (7, 8)


@pytest.fixture(scope="module")
def reacquiring_masc(tiny_dataset, perturbed_mar, tmp_path_factory):
    out = tmp_path_factory.mktemp("reacquire") / "masc.pt"
    config = load_config(CONFIGS / "tiny.yaml", ["masc_train.rollouts=2", "masc_train.val_every=1",
                                                 "masc_train.mar_mode=frozen", *CORRUPTED])
    train_masc(config, tiny_dataset, perturbed_mar, out, progress=False)
    return out


def test_masc_trains_on_corrupted_acquisitions(reacquiring_masc, tiny_dataset, perturbed_mar, tmp_path):
    policy, _, meta = load_masc(reacquiring_masc, "cpu")
    assert policy.net.config.reacquire
    assert meta["config"]["env"]["corruption"]["probability"] == 0.5 and meta["config"]["env"]["corruption"]["kind"] == "spike"
    log = (reacquiring_masc.with_suffix(".csv")).read_text().splitlines()
    assert len(log) >= 3  # rollout 0 and two rollouts, validated on corrupted acquisitions
    for mismatch in (["env.corruption=0.5"], ["policy_net.reacquire=true"]):
        config = load_config(CONFIGS / "tiny.yaml", ["masc_train.rollouts=1", *mismatch])
        with pytest.raises(ValueError, match="policy_net.reacquire"):
            train_masc(config, tiny_dataset, perturbed_mar, tmp_path / "x.pt", progress=False)


def test_headroom_judges_a_reacquiring_policy_against_the_gated_order(reacquiring_masc, tiny_dataset, perturbed_mar,
                                                                       tmp_path):
    args = ["--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset), "--split", "train",
            "--set", "headroom.slices_per_subject=0", "--set", "headroom.corruption.probability=0.5",
            "--set", "headroom.corruption.kind=spike", "--set", "headroom.corruption.detection=1",
            "--set", "headroom.corruption.false_alarm=0"]
    assert main(["headroom", *args, "--mar", str(perturbed_mar), "--policy", str(reacquiring_masc),
                 "--out", str(tmp_path / "hr")]) == 0
    report = json.loads((tmp_path / "hr" / "headroom.json").read_text())
    run = report["runs"][0]
    n = report["n_slices"]
    gated = np.asarray(run["gated_counts"])
    assert gated.shape == (n, report["acquisition"]["n_pe"]) and (gated.sum(axis=1) == 3).all()
    assert run["corruption"]["repeats_per_slice_gated"] == pytest.approx(float((gated.sum(1) - (gated > 0).sum(1)).mean()))
    assert len(run["policy_lines"]) == n and all(len(r) == 2 for r in run["policy_lines"])
    gain = np.mean(run["slices"]["policy"]["ssim"]) - np.mean(run["slices"]["gated"]["ssim"])
    assert run["policy_vs_gated"]["diff"] == pytest.approx(gain)
    assert "vs_gated" in report["summary"]["policy"] and "gated" in report["summary"]
    text = (tmp_path / "hr" / "headroom.md").read_text()
    assert "navigator gating" in text and "Against the gated order" in text
    # the same policy against the earlier measurement: the same draws, so the same scores
    assert main(["headroom", *args, "--mar", str(perturbed_mar), "--out", str(tmp_path / "bare")]) == 0
    assert main(["headroom", "--config", str(CONFIGS / "tiny.yaml"), "--from", str(tmp_path / "bare"),
                 "--policy", str(reacquiring_masc), "--out", str(tmp_path / "later")]) == 0
    later = json.loads((tmp_path / "later" / "headroom.json").read_text())
    assert later["runs"][0]["slices"]["policy"] == run["slices"]["policy"]
    assert later["runs"][0]["slices"]["gated"] == run["slices"]["gated"]


def test_the_trainers_that_acquire_each_line_once_refuse_corruption(tiny_dataset, tmp_path):
    from training.data import load_split
    from training.rl.dqn import train_dqn
    from training.rl.gym_env import ActiveAcquisitionEnv

    with pytest.raises(ValueError, match="env.corruption"):
        train_dqn(load_config(CONFIGS / "tiny.yaml", ["env.corruption=0.1"]), tiny_dataset, None, tmp_path / "d.pt",
                  progress=False)
    with pytest.raises(ValueError, match="env.corruption"):
        ActiveAcquisitionEnv(data=load_split(tiny_dataset, "train"), config={"env": {"corruption": 0.1}})


def test_the_gated_order_repeats_the_most_central_flagged_line_first():
    """Hand-worked: order 4, 3, 5, 2 on 8 lines; a slice with no flag plays the next line of the
    order, a slice with flags repeats the flagged line nearest the centre (line 4)."""
    from types import SimpleNamespace

    from training.rl.corruption import GatedOrder

    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0, 4] = mask[1, [4, 3]] = mask[2, [4, 3]] = True
    flagged = torch.zeros(3, 8, dtype=torch.bool)
    flagged[1, [3, 4]] = flagged[2, 3] = True
    play = GatedOrder(np.array([4, 3, 5, 2]), 8)
    assert play(SimpleNamespace(mask=mask, repeatable=flagged)).tolist() == [3, 4, 3]
