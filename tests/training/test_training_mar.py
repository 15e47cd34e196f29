"""Stage 1 MAR pre-training on the tiny dataset."""

import csv

import numpy as np
import pytest
import torch

from masc_gadget.models.checkpoint import load_checkpoint, load_mar
from masc_gadget.config import load_config
from masc_gadget.acquisition.episode import AcquisitionConfig
from training.mar import MarTrainConfig, draw_masks, mar_loss, train_mar

from tests.conftest import CONFIGS


def _config(*extra):
    return load_config(CONFIGS / "tiny.yaml", ["mar_train.epochs=12", "mar_train.lr=0.003", "mar_train.input=mixed", *extra])


def test_pretraining_lowers_validation_loss(tiny_dataset, tmp_path, global_rng_guard):
    out = tmp_path / "mar.pt"
    best = train_mar(_config(), tiny_dataset, out, progress=False)
    assert best["loss"] < best["input_loss"]  # better than leaving the images alone (identity init)
    with open(out.with_suffix(".csv")) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 12 and rows[0]["epoch"] == "1"
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
    model, meta = load_mar(out, torch.device("cpu"))
    assert meta["kind"] == "mar" and meta["mar_model"]["width"] == 4 and meta["epoch"] == best["epoch"]
    assert meta["val"]["loss"] == pytest.approx(best["loss"])
    assert out.with_suffix(".png").stat().st_size > 10_000  # the learning curve, selected epoch marked


def test_resume_continues_where_it_stopped(tiny_dataset, tmp_path):
    first = tmp_path / "a.pt"
    train_mar(_config("mar_train.epochs=2"), tiny_dataset, first, progress=False)
    resumed = train_mar(_config("mar_train.epochs=4"), tiny_dataset, first,
                        resume=tmp_path / "a.last.pt", progress=False)
    straight = tmp_path / "b.pt"
    direct = train_mar(_config("mar_train.epochs=4"), tiny_dataset, straight, progress=False)
    # same seed, same data: stopping and resuming gives the run that never stopped
    assert resumed["loss"] == pytest.approx(direct["loss"], rel=1e-4)
    with open(first.with_suffix(".csv")) as fh:
        assert len(list(csv.DictReader(fh))) == 4
    last = load_checkpoint(tmp_path / "a.last.pt")
    assert last.metadata["epoch"] == 4 and "optimizer" in last.extra


@pytest.mark.parametrize("mode", ["undersampled", "mixed"])
def test_undersampled_inputs(tiny_dataset, tmp_path, mode):
    best = train_mar(_config("mar_train.epochs=1", f"mar_train.input={mode}"), tiny_dataset,
                     tmp_path / "m.pt", progress=False)
    assert np.isfinite(best["loss"]) and best["input_ssim"] < 0.95  # inputs are really undersampled


def test_draw_masks_budget_range():
    acq = AcquisitionConfig(initial=2, budget=5)
    masks = draw_masks(200, 32, acq, ("random", "equispaced"), np.random.default_rng(0)).numpy()
    counts = masks.sum(axis=1)
    assert counts.min() >= 2 and counts.max() <= 7 and len(set(counts)) > 3
    assert masks[:, 15:17].all()  # the initial centre lines are always there


def test_loss_is_scale_invariant_and_zero_at_target():
    rng = torch.Generator().manual_seed(0)
    t = torch.rand(3, 16, 16, generator=rng)
    p = t + 0.1 * torch.rand(3, 16, 16, generator=rng)
    assert float(mar_loss(t, t, 1.0)) == pytest.approx(0.0, abs=1e-6)
    assert float(mar_loss(7 * p, 7 * t, 1.0)) == pytest.approx(float(mar_loss(p, t, 1.0)), rel=1e-5)


def test_config_rejects_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        MarTrainConfig(policies=("nope",))


