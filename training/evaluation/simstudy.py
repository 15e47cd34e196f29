"""How the simulation's physics changes the problem: ``masc check sim-params``.

The paper's appendix discusses field strength, readout bandwidth and implant material; this
measures them. For each setting a test set is simulated with the *same* subjects (the same
dataset seed, so the anatomy and the implant pose are paired across settings) and only that
parameter changed:

* field strength: 0.55, 1.5, 3 and 7 T;
* readout bandwidth: 0.5x, 1x and 2x the sequence's;
* implant material: CoCr and titanium (stem and head).

Each row reports the artifact severity (NMSE and SSIM of the fully sampled metal image against
the clean one) and, with a trained MASC checkpoint, MASC against the best non-adaptive baseline
under MASC's MAR network (mean SSIM, the difference and the paired t-test p-value).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from masc_gadget.config import Config, load_config
from masc_gadget.core.metrics import slice_metrics
from training.data import load_split
from training.evaluation.stats import subject_tests
from training.evaluation.tables import BASELINES, DISPLAY_NAMES, result_subjects

log = logging.getLogger(__name__)

__all__ = ["STUDIES", "run_study", "render_study"]

STUDIES: dict[str, list[tuple[str, list[str]]]] = {
    "field strength": [(f"{b} T", [f"variation.b0_t=[{b}]", f"sequence.b0_t={b}"]) for b in (0.55, 1.5, 3.0, 7.0)],
    "readout bandwidth": [(f"{s}x bandwidth", [f"variation.bandwidth_scale=[{s}, {s}]"]) for s in (0.5, 1.0, 2.0)],
    "implant material": [(name, [f"variation.stem_materials=[{m}]", f"variation.head_materials=[{m}]",
                                 f"implant.stem_material={m}", f"implant.head_material={m}"])
                         for name, m in (("CoCr", "cocr"), ("titanium", "titanium"))],
}
"""Study -> (setting label, config overrides) rows."""


def severity(data_dir: Path) -> dict[str, float]:
    """Mean NMSE and SSIM of the fully sampled metal image against the clean one (test split)."""
    data = load_split(data_dir, "test")
    metrics = slice_metrics(data.metal_image, data.target)
    return {"nmse": float(metrics["nmse"].mean()), "ssim": float(metrics["ssim"].mean()), "n_slices": len(data)}


def compare(results: dict[str, Any], method: str = "masc") -> dict[str, Any]:
    """``method`` against the best non-adaptive baseline (with MAR) of an evaluation's first block."""
    block = next(iter(results["accelerations"].values()))
    rows = {r["key"]: r for r in block["rows"]}
    if method not in rows:
        raise ValueError(f"the evaluation has no {method!r} row")
    baselines = [rows[b] for b in BASELINES if b in rows]
    if not baselines:
        raise ValueError("the evaluation has no non-adaptive baseline row with MAR")
    best = max(baselines, key=lambda r: r["summary"]["ssim"]["mean"])
    ours = np.asarray(rows[method]["per_slice"]["ssim"])
    theirs = np.asarray(best["per_slice"]["ssim"])
    tests = subject_tests(ours, theirs, result_subjects(results))
    return {"method_ssim": float(ours.mean()), "best_baseline": best["method"],
            "best_baseline_ssim": float(theirs.mean()), "diff": float(ours.mean() - theirs.mean()),
            "p_ttest": tests["p_ttest"], "p_wilcoxon": tests["p_wilcoxon"],
            "p_ttest_slices": tests["p_ttest_slices"], "n_subjects": tests["n_subjects"]}


def run_study(config_path: str | Path | None, overrides: list[str], out: str | Path, subjects: int = 4,
              studies: list[str] | None = None, checkpoint: str | Path | None = None,
              population_data: str | Path | None = None, progress: bool = True,
              data_dir: str | Path | None = None) -> dict[str, Any]:
    """Simulate each setting's test set under ``data_dir/<study>/<setting>/`` (default
    ``out/datasets``; resumable: a finished dataset is kept) and measure it; returns (and writes
    ``out/study.json`` and ``study.md``) the report. ``checkpoint``: a MASC checkpoint evaluated on every set with its own MAR network
    against the baselines (``population`` too when ``population_data`` names the training set)."""
    from sim_scanner.dataset.simulate import simulate_dataset
    from training.evaluation.evaluate import evaluate

    if subjects < 1:
        raise ValueError(f"subjects must be >= 1, got {subjects}")
    chosen = studies or list(STUDIES)
    unknown = [s for s in chosen if s not in STUDIES]
    if unknown:
        raise ValueError(f"unknown study {unknown[0]!r}; studies: {', '.join(STUDIES)}")
    out = Path(out)
    report: dict[str, Any] = {"subjects": subjects, "checkpoint": str(checkpoint) if checkpoint else None,
                              "studies": {}}
    for study in chosen:
        rows = []
        for label, setting in STUDIES[study]:
            folder = Path(data_dir or out / "datasets") / study.replace(" ", "-") / label.replace(" ", "-")
            base = [*overrides, f"dataset.subjects={subjects}", "dataset.split_fractions=[0.0, 0.0, 1.0]", *setting]
            config: Config = load_config(config_path, base)
            log.info("%s: %s -> %s", study, label, folder)
            simulate_dataset(config, folder, progress=progress)
            row: dict[str, Any] = {"setting": label, "overrides": setting, "data": str(folder), **severity(folder)}
            if checkpoint:
                methods = ["random", "center-out", "equispaced", "masc"]
                eval_overrides = [*base]
                if population_data:
                    methods.insert(3, "population")
                    eval_overrides.append(f"eval.population_data={population_data}")
                eval_config = load_config(config_path, eval_overrides)
                results, _ = evaluate(eval_config, folder, "test", methods, checkpoint, progress=False,
                                      checkpoint=checkpoint)
                row.update(compare(results))
            rows.append(row)
        report["studies"][study] = rows
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "study.md").write_text(render_study(report))
    return report


def _p(p: float) -> str:
    return "–" if p is None or math.isnan(p) else ("< 0.001" if p < 0.001 else f"{p:.3f}")


def render_study(report: dict[str, Any]) -> str:
    """The report as Markdown tables (from the report dict only)."""
    out = [f"# Simulation-parameter study ({report['subjects']} subjects per setting, paired anatomy)", ""]
    with_masc = bool(report.get("checkpoint"))
    for study, rows in report["studies"].items():
        out += [f"## {study}", ""]
        head = "| setting | slices | metal vs clean NMSE | metal vs clean SSIM |"
        sep = "| --- | --- | --- | --- |"
        if with_masc:
            head += " MASC SSIM | best baseline (SSIM) | MASC - best | p (t-test over subjects) |"
            sep += " --- | --- | --- | --- |"
        out += [head, sep]
        for r in rows:
            line = f"| {r['setting']} | {r['n_slices']} | {r['nmse']:.4f} | {r['ssim']:.4f} |"
            if with_masc:
                name = DISPLAY_NAMES.get(r["best_baseline"], r["best_baseline"])
                line += (f" {r['method_ssim']:.4f} | {name} ({r['best_baseline_ssim']:.4f}) | {r['diff']:+.4f} |"
                         f" {_p(r['p_ttest'])} |")
            out.append(line)
        out.append("")
    return "\n".join(out)
