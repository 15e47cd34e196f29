"""Per-slice metrics against scikit-image, hand cases, the scaling convention, SSIM gradients."""

import math

import numpy as np
import pytest
import torch
from skimage.metrics import (
    mean_squared_error,
    peak_signal_noise_ratio,
    structural_similarity,
)

from masc_gadget.core.metrics import (
    HIGHER_IS_BETTER,
    METRICS,
    QualityReference,
    mae,
    mse,
    nmse,
    psnr,
    quality,
    scale_by_target,
    slice_metrics,
    ssim,
    ssim_loss,
)

SIZES = [(7, 7), (16, 16), (31, 45), (64, 48), (33, 17), (96, 96)]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _skimage_ssim(x: np.ndarray, y: np.ndarray) -> float:
    return structural_similarity(
        x, y, win_size=7, data_range=1.0, gaussian_weights=False,
        use_sample_covariance=True, K1=0.01, K2=0.03,
    )


def _structured(h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """A phantom-like magnitude image: ellipse, insert, hole, texture, zero background."""
    yy, xx = np.mgrid[:h, :w].astype(np.float64)
    cy, cx = (h - 1) / 2, (w - 1) / 2
    img = 0.6 * (((yy - cy) / (0.42 * h)) ** 2 + ((xx - cx) / (0.38 * w)) ** 2 < 1)
    img += 0.4 * ((yy - 0.4 * h) ** 2 + (xx - 0.55 * w) ** 2 < (0.12 * min(h, w)) ** 2)
    img *= 1 - ((yy - 0.65 * h) ** 2 + (xx - 0.4 * w) ** 2 < (0.08 * min(h, w)) ** 2)
    img *= 1 + 0.05 * np.sin(xx / 2.5) * np.cos(yy / 4)
    return img * rng.uniform(0.5, 300.0)  # arbitrary units: the metrics scale them


def _pair(kind: str, h: int, w: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(pred, target) float64 images of one kind."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        target = rng.random((h, w))
        pred = np.clip(target + 0.2 * rng.standard_normal((h, w)), 0, None)
    elif kind == "structured":
        target = _structured(h, w, rng)
        noise = 0.05 * target.max() * rng.standard_normal((h, w))
        pred = np.abs(target + noise + 0.1 * np.roll(target, h // 3, axis=0))  # noise + ghost
    else:  # "close": nearly identical, the regime where float32 cancellation bites
        target = _structured(h, w, rng)
        pred = target + 1e-4 * target.max() * rng.standard_normal((h, w))
    return pred, target


def _scaled_np(pred: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    m = target.max()
    return pred / m, target / m


# --- SSIM against scikit-image --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "structured", "close"])
@pytest.mark.parametrize("h, w", SIZES)
def test_ssim_matches_skimage(kind, h, w):
    pairs = [_pair(kind, h, w, seed) for seed in range(3)]
    expected = [_skimage_ssim(*_scaled_np(p, t)) for p, t in pairs]
    pred = torch.tensor(np.stack([p for p, _ in pairs]))
    target = torch.tensor(np.stack([t for _, t in pairs]))
    got64 = slice_metrics(pred, target)["ssim"]
    got32 = slice_metrics(pred.float(), target.float())["ssim"]
    assert got64.dtype == torch.float64 and got32.dtype == torch.float32
    np.testing.assert_allclose(got64.numpy(), expected, rtol=0, atol=1e-10)
    np.testing.assert_allclose(got32.numpy(), expected, rtol=0, atol=1e-4)
    # the measured error is far below the tolerance (about 1e-6 on these images)
    assert np.max(np.abs(got32.numpy() - expected)) < 2e-5


def test_ssim_on_scaled_images_matches_skimage_directly():
    pred, target = _pair("structured", 40, 30, seed=4)
    p, t = _scaled_np(pred, target)
    got = ssim(torch.tensor(p)[None], torch.tensor(t)[None])
    np.testing.assert_allclose(got.numpy(), [_skimage_ssim(p, t)], rtol=0, atol=1e-10)


def test_ssim_accepts_channel_dim_and_numpy():
    pred, target = _pair("random", 20, 24, seed=5)
    p, t = torch.tensor(pred)[None], torch.tensor(target)[None]
    torch.testing.assert_close(ssim(p[:, None], t[:, None]), ssim(p, t))
    torch.testing.assert_close(ssim(pred[None], target[None]), ssim(p, t))


def test_ssim_data_range_per_slice():
    pairs = [_pair("random", 16, 16, seed) for seed in range(3)]
    p = torch.tensor(np.stack([a for a, _ in pairs]))
    t = torch.tensor(np.stack([b for _, b in pairs]))
    ranges = torch.tensor([1.0, 3.0, 0.5], dtype=torch.float64)
    scaled = ssim(p * ranges[:, None, None], t * ranges[:, None, None], data_range=ranges)
    torch.testing.assert_close(scaled, ssim(p, t))
    for i in range(3):  # a (B,) range is the same as one float per slice
        r = float(ranges[i])
        torch.testing.assert_close(ssim(r * p[i : i + 1], r * t[i : i + 1], data_range=r),
                                   scaled[i : i + 1])
    torch.testing.assert_close(ssim(p, t, data_range=torch.tensor(1.0)), ssim(p, t))


def test_ssim_other_window_matches_skimage():
    pred, target = _scaled_np(*_pair("structured", 30, 26, seed=6))
    expected = structural_similarity(pred, target, win_size=11, data_range=1.0,
                                     use_sample_covariance=True, K1=0.01, K2=0.03)
    got = ssim(torch.tensor(pred)[None], torch.tensor(target)[None], win_size=11)
    np.testing.assert_allclose(got.numpy(), [expected], rtol=0, atol=1e-10)


def test_ssim_batch_is_independent():
    pairs = [_pair("structured", 24, 20, seed) for seed in range(4)]
    p = torch.tensor(np.stack([a for a, _ in pairs]))
    t = torch.tensor(np.stack([b for _, b in pairs]))
    batched = slice_metrics(p, t)
    for i in range(4):
        single = slice_metrics(p[i : i + 1], t[i : i + 1])
        for name in METRICS:
            torch.testing.assert_close(batched[name][i : i + 1], single[name])


def test_ssim_errors():
    x = torch.rand(2, 16, 16)
    with pytest.raises(ValueError, match="same shape"):
        ssim(x, torch.rand(2, 16, 15))
    with pytest.raises(ValueError, match="odd"):
        ssim(x, x, win_size=6)
    with pytest.raises(ValueError, match="at least win_size x win_size"):
        ssim(torch.rand(1, 6, 16), torch.rand(1, 6, 16))
    with pytest.raises(ValueError, match=r"\(B, H, W\) or \(B, 1, H, W\)"):
        ssim(torch.rand(16, 16), torch.rand(16, 16))
    with pytest.raises(ValueError, match=r"\(B, H, W\) or \(B, 1, H, W\)"):
        mse(torch.rand(2, 3, 16, 16), torch.rand(2, 3, 16, 16))
    with pytest.raises(ValueError, match=r"data_range must be a float or a \(2,\) tensor"):
        ssim(x, x, data_range=torch.ones(3))
    with pytest.raises(ValueError, match="real images"):
        mse(torch.zeros(1, 8, 8, dtype=torch.complex64), torch.zeros(1, 8, 8))


# --- the other metrics -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "structured"])
def test_psnr_and_mse_match_skimage(kind):
    pairs = [_pair(kind, 32, 40, seed) for seed in range(3)]
    pred = torch.tensor(np.stack([p for p, _ in pairs])).float()
    target = torch.tensor(np.stack([t for _, t in pairs])).float()
    got = slice_metrics(pred, target)
    for i, (p, t) in enumerate(pairs):
        ps, ts = _scaled_np(p, t)
        assert got["mse"][i].item() == pytest.approx(mean_squared_error(ts, ps), rel=1e-5)
        assert got["psnr"][i].item() == pytest.approx(
            peak_signal_noise_ratio(ts, ps, data_range=1.0), abs=1e-4)
        assert got["mae"][i].item() == pytest.approx(np.abs(ps - ts).mean(), rel=1e-5)
        nmse_np = np.sum((ps - ts) ** 2) / np.sum(ts**2)
        assert got["nmse"][i].item() == pytest.approx(nmse_np, rel=1e-5)


def test_hand_cases():
    target = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    assert nmse(torch.zeros_like(target), target).item() == pytest.approx(1.0)
    assert nmse(1.1 * target, target).item() == pytest.approx(0.01, rel=1e-5)
    # ||(1,1,1,1)||^2 / ||(1,2,3,4)||^2 = 4 / 30
    assert nmse(target + 1, target).item() == pytest.approx(4 / 30, rel=1e-6)
    assert mse(target + 1, target).item() == pytest.approx(1.0)
    assert mae(target - 2, target).item() == pytest.approx(2.0)
    assert psnr(target + 0.1, target).item() == pytest.approx(20.0, rel=1e-5)  # 10 log10(1/0.01)
    assert psnr(target + 1, target, data_range=10.0).item() == pytest.approx(20.0, rel=1e-6)


def test_identical_images():
    _, target = _pair("structured", 20, 20, seed=7)
    t = torch.tensor(target)[None].float().repeat(2, 1, 1)
    got = slice_metrics(t, t)
    torch.testing.assert_close(got["ssim"], torch.ones(2))
    assert torch.all(got["nmse"] == 0) and torch.all(got["mse"] == 0) and torch.all(got["mae"] == 0)
    assert torch.all(torch.isfinite(got["psnr"])) and torch.all(got["psnr"] >= 150)
    torch.testing.assert_close(quality(t, t), torch.ones(2))


@pytest.mark.parametrize("factor", [1e-3, 7.0, 1e4])
def test_scale_invariance(factor):
    pairs = [_pair("structured", 24, 28, seed) for seed in range(2)]
    p = torch.tensor(np.stack([a for a, _ in pairs]))
    t = torch.tensor(np.stack([b for _, b in pairs]))
    base, scaled = slice_metrics(p, t), slice_metrics(factor * p, factor * t)
    for name in METRICS:
        torch.testing.assert_close(scaled[name], base[name], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(quality(factor * p, factor * t), quality(p, t))


def test_scale_by_target():
    target = torch.tensor([[[0.0, 2.0], [1.0, 4.0]], [[0.0, 0.0], [0.0, 0.0]]])
    pred = torch.ones(2, 1, 2, 2)  # (B, 1, H, W) is accepted
    p, t = scale_by_target(pred, target[:, None])
    assert p.shape == t.shape == (2, 1, 2, 2)  # the input shape is kept
    torch.testing.assert_close(t[0, 0], target[0] / 4)
    torch.testing.assert_close(p[0, 0], torch.full((2, 2), 0.25))
    assert torch.equal(t[1, 0], target[1]) and torch.equal(p[1, 0], torch.ones(2, 2))  # unscaled
    p, t = scale_by_target(pred[:, 0], target)
    assert p.shape == t.shape == (2, 2, 2)
    torch.testing.assert_close(t[0], target[0] / 4)
    empty = slice_metrics(torch.ones(1, 8, 8), torch.zeros(1, 8, 8))
    assert all(torch.all(torch.isfinite(value)) for value in empty.values())


def test_slice_metrics_contract():
    pred = torch.rand(3, 1, 12, 10, requires_grad=True)
    target = torch.rand(3, 1, 12, 10)
    got = slice_metrics(pred, target)
    assert tuple(got) == METRICS
    for value in got.values():
        assert value.shape == (3,) and value.dtype == torch.float32 and not value.requires_grad
    assert set(HIGHER_IS_BETTER) == set(METRICS)
    assert [name for name in METRICS if HIGHER_IS_BETTER[name]] == ["ssim", "psnr"]


def test_quality_formula():
    pairs = [_pair("structured", 20, 22, seed) for seed in range(3)]
    p = torch.tensor(np.stack([a for a, _ in pairs]))
    t = torch.tensor(np.stack([b for _, b in pairs]))
    got = slice_metrics(p, t)
    torch.testing.assert_close(quality(p, t), 0.5 * got["ssim"] + 0.5 * (1 - got["nmse"]))
    torch.testing.assert_close(quality(p, t, l_ssim=0.8, l_nmse=0.2),
                               0.8 * got["ssim"] + 0.2 * (1 - got["nmse"]))
    torch.testing.assert_close(quality(p, t, l_ssim=1.0, l_nmse=0.0), got["ssim"])
    with pytest.raises(ValueError, match="finite"):
        quality(p, t, l_ssim=math.nan)


def test_quality_reference_keeps_the_target_side_for_many_predictions():
    pairs = [_pair("structured", 20, 22, seed) for seed in range(4)]
    p = torch.tensor(np.stack([a for a, _ in pairs]))
    t = torch.tensor(np.stack([b for _, b in pairs]))
    t[3] = 0.0  # an empty slice: unscaled, no division by zero
    ref = QualityReference(t, l_ssim=0.7, l_nmse=0.3)
    expected = 0.7 * ssim(*scale_by_target(p, t)) + 0.3 * (1 - nmse(p, t))
    torch.testing.assert_close(ref(p), expected)
    torch.testing.assert_close(ref(p[:, None]), expected)  # (B, 1, H, W) too
    torch.testing.assert_close(ref(3.0 * p), QualityReference(t, 0.7, 0.3)(3.0 * p))
    # concatenate and replace rows, as the batched environment does at an episode reset
    first, last = QualityReference(t[:2], 0.7, 0.3), QualityReference(t[2:], 0.7, 0.3)
    torch.testing.assert_close(first.cat(last)(p), expected)
    swapped = ref.replace(torch.tensor([1]), QualityReference(t[3:], 0.7, 0.3))
    torch.testing.assert_close(swapped(p)[[0, 2, 3]], expected[[0, 2, 3]])
    torch.testing.assert_close(swapped(p)[1], QualityReference(t[3:], 0.7, 0.3)(p[1:2])[0])
    with pytest.raises(ValueError, match="shape"):
        ref(p[:2])
    with pytest.raises(ValueError, match="at least 7"):
        QualityReference(torch.rand(2, 6, 9))


# --- gradients -------------------------------------------------------------------------------


def test_ssim_loss_gradient_step_improves_ssim():
    pairs = [_pair("structured", 24, 24, seed) for seed in range(2)]
    p0, t = scale_by_target(torch.tensor(np.stack([a for a, _ in pairs])).float(),
                            torch.tensor(np.stack([b for _, b in pairs])).float())
    pred = p0.clone().requires_grad_(True)
    loss = ssim_loss(pred, t)
    assert loss.ndim == 0
    loss.backward()
    assert pred.grad is not None and torch.all(torch.isfinite(pred.grad))
    assert pred.grad.abs().sum() > 0
    with torch.no_grad():
        stepped = pred - 0.5 * pred.grad / pred.grad.abs().max()
    before, after = ssim(p0, t), ssim(stepped, t)
    assert torch.all(after > before), (before, after)
    assert ssim_loss(stepped, t) < loss


def test_ssim_gradcheck():
    g = torch.Generator().manual_seed(0)
    pred = torch.rand(2, 1, 9, 10, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.rand(2, 1, 9, 10, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: ssim(x, target), (pred,))
    assert torch.autograd.gradcheck(lambda x: quality(x, target), (pred,))


def test_no_global_rng_use(global_rng_guard):
    p, t = torch.ones(1, 8, 8), torch.full((1, 8, 8), 2.0)
    slice_metrics(p, t)
    quality(p, t)


# --- CUDA ------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_cuda_matches_cpu(device):
    pairs = [_pair("structured", 40, 36, seed) for seed in range(3)]
    p = torch.tensor(np.stack([a for a, _ in pairs])).float()
    t = torch.tensor(np.stack([b for _, b in pairs])).float()
    cpu = slice_metrics(p, t)
    gpu = slice_metrics(p.to(device), t.to(device))
    for name in METRICS:
        assert gpu[name].device.type == "cuda"
        torch.testing.assert_close(gpu[name].cpu(), cpu[name], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(quality(p.to(device), t.to(device)).cpu(), quality(p, t),
                               rtol=1e-5, atol=1e-5)
    grads = []
    for dev in ("cpu", device):
        x = p.detach().to(dev).requires_grad_(True)  # a leaf on each device, p left alone
        ssim_loss(*scale_by_target(x, t.to(dev))).backward()
        grads.append(x.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)


def test_roi_metrics_over_the_whole_image_are_the_slice_metrics():
    from masc_gadget.core.metrics import quality, roi_metrics, slice_metrics

    gen = torch.Generator().manual_seed(3)
    target = torch.rand(3, 24, 20, generator=gen)
    pred = target + 0.2 * torch.randn(3, 24, 20, generator=gen)
    whole = torch.ones(3, 24, 20, dtype=torch.bool)
    local, plain = roi_metrics(pred, target, whole), slice_metrics(pred, target)
    for key in ("ssim", "psnr", "nmse"):
        assert torch.allclose(local[key], plain[key], rtol=1e-5, atol=1e-6), key
    assert torch.allclose(quality(pred, target, roi=whole), quality(pred, target), atol=1e-6)


def test_roi_metrics_see_only_their_region():
    from masc_gadget.core.metrics import QualityReference, quality, roi_metrics

    gen = torch.Generator().manual_seed(4)
    target = torch.rand(2, 32, 32, generator=gen) + 0.5
    pred = target.clone()
    pred[:, :, 16:] += 0.5 * torch.randn(2, 32, 16, generator=gen)  # only the right half is wrong
    left = torch.zeros(2, 32, 32, dtype=torch.bool)
    left[:, 4:28, 3:10] = True  # every window centred here lies in the left half
    right = torch.zeros_like(left)
    right[:, 4:28, 22:29] = True
    good, bad = roi_metrics(pred, target, left), roi_metrics(pred, target, right)
    assert torch.allclose(good["ssim"], torch.ones(2), atol=1e-6) and torch.all(good["nmse"] < 1e-12)
    assert torch.all(bad["ssim"] < 0.9) and torch.all(bad["psnr"] < good["psnr"])
    assert torch.all(quality(pred, target, roi=left) > quality(pred, target) + 0.01)
    with pytest.raises(ValueError, match="at least one pixel"):
        roi_metrics(pred, target, torch.zeros_like(left))
    with pytest.raises(ValueError, match="with and without a region"):
        QualityReference(target, roi=left).cat(QualityReference(target))


def test_a_region_in_the_cropped_border_still_has_windows():
    from masc_gadget.core.metrics import roi_metrics

    target = torch.rand(1, 16, 16, generator=torch.Generator().manual_seed(5))
    corner = torch.zeros(1, 16, 16, dtype=torch.bool)
    corner[0, 0, 0] = True  # no SSIM window is centred on the corner pixel
    out = roi_metrics(target * 0.9, target, corner)
    assert torch.isfinite(out["ssim"]).all() and 0 < float(out["ssim"]) <= 1
