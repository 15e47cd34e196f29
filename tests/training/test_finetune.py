"""One MAR fine-tuning recipe for every method (training.finetune, masc train finetune) and the
co-adaptive loop's record of the masks it served."""

import csv

import numpy as np
import pytest
import torch

from masc_gadget.acquisition.learned import load_learned
from masc_gadget.cli import main
from masc_gadget.config import load_config
from masc_gadget.models.checkpoint import load_checkpoint
from training.finetune import FinetuneConfig, JointFinetuneConfig, episode_pairs, finetune_mar

from tests.conftest import CONFIGS

TINY = ["--config", str(CONFIGS / "tiny.yaml"), "--log-level", "WARNING"]


def test_episode_pairs_served_and_pre_action():
    lines = np.array([[4, 3, 0, 7], [4, 3, 6, 1]])  # 2 initial lines, then 2 chosen
    slices, masks = episode_pairs(lines, 8, 2, "served")
    assert slices.tolist() == [0, 1] and masks.sum(dim=1).tolist() == [4, 4]
    assert masks[0, [0, 3, 4, 7]].all() and masks[1, [1, 3, 4, 6]].all()
    slices, masks = episode_pairs(lines, 8, 2, "pre-action")
    # before each of the 2 actions: the 2 initial lines, then those and the first chosen line
    assert slices.tolist() == [0, 1, 0, 1] and masks.sum(dim=1).tolist() == [2, 2, 3, 3]
    assert masks[2, 0] and masks[3, 6] and not masks[0, 0]
    with pytest.raises(ValueError, match="served' or 'pre-action"):
        episode_pairs(lines, 8, 2, "final")


def test_recipe_budgets_and_checks():
    assert FinetuneConfig(epochs=3, batch_size=16).total_steps(40) == 9
    assert FinetuneConfig(steps=5).total_steps(40) == 5
    joint = JointFinetuneConfig()
    assert (joint.masks, joint.lr, joint.batch_size, joint.loss) == ("pre-action", 1e-5, 32, "mse")
    with pytest.raises(ValueError, match="clean_fraction"):
        FinetuneConfig(clean_fraction=1.5)
    with pytest.raises(ValueError, match="identity_fraction"):
        FinetuneConfig(identity_fraction=-0.1)
    config = load_config(CONFIGS / "small.yaml")  # the committed budgets of the fair comparison
    assert config["finetune"].masks == "served" and config["finetune_joint"].masks == "pre-action"


class _Recorder(torch.nn.Module):
    """A one-parameter network that keeps the inputs it was given."""

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(()))
        self.seen = []

    def forward(self, x):
        self.seen.append(x.detach().clone())
        return x * self.gain


@pytest.mark.parametrize("identity", [0.0, 1.0])
def test_identity_anchors_are_fully_sampled_clean_images(identity):
    from masc_gadget.core.kspace import ifft2c, zero_filled

    gen = torch.Generator().manual_seed(0)
    metal = torch.randn(3, 8, 8, dtype=torch.complex64, generator=gen)
    clean = torch.randn(3, 8, 8, dtype=torch.complex64, generator=gen)
    masks = torch.zeros(3, 8, dtype=torch.bool)
    masks[:, [3, 4]] = True
    net = _Recorder()
    finetune_mar(net, torch.optim.SGD(net.parameters(), lr=0.0), metal, ifft2c(clean).abs(), torch.arange(3),
                 masks, 1, 3, torch.Generator().manual_seed(1), clean_kspace=clean, clean_fraction=1.0,
                 identity_fraction=identity)
    (seen,) = net.seen
    expected = ifft2c(clean).abs() if identity else zero_filled(clean, masks)
    order = [int(np.argmin([float((s - e).abs().max()) for e in expected])) for s in seen]
    assert sorted(order) == [0, 1, 2]  # a shuffled batch: every slice once, as expected
    assert torch.allclose(seen, expected[order], atol=1e-5)


