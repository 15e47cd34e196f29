"""Per-slice image-quality metrics in torch: SSIM, PSNR, MSE, NMSE, MAE and the reward quality Q.

Convention (DESIGN.md, "Data"): metrics are per slice, against the clean fully sampled image,
both divided by the clean (target) image's maximum so that the data range is 1.
:func:`slice_metrics` and :func:`quality` apply that scaling themselves; the single metrics
(:func:`ssim`, :func:`psnr`, :func:`mse`, :func:`nmse`, :func:`mae`) compute on the images as
given, so scale first (:func:`scale_by_target`) or pass the right ``data_range``.

All functions are batched: images are ``(B, H, W)`` or ``(B, 1, H, W)`` real tensors (numpy arrays
are accepted too) and every metric returns ``(B,)``, on the input's device. They are
differentiable (SSIM is built from ``conv2d``), so :func:`ssim_loss` can train a network.

SSIM is scikit-image's ``structural_similarity(x, y, win_size=7, data_range=1.0,
gaussian_weights=False, use_sample_covariance=True, K1=0.01, K2=0.03)``: a uniform 7x7 window,
sample covariance ``N / (N - 1)``, and the mean of the SSIM map over the interior, where the whole
window lies inside the image (``(win_size - 1) // 2`` cropped from each side).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "HIGHER_IS_BETTER",
    "METRICS",
    "QualityReference",
    "mae",
    "mse",
    "nmse",
    "psnr",
    "quality",
    "roi_metrics",
    "scale_by_target",
    "slice_metrics",
    "ssim",
    "ssim_loss",
]

METRICS = ("ssim", "psnr", "mse", "nmse", "mae")
"""Names of the per-slice metrics, in report order (the keys of :func:`slice_metrics`)."""

HIGHER_IS_BETTER = {"ssim": True, "psnr": True, "mse": False, "nmse": False, "mae": False}
"""For each metric, whether a larger value is a better reconstruction."""

_WIN = 7
"""Side of SSIM's uniform window in :func:`quality` (scikit-image's default)."""

_EPS = 1e-20
"""Floor for the MSE in PSNR and for ``||target||^2`` in NMSE: identical images give a large,
finite PSNR (200 dB at data range 1) and an all-zero target a finite NMSE."""


def _as_bhw(x: torch.Tensor | np.ndarray, name: str) -> torch.Tensor:
    """``(B, H, W)`` or ``(B, 1, H, W)`` real images as a floating ``(B, H, W)`` tensor (a view)."""
    x = torch.as_tensor(x)
    if x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{name} must be real images, got dtype {x.dtype}")
    if not x.is_floating_point():
        x = x.to(torch.float32)
    if x.ndim == 4 and x.shape[1] == 1:
        x = x[:, 0]
    if x.ndim != 3:
        raise ValueError(
            f"{name} must be (B, H, W) or (B, 1, H, W) images, got shape {tuple(x.shape)}"
        )
    return x


def _pair(
    pred: torch.Tensor | np.ndarray, target: torch.Tensor | np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both images as ``(B, H, W)`` tensors of one floating dtype, on ``target``'s device."""
    p = _as_bhw(pred, "pred")
    t = _as_bhw(target, "target")
    if p.shape != t.shape:
        raise ValueError(
            f"pred and target must have the same shape, got {tuple(torch.as_tensor(pred).shape)} "
            f"and {tuple(torch.as_tensor(target).shape)}"
        )
    dtype = torch.promote_types(p.dtype, t.dtype)
    return p.to(device=t.device, dtype=dtype), t.to(dtype=dtype)


def _per_slice(
    value: float | torch.Tensor | np.ndarray, batch: int, like: torch.Tensor, name: str
) -> torch.Tensor:
    """A float or a ``(B,)`` / scalar tensor as a ``(B, 1, 1)`` tensor like ``like``."""
    v = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if v.numel() == 1:
        v = v.reshape(1)
    elif v.shape != (batch,):
        raise ValueError(
            f"{name} must be a float or a ({batch},) tensor, got shape {tuple(v.shape)}"
        )
    return v.reshape(-1, 1, 1)


