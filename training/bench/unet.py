"""``masc bench unet``: forward latency and throughput of the MAR network. :func:`bench_unet`
returns one row (a dict) per measured configuration; :func:`format_table` prints them.

MAR U-Net variants (``variants``):

- ``fp32``: eager float32, the reference every other variant is compared with;
- ``bf16``: ``torch.autocast`` to bfloat16 (the input scale and the residual sum stay float32);
- ``nchw``, ``nchw_bf16``: weights and activations in the contiguous NCHW layout instead of the
  network's default channels-last;
- ``compile``, ``compile_bf16``: ``torch.compile`` (inductor); the first call, compilation
  included, is reported as ``first_call_s``.

A variant that fails (no compiler, out of memory, unsupported op...) gives a row with
``status`` "failed" and the error; for a width where it failed once it is skipped afterwards.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from masc_gadget.core.seeding import isolated_rng
from masc_gadget.device import resolve_device
from masc_gadget.models.unet import MarNet
from training.bench.common import percentile_of, device_sync
from training.bench.names import VARIANTS

log = logging.getLogger("masc.bench")

CPU_DEFAULT_VARIANTS = ("fp32",)
CUDA_DEFAULT_VARIANTS = VARIANTS

ROW_KEYS = (
    "variant",  # one of VARIANTS
    "device",  # e.g. "cpu", "cuda:0"
    "width",  # channels of the first stage (paper: 64)
    "depth",  # encoder stages (paper: 4)
    "weights",  # "random" (seeded) or the checkpoint path
    "params",  # number of parameters
    "height",  # image size (pixels)
    "width_px",
    "batch",  # images per forward call
    "status",  # "ok", "failed" or "skipped"
    "error",  # None or the error message
    "repeats",  # timed forward calls
    "first_call_s",  # first (warm-up) call, seconds; includes compilation for compile variants
    "latency_median_ms",  # per forward call (whole batch)
    "latency_p90_ms",
    "throughput_img_s",  # batch / median latency
    "max_abs_diff",  # max |output - fp32 output|; 0 for fp32
    "max_rel_diff",  # max_abs_diff / max |fp32 output|
    "mean_abs_diff",  # mean |output - fp32 output|
    "peak_mem_mb",  # CUDA peak allocated memory during the timed calls; None on CPU
)


def _reference_model(width: int, depth: int, scale_quantile: float, seed: int,
                     calibration: torch.Tensor) -> MarNet:
    """A MarNet with seeded random weights (head included, so r != 0 and variant differences
    are visible) and BatchNorm statistics taken from one calibration batch, so activations
    have trained-like magnitudes in eval mode. Leaves the global RNG state alone."""
    with isolated_rng(seed):
        model = MarNet(width=width, depth=depth, scale_quantile=scale_quantile)
        torch.nn.init.normal_(model.residual.head.weight, std=1.0 / math.sqrt(width))
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    for bn in bns:
        bn.momentum = None  # cumulative average: one batch gives exactly its statistics
    model.train()
    with torch.no_grad():
        model(calibration)
    for bn in bns:
        bn.momentum = 0.1
    return model.eval()


def _make_variant(variant: str, base: MarNet) -> torch.nn.Module:
    if variant in ("fp32", "bf16"):
        return base
    model = copy.deepcopy(base)
    if variant.startswith("nchw"):
        model.residual.set_memory_format(torch.contiguous_format)
        return model
    if variant.startswith("compile"):
        return torch.compile(model)
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


def _error_text(err: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(err).strip()
    return type(err).__name__ + (f": {text.splitlines()[0]}" if text else "")


def _check_unet_args(device: str | torch.device, widths: Sequence[int],
                     sizes: Sequence[int | tuple[int, int]], batch_sizes: Sequence[int], repeats: int,
                     warmup: int, variants: Sequence[str] | None
                     ) -> tuple[torch.device, list[str], list[tuple[int, int]]]:
    """Validate :func:`bench_unet`'s arguments: (device, variants, (H, W) shapes)."""
    device = resolve_device(device)
    if variants is None:
        variants = CUDA_DEFAULT_VARIANTS if device.type == "cuda" else CPU_DEFAULT_VARIANTS
    variants = list(variants)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant {unknown[0]!r}; known: {', '.join(VARIANTS)}")
    if repeats < 1 or warmup < 1:
        raise ValueError(f"repeats and warmup must be >= 1, got {repeats} and {warmup}")
    shapes = [(s, s) if isinstance(s, int) else (int(s[0]), int(s[1])) for s in sizes]
    if not widths or not shapes or not batch_sizes or min(min(h, w) for h, w in shapes) < 1:
        raise ValueError("widths, sizes and batch_sizes must be non-empty and positive")
    if min(batch_sizes) < 1 or min(widths) < 1:
        raise ValueError(f"batch sizes and widths must be >= 1, got {list(batch_sizes)}, {list(widths)}")
    return device, variants, shapes