def test_clean_inputs_are_the_clean_images_and_training_reports_how_unchanged_they_stay(tiny_dataset, tmp_path):
    from masc_gadget.core.kspace import zero_filled
    from training.data import load_split
    from training.mar import draw_clean, network_inputs

    data = load_split(tiny_dataset, "val")
    index = torch.arange(len(data))
    masks = torch.zeros(len(data), data.n_pe, dtype=torch.bool)
    masks[:, : data.n_pe // 2] = True
    every = torch.ones(len(data), dtype=torch.bool)
    assert torch.equal(network_inputs(data, index, "full", None, torch.device("cpu"), clean=every), data.target)
    under = network_inputs(data, index, "undersampled", masks, torch.device("cpu"), clean=every)
    assert torch.equal(under, zero_filled(data.kspace_clean, masks))
    assert torch.equal(network_inputs(data, index, "full", None, torch.device("cpu"), clean=~every), data.metal_image)
    assert draw_clean(5, 0.0, np.random.default_rng(0)) is None  # no draw: earlier recipes keep their streams
    assert draw_clean(1000, 0.25, np.random.default_rng(0)).float().mean() == pytest.approx(0.25, abs=0.05)
    best = train_mar(_config("mar_train.epochs=2", "mar_train.clean_fraction=0.5"),
                     f"{tiny_dataset},{tiny_dataset}", tmp_path / "c.pt", progress=False)
    assert 0.5 < best["identity_ssim"] <= 1.0
    assert load_mar(tmp_path / "c.pt")[1]["data"] == f"{tiny_dataset},{tiny_dataset}"
    with pytest.raises(ValueError, match="clean_fraction must be in \\[0, 1\\], got 1.5"):
        MarTrainConfig(clean_fraction=1.5)


def test_acquisition_noise_has_the_asked_snr_and_per_slice_seeds_do_not_depend_on_batching():
    from masc_gadget.core.kspace import fft2c, ifft2c
    from training.mar import acquisition_noise, draw_anchor_noise

    image = torch.zeros(2, 64, 64)
    image[:, 16:48, 16:48] = 1.0  # tissue of mean signal 1
    k = fft2c(image.to(torch.complex64))
    noise = acquisition_noise(k, torch.tensor([10.0, 20.0]), torch.Generator().manual_seed(0))
    stds = ifft2c(noise).abs().pow(2).mean(dim=(-2, -1)).sqrt()  # orthonormal: image noise = k-space noise
    assert stds[0] == pytest.approx(0.1, rel=0.05) and stds[1] == pytest.approx(0.05, rel=0.05)
    snr, seeds = draw_anchor_noise(2, (10.0, 20.0), np.random.default_rng(0))
    both = acquisition_noise(k, snr, seeds=seeds)
    alone = acquisition_noise(k[1:], snr[1:], seeds=seeds[1:])
    assert torch.equal(both[1:], alone)
    assert draw_anchor_noise(2, (0.0, 0.0), np.random.default_rng(0)) is None
    with pytest.raises(ValueError, match="anchor_snr"):
        from training.mar import MarTrainConfig

        MarTrainConfig(anchor_snr=(30.0, 10.0))


def test_noisy_anchors_change_only_the_anchor_inputs(tiny_dataset):
    from training.data import load_split
    from training.mar import draw_anchor_noise, network_inputs

    data = load_split(tiny_dataset, "train")
    index = torch.arange(len(data))
    clean = torch.zeros(len(data), dtype=torch.bool)
    clean[0] = True
    noise = draw_anchor_noise(len(data), (20.0, 40.0), np.random.default_rng(1))
    quiet = network_inputs(data, index, "full", None, torch.device("cpu"), clean=clean)
    noisy = network_inputs(data, index, "full", None, torch.device("cpu"), clean=clean, noise=noise)
    assert torch.equal(quiet[1:], noisy[1:]) and not torch.equal(quiet[0], noisy[0])
    assert torch.allclose(quiet[0], data.target[0])  # the noiseless anchor is the target itself
