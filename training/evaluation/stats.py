"""Paired statistics between methods evaluated on the same slices.

Slices of one subject are not independent (the same anatomy, implant and scanner), so the
tests that decide are computed over *subjects*: each subject's mean over its slices, then the
paired t-test and the Wilcoxon signed-rank test over the subjects (:func:`subject_tests`). The
tests over slices stay beside them as a secondary figure, with the intraclass correlation of
the paired differences within a subject, which says how far they overstate the evidence (the
design effect ``1 + (m - 1) ICC`` for m slices a subject)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
from scipy import stats


def paired_tests(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Two-sided paired t-test and Wilcoxon signed-rank test of ``a`` vs ``b`` (same slices).

    Returns {"t": statistic, "p_ttest": p, "w": statistic, "p_wilcoxon": p}; p is NaN when a test
    is undefined (fewer than two pairs, or all differences zero).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired samples must be 1D and of equal length, got {a.shape} and {b.shape}")
    out = {"t": math.nan, "p_ttest": math.nan, "w": math.nan, "p_wilcoxon": math.nan}
    diff = a - b
    if len(a) < 2 or not np.any(diff != 0):
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        t = stats.ttest_rel(a, b)
        out["t"], out["p_ttest"] = float(t.statistic), float(t.pvalue)
        try:
            w = stats.wilcoxon(a, b)
            out["w"], out["p_wilcoxon"] = float(w.statistic), float(w.pvalue)
        except ValueError:
            pass
    return out


def subject_of(label: str) -> str:
    """The subject of a slice label ``"SUBJECT/SLICE"`` (a label without a slice part is its own
    subject)."""
    return str(label).rsplit("/", 1)[0]


def subject_means(values: np.ndarray, subjects: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """(subjects in order of first appearance, (S,) each subject's mean of ``values``)."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1 or len(values) != len(subjects):
        raise ValueError(f"need one subject per value, got {len(subjects)} subjects for shape {values.shape}")
    order = list(dict.fromkeys(subjects))
    index = {s: i for i, s in enumerate(order)}
    groups = np.array([index[s] for s in subjects], dtype=np.int64)
    sums = np.bincount(groups, weights=values, minlength=len(order))
    return order, sums / np.bincount(groups, minlength=len(order))


def intraclass_correlation(values: np.ndarray, subjects: Sequence[str]) -> float:
    """ICC(1) of ``values`` grouped by subject (one-way random-effects ANOVA, unequal group
    sizes): the share of the variance between subjects. NaN with fewer than two subjects or no
    replication within them."""
    values = np.asarray(values, dtype=np.float64)
    order, means = subject_means(values, subjects)
    g, n = len(order), len(values)
    if g < 2 or n <= g:
        return math.nan
    index = {s: i for i, s in enumerate(order)}
    groups = np.array([index[s] for s in subjects])
    sizes = np.bincount(groups, minlength=g).astype(np.float64)
    grand = values.mean()
    msb = float((sizes * (means - grand) ** 2).sum() / (g - 1))
    msw = float(((values - means[groups]) ** 2).sum() / (n - g))
    k0 = (n - (sizes ** 2).sum() / n) / (g - 1)
    denom = msb + (k0 - 1.0) * msw
    return float((msb - msw) / denom) if denom > 0 else math.nan


def subject_tests(a: np.ndarray, b: np.ndarray, subjects: Sequence[str]) -> dict[str, float]:
    """Paired tests of ``a`` vs ``b`` (the same slices) at subject level, with the slice-level
    ones as a secondary figure.

    Returns :func:`paired_tests` of the per-subject means (``t``, ``p_ttest``, ``w``,
    ``p_wilcoxon``: these decide), ``n_subjects``, ``n_slices``, the mean difference ``diff``
    (over slices), ``p_ttest_slices`` / ``p_wilcoxon_slices`` (every slice as a pair) and ``icc``
    (:func:`intraclass_correlation` of the differences ``a - b``)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(subjects) != len(a):
        raise ValueError(f"paired samples must be 1D, of equal length and one subject each, got {a.shape}, "
                         f"{b.shape} and {len(subjects)} subjects")
    order, mean_a = subject_means(a, subjects)
    _, mean_b = subject_means(b, subjects)
    slices = paired_tests(a, b)
    return {**paired_tests(mean_a, mean_b), "n_subjects": len(order), "n_slices": int(len(a)),
            "diff": float(np.mean(a - b)) if len(a) else math.nan,
            "p_ttest_slices": slices["p_ttest"], "p_wilcoxon_slices": slices["p_wilcoxon"],
            "icc": intraclass_correlation(a - b, subjects)}


def subject_folds(subjects: list[str], folds: int) -> np.ndarray:
    """(N,) int: the fold of each slice, its subject's position in sorted order modulo ``folds``
    (deterministic, every subject wholly in one fold)."""
    names = sorted(set(subjects))
    if len(names) < folds:
        raise ValueError(f"{folds} folds need at least {folds} subjects, got {len(names)}")
    fold = {s: i % folds for i, s in enumerate(names)}
    return np.array([fold[s] for s in subjects], dtype=np.int64)


def mean_std(values: np.ndarray) -> dict[str, float]:
    values = np.asarray(values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return {"mean": math.nan, "std": math.nan}
    return {"mean": float(finite.mean()), "std": float(finite.std(ddof=1)) if finite.size > 1 else 0.0}
