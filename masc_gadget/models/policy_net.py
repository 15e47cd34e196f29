"""The artifact-aware acquisition agent of the paper: an actor-critic network over image + mask.

Paper ("Acquisition Policy"): a shared convolutional encoder for the actor and critic branches
processes the concatenated reconstruction and acquisition mask; the actor outputs probabilities
over all k-space lines with the already acquired lines masked to zero.

Layout (``channels`` = (c1, ..., cn), default (16, 32, 64))::

    input    (B, 2, H, W): image / quantile(|image|, scale_quantile)  ++  mask rows as an (H, W) map
    encoder  [3x3 conv stride 2 -> ReLU] x n           2 -> c1 -> ... -> cn,  (H, W) / 2**n
             adaptive average pool                     -> (cn, pool_size, pool_size)
    trunk    flatten ++ steps_left fraction -> Linear -> ReLU                 -> (B, hidden)
    actor    Linear hidden -> n_pe                                            -> logits (B, n_pe)
    critic   Linear hidden -> 1                                               -> value (B,)
    prior    (optional) + s * onehot(next line of a fixed order not yet acquired)  -> logits
    repeat   (``reacquire``) + r * flagged lines; a third input plane holds them      -> logits

With a prior (``prior_lines`` > 0, the order set by :meth:`PolicyNet.set_prior`), the actor
starts from a fixed line order, e.g. the population-greedy one, and learns per-slice
corrections to it: the logit of the first line of the order that is not yet acquired gets the
bonus ``s``, a learnable scalar initialised to ``policy_net.prior_weight``.

Image rows are PE lines (line k is row k of centred k-space), so the mask of line k fills row
k of the mask channel. Weights are initialised as in CleanRL: orthogonal, gain sqrt(2) for the
hidden layers, 0.01 for the actor's last layer (near-uniform initial policy), 1 for the critic;
zero biases. Acquired lines are masked with the most negative finite float (not -inf), so
log-probabilities and the entropy stay finite (the CleanRL / MaskablePPO invalid-action mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributions import Categorical

from masc_gadget.core.seeding import isolated_rng
from masc_gadget.models.unet import check_scale_quantile, check_sizes, image_scale


@dataclass(frozen=True)
class PolicyNetConfig:
    """Architecture of the acquisition policy network (config section ``policy_net``)."""

    channels: tuple[int, ...] = (16, 32, 64)
    """Output channels of the encoder's stride-2 3x3 convolutions, one per stage; each stage
    halves H and W."""
    hidden: int = 256
    """Width of the shared fully connected layer that feeds the actor and the critic."""
    scale_quantile: float = 0.99
    """Each input image is divided by this quantile of its own magnitude (as the MAR network
    does), so the policy sees intensities of order 1 whatever the scanner's units (0 < q <= 1)."""
    pool_size: int = 8
    """The encoder's output map is average-pooled to pool_size x pool_size before flattening,
    so the size of the fully connected layer does not grow with the matrix."""
    prior_weight: float = 0.0
    """Initial logit bonus of the next line of a fixed prior order (``masc train masc``: the
    population-greedy order of the training split); 0 = no prior. With the actor head's small
    init, a bonus of 8 makes the untrained policy follow the order about 96 % of the time at
    128 lines; PPO then learns where to depart from it."""

    reacquire: bool = False
    """The policy may acquire a flagged line again (``env.corruption`` > 0): a third input plane
    holds the lines the scanner flagged (``repeatable``, rows as the mask's), and the actor may
    pick them."""
    repeat_weight: float = 0.0
    """With ``reacquire``: the initial logit bonus of a flagged line, a learnable scalar as the
    prior's. Above ``prior_weight`` the untrained policy acquires every flagged line again
    before the next line of its order (navigator gating); PPO then learns which to let go."""

    def __post_init__(self) -> None:
        channels = self.channels
        if not isinstance(channels, (tuple, list)) or not channels:
            raise ValueError(f"channels must be a non-empty list of integers >= 1, got {channels!r}")
        for c in channels:
            if not isinstance(c, int) or isinstance(c, bool) or c < 1:
                raise ValueError(f"channels must be a non-empty list of integers >= 1, got {channels!r}")
        object.__setattr__(self, "channels", tuple(channels))
        check_sizes(self, ("hidden", "pool_size"))
        check_scale_quantile(self.scale_quantile)
        weight = self.prior_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < math.inf:
            raise ValueError(f"prior_weight must be a finite number >= 0, got {weight!r}")
        object.__setattr__(self, "prior_weight", float(weight))
        if not isinstance(self.reacquire, bool):
            raise TypeError(f"reacquire must be true or false, got {self.reacquire!r}")
        weight = self.repeat_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < math.inf:
            raise ValueError(f"repeat_weight must be a finite number >= 0, got {weight!r}")
        object.__setattr__(self, "repeat_weight", float(weight))


