"""The value networks of the value-based baselines: a Q-value per phase-encoding line.

Two baselines of the paper's Table 1 learn ``Q(s, a)``, the return of acquiring line ``a`` in
state ``s`` and then acting greedily:

* ``dqn`` (Mnih et al. 2015): the network reads the current image and the acquisition mask;
* ``ss-ddqn`` (Pineda et al. 2020, "Active MR k-space sampling with reinforcement learning",
  the subject-specific Double DQN): the network reads the *reconstruction* and, as that paper's
  value network does, its k-space, from which it can see which lines the reconstruction lacks
  (``spectral: true``).

Layout (``channels`` = (c1, ..., cn))::

    input    (B, C, H, W): image / quantile(|image|, scale_quantile)  ++  mask rows as an (H, W) map
             (++ log(1 + |F(image / scale)|) when spectral: C = 3, else 2)
    encoder  [3x3 conv stride 2 -> ReLU] x n      -> adaptive average pool (cn, pool, pool)
    trunk    flatten ++ steps_left fraction -> Linear -> ReLU                    -> (B, hidden)
    head     Linear hidden -> n_pe                                               -> Q (B, n_pe)

Acquired lines are not valid actions: :func:`masked_q` gives them the most negative finite
value, so an argmax never picks one and a bootstrap target's max ignores them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from masc_gadget.core.seeding import isolated_rng
from masc_gadget.models.policy_net import PoolTo, input_planes, layer_init
from masc_gadget.models.unet import check_scale_quantile, check_sizes

__all__ = ["QNet", "QNetConfig", "masked_q"]


@dataclass(frozen=True)
class QNetConfig:
    """Architecture of a Q-network (config section ``q_net``)."""

    channels: tuple[int, ...] = (16, 32, 64)
    """Output channels of the encoder's stride-2 3x3 convolutions, one per stage."""
    hidden: int = 256
    """Width of the fully connected layer before the Q head."""
    scale_quantile: float = 0.99
    """Each input image is divided by this quantile of its own magnitude (0 < q <= 1)."""
    pool_size: int = 8
    """The encoder's output map is average-pooled to pool_size x pool_size."""

    def __post_init__(self) -> None:
        channels = self.channels
        if not isinstance(channels, (tuple, list)) or not channels or any(
                not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in channels):
            raise ValueError(f"channels must be a non-empty list of integers >= 1, got {channels!r}")
        object.__setattr__(self, "channels", tuple(channels))
        check_sizes(self, ("hidden", "pool_size"))
        check_scale_quantile(self.scale_quantile)


def masked_q(q: torch.Tensor, acquired: torch.Tensor) -> torch.Tensor:
    """q: (B, n_pe); acquired: (B, n_pe) bool -> q with the acquired lines set to the most
    negative finite value of its dtype (never an argmax, never a max while a free line exists)."""
    if acquired.shape != q.shape:
        raise ValueError(f"acquired mask {tuple(acquired.shape)} must have the shape of q {tuple(q.shape)}")
    return q.masked_fill(acquired.bool(), torch.finfo(q.dtype).min)


class QNet(nn.Module):
    """(image, acquisition mask, steps-left fraction) -> Q-value of every PE line.

    Args:
        n_pe: number of PE lines (= ``height``: image rows are PE lines).
        height, width: image size.
        cfg: architecture; default :class:`QNetConfig`.
        spectral: also read the reconstruction's k-space magnitude (SS-DDQN's value network).
        generator: torch.Generator for the weight init (None: the global RNG).
    """

    def __init__(self, n_pe: int, height: int, width: int, cfg: QNetConfig | None = None,
                 spectral: bool = False, generator: torch.Generator | None = None) -> None:
        super().__init__()
        cfg = QNetConfig() if cfg is None else cfg
        for name, value in (("n_pe", n_pe), ("height", height), ("width", width)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if n_pe != height:
            raise ValueError(f"n_pe must equal the image height (image rows are PE lines), got n_pe={n_pe}, "
                             f"height={height}")
        if not isinstance(spectral, bool):
            raise TypeError(f"spectral must be true or false, got {spectral!r}")
        self.config = cfg
        self.n_pe, self.height, self.width, self.spectral = n_pe, height, width, spectral
        with isolated_rng():  # the default init is replaced below
            layers: list[nn.Module] = []
            in_channels = 3 if spectral else 2
            for out_channels in cfg.channels:
                layers += [nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1), nn.ReLU()]
                in_channels = out_channels
            self.encoder = nn.Sequential(*layers, PoolTo(cfg.pool_size), nn.Flatten())
            self.trunk = nn.Sequential(nn.Linear(in_channels * cfg.pool_size**2 + 1, cfg.hidden), nn.ReLU())
            self.head = nn.Linear(cfg.hidden, n_pe)
        for module in (*self.encoder, *self.trunk):
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                layer_init(module, math.sqrt(2.0), generator)
        layer_init(self.head, 1.0, generator)

    def forward(self, image: torch.Tensor, mask: torch.Tensor, steps_left_frac: torch.Tensor) -> torch.Tensor:
        """image: (B, H, W) magnitude images; mask: (B, n_pe) bool, True = acquired;
        steps_left_frac: (B,) in [0, 1]. Returns the *unmasked* Q (B, n_pe)."""
        planes = input_planes(self, image, mask, steps_left_frac)
        if self.spectral:
            spectrum = torch.fft.fftshift(torch.fft.fft2(planes[0], norm="ortho"), dim=(-2, -1)).abs()
            planes.append(torch.log1p(spectrum))
        h = self.encoder(torch.cat(planes, dim=1))
        h = torch.cat([h, steps_left_frac.to(h.dtype).unsqueeze(1)], dim=1)
        return self.head(self.trunk(h))

    def scores(self, image: torch.Tensor, mask: torch.Tensor, steps_left_frac: torch.Tensor) -> torch.Tensor:
        """(B, n_pe) masked Q: what a greedy policy takes the argmax of."""
        return masked_q(self(image, mask, steps_left_frac), mask)

    def extra_repr(self) -> str:
        return f"n_pe={self.n_pe}, height={self.height}, width={self.width}, spectral={self.spectral}"
