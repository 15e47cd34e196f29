"""Paired tests over subjects: per-subject means, the ICC of the differences, and a slice-level
'win' that is no subject-level win."""

import math

import numpy as np
import pytest
from scipy import stats

from training.evaluation.stats import (
    intraclass_correlation,
    paired_tests,
    subject_means,
    subject_of,
    subject_tests,
)


def test_subject_of_labels():
    assert subject_of("sub-0003/12") == "sub-0003"
    assert subject_of("MR_small/pose-2/0") == "MR_small/pose-2"
    assert subject_of("lonely") == "lonely"


def test_subject_means_in_order_of_first_appearance():
    order, means = subject_means(np.array([1.0, 2.0, 10.0, 3.0]), ["b", "b", "a", "b"])
    assert order == ["b", "a"]
    np.testing.assert_allclose(means, [2.0, 10.0])
    with pytest.raises(ValueError, match="one subject per value"):
        subject_means(np.zeros(3), ["a"])


def test_icc_against_a_balanced_anova_by_hand():
    rng = np.random.default_rng(0)
    groups, per = 6, 5
    values = (rng.normal(0, 1.0, groups)[:, None] + rng.normal(0, 0.5, (groups, per))).ravel()
    subjects = [f"s{g}" for g in range(groups) for _ in range(per)]
    x = values.reshape(groups, per)
    msb = per * ((x.mean(1) - x.mean()) ** 2).sum() / (groups - 1)
    msw = ((x - x.mean(1, keepdims=True)) ** 2).sum() / (groups * (per - 1))
    assert intraclass_correlation(values, subjects) == pytest.approx((msb - msw) / (msb + (per - 1) * msw))
    assert math.isnan(intraclass_correlation(values[:3], ["a", "b", "c"]))  # no replication


def test_clustered_slices_win_over_slices_but_not_over_subjects():
    """Four subjects of 30 slices whose paired differences share a subject effect: the slices
    (120 'independent' pairs) give a tiny p, the four subjects do not."""
    rng = np.random.default_rng(3)
    effect = np.array([0.03, -0.01, 0.02, 0.015])
    subjects = [f"sub-{s}" for s in range(4) for _ in range(30)]
    b = rng.uniform(0.5, 0.7, 120)
    a = b + np.repeat(effect, 30) + rng.normal(0, 0.002, 120)
    out = subject_tests(a, b, subjects)
    assert out["n_subjects"] == 4 and out["n_slices"] == 120
    assert out["p_ttest_slices"] < 1e-10
    mean_a = np.array([a[i * 30:(i + 1) * 30].mean() for i in range(4)])
    mean_b = np.array([b[i * 30:(i + 1) * 30].mean() for i in range(4)])
    assert out["p_ttest"] == pytest.approx(stats.ttest_rel(mean_a, mean_b).pvalue)
    assert out["p_ttest"] > 0.05
    assert out["icc"] > 0.9
    assert out["diff"] == pytest.approx(np.mean(a - b))


def test_one_slice_per_subject_is_the_slice_level_test():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=12), rng.normal(size=12)
    out = subject_tests(a, b, [f"s{i}/0" for i in range(12)])
    ref = paired_tests(a, b)
    assert out["p_ttest"] == pytest.approx(ref["p_ttest"]) == pytest.approx(out["p_ttest_slices"])
    assert out["p_wilcoxon"] == pytest.approx(ref["p_wilcoxon"])
