"""The one measurement of a line set's served image (training.scoring)."""

import collections
import contextlib
import sys

import numpy as np
import pytest
import torch

from masc_gadget.acquisition.episode import initial_lines
from masc_gadget.core.kspace import zero_filled
from masc_gadget.core.metrics import slice_metrics
from masc_gadget.core.ood import OodCalibration
from masc_gadget.models.checkpoint import load_mar
from training.data import load_split
from training.scoring import line_masks, score_masks


def test_line_masks_hold_the_centre_and_the_lines():
    masks = line_masks(3, 16, 2, [0, 15])
    assert masks.shape == (3, 16) and masks.dtype == bool
    assert masks[:, initial_lines(16, 2)].all() and masks[:, [0, 15]].all() and masks.sum() == 3 * 4
    per_slice = line_masks(2, 16, 1, np.array([[3], [5]]))
    assert per_slice[0, 3] and not per_slice[0, 5] and per_slice[1, 5] and per_slice.sum() == 4
    assert line_masks(2, 16, 1, np.zeros((0,), dtype=np.int64)).sum() == 2  # the centre alone


def test_score_masks_scores_the_served_image(tiny_dataset, perturbed_mar):
    data = load_split(tiny_dataset, "train")
    mar, _ = load_mar(perturbed_mar, "cpu")
    rng = np.random.default_rng(0)
    masks = line_masks(len(data), data.n_pe, 1, rng.choice(data.n_pe, size=(len(data), 3)))
    scores = score_masks(data, masks, mar, batch_size=3)
    # by hand: the network's output, clamped at zero, against the target
    with torch.no_grad():
        zf = zero_filled(data.kspace_metal, torch.from_numpy(masks))
        by_hand = slice_metrics(mar(zf).clamp_min(0), data.target)
    np.testing.assert_allclose(scores.image["ssim"], by_hand["ssim"].double().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores.zero_filled["psnr"], slice_metrics(zf, data.target)["psnr"].double().numpy(),
                               rtol=1e-5)
    assert scores.mar_used.all() and len(scores) == len(data) and not scores.roi and not scores.ood
    # batching does not change a figure
    one = score_masks(data, masks, mar, batch_size=len(data))
    np.testing.assert_allclose(one.image["ssim"], scores.image["ssim"], rtol=1e-5, atol=1e-6)
    # without a network the served image is the zero-filled one
    plain = score_masks(data, masks, None, metrics=("ssim",))
    np.testing.assert_array_equal(plain.image["ssim"], plain.zero_filled["ssim"])
    assert list(plain.image) == ["ssim"] and not plain.mar_used.any()


def test_score_masks_region_ood_and_fallback(tiny_dataset, perturbed_mar):
    data = load_split(tiny_dataset, "train")
    mar, _ = load_mar(perturbed_mar, "cpu")
    masks = line_masks(len(data), data.n_pe, 1, [0, 5])
    roi = data.periprosthetic_roi(4)
    scored = score_masks(data, masks, mar, roi=roi, metrics=("ssim", "psnr"), kinds=("residual", "consistency"))
    assert set(scored.roi) == {"ssim", "psnr"} and set(scored.flat()) == {"ssim", "psnr", "roi_ssim", "roi_psnr"}
    assert set(scored.ood) == {"residual", "consistency"}
    # an OOD rule whose threshold every slice passes serves every slice zero-filled
    everything = score_masks(data, masks, mar, ood=OodCalibration("residual", 1e-9))
    assert not everything.mar_used.any()
    np.testing.assert_array_equal(everything.image["ssim"], everything.zero_filled["ssim"])


def test_doing_nothing_is_centre_out_zero_filled_with_as_many_lines(tiny_dataset):
    from training.scoring import center_out_masks, do_nothing, harmed

    data = load_split(tiny_dataset, "train")
    masks = center_out_masks(len(data), data.n_pe, 1, 2)
    assert (masks.sum(axis=1) == 3).all() and masks[:, data.n_pe // 2].all()
    centre = np.flatnonzero(masks[0])
    assert centre.max() - centre.min() == 2  # contiguous around the centre
    nothing = do_nothing(data, 1, 2)
    np.testing.assert_array_equal(nothing["ssim"], score_masks(data, masks, None).zero_filled["ssim"])
    assert harmed(nothing["ssim"] - 0.01, nothing["ssim"]).all() and not harmed(nothing["ssim"], nothing["ssim"]).any()


def test_score_masks_refuses_masks_of_another_shape(tiny_dataset):
    data = load_split(tiny_dataset, "train")
    with pytest.raises(ValueError, match=r"masks must be \(\d+, 32\) bool"):
        score_masks(data, np.ones((len(data) + 1, data.n_pe), dtype=bool), None)
    with pytest.raises(ValueError, match="batch_size"):
        score_masks(data, np.ones((len(data), data.n_pe), dtype=bool), None, batch_size=0)


@contextlib.contextmanager
def calls_to(*functions):
    """Count the calls of ``functions`` while the block runs, however the caller bound their names
    (the profiler sees each call's code object)."""
    codes = {f.__code__: f.__name__ for f in functions}
    seen = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            seen[codes[frame.f_code]] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


def test_every_site_that_scores_a_line_set_goes_through_the_one_measurement(tiny_dataset, perturbed_mar, tmp_path):
    """The headroom gate, the fixed order's selection, the MAR check, the environment's validation and
    masc eval score a line set's served image with one function (``score_batch``), and build a
    protocol's masks with one (``line_masks``) where they start from lines."""
    from masc_gadget.acquisition.policies import make_policy
    from masc_gadget.config import load_config
    from training.evaluation.evaluate import run_method
    from training.evaluation.headroom import headroom
    from training.evaluation.marcheck import mar_check
    from training.fixed_order import train_fixed_order
    from training.rl.env import BatchedAcquisitionEnv, EnvConfig
    from training.scoring import score_batch

    from tests.conftest import CONFIGS

    config = load_config(CONFIGS / "tiny.yaml", ["headroom.slices_per_subject=1", "fixed_order.population_slices=1",
                                                 "fixed_order.device=cpu", "finetune.epochs=1"])
    data, mar = load_split(tiny_dataset, "val"), load_mar(perturbed_mar)[0]
    sites = {
        "headroom": lambda: headroom(config, tiny_dataset, "train", [perturbed_mar], progress=False),
        "fixed order": lambda: train_fixed_order(config, tiny_dataset, perturbed_mar, tmp_path / "f.pt",
                                                 progress=False),
        "mar check": lambda: mar_check({"p": mar}, str(tiny_dataset), "val", 1, 2, tmp_path / "c"),
        "environment": lambda: BatchedAcquisitionEnv(data, EnvConfig(n_envs=1), 1, 2, mar).evaluate(
            lambda obs: (~obs.mask).float().argmax(dim=1)),
        "masc eval": lambda: run_method(make_policy("center-out"), data, 1, 2, mar, 0, 8, torch.device("cpu")),
    }
    for name, run in sites.items():
        with calls_to(score_batch, line_masks) as seen:
            run()
        assert seen["score_batch"] > 0, f"{name} scores its images elsewhere"
        if name in ("headroom", "fixed order", "mar check"):
            assert seen["line_masks"] > 0, f"{name} builds its masks elsewhere"
