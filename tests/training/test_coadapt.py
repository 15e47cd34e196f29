"""Stage 2 on the tiny dataset: PPO learns, co-adaptive checkpoints load in eval and the gadget."""


import numpy as np
import pytest
import torch

from masc_gadget.models.checkpoint import load_checkpoint
from masc_gadget.config import load_config
from masc_gadget.core.metrics import quality, roi_metrics
from masc_gadget.serving.gadget import GadgetSettings, process
from masc_gadget.acquisition.learned import load_masc
from masc_gadget.mrd.header import parse_header
from training.coadapt import train_masc
from training.data import load_split
from training.rl.env import BatchedAcquisitionEnv, EnvConfig
from training.evaluation.evaluate import evaluate

from tests.conftest import CONFIGS


@pytest.fixture(scope="module")
def pretrained_mar(perturbed_mar):
    return perturbed_mar


def _mean_return(env_data, config, actions_fn):
    env = BatchedAcquisitionEnv(env_data, EnvConfig(observe_mar=False, reward_mar=False, n_envs=4),
                                config["acquisition"].initial, config["acquisition"].budget)
    result = env.evaluate(actions_fn)
    return float(result["returns"].mean())


def test_ppo_run_beats_a_random_policy(tiny_dataset, tmp_path, global_rng_guard):
    config = load_config(CONFIGS / "tiny.yaml", ["masc_train.mar_mode=none", "masc_train.rollouts=12",
                                                 "masc_train.val_every=12", "ppo.lr=0.001"])
    out = tmp_path / "ppo.pt"
    train_masc(config, tiny_dataset, None, out, progress=False)  # 12 x 32 = 384 environment steps
    policy, mar, meta = load_masc(out, "cpu")
    assert mar is None and meta["observes_mar"] is False
    data = load_split(tiny_dataset, "train")
    from training.rl.ppo import greedy_actions

    learned = _mean_return(data, config, lambda obs: greedy_actions(policy.net, obs, config["acquisition"].budget))
    gen = torch.Generator().manual_seed(0)

    def random_actions(obs):
        scores = torch.rand(obs.mask.shape, generator=gen).masked_fill(obs.mask, -1.0)
        return scores.argmax(dim=1)

    random_return = np.mean([_mean_return(data, config, random_actions) for _ in range(5)])
    assert learned > random_return + 1.0, (learned, random_return)
    with open(out.with_suffix(".csv")) as fh:
        header = fh.readline()
    assert "charts/episodic_return" in header and "losses/approx_kl" in header and "val/ssim" in header


