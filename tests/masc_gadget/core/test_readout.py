"""Readout lines onto the reconstruction grid: oversampling removal and echo placement."""

import numpy as np
import pytest

from masc_gadget.core.readout import oversampling_output, place_readout, remove_oversampling


def _line(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(2, n)) + 1j * rng.normal(size=(2, n))).astype(np.complex64)


def test_oversampling_removal_keeps_the_centre_pixels():
    n = 64
    image = np.zeros((2, n), complex)
    image[:, n // 4:3 * n // 4] = np.random.default_rng(1).normal(size=(2, n // 2))  # inside the recon FOV
    line = np.fft.fftshift(np.fft.fft(np.fft.ifftshift(image, axes=-1), axis=-1, norm="ortho"), axes=-1)
    out = remove_oversampling(line, n // 2)
    back = np.fft.fftshift(np.fft.ifft(np.fft.ifftshift(out, axes=-1), axis=-1, norm="ortho"), axes=-1)
    np.testing.assert_allclose(back, image[:, n // 4:3 * n // 4], atol=1e-5)
    assert out.dtype == np.complex64
    np.testing.assert_array_equal(remove_oversampling(line, n), line.astype(np.complex64))
    assert oversampling_output(320, 400.0, 200.0) == 160
    with pytest.raises(ValueError, match="keeps 1 to 64 samples"):
        remove_oversampling(line, 65)
    with pytest.raises(ValueError, match="fields of view must be > 0"):
        oversampling_output(10, 0.0, 1.0)


def test_an_asymmetric_echo_lands_its_centre_on_the_grid_centre():
    line = _line(24)
    out = place_readout(line, 32, center_sample=8)  # 8 samples before the echo, 16 after
    assert out.shape == (2, 32) and out.dtype == np.complex64
    np.testing.assert_array_equal(out[:, 8:32], line)
    assert not out[:, :8].any()
    assert np.array_equal(out[:, 16], line[:, 8])  # the echo at n // 2


def test_full_lines_are_taken_as_they_are_and_lines_that_do_not_fit_are_named():
    line = _line(32)
    for centre in (0, 15, 16, 40):
        np.testing.assert_array_equal(place_readout(line, 32, centre), line)
    with pytest.raises(ValueError, match="does not fit the reconstruction grid of 16"):
        place_readout(line, 16, 8)
    with pytest.raises(ValueError, match="center_sample 2 does not fit"):
        place_readout(_line(30), 32, 2)
    with pytest.raises(ValueError, match="outside the readout"):
        place_readout(_line(20), 32, 25)
