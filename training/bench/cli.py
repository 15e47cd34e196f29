"""``masc bench``: throughput benchmarks.

``masc bench unet``: forward latency and throughput of the MAR network. The library function
:func:`bench_unet` returns one row (a dict) per measured configuration; the CLI prints them as a
table and optionally writes JSON.

``masc bench env``: acquisition-environment steps per second, batched (:func:`bench_env`: one
:class:`~training.rl.env.BatchedAcquisitionEnv` stepping ``n_envs`` slices together) against one
slice at a time (a one-env batched env and the Gymnasium env), and end-to-end PPO training
throughput (:func:`bench_ppo`: our batched PPO against sb3-contrib's MaskablePPO on the
Gymnasium env, the optional ``bench`` extra).

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

import argparse
import copy
import dataclasses
import importlib.util
import json
import logging
import math
import os
import platform
import random
import shlex
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from masc_gadget import __version__
from masc_gadget.acquisition.episode import AcquisitionConfig
from masc_gadget.device import resolve_device
from masc_gadget.models.policy_net import PolicyNet, PolicyNetConfig
from masc_gadget.models.unet import MarModelConfig, MarNet, build_mar
from training.data import SliceSet
from training.rl.env import BatchedAcquisitionEnv, EnvConfig
from training.rl.ppo import PPOConfig, collect_rollout, make_optimizer, ppo_update, start

log = logging.getLogger("masc.bench")

VARIANTS = ("fp32", "bf16", "nchw", "nchw_bf16", "compile", "compile_bf16")
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
    if variant.startswith("nchw"):
        model.residual.set_memory_format(torch.contiguous_format)
        return model
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
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
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


# --- masc bench env ---------------------------------------------------------------------------

SB3_HINT = "pip install sb3-contrib (or .[bench])"
"""What to do when sb3-contrib is missing."""

ENV_KEYS = (
    "device",  # e.g. "cpu", "cuda:0"
    "n_envs",  # B, slices stepped together by the batched env
    "steps_per_env",  # timed steps of each of the B envs
    "total_steps",  # n_envs * steps_per_env: environment steps of every timed loop
    "warmup_steps",  # untimed steps per env before each timed loop
    "initial",  # centre lines acquired at the start of an episode
    "budget",  # lines chosen per episode (episode length)
    "n_pe",  # PE lines (actions)
    "image_shape",  # [H, W]
    "n_slices",  # slices the episodes are drawn from
    "mar_width",  # width of the MAR network; 0 = none, None = not a MarNet
    "mar_params",  # its number of parameters (0 without)
    "batched_s",  # seconds of the timed loop: B envs together, steps_per_env batched steps
    "batched_steps_per_s",  # total_steps / batched_s
    "single_s",  # one-env BatchedAcquisitionEnv stepped total_steps times
    "single_steps_per_s",
    "gym_s",  # the Gymnasium ActiveAcquisitionEnv stepped total_steps times
    "gym_steps_per_s",
    "speedup",  # batched_steps_per_s / single_steps_per_s
    "speedup_vs_gym",  # batched_steps_per_s / gym_steps_per_s
)

PPO_KEYS = (
    "device",
    "n_envs",  # environments of our batched PPO (sb3 steps one Gymnasium env)
    "total_steps",  # environment steps of each training run (a multiple of rollout_steps)
    "rollout_steps",  # transitions per rollout (both)
    "minibatch_size",  # both
    "epochs",  # both
    "mar_width",
    "ours_s",  # seconds of collect_rollout + ppo_update over total_steps
    "ours_steps_per_s",  # total_steps / ours_s
    "ours_policy_params",  # PolicyNet parameters
    "sb3_status",  # "ok", or "skipped: ..." when not asked for or sb3-contrib is missing
    "sb3_version",  # sb3-contrib version, None when skipped
    "sb3_s",  # seconds of MaskablePPO.learn(total_steps)
    "sb3_steps_per_s",
    "sb3_policy_params",  # MultiInputPolicy parameters
    "sb3_policy",  # "mlp": sb3's default MLP over the flattened observation; "ours": our PolicyNet
    "speedup",  # ours_steps_per_s / sb3_steps_per_s; None when skipped
)


def sb3_available() -> bool:
    """True when sb3-contrib (MaskablePPO) can be imported."""
    return importlib.util.find_spec("sb3_contrib") is not None


def seeded_mar(width: int, cfg: MarModelConfig | None = None, seed: int = 0,
               device: str | torch.device = "cpu") -> MarNet | None:
    """The MAR network both sides of a comparison share: ``cfg`` (depth, scale quantile) at
    ``width`` with seeded weights, in eval mode on ``device``; None when ``width`` is 0.
    Leaves the global RNG state alone."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"MAR width must be an integer >= 0 (0 = no MAR network), got {width!r}")
    if width == 0:
        return None
    cfg = dataclasses.replace(cfg or MarModelConfig(), width=width)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mar = build_mar(cfg)
    return mar.to(resolve_device(device)).eval()


