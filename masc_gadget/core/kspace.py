"""k-space maths: centred orthonormal FFTs, phase-encoding line masks, zero-filled images.

Pure, batched torch functions (fastMRI ``fftc.py`` style); no state, no I/O, no ismrmrd.
Everything follows the device and dtype of its input, so the same call runs on CPU and CUDA.

Conventions (DESIGN.md, "Data"):

* k-space is a complex tensor ``(..., PE, RO)``: rows are phase-encoding (PE) lines, columns are
  readout (RO) samples; the image of ``ifft2c`` has rows ``y`` (= PE) and columns ``x`` (= RO).
* the image is the magnitude of the *centred*, *orthonormal* 2D inverse FFT: ``ifftshift`` ->
  ``ifft2`` -> ``fftshift`` over the last two dimensions, ``norm="ortho"``, so that ``fft2c`` is
  unitary (Parseval holds) and ``ifft2c`` is its inverse and adjoint.
* a line mask is ``(..., PE)``, ``True`` (or 1) for an acquired line.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "apply_line_mask",
    "fft2c",
    "ifft2c",
    "initial_lines",
    "lines_to_mask",
    "magnitude",
    "to_hybrid",
    "zero_filled",
    "zero_filled_hybrid",
]

_DIMS = (-2, -1)


def _check_2d(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(
            f"{name} must have at least 2 dimensions (..., H, W), got shape {tuple(x.shape)}"
        )


def fft2c(x: torch.Tensor) -> torch.Tensor:
    """Centred, orthonormal 2D FFT over the last two dimensions (image -> k-space).

    Args:
        x: image, complex (real is promoted) ``(..., H, W)``.

    Returns:
        k-space ``(..., H, W)``, complex, with the DC sample at ``(H // 2, W // 2)``.
    """
    _check_2d(x, "x")
    x = torch.fft.ifftshift(x, dim=_DIMS)
    x = torch.fft.fft2(x, dim=_DIMS, norm="ortho")
    return torch.fft.fftshift(x, dim=_DIMS)


def ifft2c(x: torch.Tensor) -> torch.Tensor:
    """Centred, orthonormal 2D inverse FFT over the last two dimensions (k-space -> image).

    Args:
        x: k-space, complex (real is promoted) ``(..., PE, RO)``.

    Returns:
        complex image ``(..., y, x)`` with ``y`` = PE and ``x`` = RO.
    """
    _check_2d(x, "x")
    x = torch.fft.ifftshift(x, dim=_DIMS)
    x = torch.fft.ifft2(x, dim=_DIMS, norm="ortho")
    return torch.fft.fftshift(x, dim=_DIMS)


def magnitude(kspace: torch.Tensor) -> torch.Tensor:
    """The image convention: ``|ifft2c(kspace)|``.

    Args:
        kspace: complex ``(..., PE, RO)``.

    Returns:
        real magnitude image ``(..., PE, RO)``: float32 for complex64 (float64 for complex128).
    """
    return ifft2c(kspace).abs()


def _as_bool_mask(mask: torch.Tensor | Sequence, device: torch.device) -> torch.Tensor:
    """A mask given as bool or 0/1 numbers, as a bool tensor on ``device``."""
    mask = torch.as_tensor(mask, device=device)
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise ValueError(f"mask must be bool or 0/1 numbers, got dtype {mask.dtype}")
    acquired = mask != 0
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must be bool or hold only 0 and 1, got other values")
    return acquired


def apply_line_mask(kspace: torch.Tensor, mask: torch.Tensor | Sequence) -> torch.Tensor:
    """Zero every phase-encoding line (row) that the mask marks as not acquired.

    Args:
        kspace: complex ``(..., PE, RO)``.
        mask: ``(..., PE)``, bool or 0/1 numbers, ``True`` for an acquired line. Its leading
            dimensions broadcast against those of ``kspace`` (one mask for a whole batch, or one
            k-space under a batch of masks); it is moved to ``kspace``'s device.

    Returns:
        ``(..., PE, RO)``, ``kspace``'s dtype: acquired rows exactly as in ``kspace``, the other
        rows exactly zero. The leading shape is the broadcast of both leading shapes.

    Raises:
        ValueError: the mask's last dimension is not ``PE`` or the leading shapes do not broadcast.
    """
    _check_2d(kspace, "kspace")
    mask = _as_bool_mask(mask, kspace.device)
    if mask.ndim < 1:
        raise ValueError("mask must have at least 1 dimension (..., PE), got a scalar")
    n_pe = kspace.shape[-2]
    if mask.shape[-1] != n_pe:
        raise ValueError(
            f"mask's last dimension must equal the number of PE lines of kspace ({n_pe}), "
            f"got mask shape {tuple(mask.shape)} for kspace shape {tuple(kspace.shape)}"
        )
    try:
        torch.broadcast_shapes(mask.shape[:-1], kspace.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"mask's leading dimensions {tuple(mask.shape[:-1])} must broadcast against "
            f"kspace's leading dimensions {tuple(kspace.shape[:-2])}"
        ) from None
    zero = torch.zeros((), dtype=kspace.dtype, device=kspace.device)
    return torch.where(mask.unsqueeze(-1), kspace, zero)


def zero_filled(kspace: torch.Tensor, mask: torch.Tensor | Sequence) -> torch.Tensor:
    """Zero-filled reconstruction of the acquired lines: ``|ifft2c(apply_line_mask(k, mask))|``.

    Args:
        kspace: complex ``(..., PE, RO)``.
        mask: ``(..., PE)`` bool or 0/1, ``True`` for an acquired line
            (see :func:`apply_line_mask`).

    Returns:
        magnitude image ``(..., y, x)`` = ``(..., PE, RO)``; float32 for complex64 k-space
        (float64 for complex128).
    """
    return magnitude(apply_line_mask(kspace, mask))


def to_hybrid(kspace: torch.Tensor) -> torch.Tensor:
    """k-space in the form :func:`zero_filled_hybrid` reconstructs from, for many masks.

    A line mask zeroes whole rows, so it commutes with the readout transform: that one is done
    here, once. Rows are put in FFT order (``ifftshift``) and the image's ``fftshift`` along y
    becomes a phase ramp over them (``fftshift(ifft(X))[n] = ifft(X * exp(-2 pi i k s / N))[n]``
    with ``s = N // 2``, any N).

    Args:
        kspace: complex ``(..., PE, RO)``.

    Returns:
        complex ``(..., PE, RO)``, ``kspace``'s dtype and device.
    """
    _check_2d(kspace, "kspace")
    n = kspace.shape[-2]
    x = torch.fft.fftshift(torch.fft.ifft(torch.fft.ifftshift(kspace, dim=-1), dim=-1, norm="ortho"),
                           dim=-1)
    x = torch.fft.ifftshift(x, dim=-2)
    k = torch.arange(n, device=kspace.device, dtype=torch.float64)
    ramp = torch.polar(torch.ones_like(k), -2.0 * torch.pi * k * (n // 2) / n).to(kspace.dtype)
    return x * ramp[:, None]


def zero_filled_hybrid(hybrid: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`zero_filled` of k-space given as :func:`to_hybrid` made it (equal to float rounding,
    and faster: one 1D inverse FFT over the acquired lines, no shifts).

    Args:
        hybrid: ``to_hybrid(kspace)``, complex ``(..., PE, RO)``.
        mask: bool ``(..., PE)`` on ``hybrid``'s device, ``True`` for an acquired line (centred
            line order, as everywhere else); leading dimensions broadcast.

    Returns:
        magnitude image ``(..., PE, RO)``.
    """
    if mask.dtype != torch.bool or mask.shape[-1] != hybrid.shape[-2]:
        raise ValueError(f"mask must be bool (..., PE) with PE = {hybrid.shape[-2]}, got "
                         f"{mask.dtype} {tuple(mask.shape)}")
    rows = torch.fft.ifftshift(mask, dim=-1).unsqueeze(-1)
    zero = torch.zeros((), dtype=hybrid.dtype, device=hybrid.device)
    return torch.fft.ifft(torch.where(rows, hybrid, zero), dim=-2, norm="ortho").abs()


def _is_row(item: object) -> bool:
    """Whether an element of ``lines`` is itself a row of indices (a batch) rather than an index."""
    if isinstance(item, (torch.Tensor, np.ndarray)):
        return item.ndim >= 1
    return isinstance(item, Sequence) and not isinstance(item, (str, bytes))


def lines_to_mask(
    lines: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,
    n_pe: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A bool PE-line mask from the indices of the acquired lines.

    Args:
        lines: acquired line indices in ``[0, n_pe)``: a sequence of ints or an ``(L,)`` tensor
            (one mask), or a ``(B, L)`` long tensor or a sequence of ``B`` sequences (ragged
            lengths allowed) for a batch. Repeats are allowed.
        n_pe: number of phase-encoding lines.
        device: device of the mask; default that of ``lines`` if it is a tensor, else CPU.

    Returns:
        bool mask ``(n_pe,)`` or ``(B, n_pe)``.

    Raises:
        ValueError: ``n_pe`` is not positive, a line is out of range, or ``lines`` has more than
            two dimensions or is not integer.
    """
    try:
        n_pe_int = operator.index(n_pe)
    except TypeError:
        n_pe_int = 0
    if isinstance(n_pe, bool) or n_pe_int < 1:
        raise ValueError(f"n_pe must be a positive int, got {n_pe!r}")
    n_pe = n_pe_int
    if device is None and isinstance(lines, torch.Tensor):
        device = lines.device
    if (
        not isinstance(lines, torch.Tensor)
        and len(lines) > 0
        and all(_is_row(row) for row in lines)
    ):
        # a batch of (possibly ragged) sequences: one row each
        rows = [lines_to_mask(row, n_pe, device) for row in lines]
        return torch.stack(rows)
    index = torch.as_tensor(lines, device=device)
    if index.numel() == 0:
        index = index.reshape(index.shape if index.ndim else (0,)).long()
    if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
        raise ValueError(f"lines must be integer indices, got dtype {index.dtype}")
    if index.ndim not in (1, 2):
        raise ValueError(
            f"lines must be (L,) or (B, L) line indices, got shape {tuple(index.shape)}"
        )
    index = index.long()
    if index.numel():
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= n_pe:
            bad = lo if lo < 0 else hi
            raise ValueError(f"line indices must be in [0, {n_pe}), got {bad}")
    mask = torch.zeros(*index.shape[:-1], n_pe, dtype=torch.bool, device=index.device)
    return mask.scatter_(-1, index, True)


def initial_lines(n_pe: int, initial: int) -> np.ndarray:
    """The ``initial`` lines centred on the k-space centre ``n_pe // 2``: (initial,) int64, sorted.

    An even count has one more line below the centre than above it, e.g. n_pe=200:
    initial=2 -> [99, 100], initial=3 -> [99, 100, 101], initial=4 -> [98, 99, 100, 101].
    """
    if not 1 <= initial <= n_pe:
        raise ValueError(
            f"initial must be between 1 and the number of PE lines ({n_pe}), got {initial}"
        )
    start = n_pe // 2 - initial // 2
    return np.arange(start, start + initial, dtype=np.int64)
