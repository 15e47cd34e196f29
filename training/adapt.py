"""``masc train adapt``: a model adapted to a site's own metal-free images, and whether it does no
harm on the volumes it never saw.

One command for the whole path, each step the project's own:

1. **import** the site's volumes (DICOM folders, NIfTI, fastMRI / ISMRMRD files:
   :func:`sim_scanner.dataset.external.read_volumes`, file by file, with its summary) and split
   them by volume: ``--train`` / ``--val`` / ``--test`` names, or, without names, the last volume
   (by name) for validation, the quarter before it held out for the test, the rest for training;
2. **simulate implants** into them (:func:`~sim_scanner.dataset.external.simulate_external`, the
   config's ``artifact2d`` model; training volumes with several poses and augmentation);
3. **fine-tune** the base model's MAR network to the lines its policy plays on those images, by the
   shared recipe (:func:`training.finetune_policy.finetune_policy`, section ``finetune``), selecting
   on the validation volumes;
4. **calibrate** its OOD rule on the validation volumes and check its promises (``masc check mar
   --calibrate``), and **export** it with the calibration and provenance (``masc models export``);
5. **judge** it on the held-out volumes: per volume, the image the gadget would serve (the policy's
   own lines, the calibrated rule applied) against doing nothing (centre-out's zero-filled image
   with as many lines) and against the base model served the same way. The adapted network does no
   harm when the mean over volumes is not below doing nothing by more than 0.005 SSIM and no volume of
   4 slices or more is below it by more than 0.02 (the project's real-anatomy target).

``report.md`` says which, volume by volume; ``report.json`` holds every figure. The reserved public
data (pydicom-data, nibabel's test data, twixtools' and pypulseq's raw data) are for independent
checks, not for adapting.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from masc_gadget.config import Config

__all__ = ["HARM_MEAN", "HARM_VOLUME", "adapt", "default_splits", "judge", "render_report"]

log = logging.getLogger(__name__)

HARM_MEAN = 0.005
"""The mean over held-out volumes may be at most this far below doing nothing (SSIM)."""
HARM_VOLUME = 0.02
"""No held-out volume of :data:`MIN_VOLUME_SLICES` slices or more may be further below (SSIM)."""
MIN_VOLUME_SLICES = 4


def default_splits(names: list[str]) -> list[str]:
    """Splits by volume when none are named: sorted by name, the last for validation, the quarter
    before it (at least one) held out for the test, the rest for training. ValueError for fewer
    than three volumes (one of each is the least a judgement needs)."""
    if len(names) < 3:
        raise ValueError(f"adapting needs at least 3 volumes (train, validation, held-out test), got {len(names)}: "
                         f"{', '.join(names) or 'none'}")
    order = sorted(range(len(names)), key=lambda i: names[i])
    n_test = max(1, (len(names) - 1) // 4)
    splits = ["train"] * len(names)
    splits[order[-1]] = "val"
    for i in order[-1 - n_test:-1]:
        splits[i] = "test"
    return splits


@torch.no_grad()
def _served(policy: Any, mar: torch.nn.Module, data: Any, initial: int, budget: int) -> np.ndarray:
    """Per slice: SSIM of what the gadget serves (the policy's own lines, its network's own OOD rule)."""
    from masc_gadget.core.ood import fallback_rule
    from training.evaluation.evaluate import run_method

    rule = fallback_rule(mar, "auto", switches_early=True)
    traj = run_method(policy, data, initial, budget, mar, seed=0, batch_size=32, device=torch.device("cpu"), ood=rule)
    return traj.curves[True]["ssim"][:, -1]


def judge(models: dict[str, str | Path], data_dir: str | Path, split: str, initial: int, budget: int
          ) -> dict[str, Any]:
    """Per model (name -> checkpoint carrying its policy and network) and per volume of ``split``:
    the served SSIM against doing nothing; whether each model does no harm (module docstring)."""
    from masc_gadget.acquisition.learned import load_learned
    from training.data import load_split
    from training.evaluation.stats import subject_tests
    from training.scoring import do_nothing

    data = load_split(data_dir, split)
    nothing = do_nothing(data, initial, budget)["ssim"]
    subjects = list(data.subjects)
    out: dict[str, Any] = {"split": split, "n_slices": len(data), "volumes": sorted(set(subjects)),
                           "nothing_ssim": float(nothing.mean()), "models": {}}
    for name, path in models.items():
        policy, mar, _ = load_learned(path, "cpu")
        if mar is None:
            raise ValueError(f"{path} carries no MAR network to judge")
        served = _served(policy, mar.eval(), data, initial, budget)
        per_volume = {}
        for volume in sorted(set(subjects)):
            rows = np.asarray([s == volume for s in subjects])
            per_volume[volume] = {"slices": int(rows.sum()), "served_ssim": float(served[rows].mean()),
                                  "nothing_ssim": float(nothing[rows].mean()),
                                  "gain": float(served[rows].mean() - nothing[rows].mean())}
        gains = np.array([v["gain"] for v in per_volume.values()])
        worst = [v for v in per_volume.values() if v["slices"] >= MIN_VOLUME_SLICES]
        no_harm = bool(gains.mean() >= -HARM_MEAN and all(v["gain"] >= -HARM_VOLUME for v in worst))
        out["models"][name] = {"served_ssim": float(served.mean()), "volume_mean_gain": float(gains.mean()),
                               "worst_volume_gain": float(gains.min()), "per_volume": per_volume,
                               "vs_nothing": subject_tests(served, nothing, subjects), "no_harm": no_harm,
                               "served_per_slice": served.tolist()}
    return out


def adapt(config: Config, source: str, base: str, out_dir: str | Path, train: list[str] = (), val: list[str] = (),
          test: list[str] = (), draws: int = 3, train_draws: int = 8, device: str = "auto",
          progress: bool = True) -> dict[str, Any]:
    """The module's command; returns the report written to ``OUT/report.json``."""
    from sim_scanner.dataset.external import (ImportSummary, assign_splits, builtin_volumes, read_volumes,
                                              simulate_external)
    from training.evaluation.marcheck import mar_check
    from training.export import export_checkpoint
    from training.finetune_policy import finetune_policy

    from masc_gadget.acquisition.learned import load_learned
    from masc_gadget.models.checkpoint import load_mar

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    acq = config["acquisition"]
    summary = ImportSummary()
    if source == "builtin" or source.startswith("builtin:"):
        volumes = builtin_volumes([p for p in source.partition(":")[2].split(",") if p] or None)
    else:
        volumes = read_volumes(source, summary)
    names = [v.name for v in volumes]
    if train or val or test:
        splits = assign_splits(volumes, list(train), list(val))
        if test:
            named = assign_splits(volumes, list(test), [])
            clash = [n for n, s, t in zip(names, splits, named) if t == "train" and s != "test"]
            if clash:
                raise ValueError(f"volume {clash[0]!r} is named for the test and for training or validation")
        missing = [s for s in ("train", "val", "test") if s not in splits]
        if missing:
            raise ValueError(f"no volume left for {', '.join(missing)}: name volumes for each of train, val and test")
    else:
        splits = default_splits(names)
    log.info("adapt: %d volumes: train %s; val %s; test %s", len(volumes),
             *(", ".join(n for n, s in zip(names, splits) if s == k) for k in ("train", "val", "test")))
    data_dir = out / "data"
    simulate_external(config, volumes, data_dir, draws=draws, splits=splits, train_draws=train_draws,
                      train_augment=True, progress=progress)
    adapted = out / "adapted.pt"
    best = finetune_policy(config, data_dir, base, base, adapted, "finetune", device, progress)
    policy, _, _ = load_learned(adapted, "cpu")
    base_policy, _, _ = load_learned(base, "cpu")
    snr = tuple(config["variation"].snr) if tuple(config["variation"].snr) != (0.0, 0.0) else (config["physics"].snr,) * 2
    check = mar_check({"adapted": load_mar(adapted)[0], "base": load_mar(base)[0]}, str(data_dir), "val",
                      acq.initial, acq.budget, out / "check_val", do_calibrate=True,
                      policies={"adapted": policy, "base": base_policy}, reference="base",
                      snr=snr if snr[0] > 0 else None)
    shipped = out / "adapted_shipped.pt"
    export_checkpoint(adapted, shipped, command=f"masc train adapt --source {source} --base {base}",
                      ood=check["calibration"]["adapted"],
                      notes={"adapted_from": str(base), "promises": check["folders"]["data"]["adapted"]["summary"]
                             .get("promises")})
    verdict = judge({"adapted": shipped, "base": base}, data_dir, "test", acq.initial, acq.budget)
    report = {"source": source, "base": str(base), "volumes": dict(zip(names, splits)),
              "imported": summary.imported, "skipped": summary.skipped, "import_warnings": summary.warnings,
              "finetune_best": best, "calibration": check["calibration"]["adapted"],
              "promises": check["folders"]["data"]["adapted"]["summary"].get("promises"),
              "held_out": verdict, "model": str(shipped)}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    (out / "report.md").write_text(render_report(report))
    return report


