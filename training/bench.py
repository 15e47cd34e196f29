"""``masc bench unet``: forward latency and throughput of the MAR network.

The library function :func:`bench_unet` returns one row (a dict) per measured configuration;
the CLI prints them as a table and optionally writes JSON.

Variants (``variants``):

- ``fp32``: eager float32, the reference every other variant is compared with;
- ``bf16``: ``torch.autocast`` to bfloat16 (the input scale and the residual sum stay float32);
- ``channels_last``, ``channels_last_bf16``: weights and input in channels-last memory format;
- ``compile``, ``compile_bf16``: ``torch.compile`` (inductor); the first call, compilation
  included, is reported as ``first_call_s``.

A variant that fails (no compiler, out of memory, unsupported op...) gives a row with
``status`` "failed" and the error; for a width where it failed once it is skipped afterwards.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import platform
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from masc_gadget import __version__
from masc_gadget.device import resolve_device
from masc_gadget.models.unet import MarNet

log = logging.getLogger("masc.bench")

VARIANTS = ("fp32", "bf16", "channels_last", "channels_last_bf16", "compile", "compile_bf16")
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


def _percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty sequence."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _reference_model(width: int, depth: int, scale_quantile: float, seed: int,
                     calibration: torch.Tensor) -> MarNet:
    """A MarNet with seeded random weights (head included, so r != 0 and variant differences
    are visible) and BatchNorm statistics taken from one calibration batch, so activations
    have trained-like magnitudes in eval mode. Leaves the global RNG state alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
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
    if variant.startswith("channels_last"):
        return model.to(memory_format=torch.channels_last)
    if variant.startswith("compile"):
        return torch.compile(model)
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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

    gen = torch.Generator().manual_seed(seed)
    trained = None
    if checkpoint is not None:
        from masc_gadget.checkpoint import load_mar

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
        params = sum(p.numel() for p in base.parameters())
        models: dict[str, torch.nn.Module] = {}
        broken: dict[str, str] = {}
        for height, width_px in shapes:
            for batch in batch_sizes:
                x = torch.rand(batch, 1, height, width_px, generator=gen).to(device)
                try:
                    with torch.no_grad():
                        reference = base(x).float()
                    ref_max, ref_error = float(reference.abs().max()), None
                except Exception as err:  # e.g. out of memory: report, go on with the next shape
                    text = str(err).strip()
                    ref_error = "fp32 reference: " + type(err).__name__ + (f": {text.splitlines()[0]}" if text else "")
                    log.warning("%s (width %d, %dx%d, batch %d)", ref_error, width, height, width_px, batch)
                    reference, ref_max = None, 0.0
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                for variant in variants:
                    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
                    row.update(variant=variant, device=str(device), width=width, depth=depth,
                               weights="random" if trained is None else str(checkpoint),
                               params=params, height=height, width_px=width_px, batch=batch,
                               repeats=repeats)
                    log.info("[%d/%d] width %d, %dx%d, batch %d, %s", len(rows) + 1, total,
                             width, height, width_px, batch, variant)
                    if ref_error is not None:
                        row.update(status="failed", error=ref_error)
                    elif variant in broken:
                        row.update(status="skipped", error=f"failed earlier: {broken[variant]}")
                    else:
                        try:
                            row.update(_time_variant(variant, base, models, x, reference, ref_max,
                                                     device, repeats, warmup))
                            row.update(status="ok")
                        except Exception as err:  # report per variant, never abort the benchmark
                            text = str(err).strip()
                            message = type(err).__name__ + (f": {text.splitlines()[0]}" if text else "")
                            log.warning("%s failed (width %d, %dx%d, batch %d): %s", variant, width,
                                        height, width_px, batch, message)
                            row.update(status="failed", error=message)
                            if not isinstance(err, torch.cuda.OutOfMemoryError):
                                broken[variant] = message
                            models.pop(variant, None)
                            if device.type == "cuda":
                                torch.cuda.empty_cache()
                    if row["status"] == "ok":
                        log.info("  median %.2f ms, p90 %.2f ms, %.1f images/s, max |diff| %.2e",
                                 row["latency_median_ms"], row["latency_p90_ms"],
                                 row["throughput_img_s"], row["max_abs_diff"])
                    rows.append(row)
        del base, models
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _time_variant(variant: str, base: MarNet, models: dict[str, torch.nn.Module], x: torch.Tensor,
                  reference: torch.Tensor, ref_max: float, device: torch.device, repeats: int,
                  warmup: int) -> dict[str, Any]:
    if variant not in models:
        models[variant] = _make_variant(variant, base)
    model = models[variant]
    if variant.startswith("channels_last"):
        x = x.contiguous(memory_format=torch.channels_last)
    autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16)
                if variant.endswith("bf16") else nullcontext())
    times = []
    with torch.no_grad(), autocast:
        for i in range(warmup + repeats):
            if i == warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            t0 = time.perf_counter()
            out = model(x)
            _sync(device)
            elapsed = time.perf_counter() - t0
            if i == 0:
                first_call_s = elapsed
            if i >= warmup:
                times.append(elapsed)
    diff = float((out.float() - reference).abs().max())
    median = _percentile(times, 50)
    return {
        "first_call_s": first_call_s,
        "latency_median_ms": 1e3 * median,
        "latency_p90_ms": 1e3 * _percentile(times, 90),
        "throughput_img_s": x.shape[0] / median,
        "max_abs_diff": diff,
        "max_rel_diff": diff / ref_max if ref_max > 0 else diff,
        "mean_abs_diff": float((out.float() - reference).abs().mean()),
        "peak_mem_mb": (torch.cuda.max_memory_allocated(device) / 2**20
                        if device.type == "cuda" else None),
    }


