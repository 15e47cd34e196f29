"""k-space maths: centred orthonormal FFTs against numpy, unitarity, line masks, zero filling."""

import numpy as np
import pytest
import torch

from masc_gadget.core.kspace import (
    apply_line_mask,
    fft2c,
    ifft2c,
    lines_to_mask,
    magnitude,
    to_hybrid,
    zero_filled,
    zero_filled_hybrid,
)

SHAPES = [(8, 8), (7, 9), (2, 6, 5), (2, 3, 16, 11)]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _complex(shape, seed=0, dtype=torch.complex128):
    g = torch.Generator().manual_seed(seed)
    real = torch.randn(shape, generator=g, dtype=torch.float64)
    imag = torch.randn(shape, generator=g, dtype=torch.float64)
    return torch.complex(real, imag).to(dtype)


def _np_fft2c(x):
    axes = (-2, -1)
    return np.fft.fftshift(np.fft.fft2(np.fft.ifftshift(x, axes=axes), norm="ortho"), axes=axes)


def _np_ifft2c(x):
    axes = (-2, -1)
    return np.fft.fftshift(np.fft.ifft2(np.fft.ifftshift(x, axes=axes), norm="ortho"), axes=axes)


# --- FFTs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_fft2c_matches_numpy(shape):
    x = _complex(shape)
    np.testing.assert_allclose(fft2c(x).numpy(), _np_fft2c(x.numpy()), rtol=0, atol=1e-12)
    np.testing.assert_allclose(ifft2c(x).numpy(), _np_ifft2c(x.numpy()), rtol=0, atol=1e-12)


def test_fft2c_complex64_matches_numpy():
    x = _complex((3, 12, 10), dtype=torch.complex64)
    k = fft2c(x)
    assert k.dtype == torch.complex64
    np.testing.assert_allclose(k.numpy(), _np_fft2c(x.numpy().astype(np.complex128)), atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip(shape):
    x = _complex(shape, seed=1)
    torch.testing.assert_close(ifft2c(fft2c(x)), x, rtol=0, atol=1e-12)
    torch.testing.assert_close(fft2c(ifft2c(x)), x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_parseval_unitarity(shape):
    x = _complex(shape, seed=2)
    dims = (-2, -1)
    energy = x.abs().square().sum(dims)
    torch.testing.assert_close(fft2c(x).abs().square().sum(dims), energy, rtol=1e-12, atol=0)
    torch.testing.assert_close(ifft2c(x).abs().square().sum(dims), energy, rtol=1e-12, atol=0)


def test_ifft2c_is_adjoint_of_fft2c():
    x, y = _complex((9, 6), seed=3), _complex((9, 6), seed=4)
    lhs = torch.vdot(fft2c(x).flatten(), y.flatten())
    rhs = torch.vdot(x.flatten(), ifft2c(y).flatten())
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)


def test_linearity():
    x, y = _complex((4, 10, 7), seed=5), _complex((4, 10, 7), seed=6)
    a, b = 2.0 - 1.5j, -0.25 + 3.0j
    torch.testing.assert_close(fft2c(a * x + b * y), a * fft2c(x) + b * fft2c(y))
    torch.testing.assert_close(ifft2c(a * x + b * y), a * ifft2c(x) + b * ifft2c(y))


@pytest.mark.parametrize("h, w", [(8, 8), (7, 9)])
def test_dc_is_at_the_centre(h, w):
    k = fft2c(torch.ones(h, w, dtype=torch.complex128))
    expected = torch.zeros(h, w, dtype=torch.complex128)
    expected[h // 2, w // 2] = np.sqrt(h * w)
    torch.testing.assert_close(k, expected, rtol=0, atol=1e-12)


def test_fft_rejects_1d():
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        fft2c(torch.zeros(5, dtype=torch.complex64))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        ifft2c(torch.zeros(5, dtype=torch.complex64))


# --- line masks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mask_dtype", [torch.bool, torch.uint8, torch.int64, torch.float32], ids=str
)
def test_apply_line_mask_zeroes_exactly_the_unacquired_rows(mask_dtype):
    k = _complex((3, 10, 6), seed=7, dtype=torch.complex64)
    acquired = torch.zeros(3, 10, dtype=torch.bool)
    acquired[0, [0, 4, 5]] = True
    acquired[1, [9]] = True  # slice 2 acquires nothing
    out = apply_line_mask(k, acquired.to(mask_dtype))
    assert out.shape == k.shape and out.dtype == k.dtype
    assert torch.equal(out[acquired], k[acquired])  # acquired rows bit-exact
    assert torch.count_nonzero(out[~acquired]) == 0  # the others exactly zero
    assert torch.count_nonzero(out[2]) == 0


def test_apply_line_mask_zeroes_non_finite_unacquired_rows():
    k = torch.full((4, 3), float("nan"), dtype=torch.complex64)
    k[1] = 1.0
    out = apply_line_mask(k, [False, True, False, False])
    assert torch.count_nonzero(out) == 3 and torch.all(out[1] == 1.0)


def test_apply_line_mask_broadcasts():
    k = _complex((2, 8, 4), seed=8)
    one_mask = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0], dtype=torch.bool)
    out = apply_line_mask(k, one_mask)  # one mask for the batch
    assert out.shape == (2, 8, 4)
    assert torch.count_nonzero(out[:, 1::2]) == 0 and torch.equal(out[:, ::2], k[:, ::2])
    masks = lines_to_mask([[0], [1, 2]], 8)
    out = apply_line_mask(k[0], masks)  # one k-space under a batch of masks
    assert out.shape == (2, 8, 4)
    assert torch.equal(out[0, 0], k[0, 0]) and torch.count_nonzero(out[0, 1:]) == 0
    assert torch.equal(out[1, 1:3], k[0, 1:3]) and torch.count_nonzero(out[1, 3:]) == 0


