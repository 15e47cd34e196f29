"""How predictable is a dataset? The numbers that say whether line choice can matter.

If a template predicts the test images, a MAR network can reproduce them from the two centre
lines and the lines chosen after them hardly change its output: no policy can then beat random
lines. ``masc check diversity`` measures, on the evaluated split:

- **nearest training image**: for each slice, the SSIM of the most similar *clean training*
  image (over every training slice, each scaled by its own maximum): a lookup that needs no scan
  at all. It must fall far below what a scan with the budget achieves.
- **MAR from the initial lines**: the MAR network's SSIM from the initial centre lines alone,
  and, for comparison, after a centre-out and a random scan with the budget, for every
  acceleration of ``eval.accelerations``. A flat curve (initial ~ budget) means the lines do not
  matter.
- **train / test gap**: the same centre-out scan on as many *training* slices: a network that
  memorises its training subjects scores far higher there.
- **ceiling**: the MAR of the fully sampled metal image.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from masc_gadget.acquisition.policies import make_policy
from masc_gadget.config import Config
from masc_gadget.core.metrics import slice_metrics, ssim
from masc_gadget.device import resolve_device
from masc_gadget.models.checkpoint import load_mar
from training.data import SliceSet, load_split, spread_subset
from training.evaluation.evaluate import EvalConfig, run_method
from training.evaluation.stats import mean_std

log = logging.getLogger(__name__)


def _unit_max(images: torch.Tensor) -> torch.Tensor:
    peak = images.reshape(len(images), -1).amax(dim=1).clamp_min(1e-12)
    return images / peak[:, None, None]


@torch.no_grad()
def nearest_training_ssim(data: SliceSet, train: SliceSet, chunk: int = 512) -> np.ndarray:
    """(N,) per slice of ``data``: the largest SSIM of any clean training image against its
    clean image, both scaled to maximum 1 (a template lookup that knows the answer)."""
    if len(train) == 0:
        raise ValueError("the nearest-training-image SSIM needs at least one training slice")
    if train.target.shape[1:] != data.target.shape[1:]:
        raise ValueError(f"training images are {tuple(train.target.shape[1:])}, evaluated ones "
                         f"{tuple(data.target.shape[1:])}")
    bank = _unit_max(train.target.float())
    best = np.full(len(data), -np.inf)
    for i, target in enumerate(_unit_max(data.target.float())):
        for start in range(0, len(bank), chunk):
            part = bank[start:start + chunk]
            best[i] = max(best[i], float(ssim(part, target.expand_as(part)).max()))
    return best


def _summary(values: np.ndarray) -> dict[str, float]:
    return mean_std(np.asarray(values, dtype=np.float64))


@torch.no_grad()
def diversity_report(config: Config, data_dir: str | Path, mar_path: str | Path, split: str = "test",
                     seed: int = 0) -> dict[str, Any]:
    """The numbers of the module docstring, as a dict (written as JSON by the command)."""
    ecfg: EvalConfig = config["eval"]
    device = resolve_device(ecfg.device)
    data = load_split(data_dir, split, ecfg.max_slices)
    train = load_split(data_dir, "train")
    mar, _ = load_mar(mar_path, device)
    mar.eval()
    report: dict[str, Any] = {"split": split, "data": str(data_dir), "n_slices": len(data),
                              "n_train_slices": len(train), "mar_checkpoint": str(mar_path)}
    log.info("nearest training image: %d x %d SSIMs", len(data), len(train))
    report["nearest_training_ssim"] = _summary(nearest_training_ssim(data, train))
    ceiling = [slice_metrics(mar(data.metal_image[i:i + ecfg.batch_size].to(device)),
                             data.target[i:i + ecfg.batch_size].to(device))["ssim"].cpu().numpy()
               for i in range(0, len(data), ecfg.batch_size)]
    report["mar_fully_sampled_ssim"] = _summary(np.concatenate(ceiling))
    train_like = spread_subset(train, len(data))
    report["accelerations"] = {}
    for acc, (initial, budget) in ecfg.accelerations.items():
        row: dict[str, Any] = {"initial": initial, "budget": budget, "n_pe": data.n_pe}
        for name in ("center-out", "random"):
            traj = run_method(make_policy(name), data, initial, budget, mar, seed, ecfg.batch_size, device)
            ssim_curve = traj.curves[True]["ssim"]
            row["mar_initial_ssim"] = _summary(ssim_curve[:, 0])
            row["zero_filled_initial_ssim"] = _summary(traj.curves[False]["ssim"][:, 0])
            row[f"mar_{name}_ssim"] = _summary(ssim_curve[:, -1])
        traj = run_method(make_policy("center-out"), train_like, initial, budget, mar, seed,
                          ecfg.batch_size, device)
        row["train_mar_center-out_ssim"] = _summary(traj.curves[True]["ssim"][:, -1])
        report["accelerations"][acc] = row
    return report


def render_report(report: dict[str, Any]) -> str:
    """The report as Markdown: one line per acceleration."""
    def f(stats: dict[str, float]) -> str:
        return f"{stats['mean']:.4f} ± {stats['std']:.4f}"

    out = [f"# Predictability of split `{report['split']}` ({report['n_slices']} slices; "
           f"{report['n_train_slices']} training slices)", "",
           f"- nearest training image (no scan), SSIM: {f(report['nearest_training_ssim'])}",
           f"- MAR of the fully sampled metal image (ceiling), SSIM: {f(report['mar_fully_sampled_ssim'])}", "",
           "| setting | zero-filled, initial lines | MAR, initial lines | MAR, centre-out scan | "
           "MAR, random scan | MAR, centre-out scan on train (gap) |",
           "|---|---:|---:|---:|---:|---:|"]
    for acc, row in report["accelerations"].items():
        gap = row["train_mar_center-out_ssim"]["mean"] - row["mar_center-out_ssim"]["mean"]
        out.append(f"| {acc}: {row['initial']} + {row['budget']} of {row['n_pe']} | "
                   f"{f(row['zero_filled_initial_ssim'])} | {f(row['mar_initial_ssim'])} | "
                   f"{f(row['mar_center-out_ssim'])} | {f(row['mar_random_ssim'])} | "
                   f"{f(row['train_mar_center-out_ssim'])} ({gap:+.4f}) |")
    out += ["", "SSIM against the clean fully sampled image (mean ± std over slices). The lines can only "
            "matter if the nearest training image and the MAR from the initial lines score well below a scan "
            "with the budget; a large train / test gap means the MAR network memorises its training subjects."]
    return "\n".join(out) + "\n"
