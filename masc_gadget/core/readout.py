"""Readout lines as scanners send them, brought onto the reconstruction grid.

What Gadgetron's Cartesian chain does to each line before it is placed in k-space (its
``RemoveROOversamplingGadget`` and ``BucketToBufferGadget``), as pure numpy functions:

* :func:`remove_oversampling`: a line sampled over a wider field of view than the image's (the
  usual 2x readout oversampling: encoded field of view x / recon field of view x = 2) is
  transformed to image space along the readout (centred orthonormal inverse FFT), its centre
  ``n_out`` samples are kept and it is transformed back (orthonormal FFTs both ways, so the
  image of the kept field of view keeps its pixel values);
* :func:`place_readout`: a line shorter than the grid (asymmetric echo, partial Fourier along the
  readout) is placed so that its ``center_sample`` lands on the grid's centre ``n // 2``, the
  missing samples left zero (zero-filled).

Shapes: a line is ``(coils, samples)`` complex; the centred FFT convention is
:mod:`masc_gadget.core.kspace`'s (DC at ``n // 2``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["oversampling_output", "place_readout", "remove_oversampling"]


def _ifft1c(x: np.ndarray) -> np.ndarray:
    return np.fft.fftshift(np.fft.ifft(np.fft.ifftshift(x, axes=-1), axis=-1, norm="ortho"), axes=-1)


def _fft1c(x: np.ndarray) -> np.ndarray:
    return np.fft.fftshift(np.fft.fft(np.fft.ifftshift(x, axes=-1), axis=-1, norm="ortho"), axes=-1)


def oversampling_output(n_samples: int, encoded_fov: float, recon_fov: float) -> int:
    """Samples a line of ``n_samples`` keeps once its readout oversampling is removed:
    ``int(n_samples / (encoded_fov / recon_fov))`` (Gadgetron's rule)."""
    if encoded_fov <= 0 or recon_fov <= 0:
        raise ValueError(f"fields of view must be > 0, got encoded {encoded_fov} and recon {recon_fov} mm")
    return int(n_samples / (encoded_fov / recon_fov))


def remove_oversampling(samples: np.ndarray, n_out: int) -> np.ndarray:
    """``(coils, n)`` complex line -> ``(coils, n_out)`` complex64: the centre ``n_out`` samples of
    its image along the readout, back in k-space (module docstring). ``n_out == n`` returns the
    line unchanged."""
    samples = np.asarray(samples)
    n = samples.shape[-1]
    if not 1 <= n_out <= n:
        raise ValueError(f"oversampling removal keeps 1 to {n} samples, got {n_out}")
    if n_out == n:
        return samples.astype(np.complex64, copy=False)
    start = (n - n_out) // 2
    image = _ifft1c(samples.astype(np.complex128))
    # orthonormal both ways: the kept pixels keep their values in the final image
    return _fft1c(image[..., start:start + n_out]).astype(np.complex64)


def place_readout(samples: np.ndarray, n: int, center_sample: int) -> np.ndarray:
    """``(coils, m)`` line -> ``(coils, n)`` complex64 on the grid, ``center_sample`` at ``n // 2``.

    A line of ``n`` samples fills the grid as it is, whatever its ``center_sample`` says (many
    writers leave it 0; an echo a sample off the centre is the sequence's, not a gap to fill).
    ValueError when a line does not fit: more samples than the grid, or a short line whose
    centre is too far off for its samples to fall inside."""
    samples = np.asarray(samples)
    m = samples.shape[-1]
    if m > n:
        raise ValueError(f"a readout of {m} samples does not fit the reconstruction grid of {n}")
    if m == n:
        return samples.astype(np.complex64, copy=False)
    if not 0 <= center_sample < m:
        raise ValueError(f"center_sample {center_sample} is outside the readout of {m} samples")
    offset = n // 2 - center_sample
    if offset < 0 or offset + m > n:
        raise ValueError(f"a readout of {m} samples with center_sample {center_sample} does not fit the "
                         f"reconstruction grid of {n} samples centred at {n // 2}")
    out = np.zeros((*samples.shape[:-1], n), dtype=np.complex64)
    out[..., offset:offset + m] = samples
    return out