def test_fallback_pairs_get_centre_out_lines():
    from masc_gadget.core.kspace import zero_filled
    from training.finetune import center_out_masks

    # centre-out from the k-space centre (row 4 of 8): 4, 5, 3, 6, 2, ...
    assert center_out_masks(torch.tensor([1, 2, 3]), 8).nonzero()[:, 1].tolist() == [4, 4, 5, 3, 4, 5]
    gen = torch.Generator().manual_seed(0)
    metal = torch.randn(3, 8, 8, dtype=torch.complex64, generator=gen)
    masks = torch.zeros(3, 8, dtype=torch.bool)
    masks[:, [0, 7]] = True  # two edge lines; the fallback pair has centre-out's two instead
    net = _Recorder()
    finetune_mar(net, torch.optim.SGD(net.parameters(), lr=0.0), metal, metal.abs(), torch.arange(3), masks, 1, 3,
                 torch.Generator().manual_seed(1), fallback_fraction=1.0)
    (seen,) = net.seen
    centre = torch.zeros(3, 8, dtype=torch.bool)
    centre[:, [4, 5]] = True
    expected = zero_filled(metal, centre)
    assert torch.allclose(seen.sort(dim=0).values, expected.sort(dim=0).values, atol=1e-5)


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("recipe", ["finetune", "finetune_joint"])
def test_a_policy_keeps_its_lines_and_gets_the_recipe_network(tiny_dataset, perturbed_mar, tmp_path, recipe):
    fixed = tmp_path / "fixed.pt"
    assert main(["train", "fixed-order", *TINY, "--data", str(tiny_dataset), "--mar", str(perturbed_mar),
                 "--out", str(fixed), "--set", "fixed_order.population_slices=2", "--set", "finetune.epochs=0",
                 "--set", "fixed_order.device=cpu"]) == 0
    out = tmp_path / "tuned.pt"
    assert main(["train", "finetune", *TINY, "--data", str(tiny_dataset), "--policy", str(fixed),
                 "--mar", str(perturbed_mar), "--recipe", recipe, "--device", "cpu", "--out", str(out),
                 "--set", f"{recipe}.steps=4", "--set", f"{recipe}.val_every=2", "--set", f"{recipe}.batch_size=2",
                 "--set", f"{recipe}.lr=0.001"]) == 0
    rows = _rows(tmp_path / "tuned.csv")
    assert [int(r["step"]) for r in rows] == [0, 2, 4]  # the network as given, then every 2 steps
    meta = load_checkpoint(out).metadata
    best = max(float(r["val_ssim"]) for r in rows)
    assert meta["best_val"]["ssim"] == pytest.approx(best)  # selection on validation
    assert meta["recipe"] == recipe and meta["masks_from"] == str(fixed) and meta["line_sets"]["train"] == 1
    assert meta["finetune"]["masks"] == ("served" if recipe == "finetune" else "pre-action")
    # served like the policy it came from: the same order, the fine-tuned network
    policy, mar, _ = load_learned(out, "cpu")
    assert policy.order.tolist() == load_checkpoint(fixed).metadata["order"]
    tuned = load_checkpoint(out).state_dicts["mar"]
    before = load_checkpoint(perturbed_mar).state_dicts["mar"]
    changed = any(not torch.equal(tuned[k], before[k]) for k in before)
    assert changed == (meta["best_val"]["step"] > 0)


def test_the_network_can_be_selected_on_other_folders(tiny_dataset, perturbed_mar, tmp_path):
    import shutil

    fixed = tmp_path / "fixed.pt"
    assert main(["train", "fixed-order", *TINY, "--data", str(tiny_dataset), "--mar", str(perturbed_mar),
                 "--out", str(fixed), "--set", "fixed_order.population_slices=2", "--set", "finetune.epochs=0",
                 "--set", "fixed_order.device=cpu"]) == 0
    other = tmp_path / "other"
    shutil.copytree(tiny_dataset, other)
    out = tmp_path / "tuned.pt"
    assert main(["train", "finetune", *TINY, "--data", str(tiny_dataset), "--select-on", str(other),
                 "--policy", str(fixed), "--mar", str(perturbed_mar), "--device", "cpu", "--out", str(out),
                 "--set", "finetune.steps=2", "--set", "finetune.batch_size=2"]) == 0
    meta = load_checkpoint(out).metadata
    assert meta["selected_on"] == str(other) and meta["data"] == str(tiny_dataset)
    assert [d["folder"] for d in meta["provenance"]["data"]] == [tiny_dataset.name, "other"]
    assert main(["train", "finetune", *TINY, "--data", str(tiny_dataset), "--select-on", str(tmp_path / "none"),
                 "--policy", str(fixed), "--mar", str(perturbed_mar), "--device", "cpu",
                 "--out", str(tmp_path / "x.pt")]) != 0


def test_every_trained_checkpoint_says_what_touched_its_data(tiny_dataset, perturbed_mar, tmp_path):
    out = tmp_path / "fixed.pt"
    assert main(["train", "fixed-order", *TINY, "--data", str(tiny_dataset), "--mar", str(perturbed_mar),
                 "--out", str(out), "--set", "fixed_order.population_slices=2", "--set", "finetune.epochs=1",
                 "--set", "fixed_order.device=cpu"]) == 0
    for path in (out, tmp_path / "fixed.last.pt"):
        prov = load_checkpoint(path).metadata["provenance"]
        assert prov["data"][0]["folder"] == tiny_dataset.name and len(prov["data"][0]["manifest_sha256"]) == 64
        train, val = set(prov["subjects"]["train"]), set(prov["subjects"]["val"])
        assert train and val and not train & val  # trained on one, selected on the other
        assert prov["git_commit"] is None or len(prov["git_commit"]) >= 40
    # a calibration names its subjects too, and the export carries both
    check = tmp_path / "check"
    assert main(["mar-check", *TINY, "--data", str(tiny_dataset), "--split", "val", "--mar", f"f={out}",
                 "--calibrate", "--out", str(check)]) == 0
    shipped = tmp_path / "shipped.pt"
    assert main(["export", str(out), "--out", str(shipped), "--ood", f"{check / 'ood.json'}:f"]) == 0
    meta = load_checkpoint(shipped).metadata
    assert set(meta["ood"]["calibrated_on"]["subjects"]) == val
    record = __import__("json").loads(shipped.with_suffix(".json").read_text())
    assert record["provenance"]["subjects"]["val"] == sorted(val) and record["command"]


def test_coadaptive_run_records_the_masks_it_served(tiny_masc):
    from training.coadapt import load_served, served_path

    slices, masks = load_served(served_path(tiny_masc))
    acq = load_config(CONFIGS / "tiny.yaml")["acquisition"]
    assert len(slices) > 0 and len(slices) == len(masks)
    assert (masks.sum(axis=1) == acq.initial + acq.budget).all()  # each a whole episode's lines
    assert slices.min() >= 0