def environment(device: str | torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    device = resolve_device(device)
    env = {
        "masc_version": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


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


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _size_list(text: str) -> list[int | tuple[int, int]]:
    """``64,200`` or ``200x180,64``."""
    out: list[int | tuple[int, int]] = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        try:
            out.append(tuple(int(p) for p in item.lower().split("x")) if "x" in item.lower() else int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected sizes like 64,200 or 200x180, got {text!r}") from None
        if isinstance(out[-1], tuple) and len(out[-1]) != 2:
            raise argparse.ArgumentTypeError(f"expected sizes like 64,200 or 200x180, got {text!r}")
    if not out:
        raise argparse.ArgumentTypeError(f"expected at least one size, got {text!r}")
    return out


def _variant_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in VARIANTS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"unknown variant {bad[0] if bad else text!r}; known: {', '.join(VARIANTS)}")
    return values


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    bench = subparsers.add_parser("bench", help="benchmark networks on this machine",
                                  description="Latency and throughput benchmarks.")
    actions = bench.add_subparsers(dest="action", metavar="ACTION", required=True)
    unet = actions.add_parser(
        "unet", parents=[common], help="MAR U-Net forward latency and throughput",
        description="Forward latency (median, p90) and throughput of the MAR network in eval mode "
        "at the paper width (64) and the small width (16); on CUDA also bf16 autocast, "
        "channels-last and torch.compile, each with its max |difference| from float32. "
        "Depth and scale quantile come from the mar_model config section.",
    )
    unet.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default auto)")
    unet.add_argument("--sizes", type=_size_list, default=[64, 200], metavar="N[,HxW...]",
                      help="image sizes (default 64,200)")
    unet.add_argument("--widths", type=_int_list, default=[64, 16], metavar="W[,W...]",
                      help="network widths (default 64,16)")
    unet.add_argument("--batch-sizes", type=_int_list, default=[1, 8], metavar="B[,B...]",
                      help="batch sizes (default 1,8)")
    unet.add_argument("--repeats", type=int, default=5, metavar="N", help="timed calls (default 5)")
    unet.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed calls (default 1)")
    unet.add_argument("--variants", type=_variant_list, default=None, metavar="V[,V...]",
                      help=f"subset of {','.join(VARIANTS)} (default: fp32 on CPU, all on CUDA)")
    unet.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's)")
    unet.add_argument("--seed", type=int, default=0)
    unet.add_argument("--checkpoint", metavar="FILE.pt",
                      help="benchmark this trained MAR checkpoint (its width) instead of random weights")
    unet.add_argument("--out", metavar="FILE.json", help="also write the rows as JSON")
    unet.set_defaults(func=cmd_unet)


def cmd_unet(args: argparse.Namespace) -> int:
    from masc_gadget.cli import config_from_args
    from masc_gadget.models.unet import MarModelConfig

    mar_cfg = config_from_args(args).sections.get("mar_model", MarModelConfig())
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    rows = bench_unet(device=args.device, widths=args.widths, sizes=args.sizes,
                      batch_sizes=args.batch_sizes, repeats=args.repeats, warmup=args.warmup,
                      depth=mar_cfg.depth, scale_quantile=mar_cfg.scale_quantile,
                      variants=args.variants, seed=args.seed, checkpoint=args.checkpoint)
    env = environment(args.device)
    weights = args.checkpoint or "seeded random weights"
    print(f"MAR U-Net forward ({weights}), eval mode, no_grad; {env['device']}"
          f"{' (' + env['device_name'] + ')' if 'device_name' in env else ''}, torch {env['torch']}, "
          f"{env['cpu_threads']} CPU threads; latency per call (whole batch)")
    print(format_table(rows))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"environment": env, "rows": rows}, indent=2) + "\n")
        print(f"results written to {out}")
    return 0
