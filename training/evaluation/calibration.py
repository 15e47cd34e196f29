"""The OOD rule's calibration: how well a score finds harm (ROC), the threshold a network is
served by, and the served image when no subject chooses the rule it is served under.

Per-slice rows come from :mod:`training.evaluation.marcheck` (``mar_ssim``, ``nothing_ssim``,
``zf_ssim``, the scores ``score_<kind>`` / ``early_score_<kind>``, and for a later switch
``switched_ssim``; the same with ``_psnr``). Harm is one thing everywhere
(:func:`training.scoring.harmed`): the served image scores below doing nothing, the zero-filled
image of centre-out's lines with as many lines.

Two objectives pick the threshold (:data:`OBJECTIVES`):

``served``
    the largest mean served SSIM over the calibration slices;
``no-harm``
    the largest mean served SSIM among the thresholds that keep the do-no-harm target on the
    calibration subjects (:data:`NO_HARM`: the mean over subjects of served - nothing at least
    -0.005 SSIM and -0.05 dB, and no subject of 4 slices or more below it by more than 0.02
    SSIM), flagging every slice among the candidates; when none keeps it, the one that flags
    every slice. A rule picked by ``served`` on one set of harm cases follows them: it flags a new
    kind of harm only if it scores above the harm it was picked on; ``no-harm`` spends the margin
    the target leaves on the subjects it can see.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from masc_gadget.core.ood import EARLY_SCORES
from training.evaluation.stats import mean_std, subject_folds, subject_tests
from training.scoring import harmed

log = logging.getLogger(__name__)

__all__ = ["NO_HARM", "OBJECTIVES", "STAGE_KEYS", "auc_interval", "calibrate", "cross_validated", "fallback_rows",
           "roc", "served_under"]

OBJECTIVES = ("served", "no-harm")

NO_HARM = {"mean_ssim": -0.005, "mean_psnr": -0.05, "worst_ssim": -0.02, "min_slices": 4}
"""The do-no-harm target of the served image against doing nothing, per subject (a real volume
is one subject): the mean over subjects of the SSIM and PSNR gains at least ``mean_ssim`` and
``mean_psnr`` (dB), and no subject of ``min_slices`` slices or more below by more than
``-worst_ssim`` SSIM."""

STAGE_KEYS = {"end": ("score_", "zf"), "early": ("early_score_", "nothing")}
"""Per stage of the OOD rule (:mod:`masc_gadget.core.ood`): the prefix of its score rows and the
rows a flagged slice is served as (``<fallback>_ssim``, ``<fallback>_psnr``): at the end, the
zero-filled image of its own lines; switched early, centre-out's zero-filled image (doing
nothing), or, switched after more lines than the initial ones (``--early-lines``), the
zero-filled image of those lines and centre-out's next ones (rows ``switched_*``)."""


