"""Coil combination against hand-made 2- and 8-coil cases."""

import math

import numpy as np
import pytest
import torch

from masc_gadget.core.coils import calibration_rows, coil_combine, sensitivities
from masc_gadget.core.kspace import fft2c, zero_filled


def _object(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    disc = (((y - n / 2) ** 2 + (x - n / 2) ** 2) < (0.35 * n) ** 2).double()
    phase = torch.exp(1j * 0.3 * torch.randn(n, n, generator=g, dtype=torch.float64))
    return disc * (1 + 0.3 * torch.rand(n, n, generator=g, dtype=torch.float64)) * phase


@pytest.mark.parametrize("coils", [2, 8])
@pytest.mark.parametrize("method", ["rss", "sensitivity"])
def test_uniform_sensitivities_give_the_single_coil_image(coils, method):
    image = _object()
    weights = torch.exp(1j * torch.linspace(0, 2, coils, dtype=torch.float64)) / math.sqrt(coils)  # sum |a|^2 = 1
    k_single = fft2c(image)[None]
    k_coils = (weights[:, None, None] * fft2c(image))[None]
    mask = torch.zeros(1, 32, dtype=torch.bool)
    mask[0, 14:19] = True  # a centre run (calibration)
    mask[0, [3, 9, 25, 29]] = True
    combined = coil_combine(k_coils, mask, method)
    assert torch.allclose(combined, zero_filled(k_single[:, ], mask), atol=1e-10)


def test_one_coil_is_exactly_the_zero_filled_image():
    k = fft2c(_object()).to(torch.complex64)[None, None]
    mask = torch.rand(1, 32, generator=torch.Generator().manual_seed(3)) < 0.5
    for method in ("rss", "sensitivity"):
        assert torch.equal(coil_combine(k, mask, method), zero_filled(k[:, 0], mask))


def test_sensitivity_combine_recovers_the_object_under_smooth_coil_profiles():
    n, coils = 32, 8
    image = _object(n).abs().to(torch.complex128)
    y, x = torch.meshgrid(torch.arange(n, dtype=torch.float64), torch.arange(n, dtype=torch.float64), indexing="ij")
    profiles = []
    for c in range(coils):  # coils on a ring around the object, each brighter on its side
        angle = 2 * math.pi * c / coils
        cy, cx = n / 2 + 0.8 * n * math.sin(angle), n / 2 + 0.8 * n * math.cos(angle)
        profiles.append(torch.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * (0.6 * n) ** 2)) * np.exp(1j * angle))
    sens = torch.stack(profiles)
    sens = sens / torch.sqrt((sens.abs() ** 2).sum(0))  # normalised: the combine's ideal is |image|
    k = fft2c(sens * image)[None]
    full = torch.ones(1, n, dtype=torch.bool)
    est = sensitivities(k, full)
    assert torch.allclose((est.abs() ** 2).sum(1)[0][image.abs() > 0], torch.ones(1, dtype=torch.float64))
    combined = coil_combine(k, full, "sensitivity")[0]
    inside = image.abs() > 0
    assert torch.allclose(combined[inside], image.abs()[inside], rtol=1e-6)
    # rss of normalised sensitivities is the image too; both are finite where the coils see nothing
    assert torch.isfinite(coil_combine(k, full, "rss")).all() and torch.isfinite(combined).all()


def test_calibration_rows_and_errors():
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, [3, 4, 5, 6, 8]] = True  # centre 5: the run 3..6
    mask[1, [1, 9]] = True  # centre not acquired: no calibration
    rows = calibration_rows(mask)
    assert rows[0].nonzero().flatten().tolist() == [3, 4, 5, 6] and not rows[1].any()
    with pytest.raises(ValueError, match="coil combine must be one of"):
        coil_combine(torch.zeros(1, 2, 10, 4, dtype=torch.complex64), mask[:1], "average")
    with pytest.raises(ValueError, match="mask must be"):
        coil_combine(torch.zeros(1, 2, 10, 4, dtype=torch.complex64), mask, "rss")


def _coil_kspace(n=32, coils=4):
    image = _object(n).to(torch.complex64)
    y, x = torch.meshgrid(torch.arange(n, dtype=torch.float32), torch.arange(n, dtype=torch.float32), indexing="ij")
    profiles = torch.stack([torch.exp(-((x - c * n / (coils - 1)) ** 2) / (0.5 * n ** 2)) * np.exp(1j * c)
                            for c in range(coils)]).to(torch.complex64)
    return fft2c(profiles * image)[None]  # (1, coils, n, n)


def test_sensitivity_without_calibration_lines_is_rss_not_nan():
    k = _coil_kspace()
    mask = torch.zeros(1, 32, dtype=torch.bool)
    mask[0, :5] = True  # a linear stream before the centre: no calibration line yet
    est = sensitivities(k, mask)
    assert torch.isfinite(est).all() and torch.count_nonzero(est) == 0
    assert torch.equal(coil_combine(k, mask, "sensitivity"), coil_combine(k, mask, "rss"))
    empty = torch.zeros(1, 32, dtype=torch.bool)
    assert torch.isfinite(coil_combine(k, empty, "sensitivity")).all()


@pytest.mark.parametrize("order", ["linear", "reverse", "centric", "centre-last"])
def test_sensitivity_combine_is_finite_in_any_order_and_ends_at_the_all_lines_image(order):
    """Every partial image of a streamed order is finite; the RSS fallback holds until the centre
    line comes, and the image of all lines equals the all-lines reference whatever the order."""
    n = 32
    k = _coil_kspace(n)
    lines = {"linear": list(range(n)), "reverse": list(range(n))[::-1],
             "centric": sorted(range(n), key=lambda l: (abs(l - n // 2), l)),
             "centre-last": [l for l in range(n) if l != n // 2] + [n // 2]}[order]
    mask = torch.zeros(1, n, dtype=torch.bool)
    for line in lines:
        mask[0, line] = True
        image = coil_combine(k, mask, "sensitivity")
        assert torch.isfinite(image).all(), (order, line)
        if not mask[0, n // 2]:
            assert torch.equal(image, coil_combine(k, mask, "rss"))
    reference = coil_combine(k, torch.ones(1, n, dtype=torch.bool), "sensitivity")
    nmse = float(((image - reference) ** 2).sum() / (reference ** 2).sum())
    assert nmse < 1e-10
