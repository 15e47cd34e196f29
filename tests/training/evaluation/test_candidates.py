"""The headroom candidates: k-space corruption with re-acquisition (seeded draws, local to their
lines; the oracle repeats a spoiled line) and multi-coil CG-SENSE, each measured by the gate."""

import numpy as np
import pytest
import torch

from masc_gadget.acquisition.episode import initial_lines
from masc_gadget.config import load_config
from tests.conftest import CONFIGS
from training.data import load_split
from training.oracle import ReacquireOracle, kspace_of
from training.rl.corruption import CorruptionModel, draw_attempts
from training.evaluation.headroom import headroom


def _kspace(n=2, pe=16, ro=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.complex(torch.randn(n, pe, ro, generator=gen), torch.randn(n, pe, ro, generator=gen))


def test_draws_are_seeded_and_stay_on_their_lines():
    k = _kspace()
    slices = np.array([0, 1])
    none, hit = draw_attempts(k, slices, CorruptionModel(0.0), 2)
    assert torch.equal(none[:, 0], k) and torch.equal(none[:, 1], k) and not hit.any()
    moved, hit = draw_attempts(k, slices, CorruptionModel(1.0, "motion"), 2)
    assert hit.all() and torch.allclose(moved.abs(), k[:, None].abs().expand_as(moved), atol=1e-5)
    assert not torch.allclose(moved[:, 0], k)  # the phase changed, the magnitude did not
    again, _ = draw_attempts(k, slices, CorruptionModel(1.0, "motion"), 2)
    assert torch.equal(moved, again)
    spiked, hit = draw_attempts(k, slices, CorruptionModel(0.3, "spike"), 3, seed=4)
    changed = (spiked != k[:, None]).sum(dim=-1).numpy()  # samples changed per line and attempt
    assert np.array_equal(changed > 0, hit) and changed.max() == 1 and 0 < hit.mean() < 1
    count = np.array([[0] * 15 + [1], [2] * 16])
    latest = kspace_of(spiked, count)
    assert torch.equal(latest[0], spiked[0, 0]) and torch.equal(latest[1], spiked[1, 1])
    with pytest.raises(ValueError, match="probability"):
        CorruptionModel(1.5)
    with pytest.raises(ValueError, match="kind"):
        CorruptionModel(0.1, "ghost")


def test_the_oracle_acquires_a_spoiled_line_again():
    k = _kspace(1, 16, 16, seed=2)
    k[0, 8] *= 40  # a strong centre line, as in an image
    attempts = k[:, None].repeat(1, 2, 1, 1)
    centre = int(initial_lines(16, 1)[0])
    attempts[0, 0, centre, 3] += 1e4  # its first acquisition carries a huge spike
    start = np.zeros((1, 16), dtype=bool)
    start[0, centre] = True
    target = torch.fft.ifft2(torch.fft.ifftshift(k, dim=(-2, -1))).abs().float()
    actions, count = ReacquireOracle().plan(attempts, start, 2, target, None)
    assert actions[0, 0] == centre and count[0, centre] == 2 and count.sum() == 3


def test_headroom_with_corruption(tiny_dataset, perturbed_mar):
    config = load_config(CONFIGS / "tiny.yaml", ["headroom.corruption.probability=0.5", "headroom.corruption.kind=spike",
                                                  "headroom.slices_per_subject=0"])
    report = headroom(config, tiny_dataset, "train", [perturbed_mar], progress=False)
    run = report.runs[0]
    assert set(run.corruption) == {"repeats_per_slice", "repeats_per_slice_gated", "corrupted_lines_fixed",
                                   "corrupted_lines_oracle"}
    assert run.corruption["corrupted_lines_fixed"] > 0
    assert len(run.slices["oracle"]["ssim"]) == len(load_split(tiny_dataset, "train"))
    with pytest.raises(ValueError, match="set beam 1"):
        load_config(CONFIGS / "tiny.yaml", ["headroom.corruption=0.1", "headroom.beam=2"])


def test_sense_with_one_uniform_coil_is_the_zero_filled_image_and_coils_resolve_aliasing():
    from masc_gadget.core.kspace import fft2c, zero_filled
    from masc_gadget.core.metrics import slice_metrics
    from sim_scanner.physics.coils import body_array
    from training.evaluation.sense import SenseRecon

    gen = torch.Generator().manual_seed(1)
    image = torch.zeros(2, 32, 32)
    image[:, 6:26, 8:24] = 1.0 + 0.2 * torch.rand(2, 20, 16, generator=gen)
    k = fft2c(image.to(torch.complex64))
    mask = torch.zeros(2, 32, dtype=torch.bool)
    mask[:, ::2] = True  # R = 2: the zero-filled image folds over half the field of view
    one = SenseRecon(torch.ones(1, 32, 32, dtype=torch.complex64), iterations=5, lam=0.0)
    assert torch.allclose(one(k, mask), zero_filled(k, mask), atol=1e-4)
    eight = SenseRecon(torch.from_numpy(body_array(8, (32, 32), (300.0, 300.0))), iterations=30)
    assert slice_metrics(eight(k, mask), image)["nmse"].max() < 0.1 * slice_metrics(zero_filled(k, mask), image)["nmse"].min()
    with pytest.raises(ValueError, match="maps must be complex"):
        SenseRecon(torch.ones(8, 32, 32))


def test_headroom_with_sense_needs_no_mar(tiny_dataset, perturbed_mar):
    config = load_config(CONFIGS / "tiny.yaml", ["headroom.recon=sense", "headroom.coils=4",
                                                  "headroom.sense_iterations=3"])
    report = headroom(config, tiny_dataset, "train", [], progress=False)
    assert report.runs[0].mar == "none (4-coil SENSE)" and report.summary["n_subjects"] == 2
    with pytest.raises(ValueError, match="drop --mar"):
        headroom(config, tiny_dataset, "train", [perturbed_mar], progress=False)
    with pytest.raises(ValueError, match="give at least one --mar"):
        headroom(load_config(CONFIGS / "tiny.yaml"), tiny_dataset, "train", [], progress=False)