def masked_logits(logits: torch.Tensor, acquired: torch.Tensor) -> torch.Tensor:
    """logits: (B, n_pe); acquired: (B, n_pe) bool -> (B, n_pe) logits with the acquired lines
    set to ``torch.finfo(dtype).min``: probability exactly 0 after the softmax, yet finite, so
    ``0 * log p`` in the entropy is 0 and not NaN (it would be with -inf)."""
    if acquired.shape != logits.shape:
        raise ValueError(
            f"acquired mask {tuple(acquired.shape)} must have the shape of the logits {tuple(logits.shape)}"
        )
    return logits.masked_fill(acquired.bool(), torch.finfo(logits.dtype).min)


def blocked(mask: torch.Tensor, repeatable: torch.Tensor | None = None) -> torch.Tensor:
    """(B, n_pe) bool: the lines an action may not take, the acquired ones less the flagged
    ones that may be acquired again (``repeatable``, None: none)."""
    return mask.bool() if repeatable is None else mask.bool() & ~repeatable.bool()


def masked_distribution(logits: torch.Tensor, acquired: torch.Tensor) -> Categorical:
    """The policy over PE lines: a Categorical over (B, n_pe) with probability exactly 0 on the
    acquired lines (``acquired`` (B, n_pe) bool). Each row needs at least one free line (a row
    with none becomes uniform); the log-probability of an acquired line is about -3.4e38."""
    return Categorical(logits=masked_logits(logits, acquired))


def layer_init(layer: nn.Module, std: float, generator: torch.Generator | None) -> nn.Module:
    """CleanRL's init: orthogonal weights with gain ``std``, zero bias. Drawn into a contiguous
    tensor and copied, so it works whatever the weight's memory format (channels-last too)."""
    weight = torch.empty(layer.weight.shape, dtype=layer.weight.dtype, device=layer.weight.device)
    nn.init.orthogonal_(weight, std, generator=generator)
    with torch.no_grad():
        layer.weight.copy_(weight)
    nn.init.constant_(layer.bias, 0.0)
    return layer


def input_planes(net: nn.Module, image: torch.Tensor, mask: torch.Tensor, steps_left_frac: torch.Tensor
                 ) -> list[torch.Tensor]:
    """The checked inputs of an acquisition network (``net.n_pe``, ``net.height``,
    ``net.width``, ``net.config.scale_quantile``) as (B, 1, H, W) planes: the image divided by
    its own quantile, and the mask rows as an (H, W) map. ValueError names a wrong shape."""
    if image.dim() != 3 or tuple(image.shape[1:]) != (net.height, net.width):
        raise ValueError(f"image must be (B, {net.height}, {net.width}), got {tuple(image.shape)}")
    b = image.shape[0]
    if tuple(mask.shape) != (b, net.n_pe):
        raise ValueError(f"mask must be (B, n_pe) = ({b}, {net.n_pe}), got {tuple(mask.shape)}")
    if tuple(steps_left_frac.shape) != (b,):
        raise ValueError(f"steps_left_frac must be (B,) = ({b},), got {tuple(steps_left_frac.shape)}")
    x = image.unsqueeze(1).float()
    x = x / image_scale(x, net.config.scale_quantile)
    return [x, mask.to(x.dtype)[:, None, :, None].expand(b, 1, net.height, net.width)]