def _auc(scores: np.ndarray, harmed: np.ndarray) -> float:
    """The ROC area (Mann-Whitney U / n_pos n_neg, ties counted half) from the ranks, O(n log n);
    NaN when one class is empty."""
    from scipy.stats import rankdata

    n_pos, n_neg = int(harmed.sum()), int((~harmed).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    ranks = rankdata(scores)
    return float((ranks[harmed].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def roc(scores: np.ndarray, harmed: np.ndarray) -> dict[str, Any]:
    """ROC of ``scores`` as a detector of ``harmed`` (higher score = more likely harmed):
    false / true positive rates over every threshold, and the area (Mann-Whitney U / n_pos n_neg,
    ties counted half). NaN area when one class is empty."""
    scores = np.asarray(scores, dtype=np.float64)
    harmed = np.asarray(harmed, dtype=bool)
    n_pos, n_neg = int(harmed.sum()), int((~harmed).sum())
    if n_pos == 0 or n_neg == 0:
        return {"auc": math.nan, "fpr": [], "tpr": [], "n_harmed": n_pos, "n_helped": n_neg}
    thresholds = np.unique(scores)[::-1]
    tpr = [0.0] + [float((scores[harmed] >= t).mean()) for t in thresholds]
    fpr = [0.0] + [float((scores[~harmed] >= t).mean()) for t in thresholds]
    return {"auc": _auc(scores, harmed), "fpr": fpr, "tpr": tpr, "n_harmed": n_pos, "n_helped": n_neg}


def auc_interval(scores: np.ndarray, harm: np.ndarray, subjects: list[str], draws: int = 1000,
                 seed: int = 0) -> tuple[float, float]:
    """The 95 % interval of the ROC area of ``scores`` for ``harm`` under a bootstrap over
    subjects (slices of one subject are not independent): subjects drawn with replacement,
    every slice of a drawn subject kept; draws with one class empty are skipped. NaN when none
    is left."""
    scores, harm = np.asarray(scores, dtype=np.float64), np.asarray(harm, dtype=bool)
    names = sorted(set(subjects))
    rows = {s: np.flatnonzero(np.asarray(subjects) == s) for s in names}
    rng = np.random.default_rng(seed)
    areas = []
    for _ in range(draws):
        index = np.concatenate([rows[names[i]] for i in rng.integers(len(names), size=len(names))])
        area = _auc(scores[index], harm[index])
        if math.isfinite(area):
            areas.append(area)
    if not areas:
        return math.nan, math.nan
    low, high = np.percentile(areas, [2.5, 97.5])
    return float(low), float(high)


def fallback_rows(rows: dict[str, np.ndarray], kind: str, threshold: float, stage: str = "end",
                  metric: str = "ssim") -> np.ndarray:
    """Per-slice served ``metric`` (``ssim`` or ``psnr``) when slices whose ``stage`` score
    exceeds ``threshold`` are served by that stage's fallback (:data:`STAGE_KEYS`)."""
    prefix, fallback = STAGE_KEYS[stage]
    if stage == "early" and f"switched_{metric}" in rows:
        fallback = "switched"
    above = rows[f"{prefix}{kind}"] > threshold
    return np.where(above, rows[f"{fallback}_{metric}"], rows[f"mar_{metric}"])


def _subject_gains(served: np.ndarray, nothing: np.ndarray, codes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(S,) each subject's mean of ``served - nothing`` (``codes``: each slice's subject index)."""
    return np.bincount(codes, weights=served - nothing, minlength=len(counts)) / counts


def _keeps_no_harm(rows: dict[str, np.ndarray], kind: str, threshold: float, stage: str, codes: np.ndarray,
                   counts: np.ndarray) -> bool:
    ssim = _subject_gains(fallback_rows(rows, kind, threshold, stage), rows["nothing_ssim"], codes, counts)
    ok = ssim.mean() >= NO_HARM["mean_ssim"] and not (ssim[counts >= NO_HARM["min_slices"]]
                                                      < NO_HARM["worst_ssim"]).any()
    if ok and "nothing_psnr" in rows and "mar_psnr" in rows:
        psnr = _subject_gains(fallback_rows(rows, kind, threshold, stage, "psnr"), rows["nothing_psnr"], codes, counts)
        ok = psnr.mean() >= NO_HARM["mean_psnr"]
    return bool(ok)


def calibrate(rows: dict[str, np.ndarray], stage: str = "end", objective: str = "served",
              subjects: Sequence[str] | None = None, scores: Sequence[str] | None = None) -> dict[str, Any]:
    """The score with the largest ROC area on ``rows`` (pooled validation slices), among
    ``scores`` (default: every score the rows carry), and the threshold the ``objective`` picks
    (module docstring) with the ``stage`` fallback (:data:`STAGE_KEYS`; ties: the highest
    threshold, i.e. the fewest fallbacks); ``no-harm`` needs each slice's ``subjects``."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown calibration objective {objective!r}: choose from {', '.join(OBJECTIVES)}")
    if objective == "no-harm" and (subjects is None or len(subjects) != len(rows["mar_ssim"])):
        raise ValueError("the no-harm objective needs each slice's subject")
    prefix = STAGE_KEYS[stage][0]
    harm = harmed(rows["mar_ssim"], rows["nothing_ssim"])
    kinds = [k for k in EARLY_SCORES if f"{prefix}{k}" in rows and (not scores or k in scores)]
    if not kinds:  # holdout and halves: a later early switch only
        raise ValueError(f"none of the scores {', '.join(scores or EARLY_SCORES)} is measured at this stage ({stage}): "
                         f"choose among {', '.join(k for k in EARLY_SCORES if f'{prefix}{k}' in rows)}")
    areas = {kind: roc(rows[f"{prefix}{kind}"], harm)["auc"] for kind in kinds}
    kind = max(kinds, key=lambda k: -1.0 if math.isnan(areas[k]) else areas[k])
    candidates = np.unique(np.concatenate([rows[f"{prefix}{kind}"], [np.inf]]))
    every = max(float(candidates[0]) / 2, float(np.finfo(np.float32).tiny))  # flags every slice
    feasible = np.ones(len(candidates), dtype=bool)
    if objective == "no-harm":
        candidates = np.concatenate([[every], candidates]) if every < candidates[0] else candidates
        _, codes, counts = np.unique(np.asarray(subjects), return_inverse=True, return_counts=True)
        feasible = np.array([_keeps_no_harm(rows, kind, t, stage, codes, counts) for t in candidates])
    means = np.array([fallback_rows(rows, kind, t, stage).mean() for t in candidates])
    if feasible.any():
        best = candidates[np.flatnonzero(feasible & (means >= means[feasible].max() - 1e-12))[-1]]
    else:  # not even flagging every slice keeps the target
        log.warning("calibration: no threshold keeps the do-no-harm target on these slices: every slice flagged")
        best = every
    if np.isfinite(best) and best > every:  # midway to the next score above, off the slices
        above = candidates[candidates > best]
        best = float((best + above[0]) / 2) if len(above) and np.isfinite(above[0]) else float(best)
    served = fallback_rows(rows, kind, best, stage)
    return {"score": kind, "threshold": float(best), "stage": stage, "objective": objective,
            **({"keeps_no_harm": bool(feasible.any())} if objective == "no-harm" else {}),
            "auc": {k: float(v) for k, v in areas.items()},
            "val_served_ssim": float(served.mean()),
            "val_mar_ssim": float(rows["mar_ssim"].mean()), "val_zf_ssim": float(rows["zf_ssim"].mean()),
            "fallback_fraction": float((rows[f"{prefix}{kind}"] > best).mean()), "n_slices": int(len(harm)),
            "val_nothing_ssim": float(rows["nothing_ssim"].mean()),
            "val_served_harmed": float(harmed(served, rows["nothing_ssim"]).mean())}


def served_under(rows: dict[str, np.ndarray], subjects: list[str], rules: list[dict[str, Any]],
                 rule_of: np.ndarray, stage: str = "end") -> dict[str, Any]:
    """The served image of every slice under the rule ``rules[rule_of[i]]`` ({score,
    threshold}): per subject and over subjects, the served SSIM (and PSNR where the rows have
    it), the network always on, doing nothing, the fallback rate, the tests of served against
    doing nothing, and the mean and worst subject's gain."""
    served = np.empty(len(subjects))
    served_psnr = np.full(len(subjects), np.nan)
    flagged = np.zeros(len(subjects), dtype=bool)
    with_psnr = "mar_psnr" in rows and "nothing_psnr" in rows
    for i, rule in enumerate(rules):
        at = rule_of == i
        part = {k: v[at] for k, v in rows.items()}
        served[at] = fallback_rows(part, rule["score"], rule["threshold"], stage)
        if with_psnr:
            served_psnr[at] = fallback_rows(part, rule["score"], rule["threshold"], stage, "psnr")
        flagged[at] = part[f"{STAGE_KEYS[stage][0]}{rule['score']}"] > rule["threshold"]
    where = {s: np.asarray(subjects) == s for s in sorted(set(subjects))}
    per_subject = {s: {"slices": int(m.sum()), "served_ssim": float(served[m].mean()),
                       "mar_ssim": float(rows["mar_ssim"][m].mean()),
                       "nothing_ssim": float(rows["nothing_ssim"][m].mean()),
                       **({"served_psnr": float(served_psnr[m].mean()), "mar_psnr": float(rows["mar_psnr"][m].mean()),
                           "nothing_psnr": float(rows["nothing_psnr"][m].mean())} if with_psnr else {}),
                       "fallback_fraction": float(flagged[m].mean())} for s, m in where.items()}
    gains = np.array([v["served_ssim"] - v["nothing_ssim"] for v in per_subject.values()])
    out = {"stage": stage, "rules": rules, "served_ssim": mean_std(served), "fallback_fraction": float(flagged.mean()),
           "served_vs_nothing_ssim": subject_tests(served, rows["nothing_ssim"], subjects),
           "mar_vs_nothing_ssim": subject_tests(rows["mar_ssim"], rows["nothing_ssim"], subjects),
           "harmed_fraction": float(harmed(served, rows["nothing_ssim"]).mean()),
           "subject_mean_gain": float(gains.mean()), "worst_subject_gain": float(gains.min()),
           "per_subject": per_subject}
    if with_psnr:
        out["subject_mean_gain_psnr"] = float(np.mean([v["served_psnr"] - v["nothing_psnr"]
                                                       for v in per_subject.values()]))
    return out


def cross_validated(rows: dict[str, np.ndarray], subjects: list[str], folds: int, stage: str = "end",
                    objective: str = "served", pool: dict[str, np.ndarray] | None = None,
                    pool_subjects: Sequence[str] | None = None, prefix: str = "",
                    scores: Sequence[str] | None = None) -> dict[str, Any]:
    """The served image when the OOD rule (its ``stage``) is calibrated without the subject it
    serves: the subjects (volumes) split into ``folds``
    (:func:`~training.evaluation.stats.subject_folds`), each fold served under the score and
    threshold :func:`calibrate` picks (``objective``) on the calibration slices less the fold's.
    The calibration slices are ``rows`` themselves, or ``pool`` (those of every folder the
    shipped rule is calibrated on), whose subjects ``pool_subjects`` name these ``prefix +
    subject``; a fold none of whose subjects is in the pool is served under the rule of the
    whole pool; ``scores``: those :func:`calibrate` may choose among. :func:`served_under` of the
    folds' rules."""
    if pool is None:
        pool, pool_subjects, prefix = rows, subjects, ""
    if pool_subjects is None or len(pool_subjects) != len(pool["mar_ssim"]):
        raise ValueError("the calibration slices need one subject each")
    fold_of = subject_folds(subjects, folds)
    pool_subjects = np.asarray(pool_subjects)
    keys = [k for k in pool if k in rows]
    chosen = []
    for fold in range(folds):
        held = np.isin(pool_subjects, [prefix + s for s in set(np.asarray(subjects)[fold_of == fold])])
        rule = calibrate({k: pool[k][~held] for k in keys}, stage, objective, list(pool_subjects[~held]), scores)
        chosen.append({"score": rule["score"], "threshold": rule["threshold"]})
    return {"folds": folds, "objective": objective, **served_under(rows, subjects, chosen, fold_of, stage)}
