"""Multi-coil reconstruction for the headroom gate's candidate (c): where the receive coils'
geometry makes some lines redundant, which lines a slice needs may depend on the slice.

The product's MAR network reads one coil-combined zero-filled image, which keeps none of the
coils' encoding. :class:`SenseRecon` reconstructs the acquired lines with the coils instead,
by conjugate gradients on ``(A^H A + lam I) x = A^H y`` with ``A = M F S`` (CG-SENSE: the line
mask ``M``, the centred 2D DFT ``F``, the coil sensitivities ``S``), and returns the magnitude.
The coil data are synthesised from the slice's complex image and the simulator's body array
(:func:`sim_scanner.physics.coils.body_array`), whose sensitivities have a root-sum-of-squares
of 1, so one coil of all ones gives the zero-filled image. Because the coils are synthesised
from one image, its noise is shared by the coils rather than independent per coil: the
measurement is optimistic for parallel imaging, which is the side a headroom probe may err on.
"""

from __future__ import annotations

import torch

from masc_gadget.core.kspace import ifft2c

__all__ = ["SenseRecon"]


class SenseRecon:
    """CG-SENSE magnitude images of single-channel k-space seen through ``maps`` (module
    docstring).

    Args:
        maps: (C, H, W) complex coil sensitivities.
        iterations: conjugate-gradient iterations (early stopping regularises too).
        lam: Tikhonov weight, relative to a fully sampled ``A^H A`` (the identity).
    """

    def __init__(self, maps: torch.Tensor, iterations: int = 10, lam: float = 1e-2) -> None:
        if maps.ndim != 3 or not maps.is_complex():
            raise ValueError(f"maps must be complex (coils, H, W), got {maps.dtype} {tuple(maps.shape)}")
        if iterations < 1 or lam < 0:
            raise ValueError(f"iterations must be >= 1 and lam >= 0, got {iterations} and {lam}")
        self.maps, self.iterations, self.lam = maps, int(iterations), float(lam)

    def __call__(self, kspace: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, H, W) float magnitude of the lines ``mask`` (B, PE) of ``kspace`` (B, PE, RO).

        A line mask acts along the phase-encoding axis only, so the readout transform cancels in
        ``A^H A``: the operators run on hybrid space with 1D transforms along y."""
        maps = self.maps.to(device=kspace.device, dtype=kspace.dtype)[None]
        m = mask.to(kspace.device).bool()[:, None, :, None]
        coils = _fft_y(maps * ifft2c(kspace)[:, None]) * m  # what the array records on those lines

        def normal(x: torch.Tensor) -> torch.Tensor:
            return (maps.conj() * _ifft_y(_fft_y(maps * x[:, None]) * m)).sum(dim=1) + self.lam * x

        b = (maps.conj() * _ifft_y(coils)).sum(dim=1)
        x = torch.zeros_like(b)
        r, p = b.clone(), b.clone()
        rs = (r.abs() ** 2).sum(dim=(-2, -1))
        for _ in range(self.iterations):
            ap = normal(p)
            alpha = rs / (p.conj() * ap).sum(dim=(-2, -1)).real.clamp_min(1e-30)
            x = x + alpha[:, None, None] * p
            r = r - alpha[:, None, None] * ap
            new = (r.abs() ** 2).sum(dim=(-2, -1))
            p = r + (new / rs.clamp_min(1e-30))[:, None, None] * p
            rs = new
        return x.abs().float()


def _fft_y(x: torch.Tensor) -> torch.Tensor:
    """Centred orthonormal DFT along y (dim -2), as :func:`~masc_gadget.core.kspace.fft2c` along
    that axis."""
    return torch.fft.fftshift(torch.fft.fft(torch.fft.ifftshift(x, dim=-2), dim=-2, norm="ortho"), dim=-2)


def _ifft_y(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_fft_y`."""
    return torch.fft.fftshift(torch.fft.ifft(torch.fft.ifftshift(x, dim=-2), dim=-2, norm="ortho"), dim=-2)