def _mar_width(mar: nn.Module | None) -> int | None:
    """0 without a MAR network, its ``config.width`` (a :class:`MarNet`), else None (unknown)."""
    if mar is None:
        return 0
    width = getattr(getattr(mar, "config", None), "width", None)
    return None if width is None else int(width)


def _random_free_lines(mask: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """mask: (B, PE) bool, True = acquired -> (B,) long: argmax of uniform random scores over
    the free lines (a uniformly random free line). Scores are drawn on the generator's device."""
    scores = torch.rand(mask.shape, generator=generator, device=generator.device).to(mask.device)
    return scores.masked_fill(mask, -1.0).argmax(dim=1)


def _steps_per_s(steps: int, seconds: float) -> float:
    return steps / seconds if seconds > 0 else float("inf")


def _time_batched(env: BatchedAcquisitionEnv, steps: int, warmup: int,
                  generator: torch.Generator) -> float:
    """Seconds of ``steps`` random valid steps of every env (after ``warmup`` untimed ones)."""
    obs = env.reset()
    for _ in range(warmup):
        obs = env.step(_random_free_lines(obs.mask, generator))[0]
    _sync(env.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        obs = env.step(_random_free_lines(obs.mask, generator))[0]
    _sync(env.device)
    return time.perf_counter() - t0


def _time_gym(env: Any, steps: int, warmup: int, generator: torch.Generator, seed: int) -> float:
    """Seconds of ``steps`` random valid steps of a Gymnasium env with ``action_masks()``
    (reset when an episode terminates, inside the timed loop as the batched env does)."""
    env.reset(seed=seed)

    def one_step() -> None:
        allowed = torch.from_numpy(env.action_masks())
        action = int(_random_free_lines(~allowed[None], generator)[0])
        _, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            env.reset()

    for _ in range(warmup):
        one_step()
    device = env.batched.device
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    _sync(device)
    return time.perf_counter() - t0


def bench_env(
    data: SliceSet,
    initial: int,
    budget: int,
    n_envs: int = 64,
    steps: int = 20,
    mar: nn.Module | None = None,
    device: str | torch.device = "auto",
    env_cfg: EnvConfig | None = None,
    warmup: int | None = None,
    seed: int = 0,
    gym: bool = True,
) -> dict[str, Any]:
    """Environment steps per second, batched against one slice at a time, same process.

    Three timed loops make the same number of environment steps, ``n_envs * steps``, with the
    same MAR network ``mar`` (None: reconstruction only) and random valid actions (argmax of
    uniform scores over the free lines, from a seeded ``torch.Generator``):

    * batched: one :class:`BatchedAcquisitionEnv` with ``n_envs`` slices, ``steps`` steps;
    * single: a one-env :class:`BatchedAcquisitionEnv`, ``n_envs * steps`` steps;
    * gym: the Gymnasium :class:`~training.rl.gym_env.ActiveAcquisitionEnv` (numpy observations,
      ``action_masks()``), ``n_envs * steps`` steps (skipped with ``gym=False``: None values).

    Finished episodes restart inside the timed loops (auto-reset, or ``reset()`` for the
    Gymnasium env). Each loop first makes ``warmup`` untimed steps per env (default: one
    episode, ``budget``).

    data: the slices; initial, budget: the episode (``initial + budget <= PE``);
    env_cfg: reward and observation settings (``n_envs`` is replaced); device: cpu, cuda,
    cuda:N or auto; ``mar`` must be on it.
    Returns a dict with the keys :data:`ENV_KEYS`. The global RNG state is left alone.
    """
    from training.rl.gym_env import ActiveAcquisitionEnv

    for name, value in (("n_envs", n_envs), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    warmup = budget if warmup is None else warmup
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    device = resolve_device(device)
    env_cfg = env_cfg or EnvConfig()
    total = n_envs * steps
    gen = torch.Generator().manual_seed(seed)

    batched = BatchedAcquisitionEnv(data, dataclasses.replace(env_cfg, n_envs=n_envs), initial, budget,
                                    mar=mar, device=device, seed=seed)
    log.info("batched env: %d envs x %d steps", n_envs, steps)
    batched_s = _time_batched(batched, steps, warmup, gen)
    del batched
    single = BatchedAcquisitionEnv(data, dataclasses.replace(env_cfg, n_envs=1), initial, budget,
                                   mar=mar, device=device, seed=seed)
    log.info("one-env batched env: %d steps", total)
    single_s = _time_batched(single, total, warmup, gen)
    del single
    gym_s = None
    if gym:
        config = {"acquisition": AcquisitionConfig(initial=initial, budget=budget), "env": env_cfg}
        env = ActiveAcquisitionEnv(data=data, config=config, mar=mar, device=device)
        log.info("Gymnasium env: %d steps", total)
        gym_s = _time_gym(env, total, warmup, gen, seed)
        env.close()

    batched_rate = _steps_per_s(total, batched_s)
    single_rate = _steps_per_s(total, single_s)
    gym_rate = None if gym_s is None else _steps_per_s(total, gym_s)
    return {
        "device": str(device),
        "n_envs": n_envs,
        "steps_per_env": steps,
        "total_steps": total,
        "warmup_steps": warmup,
        "initial": int(initial),
        "budget": int(budget),
        "n_pe": data.n_pe,
        "image_shape": [int(d) for d in data.target.shape[1:]],
        "n_slices": len(data),
        "mar_width": _mar_width(mar),
        "mar_params": 0 if mar is None else sum(p.numel() for p in mar.parameters()),
        "batched_s": batched_s,
        "batched_steps_per_s": batched_rate,
        "single_s": single_s,
        "single_steps_per_s": single_rate,
        "gym_s": gym_s,
        "gym_steps_per_s": gym_rate,
        "speedup": batched_rate / single_rate,
        "speedup_vs_gym": None if gym_rate is None else batched_rate / gym_rate,
    }


class _GlobalRngGuard:
    """Saves and restores Python's, numpy's and torch's (CPU and CUDA) global RNG states:
    stable-baselines3 seeds them all."""

    def __enter__(self) -> None:
        self._py, self._np = random.getstate(), np.random.get_state()
        self._torch = torch.random.fork_rng(devices=list(range(torch.cuda.device_count())))
        self._torch.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._torch.__exit__(*exc)
        random.setstate(self._py)
        np.random.set_state(self._np)


def _time_ours(data: SliceSet, initial: int, budget: int, n_envs: int, total: int,
               mar: nn.Module | None, device: torch.device, env_cfg: EnvConfig, cfg: PPOConfig,
               policy_cfg: PolicyNetConfig, seed: int) -> tuple[float, int]:
    env = BatchedAcquisitionEnv(data, dataclasses.replace(env_cfg, n_envs=n_envs), initial, budget,
                                mar=mar, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    net = PolicyNet(data.n_pe, *[int(d) for d in data.target.shape[1:]], policy_cfg,
                    generator=torch.Generator().manual_seed(seed)).to(device)
    optimizer = make_optimizer(net, cfg)
    n_steps = cfg.steps_per_env(n_envs)
    _sync(device)
    t0 = time.perf_counter()
    cursor = start(env, device)
    for _ in range(total // cfg.rollout_steps):
        net.eval()
        rollout = collect_rollout(env, net, n_steps, gen, cursor)
        cursor = rollout.cursor
        ppo_update(net, optimizer, rollout, cfg, gen)
    _sync(device)
    return time.perf_counter() - t0, sum(p.numel() for p in net.parameters())


SB3_POLICIES = ("mlp", "ours")
"""Networks of the MaskablePPO side: sb3's default MLP, or our :class:`PolicyNet`."""


def _policy_net_extractor(policy_cfg: PolicyNetConfig, budget: int) -> type:
    """An sb3 features extractor that is our PolicyNet's encoder and trunk (its actor and critic
    heads are sb3's ``action_net`` / ``value_net`` on top, with ``net_arch=[]``), so both sides
    of the comparison train the same network."""
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

    class PolicyNetFeatures(BaseFeaturesExtractor):
        def __init__(self, observation_space: Any) -> None:
            h, w = observation_space["image"].shape
            super().__init__(observation_space, features_dim=policy_cfg.hidden)
            self.net = PolicyNet(int(observation_space["mask"].n), int(h), int(w), policy_cfg)
            del self.net.actor, self.net.critic  # sb3's heads replace them

        def forward(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.net.features(obs["image"], obs["mask"] > 0.5, obs["steps_left"][:, 0] / budget)

    return PolicyNetFeatures


def _time_sb3(data: SliceSet, initial: int, budget: int, total: int, mar: nn.Module | None,
              device: torch.device, env_cfg: EnvConfig, cfg: PPOConfig, seed: int,
              sb3_policy: str = "mlp", policy_cfg: PolicyNetConfig | None = None
              ) -> tuple[float, int, str]:
    import sb3_contrib
    from sb3_contrib import MaskablePPO

    from training.rl.gym_env import ActiveAcquisitionEnv

    config = {"acquisition": AcquisitionConfig(initial=initial, budget=budget), "env": env_cfg}
    env = ActiveAcquisitionEnv(data=data, config=config, mar=mar, device=device)
    policy_kwargs: dict[str, Any] = {}
    if sb3_policy == "ours":
        policy_kwargs = {"features_extractor_class": _policy_net_extractor(policy_cfg or PolicyNetConfig(), budget),
                         "net_arch": [], "share_features_extractor": True,
                         # PolicyNet initialises itself (CleanRL's orthogonal init, as sb3's)
                         "ortho_init": False}
    with _GlobalRngGuard():
        model = MaskablePPO(
            "MultiInputPolicy", env, policy_kwargs=policy_kwargs, learning_rate=cfg.lr, n_steps=cfg.rollout_steps,
            batch_size=cfg.minibatch_size, n_epochs=cfg.epochs, gamma=cfg.gamma,
            gae_lambda=cfg.gae_lambda, clip_range=cfg.clip, normalize_advantage=cfg.norm_adv,
            ent_coef=cfg.ent_coef, vf_coef=cfg.vf_coef, max_grad_norm=cfg.max_grad_norm,
            target_kl=cfg.target_kl or None, seed=seed, device=device, verbose=0,
        )
        params = sum(p.numel() for p in model.policy.parameters())
        _sync(device)
        t0 = time.perf_counter()
        model.learn(total_timesteps=total)
        _sync(device)
        elapsed = time.perf_counter() - t0
    env.close()
    return elapsed, params, sb3_contrib.__version__


def bench_ppo(
    data: SliceSet,
    initial: int,
    budget: int,
    n_envs: int = 64,
    total_steps: int = 2048,
    mar: nn.Module | None = None,
    device: str | torch.device = "auto",
    env_cfg: EnvConfig | None = None,
    ppo_cfg: PPOConfig | None = None,
    policy_cfg: PolicyNetConfig | None = None,
    sb3: bool = True,
    seed: int = 0,
    sb3_policy: str = "mlp",
) -> dict[str, Any]:
    """End-to-end PPO training throughput (environment steps per second, updates included).

    Ours: :func:`~training.rl.ppo.collect_rollout` + :func:`~training.rl.ppo.ppo_update` of a
    :class:`PolicyNet` on a :class:`BatchedAcquisitionEnv` with ``n_envs`` slices. sb3-contrib:
    ``MaskablePPO("MultiInputPolicy")`` (its default MLP over the flattened observation, action
    masks from ``action_masks()``) on the Gymnasium env, one episode at a time. Both use
    ``ppo_cfg``'s rollout size (``n_steps`` for sb3), minibatch size, epochs, learning rate,
    gamma, GAE lambda, clip and loss weights, the same MAR network and the same number of
    environment steps, ``total_steps`` rounded up to a multiple of ``rollout_steps`` (which must
    be a multiple of ``n_envs``). Network construction is not timed; the first rollout is.

    sb3: also time MaskablePPO (ImportError naming :data:`SB3_HINT` when sb3-contrib is not
    installed); without it the ``sb3_*`` values are None and ``sb3_status`` says "skipped".
    sb3_policy: MaskablePPO's network, ``mlp`` (its default) or ``ours`` (our PolicyNet's encoder
    and trunk as its features extractor, so both sides train the same network).
    Returns a dict with the keys :data:`PPO_KEYS`. The global RNG states are left alone
    (stable-baselines3 seeds them; they are restored).
    """
    if sb3_policy not in SB3_POLICIES:
        raise ValueError(f"sb3_policy must be one of {', '.join(SB3_POLICIES)}, got {sb3_policy!r}")
    if sb3 and not sb3_available():
        raise ImportError(f"the MaskablePPO comparison needs sb3-contrib: {SB3_HINT}")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be an integer >= 1, got {total_steps!r}")
    device = resolve_device(device)
    env_cfg = env_cfg or EnvConfig()
    cfg = ppo_cfg or PPOConfig()
    cfg.steps_per_env(n_envs)  # rollout_steps must be a multiple of n_envs
    policy_cfg = policy_cfg or PolicyNetConfig()
    total = -(-total_steps // cfg.rollout_steps) * cfg.rollout_steps

    log.info("our PPO: %d envs, %d steps", n_envs, total)
    ours_s, ours_params = _time_ours(data, initial, budget, n_envs, total, mar, device, env_cfg,
                                     cfg, policy_cfg, seed)
    out: dict[str, Any] = dict.fromkeys(PPO_KEYS)
    out.update(device=str(device), n_envs=n_envs, total_steps=total, rollout_steps=cfg.rollout_steps,
               minibatch_size=cfg.minibatch_size, epochs=cfg.epochs, mar_width=_mar_width(mar),
               ours_s=ours_s, ours_steps_per_s=_steps_per_s(total, ours_s),
               ours_policy_params=ours_params, sb3_status="skipped: not asked for", sb3_policy=sb3_policy)
    if sb3:
        log.info("sb3-contrib MaskablePPO: 1 Gymnasium env, %d steps", total)
        sb3_s, sb3_params, version = _time_sb3(data, initial, budget, total, mar, device, env_cfg,
                                               cfg, seed, sb3_policy, policy_cfg)
        out.update(sb3_status="ok", sb3_version=version, sb3_s=sb3_s,
                   sb3_steps_per_s=_steps_per_s(total, sb3_s), sb3_policy_params=sb3_params)
        out["speedup"] = out["ours_steps_per_s"] / out["sb3_steps_per_s"]
    return out


def format_env_table(env_result: dict[str, Any], ppo_result: dict[str, Any] | None = None) -> str:
    """Plain-text table of :func:`bench_env` (and :func:`bench_ppo`) results."""
    r = env_result
    lines = [f"{'environment':<50} {'steps':>7} {'seconds':>9} {'steps/s':>10} {'batched/this':>12}",
             "-" * 92]
    rows = [(f"batched, {r['n_envs']} envs x {r['steps_per_env']} steps", r["batched_s"],
             r["batched_steps_per_s"], 1.0),
            ("one env at a time (BatchedAcquisitionEnv B=1)", r["single_s"], r["single_steps_per_s"],
             r["speedup"])]
    if r["gym_s"] is not None:
        rows.append(("one env at a time (Gymnasium env)", r["gym_s"], r["gym_steps_per_s"],
                     r["speedup_vs_gym"]))
    for name, seconds, rate, ratio in rows:
        lines.append(f"{name:<50} {r['total_steps']:>7} {seconds:>9.3f} {rate:>10.1f} {ratio:>12.2f}")
    if ppo_result is not None:
        p = ppo_result
        header = (f"{'PPO training (rollouts + updates)':<50} {'steps':>7} {'seconds':>9} "
                  f"{'steps/s':>10} {'ours/this':>12}")
        lines += ["", header, "-" * 92]
        lines.append(f"{'ours, batched env, ' + str(p['n_envs']) + ' envs, PolicyNet':<50} "
                     f"{p['total_steps']:>7} {p['ours_s']:>9.3f} {p['ours_steps_per_s']:>10.1f} {1.0:>12.2f}")
        if p["sb3_status"] == "ok":
            net = "PolicyNet" if p["sb3_policy"] == "ours" else "MLP"
            lines.append(f"{'sb3-contrib MaskablePPO ' + p['sb3_version'] + ', Gym env, ' + net:<50} "
                         f"{p['total_steps']:>7} {p['sb3_s']:>9.3f} {p['sb3_steps_per_s']:>10.1f} "
                         f"{p['speedup']:>12.2f}")
        else:
            lines.append(f"{'sb3-contrib MaskablePPO':<50} {p['sb3_status']}")
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
        "NCHW layout (against the default channels-last) and torch.compile, each with its max |difference| from float32. "
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

    env = actions.add_parser(
        "env", parents=[common], help="acquisition environment and PPO training throughput",
        description="Environment steps per second of the batched acquisition environment "
        "(--n-envs slices stepping together, random valid actions) against one slice at a time "
        "(a one-env batched env and the Gymnasium env), same number of steps, same MAR network. "
        "With --sb3 also end-to-end PPO training throughput: ours (batched env, PolicyNet) "
        "against sb3-contrib MaskablePPO on the Gymnasium env, same rollout size, minibatch, "
        "epochs and number of steps. The episode comes from the acquisition section, the reward "
        "from env, PPO settings from ppo, the policy from policy_net, the MAR depth from mar_model.",
    )
    env.add_argument("--data", required=True, metavar="DIR", help="a MASC data set folder")
    env.add_argument("--split", default="train", choices=["train", "val", "test"],
                     help="split whose slices the episodes use (default train)")
    env.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default auto)")
    env.add_argument("--n-envs", type=int, default=64, metavar="B",
                     help="slices stepped together by the batched env (default 64)")
    env.add_argument("--steps", type=int, default=20, metavar="N",
                     help="timed steps of each batched env; the one-env loops make n-envs x N "
                     "(default 20)")
    env.add_argument("--mar-width", type=int, default=None, metavar="W",
                     help="MAR network width, 0 = none (default: mar_model.width)")
    env.add_argument("--sb3", action="store_true",
                     help=f"also compare PPO training with sb3-contrib MaskablePPO ({SB3_HINT})")
    env.add_argument("--sb3-policy", choices=SB3_POLICIES, default="mlp",
                     help="MaskablePPO's network: mlp (its default MultiInputPolicy MLP) or ours "
                     "(our PolicyNet as its features extractor: the same network on both sides)")
    env.add_argument("--ppo-steps", type=int, default=2048, metavar="N",
                     help="environment steps of each PPO training run, rounded up to a multiple "
                     "of ppo.rollout_steps (default 2048)")
    env.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's)")
    env.add_argument("--seed", type=int, default=0)
    env.add_argument("--out", metavar="FILE.json", help="also write the results as JSON")
    env.set_defaults(func=cmd_env)


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


def _load(values: list[float] | None) -> str:
    return "n/a" if not values else " ".join(f"{x:.2f}" for x in values)


def cmd_env(args: argparse.Namespace) -> int:
    from masc_gadget.cli import CommandError, config_from_args
    from training.data import load_split

    config = config_from_args(args)
    sections = config.sections
    acq = sections.get("acquisition", AcquisitionConfig())
    env_cfg = sections.get("env", EnvConfig())
    mar_cfg = sections.get("mar_model", MarModelConfig())
    ppo_cfg = sections.get("ppo", PPOConfig())
    policy_cfg = sections.get("policy_net", PolicyNetConfig())
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    for name in ("n_envs", "steps", "ppo_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    width = mar_cfg.width if args.mar_width is None else args.mar_width
    device = resolve_device(args.device)
    data = load_split(args.data, args.split)
    acq.check(data.n_pe)
    mar = seeded_mar(width, mar_cfg, seed=args.seed, device=device)
    info = environment(device)  # load average before the runs; the one after is added below

    result = bench_env(data, acq.initial, acq.budget, n_envs=args.n_envs, steps=args.steps,
                       mar=mar, device=device, env_cfg=env_cfg, seed=args.seed)
    ppo_result = None
    if args.sb3:
        if ppo_cfg.rollout_steps % args.n_envs:
            raise CommandError(f"ppo.rollout_steps ({ppo_cfg.rollout_steps}) must be a multiple of "
                               f"--n-envs ({args.n_envs}); change one with --set ppo.rollout_steps=N")
        sb3 = sb3_available()
        if not sb3:
            print(f"sb3-contrib is not installed, MaskablePPO comparison skipped: {SB3_HINT}")
        ppo_result = bench_ppo(data, acq.initial, acq.budget, n_envs=args.n_envs,
                               total_steps=args.ppo_steps, mar=mar, device=device, env_cfg=env_cfg,
                               ppo_cfg=ppo_cfg, policy_cfg=policy_cfg, sb3=sb3, seed=args.seed,
                               sb3_policy=args.sb3_policy)
        if not sb3:
            ppo_result["sb3_status"] = f"skipped: sb3-contrib not installed ({SB3_HINT})"

    info["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    h, w = result["image_shape"]
    print(f"acquisition env, {h}x{w}, {acq.initial} initial + {acq.budget} chosen lines, "
          f"MAR width {width or 'none'}, random valid actions; {info['device']}"
          f"{' (' + info['device_name'] + ')' if 'device_name' in info else ''}, torch {info['torch']}, "
          f"{info['cpu_threads']} CPU threads, load average {_load(info['load_average'])} before, "
          f"{_load(info['load_average_end'])} after")
    print(format_env_table(result, ppo_result))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"command": command, "environment": info, "env": result, "ppo": ppo_result}
        out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"results written to {out}")
    return 0
