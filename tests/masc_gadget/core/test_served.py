"""The served image: dtype, non-finite fallbacks and the clamp, in one function."""

import pytest
import torch

from masc_gadget.core.served import served_images


def _images(seed=0, b=3, h=8, w=6):
    gen = torch.Generator().manual_seed(seed)
    zf = torch.rand(b, h, w, generator=gen)
    corrected = torch.randn(b, h, w, generator=gen)  # a residual that dips below zero
    return zf, corrected


def test_without_mar_the_image_is_the_zero_filled_one():
    zf, _ = _images()
    out = served_images(zf.double())
    assert out.zero_filled.dtype == out.image.dtype == torch.float32
    assert torch.equal(out.image, zf) and torch.equal(out.zero_filled, zf)
    assert not out.mar_used.any()


def test_mar_output_is_clamped_at_zero_and_promoted_to_float32():
    zf, corrected = _images()
    assert (corrected < 0).any()
    out = served_images(zf, corrected.half())
    assert out.image.dtype == torch.float32 and out.mar_used.all()
    assert torch.equal(out.image, corrected.half().float().clamp_min(0))
    assert (out.image >= 0).all()


def test_a_slice_whose_mar_output_is_not_finite_gets_its_zero_filled_image():
    zf, corrected = _images()
    corrected[1, 2, 3] = float("nan")
    corrected[2, 0, 0] = float("inf")
    out = served_images(zf, corrected)
    assert out.mar_used.tolist() == [True, False, False]
    assert torch.equal(out.image[0], corrected[0].clamp_min(0))
    assert torch.equal(out.image[1], zf[1]) and torch.equal(out.image[2], zf[2])


def test_non_finite_zero_filled_pixels_become_zero():
    zf, _ = _images()
    zf[0, 1, 1] = float("inf")
    zf[2, 3, 3] = float("nan")
    out = served_images(zf)
    assert torch.isfinite(out.image).all() and out.image[0, 1, 1] == 0 and out.image[2, 3, 3] == 0


@pytest.mark.parametrize("zf, corrected, match", [
    (torch.zeros(4, 4), None, r"real \(B, H, W\)"),
    (torch.zeros(1, 4, 4, dtype=torch.complex64), None, r"real \(B, H, W\)"),
    (torch.zeros(1, 4, 4), torch.zeros(1, 4, 5), "shape"),
])
def test_bad_input_is_named(zf, corrected, match):
    with pytest.raises(ValueError, match=match):
        served_images(zf, corrected)