def test_apply_line_mask_shape_errors():
    k = torch.zeros(2, 8, 4, dtype=torch.complex64)
    with pytest.raises(ValueError, match=r"number of PE lines of kspace \(8\)"):
        apply_line_mask(k, torch.ones(2, 4, dtype=torch.bool))  # RO length, not PE
    with pytest.raises(ValueError, match="must broadcast"):
        apply_line_mask(k, torch.ones(3, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="at least 1 dimension"):
        apply_line_mask(k, torch.tensor(True))
    with pytest.raises(ValueError, match="only 0 and 1"):
        apply_line_mask(k, torch.full((8,), 2.0))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        apply_line_mask(torch.zeros(8, dtype=torch.complex64), torch.ones(8, dtype=torch.bool))


def test_zero_filled_with_all_lines_is_the_full_magnitude():
    k = _complex((2, 12, 9), seed=9, dtype=torch.complex64)
    full = magnitude(k)
    assert full.dtype == torch.float32 and full.shape == (2, 12, 9)
    assert torch.equal(zero_filled(k, torch.ones(12, dtype=torch.bool)), full)
    np.testing.assert_allclose(full.numpy(), np.abs(_np_ifft2c(k.numpy())), atol=1e-5)


def test_zero_filled_matches_numpy():
    k = _complex((3, 10, 8), seed=10)
    mask = lines_to_mask([[4, 5, 6], [0, 9], [5]], 10)
    expected = np.abs(_np_ifft2c(k.numpy() * mask.numpy()[..., None]))
    np.testing.assert_allclose(zero_filled(k, mask).numpy(), expected, rtol=0, atol=1e-12)


def test_zero_filled_special_cases():
    k = _complex((10, 8), seed=11, dtype=torch.complex64)
    none = zero_filled(k, torch.zeros(10, dtype=torch.bool))
    assert none.dtype == torch.float32 and torch.count_nonzero(none) == 0
    # one PE line only carries no information along y: every image row is the same
    centre = zero_filled(k, lines_to_mask([5], 10))
    torch.testing.assert_close(centre, centre[:1].expand_as(centre))


# --- lines_to_mask ---------------------------------------------------------------------------


def test_lines_to_mask_forms():
    assert lines_to_mask([1, 3, 3], 5).tolist() == [False, True, False, True, False]
    assert lines_to_mask(torch.tensor([0, 4]), 5).tolist() == [True, False, False, False, True]
    assert lines_to_mask(np.array([2]), np.int64(3)).tolist() == [False, False, True]
    batch = lines_to_mask(torch.tensor([[0, 1], [3, 4]]), 5)
    assert batch.dtype == torch.bool and batch.shape == (2, 5)
    assert batch.tolist() == [[True, True, False, False, False], [False, False, False, True, True]]
    ragged = lines_to_mask([[2], [0, 1, 4], []], 5)
    assert ragged.shape == (3, 5)
    assert ragged.sum(-1).tolist() == [1, 3, 0]
    assert lines_to_mask([], 4).tolist() == [False] * 4


def test_lines_to_mask_round_trip():
    lines = [0, 7, 19, 20, 63]
    mask = lines_to_mask(lines, 64)
    assert torch.nonzero(mask).flatten().tolist() == lines


def test_lines_to_mask_errors():
    with pytest.raises(ValueError, match=r"in \[0, 5\), got 5"):
        lines_to_mask([0, 5], 5)
    with pytest.raises(ValueError, match=r"in \[0, 5\), got -1"):
        lines_to_mask(torch.tensor([[-1, 2]]), 5)
    with pytest.raises(ValueError, match="integer indices"):
        lines_to_mask(torch.tensor([1.0, 2.0]), 5)
    with pytest.raises(ValueError, match="positive int"):
        lines_to_mask([0], 0)
    with pytest.raises(ValueError, match=r"\(L,\) or \(B, L\)"):
        lines_to_mask(torch.zeros(1, 1, 1, dtype=torch.long), 5)


def test_no_global_rng_use(global_rng_guard):
    k = _complex((2, 8, 8), seed=12)
    zero_filled(k, lines_to_mask([1, 2], 8))
    ifft2c(fft2c(k))


# --- CUDA ------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_cuda_matches_cpu(device):
    k = _complex((3, 20, 14), seed=13, dtype=torch.complex64)
    lines = torch.tensor([[9, 10, 0], [9, 10, 19], [10, 11, 5]])
    mask_cpu = lines_to_mask(lines, 20)
    mask_gpu = lines_to_mask(lines.to(device), 20)
    assert mask_gpu.device.type == "cuda" and torch.equal(mask_gpu.cpu(), mask_cpu)
    kg = k.to(device)
    torch.testing.assert_close(fft2c(kg).cpu(), fft2c(k), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ifft2c(kg).cpu(), ifft2c(k), rtol=1e-5, atol=1e-5)
    out = zero_filled(kg, mask_gpu)
    assert out.device.type == "cuda" and out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), zero_filled(k, mask_cpu), rtol=1e-5, atol=1e-5)
    # a CPU mask follows the k-space onto the GPU
    assert torch.equal(apply_line_mask(kg, mask_cpu).cpu(), apply_line_mask(k, mask_cpu))


@pytest.mark.parametrize("shape", [(3, 16, 12), (2, 15, 9), (1, 7, 8), (4, 1, 5)])
def test_hybrid_reconstruction_equals_zero_filled(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    k = torch.complex(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    masks = torch.rand(shape[:-1], generator=gen) > 0.5
    masks[:, 0] = True
    hybrid = to_hybrid(k)
    assert hybrid.shape == k.shape and hybrid.dtype == k.dtype
    torch.testing.assert_close(zero_filled_hybrid(hybrid, masks), zero_filled(k, masks),
                               rtol=1e-5, atol=1e-5)
    # one mask for the whole batch broadcasts; complex128 stays float64
    k64 = k.to(torch.complex128)
    torch.testing.assert_close(zero_filled_hybrid(to_hybrid(k64), masks[0]), zero_filled(k64, masks[0]))
    with pytest.raises(ValueError, match="mask must be bool"):
        zero_filled_hybrid(hybrid, masks.float())
    with pytest.raises(ValueError, match="PE"):
        zero_filled_hybrid(hybrid, masks[:, :-1] if shape[1] > 1 else masks[:, :0])
