"""k-space corruption and re-acquisition: the draws are seeded and local to their lines, the
oracle repeats a line whose acquisition was spoiled, and the headroom gate measures it."""

import numpy as np
import pytest
import torch

from masc_gadget.acquisition.episode import initial_lines
from masc_gadget.config import load_config
from tests.conftest import CONFIGS
from training.data import load_split
from training.evaluation.corruption import CorruptionModel, ReacquireOracle, draw_attempts, kspace_of
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
    config = load_config(CONFIGS / "tiny.yaml", ["headroom.corruption=0.5", "headroom.corruption_kind=spike",
                                                  "headroom.slices_per_subject=0"])
    report = headroom(config, tiny_dataset, "train", [perturbed_mar], progress=False)
    run = report["runs"][0]
    assert set(run["corruption"]) == {"repeats_per_slice", "corrupted_lines_fixed", "corrupted_lines_oracle"}
    assert run["corruption"]["corrupted_lines_fixed"] > 0
    assert len(run["slices"]["oracle"]["ssim"]) == len(load_split(tiny_dataset, "train"))
    with pytest.raises(ValueError, match="set beam 1"):
        load_config(CONFIGS / "tiny.yaml", ["headroom.corruption=0.1", "headroom.beam=2"])