def test_coadaptive_checkpoint_loads_in_eval_and_gadget(tiny_dataset, tmp_path, pretrained_mar):
    config = load_config(CONFIGS / "tiny.yaml")
    out = tmp_path / "masc.pt"
    best = train_masc(config, tiny_dataset, pretrained_mar, out, progress=False)
    assert np.isfinite(best["ssim"])
    ck = load_checkpoint(out)
    assert set(ck.state_dicts) == {"policy", "mar"} and ck.metadata["kind"] == "masc"
    before = load_checkpoint(pretrained_mar).state_dicts["mar"]
    changed = any(not torch.equal(before[k], ck.state_dicts["mar"][k]) for k in before if before[k].is_floating_point())
    assert changed, "joint training must fine-tune the MAR network"
    # masc eval takes the checkpoint of the learned method
    results, _ = evaluate(config, tiny_dataset, "test", ["masc", "center-out"], pretrained_mar,
                          progress=False, checkpoint=out)
    keys = [r["key"] for r in next(iter(results["accelerations"].values()))["rows"]]
    assert keys[:2] == ["masc+nomar", "masc"]
    # the gadget loads it as its policy
    path = sorted((tiny_dataset / "test").glob("*.h5"))[0]
    import ismrmrd

    dset = ismrmrd.Dataset(str(path), "metal", create_if_needed=False)
    header = parse_header(dset.read_xml_header())
    acqs = [dset.read_acquisition(i) for i in range(dset.number_of_acquisitions())]
    dset.close()
    sent = []
    settings = GadgetSettings(policy="masc", policy_checkpoint=str(out), initial=1, budget=2, device="cpu",
                              feedback="inband")
    by_line = {(a.idx.slice, a.idx.kspace_encode_step_1): a for a in acqs}
    n_pe = 32

    def items():  # obey the gadget: initial centre line, then its decisions
        for s in range(4):
            yield by_line[(s, n_pe // 2)]
            for _ in range(2):
                decision = next(x for x in reversed(sent) if isinstance(x, ismrmrd.Acquisition))
                yield by_line[(s, decision.idx.kspace_encode_step_1)]

    stats = process(items(), header, settings, sent.append)
    assert stats["decisions"] == 8 and stats["images"] == 4 and stats["rejected"] == 0


def test_resume_and_gymnasium_registration(tiny_dataset, tmp_path, pretrained_mar):
    import gymnasium

    import training  # noqa: F401  (registers the environment)

    config = load_config(CONFIGS / "tiny.yaml", ["masc_train.rollouts=2"])
    train_masc(config, tiny_dataset, pretrained_mar, tmp_path / "a.pt", progress=False)
    more = load_config(CONFIGS / "tiny.yaml", ["masc_train.rollouts=4"])
    best = train_masc(more, tiny_dataset, pretrained_mar, tmp_path / "a.pt", resume=tmp_path / "a.last.pt",
                      progress=False)
    assert load_checkpoint(tmp_path / "a.last.pt").metadata["rollout"] == 4 and np.isfinite(best["ssim"])
    env = gymnasium.make("masc/ActiveAcquisition-v0", data_dir=str(tiny_dataset), split="train",
                         config=str(CONFIGS / "tiny.yaml"))
    obs, info = env.reset(seed=0)
    assert obs["mask"].sum() == 1 and env.unwrapped.action_masks().sum() == 31
    env.close()


def test_mar_mode_needs_a_checkpoint(tiny_dataset, tmp_path):
    with pytest.raises(ValueError, match="needs a pre-trained MAR checkpoint"):
        train_masc(load_config(CONFIGS / "tiny.yaml"), tiny_dataset, None, tmp_path / "x.pt", progress=False)


def test_learned_policy_in_the_gadget_equals_offline_evaluation(tiny_dataset, tmp_path, pretrained_mar):
    """The MASC policy served by the gadget chooses the same lines as masc eval on the same slices."""
    import ismrmrd

    config = load_config(CONFIGS / "tiny.yaml", ["masc_train.rollouts=2"])
    out = tmp_path / "masc.pt"
    train_masc(config, tiny_dataset, pretrained_mar, out, progress=False)
    offline, _ = evaluate(load_config(CONFIGS / "tiny.yaml", ["eval.accelerations={10x: [1, 2]}"]), tiny_dataset,
                          "test", ["masc"], pretrained_mar, progress=False, checkpoint=out)
    row = next(r for r in offline["accelerations"]["10x"]["rows"] if r["key"] == "masc")
    path = sorted((tiny_dataset / "test").glob("*.h5"))[0]
    dset = ismrmrd.Dataset(str(path), "metal", create_if_needed=False)
    header = parse_header(dset.read_xml_header())
    by_line = {(a.idx.slice, a.idx.kspace_encode_step_1): a
               for a in (dset.read_acquisition(i) for i in range(dset.number_of_acquisitions()))}
    dset.close()
    sent, lines = [], {}
    settings = GadgetSettings(policy="masc", policy_checkpoint=str(out), initial=1, budget=2, device="cpu",
                              feedback="inband")

    def items():
        for s in range(4):
            lines[s] = [16]
            yield by_line[(s, 16)]
            for _ in range(2):
                decision = next(x for x in reversed(sent) if isinstance(x, ismrmrd.Acquisition))
                lines[s].append(decision.idx.kspace_encode_step_1)
                yield by_line[(s, lines[s][-1])]

    process(items(), header, settings, sent.append)
    images = {img.slice: img.data[0, 0] for img in sent if isinstance(img, ismrmrd.Image)}
    assert [lines[s] for s in range(4)] == row["lines"]  # same choices online and offline
    assert len(images) == 4


def test_mar_finetuning_with_the_pretraining_loss(tiny_dataset, tmp_path, pretrained_mar):
    import csv

    config = load_config(CONFIGS / "tiny.yaml", ["masc_train.rollouts=2", "masc_train.mar_loss=pretrain"])
    train_masc(config, tiny_dataset, pretrained_mar, tmp_path / "p.pt", progress=False)
    rows = list(csv.DictReader(open(tmp_path / "p.csv")))
    losses = [float(r["losses/mar"]) for r in rows]
    # L1 + (1 - SSIM) of images scaled to [0, 1]: positive, and far above an MSE of the same images
    assert len(losses) == 2 and all(0.05 < v < 2.0 for v in losses)
    before = load_checkpoint(pretrained_mar).state_dicts["mar"]
    after = load_checkpoint(tmp_path / "p.last.pt").state_dicts["mar"]
    assert any(not torch.equal(before[k], after[k]) for k in before if before[k].is_floating_point())
    with pytest.raises(ValueError, match="mar_loss: must be one of 'mse', 'pretrain'"):
        load_config(CONFIGS / "tiny.yaml", ["masc_train.mar_loss=ssim"])


def test_region_reward_trains_and_selects_on_the_region(tiny_dataset, perturbed_mar, tmp_path):
    data = load_split(tiny_dataset, "train")
    roi = data.periprosthetic_roi(2)
    env = BatchedAcquisitionEnv(data, EnvConfig(region="implant", margin=2, n_envs=2), 1, 2)
    result = env.evaluate(lambda obs: torch.tensor([int(np.flatnonzero(~m)[0]) for m in obs.mask.numpy()]))
    q = quality(result["images"], data.target, 0.5, 0.5, roi)
    assert torch.allclose(result["final_quality"], q.float(), atol=1e-5)  # Q is computed in the region
    assert torch.allclose(result["metrics"]["roi_ssim"], roi_metrics(result["images"], data.target, roi)["ssim"])
    out = tmp_path / "region.pt"
    config = load_config(CONFIGS / "tiny.yaml", ["masc_train.rollouts=2", "env.region=implant", "env.margin=2"])
    train_masc(config, tiny_dataset, perturbed_mar, out, progress=False)
    log = out.with_suffix(".csv").read_text().splitlines()
    assert "val/roi_ssim" in log[0].split(",")
    meta = load_checkpoint(out).metadata
    assert "roi_ssim" in meta["best_val"] and meta["config"]["env"]["region"] == "implant"
    with pytest.raises(ValueError, match="region must be one of image, implant"):
        EnvConfig(region="knee")