def _f(value: float, digits: int = 3) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:+.{digits}f}"


def render_report(report: dict[str, Any]) -> str:
    """``OUT/report.md``: the verdict first, then the held-out volumes, the promises and the data."""
    held = report["held_out"]
    adapted, base = held["models"]["adapted"], held["models"]["base"]
    word = "does no harm" if adapted["no_harm"] else "HARMS"
    lines = [f"# Site adaptation of {report['base']}", "",
             f"**On the {len(held['volumes'])} held-out volume(s) ({held['n_slices']} slices), the adapted network "
             f"{word}**: mean over volumes {_f(adapted['volume_mean_gain'])} SSIM against doing nothing (centre-out's "
             f"zero-filled image with as many lines; at most {HARM_MEAN} below allowed), worst volume "
             f"{_f(adapted['worst_volume_gain'])} (at most {HARM_VOLUME} below for a volume of {MIN_VOLUME_SLICES} "
             f"slices or more). The base model served the same way: {_f(base['volume_mean_gain'])} / "
             f"{_f(base['worst_volume_gain'])} ({'no harm' if base['no_harm'] else 'harms'}).", "",
             "| held-out volume | slices | doing nothing | base, served | adapted, served | adapted - nothing |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for volume, v in adapted["per_volume"].items():
        b = base["per_volume"][volume]
        lines.append(f"| {volume} | {v['slices']} | {v['nothing_ssim']:.3f} | {b['served_ssim']:.3f} | "
                     f"{v['served_ssim']:.3f} | {_f(v['gain'])} |")
    promises = report.get("promises") or {}
    kept = ", ".join(f"{k} {'kept' if v.get('kept') else 'BROKEN' if v.get('kept') is False else 'not measured'}"
                     for k, v in promises.items() if k != "all")
    cal = report["calibration"]
    lines += ["", f"Promises on the validation volumes (masc check mar): {kept or 'not measured'}.",
              f"OOD rule calibrated on the validation volumes: score `{cal['score']}`, threshold {cal['threshold']:.4g}"
              + (f"; early switch `{cal['early']['score']}` at {cal['early']['threshold']:.4g}" if "early" in cal else "")
              + ".", "",
              "Volumes: " + "; ".join(f"{n} ({s})" for n, s in report["volumes"].items()) + ".",
              f"Imported {len(report['imported'])} volume(s), skipped {len(report['skipped'])} file(s) or series"
              + (": " + "; ".join(report["skipped"][:5]) if report["skipped"] else "") + ".",
              f"The adapted model: `{report['model']}` (serve it with `--set gadget.policy_checkpoint=... "
              "--set gadget.mar_checkpoint=...` from a models folder).", ""]
    return "\n".join(lines)
