"""Paired statistics between methods evaluated on the same slices."""

from __future__ import annotations

import math
import warnings

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


def mean_std(values: np.ndarray) -> dict[str, float]:
    values = np.asarray(values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return {"mean": math.nan, "std": math.nan}
    return {"mean": float(finite.mean()), "std": float(finite.std(ddof=1)) if finite.size > 1 else 0.0}