class PoolTo(nn.Module):
    """Average-pools (B, C, h, w) maps to (B, C, size, size); a map of that size already is
    passed through untouched (the pooling would be the identity, and costs as much as a
    convolution layer)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = int(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] == self.size and x.shape[-1] == self.size:
            return x
        return nn.functional.adaptive_avg_pool2d(x, self.size)

    def extra_repr(self) -> str:
        return f"size={self.size}"


class PolicyNet(nn.Module):
    """Actor-critic over (image, acquisition mask, steps left) -> (line logits, value).

    Args:
        n_pe: number of PE lines, the actor's output size; must equal ``height`` (image rows
            are PE lines).
        height, width: image size (H = n_pe rows, W readout columns).
        cfg: architecture; default :class:`PolicyNetConfig`.
        generator: torch.Generator for the weight init, so that building a network neither
            reads nor advances the global RNG; None draws from the global RNG like any module.
        prior_lines: length of the prior order (0 = no prior); the order itself is a buffer
            (lines 0, 1, ... until :meth:`set_prior`), saved with the weights.
    """

    def __init__(
        self,
        n_pe: int,
        height: int,
        width: int,
        cfg: PolicyNetConfig | None = None,
        generator: torch.Generator | None = None,
        prior_lines: int = 0,
    ) -> None:
        super().__init__()
        cfg = PolicyNetConfig() if cfg is None else cfg
        for name, value in (("n_pe", n_pe), ("height", height), ("width", width)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if n_pe != height:
            raise ValueError(
                f"n_pe must equal the image height (image rows are PE lines), got n_pe={n_pe}, "
                f"height={height}"
            )
        self.config = cfg
        self.n_pe, self.height, self.width = n_pe, height, width
        # The layers' default init is replaced below; building them under a forked RNG keeps
        # that throw-away init from advancing the global RNG.
        with isolated_rng():
            convs: list[nn.Module] = []
            in_channels = 3 if cfg.reacquire else 2
            for out_channels in cfg.channels:
                convs += [nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1), nn.ReLU()]
                in_channels = out_channels
            self.encoder = nn.Sequential(*convs, PoolTo(cfg.pool_size), nn.Flatten())
            n_features = in_channels * cfg.pool_size**2 + 1  # + steps_left fraction
            self.trunk = nn.Sequential(nn.Linear(n_features, cfg.hidden), nn.ReLU())
            self.actor = nn.Linear(cfg.hidden, n_pe)
            self.critic = nn.Linear(cfg.hidden, 1)
        if isinstance(prior_lines, bool) or not isinstance(prior_lines, int) or not 0 <= prior_lines <= n_pe:
            raise ValueError(f"prior_lines must be an integer in [0, n_pe={n_pe}], got {prior_lines!r}")
        self.prior_lines = prior_lines
        # buffer and parameter exist only with a prior, so checkpoints without one keep their keys
        self.register_buffer("prior_order", torch.arange(prior_lines, dtype=torch.int64) if prior_lines else None)
        self.prior_scale = nn.Parameter(torch.tensor(cfg.prior_weight)) if prior_lines else None
        self.repeat_scale = nn.Parameter(torch.tensor(cfg.repeat_weight)) if cfg.reacquire else None
        self.prior_train = 1
        """Lines of the order the prior marks at once: the echo-train length the policy chooses
        (``acquisition.lines_per_decision``); kept in the checkpoint's metadata."""
        self.reset_parameters(generator)
        # channels-last convolutions: 1.5x faster forward + backward on CPU (oneDNN) with the
        # encoder's few channels; the layout changes no value a caller sees.
        self.encoder.to(memory_format=torch.channels_last)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """CleanRL init: orthogonal gain sqrt(2) (hidden), 0.01 (actor head), 1 (critic head)."""
        for module in (*self.encoder, *self.trunk):
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                layer_init(module, math.sqrt(2.0), generator)
        layer_init(self.actor, 0.01, generator)
        layer_init(self.critic, 1.0, generator)
        if self.prior_scale is not None:
            with torch.no_grad():
                self.prior_scale.fill_(self.config.prior_weight)
        if self.repeat_scale is not None:
            with torch.no_grad():
                self.repeat_scale.fill_(self.config.repeat_weight)

    def set_prior(self, order: torch.Tensor | list[int]) -> None:
        """The fixed order the prior follows: ``prior_lines`` distinct lines in [0, n_pe)."""
        if self.prior_order is None:
            raise ValueError("this network was built without a prior (prior_lines=0)")
        order = torch.as_tensor(order, dtype=torch.int64).flatten().cpu()
        if order.numel() != self.prior_lines:
            raise ValueError(f"the prior order must have {self.prior_lines} lines, got {order.numel()}")
        if order.numel() and (int(order.min()) < 0 or int(order.max()) >= self.n_pe):
            raise ValueError(f"prior order lines must be in [0, {self.n_pe}), got {order.tolist()}")
        if len(set(order.tolist())) != order.numel():
            raise ValueError(f"prior order lines must be distinct, got {order.tolist()}")
        with torch.no_grad():
            self.prior_order.copy_(order)

    def prior_bonus(self, mask: torch.Tensor) -> torch.Tensor:
        """(B, n_pe): 1 on the first ``prior_train`` lines of the prior order that ``mask``
        (B, n_pe) has not acquired (the next echo train of the order; 1 line by default), 0
        elsewhere (all 0 once the whole order is acquired, or without a prior)."""
        bonus = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        if self.prior_order is None:
            return bonus
        free = ~mask.bool()[:, self.prior_order]  # (B, L)
        if self.prior_train == 1:
            first = free.to(torch.uint8).argmax(dim=1)  # the first free position (0 when none is)
            rows = torch.arange(mask.shape[0], device=mask.device)
            bonus[rows, self.prior_order[first]] = free.any(dim=1).float()
            return bonus
        take = free & (free.long().cumsum(dim=1) <= self.prior_train)
        return bonus.scatter(1, self.prior_order.expand(mask.shape[0], -1), take.float())

    def _repeatable(self, mask: torch.Tensor, repeatable: torch.Tensor | None) -> torch.Tensor | None:
        """The flagged lines as (B, n_pe) bool (none flagged when None), only for a network
        that re-acquires."""
        if not self.config.reacquire:
            return None
        if repeatable is None:
            return torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
        if tuple(repeatable.shape) != tuple(mask.shape):
            raise ValueError(f"repeatable must be (B, n_pe) = {tuple(mask.shape)}, got {tuple(repeatable.shape)}")
        return repeatable.bool() & mask.bool()

    def features(
        self, image: torch.Tensor, mask: torch.Tensor, steps_left_frac: torch.Tensor,
        repeatable: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The shared trunk's output: (B, hidden). Arguments as in :meth:`forward`."""
        planes = input_planes(self, image, mask, steps_left_frac)
        flagged = self._repeatable(mask, repeatable)
        if flagged is not None:
            planes.append(flagged.to(planes[0].dtype)[:, None, :, None].expand_as(planes[0]))
        x = torch.cat(planes, dim=1)
        h = self.encoder(x.contiguous(memory_format=torch.channels_last))
        h = torch.cat([h, steps_left_frac.to(h.dtype).unsqueeze(1)], dim=1)
        return self.trunk(h)

    def forward(
        self, image: torch.Tensor, mask: torch.Tensor, steps_left_frac: torch.Tensor,
        repeatable: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """image: (B, H, W) magnitude images (any units); mask: (B, n_pe) bool, True = acquired;
        steps_left_frac: (B,) steps left / budget in [0, 1]; repeatable: (B, n_pe) bool, the
        acquired lines the scanner flagged, which may be acquired again (``reacquire`` networks
        only; None: none flagged).

        Returns (logits (B, n_pe), value (B,)). The logits are *not* masked: use
        :func:`masked_logits` / :func:`masked_distribution` with :func:`blocked` of the same
        mask and flags.
        """
        h = self.features(image, mask, steps_left_frac, repeatable)
        logits = self.actor(h)
        if self.prior_scale is not None:
            logits = logits + self.prior_scale * self.prior_bonus(mask).to(logits.dtype)
        flagged = self._repeatable(mask, repeatable)
        if flagged is not None:
            logits = logits + self.repeat_scale * flagged.to(logits.dtype)
        return logits, self.critic(h).squeeze(1)

    def scores(self, image: torch.Tensor, mask: torch.Tensor, steps_left_frac: torch.Tensor,
               repeatable: torch.Tensor | None = None) -> torch.Tensor:
        """(B, n_pe) masked logits: what a greedy policy takes the argmax of."""
        return masked_logits(self(image, mask, steps_left_frac, repeatable)[0], blocked(mask, repeatable))

    def extra_repr(self) -> str:
        prior = f", prior_lines={self.prior_lines}" if self.prior_lines else ""
        return f"n_pe={self.n_pe}, height={self.height}, width={self.width}{prior}"
