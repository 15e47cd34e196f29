"""A headroom report summarised: the better fixed order, the lead over it pooled over subjects and
networks, the gate's verdict."""

from __future__ import annotations

from typing import Any

import numpy as np

from training.evaluation.headroom.config import METHODS
from training.evaluation.headroom.types import HeadroomReport, HeadroomRun
from training.evaluation.stats import mean_std, paired_tests, subject_means


def captured_share(gain: Any, lead: Any) -> Any:
    """The share of the oracle's ``lead`` over the better fixed order that a ``gain`` over it
    captures: ``gain / lead``, NaN where the oracle does not lead (``lead <= 0``): a share of
    nothing is not defined. The one rule for every captured share (floats or arrays)."""
    gain, lead = np.asarray(gain, dtype=float), np.asarray(lead, dtype=float)
    out = np.where(lead > 0, gain / np.where(lead > 0, lead, 1.0), np.nan)
    return float(out) if out.ndim == 0 else out


def better_fixed(means: dict[str, dict[str, float]], key: str) -> str:
    """The better of the two fixed orders (the fitted one, or centre-out) by their mean ``key``:
    the baseline the gate and a learned policy are measured against."""
    return max(("fixed", "center-out"), key=lambda m: means[m][key])


def _pooled_over_subjects(runs: list[HeadroomRun], method: str, key: str, subjects: list[str],
                          best: bool = False, against: str = "fixed") -> tuple[np.ndarray, dict[str, float]]:
    """Each subject's ``method - against`` (its slices' mean; with ``best``, minus each run's
    better fixed order), averaged over the MAR networks, and the paired tests against zero."""
    per_subject = [subject_means(np.asarray(r.slices[method][key])
                                 - np.asarray(r.slices[better_fixed(r.means, key) if best else against][key]),
                                 subjects)[1] for r in runs]
    pooled = np.mean(per_subject, axis=0)
    return pooled, paired_tests(pooled, np.zeros_like(pooled))


def summarise(report: HeadroomReport) -> dict[str, Any]:
    """Mean and spread over the MAR networks, a test on the subjects' leads averaged over them,
    and the gate's verdict."""
    key, runs = report.metric, report.runs
    hcfg = report.settings
    subjects = report.subjects
    leads = np.array([r.lead["diff"] for r in runs])
    pooled, test = _pooled_over_subjects(runs, "oracle", key, subjects)
    lead = mean_std(leads)
    # the gate reads the lead over the better fixed order (the fitted one, or centre-out)
    best_fixed = [better_fixed(r.means, key) for r in runs]
    best_leads = np.array([r.means["oracle"][key] - r.means[b][key] for r, b in zip(runs, best_fixed)])
    pooled_best, test_best = _pooled_over_subjects(runs, "oracle", key, subjects, best=True)
    lead_best = mean_std(best_leads)
    passes = bool(lead_best["mean"] >= hcfg["gate"])
    verdict = ("adaptive line choice can pay here: train MASC for it" if passes
               else "a fixed order refit on this population is the method to deploy here")
    if len(set(subjects)) < 3:  # no test over subjects: say what the number is
        verdict = (f"{len(set(subjects))} subject(s): too few to decide (the lead is "
                   f"{'above' if passes else 'below'} the gate here; measure at least 3 subjects)")
    out: dict[str, Any] = {}
    if runs and all("gated" in r.means for r in runs):  # corruption: the fitted order with navigator gating
        gated_gain = np.array([r.means["gated"][key] - r.means[b][key] for r, b in zip(runs, best_fixed)])
        out["gated"] = {
            "means": mean_std(np.array([r.means["gated"][key] for r in runs])),
            "gain": mean_std(gated_gain),
            "captured": mean_std(captured_share(gated_gain, best_leads)),
        }
    if runs and all(r.policy is not None for r in runs):
        pooled_gain, gain_test = _pooled_over_subjects(runs, "policy", key, subjects, best=True)
        out["policy"] = {
            "means": mean_std(np.array([r.means["policy"][key] for r in runs])),
            "gain_over_fixed": mean_std(np.array([r.policy_vs_fixed["diff"] for r in runs])),
            "gain": mean_std(np.array([r.policy_vs_best["diff"] for r in runs])),
            "captured": mean_std(np.array([r.captured for r in runs])),
            "captured_per_mar": [r.captured for r in runs],
            "p_subjects": gain_test["p_ttest"], "p_wilcoxon_subjects": gain_test["p_wilcoxon"],
            "subjects_ahead": int((pooled_gain > 0).sum()),
        }
        if all(r.policy_vs_gated is not None for r in runs):
            pooled_vs_gated, vs_gated = _pooled_over_subjects(runs, "policy", key, subjects, against="gated")
            out["policy"]["vs_gated"] = {
                "diff": mean_std(np.array([r.policy_vs_gated["diff"] for r in runs])),
                "p_subjects": vs_gated["p_ttest"], "subjects_ahead": int((pooled_vs_gated > 0).sum()),
            }
    return {
        **out,
        "metric": key,
        "lead": lead,
        "lead_per_mar": leads.tolist(),
        "lead_psnr": mean_std(np.array([r.lead_psnr["diff"] for r in runs])),
        "means": {m: mean_std(np.array([r.means[m][key] for r in runs])) for m in METHODS},
        "p_subjects": test["p_ttest"], "p_wilcoxon_subjects": test["p_wilcoxon"],
        "subjects_oracle_ahead": int((pooled > 0).sum()), "n_subjects": len(pooled),
        "lead_best": lead_best, "best_fixed": best_fixed,
        "p_subjects_best": test_best["p_ttest"], "subjects_oracle_ahead_best": int((pooled_best > 0).sum()),
        "gate": hcfg["gate"], "passes": passes, "verdict": verdict,
    }