def scale_by_target(
    pred: torch.Tensor | np.ndarray, target: torch.Tensor | np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """Divide both images by the per-slice maximum of ``target`` (data range 1).

    Args:
        pred: ``(B, H, W)`` or ``(B, 1, H, W)``.
        target: same shape as ``pred``.

    Returns:
        ``(pred / m, target / m)`` in the input shape, with ``m`` = max of each target slice. A
        slice whose target maximum is not positive (an empty, all-zero slice) is left unscaled
        (``m = 1``), so nothing is divided by zero.
    """
    shape = torch.as_tensor(target).shape
    p, t = _pair(pred, target)
    m = t.amax(dim=(-2, -1), keepdim=True)
    m = torch.where(m > 0, m, torch.ones_like(m))
    return (p / m).reshape(shape), (t / m).reshape(shape)


def _uniform_filter_valid(x: torch.Tensor, win_size: int) -> torch.Tensor:
    """Mean over every ``win_size`` x ``win_size`` window that lies inside the image.

    ``x``: ``(N, H, W)`` -> ``(N, H - win_size + 1, W - win_size + 1)``; separable ``conv2d``.
    """
    n, h, w = x.shape
    # one depthwise (grouped) convolution over all N images as channels: on CPU this is an order
    # of magnitude faster for large N than a batch of N single-channel images
    weight = torch.full((n, 1, win_size, 1), 1.0 / win_size, dtype=x.dtype, device=x.device)
    out = F.conv2d(x.reshape(1, n, h, w), weight, groups=n)
    out = F.conv2d(out, weight.transpose(-2, -1), groups=n)
    return out.reshape(n, h - win_size + 1, w - win_size + 1)


def ssim(
    pred: torch.Tensor | np.ndarray,
    target: torch.Tensor | np.ndarray,
    data_range: float | torch.Tensor = 1.0,
    win_size: int = 7,
    k1: float = 0.01,
    k2: float = 0.03,
) -> torch.Tensor:
    """Mean structural similarity of each slice, as scikit-image computes it (uniform window).

    The images are used as given (no scaling): call :func:`scale_by_target` first for the DESIGN
    convention, or use :func:`slice_metrics`.

    Args:
        pred: ``(B, H, W)`` or ``(B, 1, H, W)`` real images.
        target: same shape as ``pred``.
        data_range: dynamic range of the images, a float or a ``(B,)`` tensor (one per slice).
        win_size: side of the uniform window, odd and >= 3, at most ``min(H, W)``.
        k1: SSIM constant, ``C1 = (k1 * data_range) ** 2``.
        k2: SSIM constant, ``C2 = (k2 * data_range) ** 2``.

    Returns:
        ``(B,)`` mean SSIM over the interior of each slice (differentiable).

    Raises:
        ValueError: bad shapes, an even / too small ``win_size``, or images smaller than the window.
    """
    x, y = _pair(pred, target)
    b, h, w = x.shape
    if isinstance(win_size, bool) or not isinstance(win_size, int) or win_size < 3:
        raise ValueError(f"win_size must be an odd int >= 3, got {win_size!r}")
    if win_size % 2 != 1:
        raise ValueError(f"win_size must be odd, got {win_size}")
    if h < win_size or w < win_size:
        raise ValueError(
            f"images must be at least win_size x win_size ({win_size} x {win_size}), "
            f"got {h} x {w}"
        )
    dr = _per_slice(data_range, b, x, "data_range")
    # Local second moments of images shifted by their slice means: the (co)variances do not
    # change, and float32 loses less to cancellation in E[x^2] - E[x]^2.
    ym = y.mean(dim=(-2, -1), keepdim=True).detach()
    yc = y - ym
    uyc, uyy = _target_moments(yc, win_size)
    return _ssim_with(x, ym, yc, uyc, uyy, win_size, (k1 * dr) ** 2, (k2 * dr) ** 2)


def _target_moments(yc: torch.Tensor, win_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local mean and second moment of the mean-shifted target ``yc`` (B, H, W)."""
    b, h, w = yc.shape
    stats = _uniform_filter_valid(torch.stack([yc, yc * yc], dim=1).reshape(b * 2, h, w), win_size)
    return stats.reshape(b, 2, *stats.shape[-2:]).unbind(dim=1)


def _ssim_with(x: torch.Tensor, ym: torch.Tensor, yc: torch.Tensor, uyc: torch.Tensor,
               uyy: torch.Tensor, win_size: int, c1: torch.Tensor | float,
               c2: torch.Tensor | float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean SSIM of each ``x`` (B, H, W) against a target given by its slice mean ``ym``
    (B, 1, 1), mean-shifted image ``yc`` and local moments ``uyc``, ``uyy``
    (:func:`_target_moments`): the target side can be computed once for many predictions.
    ``weight``: (B, H', W') weights of the map's interior, summing to 1 per slice (a region of
    interest, :func:`_interior_weight`); None: the plain mean."""
    b, h, w = x.shape
    xm = x.mean(dim=(-2, -1), keepdim=True).detach()
    xc = x - xm
    stats = _uniform_filter_valid(torch.stack([xc, xc * xc, xc * yc], dim=1).reshape(b * 3, h, w),
                                  win_size)
    uxc, uxx, uxy = stats.reshape(b, 3, *stats.shape[-2:]).unbind(dim=1)

    n = win_size * win_size
    cov_norm = n / (n - 1)
    vx = cov_norm * (uxx - uxc * uxc)
    vy = cov_norm * (uyy - uyc * uyc)
    vxy = cov_norm * (uxy - uxc * uyc)
    ux, uy = uxc + xm, uyc + ym

    a1 = 2 * ux * uy + c1
    a2 = 2 * vxy + c2
    b1 = ux * ux + uy * uy + c1
    b2 = vx + vy + c2
    ssim_map = (a1 * a2) / (b1 * b2)
    if weight is None:
        return ssim_map.mean(dim=(-2, -1))
    return (ssim_map * weight).sum(dim=(-2, -1))


def _as_roi(roi: torch.Tensor | np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A ``(B, H, W)`` region of interest (bool or 0/1) as ``like``'s float dtype and device;
    every slice must hold at least one pixel."""
    r = torch.as_tensor(roi)
    if r.ndim == 4 and r.shape[1] == 1:
        r = r[:, 0]
    if r.shape != like.shape:
        raise ValueError(f"roi must have the images' shape {tuple(like.shape)}, got {tuple(r.shape)}")
    r = r.to(device=like.device, dtype=like.dtype)
    if bool((r.sum(dim=(-2, -1)) <= 0).any()):
        raise ValueError("every slice's region of interest must hold at least one pixel")
    return r


def _interior_weight(roi: torch.Tensor, win_size: int) -> torch.Tensor:
    """(B, H - w + 1, W - w + 1) weights of the SSIM map over the windows centred in ``roi``
    (B, H, W float), normalised per slice; a region that lies wholly in the border the map
    crops keeps the nearest interior windows (the region grown until it reaches the interior)."""
    pad = (win_size - 1) // 2
    inner = roi[:, pad:roi.shape[1] - pad, pad:roi.shape[2] - pad]
    grown = roi
    while bool((inner.sum(dim=(-2, -1)) <= 0).any()):
        grown = F.max_pool2d(grown[:, None], 3, stride=1, padding=1)[:, 0]
        inner = torch.where(inner.sum(dim=(-2, -1), keepdim=True) > 0, inner,
                            grown[:, pad:roi.shape[1] - pad, pad:roi.shape[2] - pad])
    return inner / inner.sum(dim=(-2, -1), keepdim=True)


def ssim_loss(
    pred: torch.Tensor | np.ndarray,
    target: torch.Tensor | np.ndarray,
    data_range: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """``1 - mean SSIM`` over the batch, a differentiable scalar loss (images used as given).

    Args:
        pred: ``(B, H, W)`` or ``(B, 1, H, W)``.
        target: same shape as ``pred``.
        data_range: a float or a ``(B,)`` tensor.

    Returns:
        scalar tensor.
    """
    return 1.0 - ssim(pred, target, data_range=data_range).mean()


def mse(pred: torch.Tensor | np.ndarray, target: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Mean squared error of each slice: ``(B, H, W)`` or ``(B, 1, H, W)`` -> ``(B,)``."""
    p, t = _pair(pred, target)
    return (p - t).square().mean(dim=(-2, -1))


def nmse(pred: torch.Tensor | np.ndarray, target: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Normalised squared error ``||pred - target||^2 / ||target||^2`` of each slice -> ``(B,)``.

    Scale-invariant; an all-zero target slice divides by a tiny floor instead of zero.
    """
    p, t = _pair(pred, target)
    err = (p - t).square().sum(dim=(-2, -1))
    return err / t.square().sum(dim=(-2, -1)).clamp_min(_EPS)


def mae(pred: torch.Tensor | np.ndarray, target: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Mean absolute error of each slice: ``(B, H, W)`` or ``(B, 1, H, W)`` -> ``(B,)``."""
    p, t = _pair(pred, target)
    return (p - t).abs().mean(dim=(-2, -1))


def psnr(
    pred: torch.Tensor | np.ndarray,
    target: torch.Tensor | np.ndarray,
    data_range: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Peak signal-to-noise ratio ``10 log10(data_range^2 / MSE)`` in dB of each slice -> ``(B,)``.

    The MSE is floored at 1e-20, so identical images give a finite value (200 dB at range 1).
    ``data_range`` is a float or a ``(B,)`` tensor.
    """
    p, t = _pair(pred, target)
    dr = _per_slice(data_range, p.shape[0], p, "data_range").reshape(-1)
    err = (p - t).square().mean(dim=(-2, -1)).clamp_min(_EPS)
    return 10.0 * torch.log10(dr * dr / err)


def slice_metrics(
    pred: torch.Tensor | np.ndarray, target: torch.Tensor | np.ndarray
) -> dict[str, torch.Tensor]:
    """Every metric of :data:`METRICS` per slice, after :func:`scale_by_target` (data range 1).

    Computed without gradients, in float32 (float64 if either input is float64).

    Args:
        pred: reconstruction, ``(B, H, W)`` or ``(B, 1, H, W)``.
        target: clean fully sampled image, same shape.

    Returns:
        ``{"ssim", "psnr", "mse", "nmse", "mae"}`` -> ``(B,)`` tensors, on ``target``'s device.
    """
    with torch.no_grad():
        p, t = _pair(pred, target)
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        p, t = scale_by_target(p.to(dtype), t.to(dtype))
        return {
            "ssim": ssim(p, t),
            "psnr": psnr(p, t),
            "mse": mse(p, t),
            "nmse": nmse(p, t),
            "mae": mae(p, t),
        }


def roi_metrics(
    pred: torch.Tensor | np.ndarray, target: torch.Tensor | np.ndarray,
    roi: torch.Tensor | np.ndarray,
) -> dict[str, torch.Tensor]:
    """SSIM, PSNR and NMSE of each slice in a region of interest, after :func:`scale_by_target`
    (the whole slice's maximum: the data range stays 1).

    SSIM is the mean of the SSIM map over the windows centred in the region (the map of
    :func:`ssim`, so a whole-image region gives :func:`ssim`); PSNR and NMSE sum the squared
    error over the region's pixels.

    Args:
        pred: reconstruction, ``(B, H, W)`` or ``(B, 1, H, W)``.
        target: clean fully sampled image, same shape.
        roi: ``(B, H, W)`` bool or 0/1, at least one pixel per slice.

    Returns:
        ``{"ssim", "psnr", "nmse"}`` -> ``(B,)`` tensors.
    """
    with torch.no_grad():
        p, t = _pair(pred, target)
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        p, t = scale_by_target(p.to(dtype), t.to(dtype))
        r = _as_roi(roi, t)
        ym = t.mean(dim=(-2, -1), keepdim=True)
        uyc, uyy = _target_moments(t - ym, _WIN)
        s = _ssim_with(p, ym, t - ym, uyc, uyy, _WIN, 0.01**2, 0.03**2, _interior_weight(r, _WIN))
        n = r.sum(dim=(-2, -1))
        err = ((p - t).square() * r).sum(dim=(-2, -1))
        return {"ssim": s, "psnr": 10.0 * torch.log10(n / err.clamp_min(_EPS)),
                "nmse": err / (t.square() * r).sum(dim=(-2, -1)).clamp_min(_EPS)}


def quality(
    pred: torch.Tensor | np.ndarray,
    target: torch.Tensor | np.ndarray,
    l_ssim: float = 0.5,
    l_nmse: float = 0.5,
    roi: torch.Tensor | np.ndarray | None = None,
) -> torch.Tensor:
    """The paper's reconstruction quality ``Q = l_ssim * SSIM + l_nmse * (1 - NMSE)`` per slice.

    Both images are scaled by the target's per-slice maximum first (data range 1). Used for the
    RL reward ``r_t = alpha * (Q(g(I_{t+1})) - Q(g(I_t)))``; differentiable.

    Args:
        pred: ``(B, H, W)`` or ``(B, 1, H, W)``.
        target: same shape.
        l_ssim: weight of SSIM.
        l_nmse: weight of ``1 - NMSE``.
        roi: ``(B, H, W)`` region of interest, or None (the whole image): SSIM and NMSE as
            :func:`roi_metrics` computes them.

    Returns:
        ``(B,)``.
    """
    p, t = _pair(pred, target)
    return QualityReference(t, l_ssim, l_nmse, roi)(p)


class QualityReference:
    """:func:`quality` against fixed targets, with the target side computed once.

    ``QualityReference(target, l_ssim, l_nmse)(pred)`` is ``quality(pred, target, l_ssim,
    l_nmse)``: the per-slice scale, the target's mean-shifted image, local moments and energy
    are kept, so each call filters three maps instead of five (the acquisition environment
    scores every step of an episode against the same clean image). Differentiable in ``pred``.

    Args:
        target: ``(B, H, W)`` or ``(B, 1, H, W)`` clean images (at least 7 x 7).
        l_ssim: weight of SSIM.
        l_nmse: weight of ``1 - NMSE``.
        roi: ``(B, H, W)`` region of interest, or None (the whole image).
    """

    _FIELDS = ("inv_scale", "target", "mean", "centred", "local_mean", "local_sq", "energy",
               "region", "weight")

    def __init__(self, target: torch.Tensor | np.ndarray, l_ssim: float = 0.5,
                 l_nmse: float = 0.5, roi: torch.Tensor | np.ndarray | None = None) -> None:
        if not (math.isfinite(l_ssim) and math.isfinite(l_nmse)):
            raise ValueError(f"l_ssim and l_nmse must be finite, got {l_ssim} and {l_nmse}")
        t = _as_bhw(target, "target").detach()
        if min(t.shape[-2:]) < _WIN:
            raise ValueError(f"images must be at least {_WIN} x {_WIN}, got {t.shape[-2]} x {t.shape[-1]}")
        self.l_ssim, self.l_nmse = float(l_ssim), float(l_nmse)
        m = t.amax(dim=(-2, -1), keepdim=True)
        m = torch.where(m > 0, m, torch.ones_like(m))
        self.inv_scale = 1.0 / m  # (B, 1, 1): data range 1 (scale_by_target)
        self.target = t * self.inv_scale
        self.mean = self.target.mean(dim=(-2, -1), keepdim=True)
        self.centred = self.target - self.mean
        self.local_mean, self.local_sq = _target_moments(self.centred, _WIN)
        self.region = self.weight = None  # whole image
        if roi is not None:
            self.region = _as_roi(roi, self.target)
            self.weight = _interior_weight(self.region, _WIN)
        energy = self.target.square() if self.region is None else self.target.square() * self.region
        self.energy = energy.sum(dim=(-2, -1)).clamp_min(_EPS)

    @classmethod
    def _of(cls, fields: dict[str, torch.Tensor], l_ssim: float, l_nmse: float) -> QualityReference:
        ref = cls.__new__(cls)
        ref.l_ssim, ref.l_nmse = l_ssim, l_nmse
        for name, value in fields.items():
            setattr(ref, name, value)
        return ref

    def cat(self, other: QualityReference) -> QualityReference:
        """This batch followed by ``other``'s (same weights, image size, device, and both with or
        both without a region of interest)."""
        self._same_kind(other)
        return self._of({f: None if getattr(self, f) is None else torch.cat([getattr(self, f), getattr(other, f)])
                         for f in self._FIELDS}, self.l_ssim, self.l_nmse)

    def _same_kind(self, other: QualityReference) -> None:
        if (self.region is None) != (other.region is None):
            raise ValueError("cannot combine references with and without a region of interest")

    def replace(self, rows: torch.Tensor, other: QualityReference) -> QualityReference:
        """A copy with slices ``rows`` ((n,) long) replaced by ``other``'s n references."""
        self._same_kind(other)
        fields = {}
        for f in self._FIELDS:
            if getattr(self, f) is None:
                fields[f] = None
                continue
            value = getattr(self, f).clone()
            value[rows] = getattr(other, f)
            fields[f] = value
        return self._of(fields, self.l_ssim, self.l_nmse)

    def __call__(self, pred: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Q of each prediction ``(B, H, W)`` or ``(B, 1, H, W)`` against its target -> ``(B,)``."""
        p = _as_bhw(pred, "pred")
        if p.shape != self.target.shape:
            raise ValueError(f"pred must have the targets' shape {tuple(self.target.shape)}, "
                             f"got {tuple(p.shape)}")
        p = p.to(self.target.device) * self.inv_scale
        c1, c2 = 0.01**2, 0.03**2  # data range 1, scikit-image's K1 and K2
        s = _ssim_with(p, self.mean, self.centred, self.local_mean, self.local_sq, _WIN, c1, c2,
                       self.weight)
        err = (p - self.target).square()
        if self.region is not None:
            err = err * self.region
        err = err.sum(dim=(-2, -1)) / self.energy
        return self.l_ssim * s + self.l_nmse * (1.0 - err)