def bench_unet(
    device: str | torch.device = "auto",
    widths: Sequence[int] = (64, 16),
    sizes: Sequence[int | tuple[int, int]] = (64, 200),
    batch_sizes: Sequence[int] = (1, 8),
    repeats: int = 5,
    warmup: int = 1,
    depth: int = 4,
    scale_quantile: float = 0.99,
    variants: Sequence[str] | None = None,
    seed: int = 0,
    checkpoint: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Forward latency / throughput of :class:`MarNet` (eval mode, ``torch.no_grad``).

    device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``.
    sizes: square sizes N or (H, W) pairs.
    variants: subset of :data:`VARIANTS`; default ``fp32`` on CPU, all of them on CUDA.
    warmup: untimed calls before the ``repeats`` timed ones (the first is ``first_call_s``).
    checkpoint: benchmark this trained MAR checkpoint instead of random networks (``widths``,
        ``depth`` and ``scale_quantile`` then come from it).
    Returns one dict per (width, size, batch, variant) with the keys :data:`ROW_KEYS`.
    Inputs are seeded uniform [0, 1) images; the global RNG state is left alone.

    Without a checkpoint the networks have seeded random weights (BatchNorm statistics from
    one calibration batch). Randomly initialised BatchNorm ReLU networks amplify small
    perturbations with depth, so their bf16 differences overstate those of a trained network:
    pass ``checkpoint`` to see the accuracy that matters.
    """
    device, variants, shapes = _check_unet_args(device, widths, sizes, batch_sizes, repeats, warmup, variants)
    gen = torch.Generator().manual_seed(seed)
    trained = None
    if checkpoint is not None:
        from masc_gadget.models.checkpoint import load_mar

        trained, _ = load_mar(checkpoint, device)
        widths, depth = [trained.config.width], trained.config.depth
    rows: list[dict[str, Any]] = []
    total = len(widths) * len(shapes) * len(batch_sizes) * len(variants)
    for width in widths:
        if trained is not None:
            base = trained
        else:
            calibration = torch.rand(4, 1, 64, 64, generator=gen)
            base = _reference_model(width, depth, scale_quantile, seed, calibration).to(device)
        fixed = {"device": str(device), "width": width, "depth": depth, "repeats": repeats,
                 "weights": "random" if trained is None else str(checkpoint),
                 "params": sum(p.numel() for p in base.parameters())}
        models: dict[str, torch.nn.Module] = {}
        broken: dict[str, str] = {}
        for height, width_px in shapes:
            for batch in batch_sizes:
                x = torch.rand(batch, 1, height, width_px, generator=gen).to(device)
                reference, ref_max, ref_error = _fp32_reference(base, x, device, width)
                for variant in variants:
                    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
                    row.update(variant=variant, height=height, width_px=width_px, batch=batch, **fixed)
                    log.info("[%d/%d] width %d, %dx%d, batch %d, %s", len(rows) + 1, total,
                             width, height, width_px, batch, variant)
                    if ref_error is not None:
                        row.update(status="failed", error=ref_error)
                    elif variant in broken:
                        row.update(status="skipped", error=f"failed earlier: {broken[variant]}")
                    else:
                        row.update(_measure(variant, base, models, broken, x, reference, ref_max,
                                            device, repeats, warmup, width))
                    rows.append(row)
        del base, models
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _fp32_reference(base: MarNet, x: torch.Tensor, device: torch.device, width: int
                    ) -> tuple[torch.Tensor | None, float, str | None]:
    """(fp32 output, its max |value|, None), or (None, 0, error) when even fp32 fails (e.g. out
    of memory: reported in every row of this input, the benchmark goes on with the next one)."""
    try:
        with torch.no_grad():
            reference = base(x).float()
        return reference, float(reference.abs().max()), None
    except Exception as err:  # e.g. out of memory: report, go on with the next shape
        ref_error = "fp32 reference: " + _error_text(err)
        batch, _, height, width_px = x.shape
        log.warning("%s (width %d, %dx%d, batch %d)", ref_error, width, height, width_px, batch)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None, 0.0, ref_error


def _measure(variant: str, base: MarNet, models: dict[str, torch.nn.Module], broken: dict[str, str],
             x: torch.Tensor, reference: torch.Tensor, ref_max: float, device: torch.device,
             repeats: int, warmup: int, width: int) -> dict[str, Any]:
    """The timing columns and ``status`` of one row; a failure is reported, never raised (and
    remembered in ``broken`` unless it was out of memory). ``width``: for the log."""
    batch, _, height, width_px = x.shape
    try:
        out = _time_variant(variant, base, models, x, reference, ref_max, device, repeats, warmup)
    except Exception as err:  # report per variant, never abort the benchmark
        message = _error_text(err)
        log.warning("%s failed (width %d, %dx%d, batch %d): %s", variant, width,
                    height, width_px, batch, message)
        if not isinstance(err, torch.cuda.OutOfMemoryError):
            broken[variant] = message
        models.pop(variant, None)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"status": "failed", "error": message}
    log.info("  median %.2f ms, p90 %.2f ms, %.1f images/s, max |diff| %.2e",
             out["latency_median_ms"], out["latency_p90_ms"], out["throughput_img_s"], out["max_abs_diff"])
    return {**out, "status": "ok"}


def _time_variant(variant: str, base: MarNet, models: dict[str, torch.nn.Module], x: torch.Tensor,
                  reference: torch.Tensor, ref_max: float, device: torch.device, repeats: int,
                  warmup: int) -> dict[str, Any]:
    if variant not in models:
        models[variant] = _make_variant(variant, base)
    model = models[variant]
    autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16)
                if variant.endswith("bf16") else nullcontext())
    times = []
    with torch.no_grad(), autocast:
        for i in range(warmup + repeats):
            if i == warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            device_sync(device)
            t0 = time.perf_counter()
            out = model(x)
            device_sync(device)
            elapsed = time.perf_counter() - t0
            if i == 0:
                first_call_s = elapsed
            if i >= warmup:
                times.append(elapsed)
    diff = float((out.float() - reference).abs().max())
    median = percentile_of(times, 50)
    return {
        "first_call_s": first_call_s,
        "latency_median_ms": 1e3 * median,
        "latency_p90_ms": 1e3 * percentile_of(times, 90),
        "throughput_img_s": x.shape[0] / median,
        "max_abs_diff": diff,
        "max_rel_diff": diff / ref_max if ref_max > 0 else diff,
        "mean_abs_diff": float((out.float() - reference).abs().mean()),
        "peak_mem_mb": (torch.cuda.max_memory_allocated(device) / 2**20
                        if device.type == "cuda" else None),
    }


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Plain-text table of :func:`bench_unet` rows."""
    header = (f"{'variant':<19} {'width':>5} {'size':>9} {'batch':>5} {'median ms':>10} "
              f"{'p90 ms':>9} {'img/s':>9} {'max|diff|':>9} {'rel':>8} {'first s':>8}  status")
    lines = [header, "-" * len(header)]
    for r in rows:
        size = f"{r['height']}x{r['width_px']}"
        if r["status"] == "ok":
            lines.append(
                f"{r['variant']:<19} {r['width']:>5} {size:>9} {r['batch']:>5} "
                f"{r['latency_median_ms']:>10.2f} {r['latency_p90_ms']:>9.2f} "
                f"{r['throughput_img_s']:>9.1f} {r['max_abs_diff']:>9.1e} {r['max_rel_diff']:>8.1e} "
                f"{r['first_call_s']:>8.2f}  ok"
            )
        else:
            lines.append(f"{r['variant']:<19} {r['width']:>5} {size:>9} {r['batch']:>5} "
                         f"{'':>10} {'':>9} {'':>9} {'':>9} {'':>8} {'':>8}  {r['status']}: {r['error']}")
    return "\n".join(lines)
