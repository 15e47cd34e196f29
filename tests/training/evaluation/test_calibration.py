"""The OOD rule's calibration: the do-no-harm objective and cross-validation pooled as the shipped rule."""

import numpy as np
import pytest

from training.evaluation.calibration import NO_HARM, calibrate, cross_validated


def _rows(mar, nothing, score):
    n = len(mar)
    return {"mar_ssim": np.asarray(mar, float), "nothing_ssim": np.asarray(nothing, float), "zf_ssim": np.full(n, 0.1),
            "early_score_consistency": np.asarray(score, float), "early_score_residual": np.full(n, 0.5),
            "early_score_flip": np.full(n, 0.5)}


def test_the_no_harm_objective_spends_the_targets_margin_where_the_served_one_takes_the_mean():
    # subject a: 4 slices the network helps (+0.3 each, scores 0.1); subject b: 4 slices it harms
    # by 0.05 each (scores 0.2). Serving b as it comes keeps the mean (+0.125) and loses 0.05 on b,
    # outside the target's 0.02 for a subject of 4 slices; flagging b serves it as doing nothing.
    rows = _rows([0.8] * 4 + [0.45] * 4, [0.5] * 8, [0.1] * 4 + [0.2] * 4)
    subjects = ["a"] * 4 + ["b"] * 4
    served, safe = calibrate(rows, "early"), calibrate(rows, "early", "no-harm", subjects)
    assert served["fallback_fraction"] == 0.5 and safe["fallback_fraction"] == 0.5  # here both flag b
    # consistency now ranks b below a (area 0): the calibration takes an uninformative score (0.5 on
    # every slice), which flags all slices or none
    rows = _rows([0.8] * 4 + [0.45] * 4, [0.5] * 8, [0.2] * 4 + [0.1] * 4)
    served, safe = calibrate(rows, "early"), calibrate(rows, "early", "no-harm", subjects)
    assert served["fallback_fraction"] == 0.0 and served["threshold"] == np.inf  # the mean pays: b is harmed
    assert safe["fallback_fraction"] == 1.0 and safe["keeps_no_harm"]  # only flagging both keeps b safe
    assert safe["val_served_harmed"] == 0.0 and safe["objective"] == "no-harm"
    # a subject under the target's size (3 slices) may lose more, as long as the mean keeps
    small = _rows([0.8] * 4 + [0.45] * 3, [0.5] * 7, [0.2] * 4 + [0.1] * 3)
    assert calibrate(small, "early", "no-harm", ["a"] * 4 + ["b"] * 3)["fallback_fraction"] == 0.0
    assert NO_HARM["min_slices"] == 4
    with pytest.raises(ValueError, match="each slice's subject"):
        calibrate(rows, "early", "no-harm")


def test_no_threshold_keeping_the_target_flags_every_slice():
    # the network harms every slice by 0.1 and the early fallback (doing nothing) is served as is
    rows = _rows([0.4] * 4, [0.5] * 4, [0.1, 0.2, 0.3, 0.4])
    rows["nothing_ssim"] = np.array([0.5] * 4)
    safe = calibrate(rows, "early", "no-harm", ["a"] * 4)
    assert safe["fallback_fraction"] == 1.0 and 0 < safe["threshold"] < 0.1


def test_a_fold_is_calibrated_on_the_pool_less_its_own_subjects():
    # the pool: hip subjects h1, h2 (helped, low scores) and the folder's own r1 (harmed, high score)
    # and r2 (helped, a middle score). r1's fold is calibrated on h1, h2 and r2 only.
    pool = _rows([0.8, 0.8, 0.3, 0.7], [0.5] * 4, [0.1, 0.1, 0.9, 0.4])
    pool_subjects = ["hip/h1", "hip/h2", "real/r1", "real/r2"]
    rows = {k: v[2:] for k, v in pool.items()}
    cv = cross_validated(rows, ["r1", "r2"], 2, "early", "served", pool, pool_subjects, prefix="real/")
    # r1 held out: nothing harmed is left in the pool, so no threshold is finite and r1 is served harmed
    assert cv["rules"][0]["threshold"] == np.inf and cv["per_subject"]["r1"]["served_ssim"] == pytest.approx(0.3)
    # r2 held out: r1's harm (score 0.9) is in the pool; r2 (0.4) scores below it and is served its network
    assert 0.4 < cv["rules"][1]["threshold"] < 0.9 and cv["per_subject"]["r2"]["fallback_fraction"] == 0.0
    # a folder none of whose subjects calibrates (a held-out domain) is served under the whole pool's rule
    other = _rows([0.2], [0.5], [0.95])
    held = cross_validated(other, ["x"], 1, "early", "served", pool, pool_subjects, prefix="new/")
    assert held["rules"][0]["threshold"] == pytest.approx(calibrate(pool, "early")["threshold"])
    assert held["per_subject"]["x"]["fallback_fraction"] == 1.0 and held["per_subject"]["x"]["served_ssim"] == 0.5


def test_a_folder_left_out_of_the_calibration_is_served_as_a_held_out_domain(tiny_dataset, perturbed_mar, tmp_path):
    """``--calibrate-on``: the rule is picked on the named folders alone; another folder is served
    under that rule (every fold alike) and its report says it calibrates nothing."""
    from masc_gadget.acquisition.policies import make_policy
    from masc_gadget.models.checkpoint import load_mar
    from training.evaluation.marcheck import mar_check

    other = tmp_path / "other"
    other.symlink_to(tiny_dataset, target_is_directory=True)
    mar = load_mar(perturbed_mar)[0]
    results = mar_check({"p": mar}, [str(tiny_dataset), str(other)], "train", 1, 2, tmp_path / "c", do_calibrate=True,
                        policies={"p": make_policy("equispaced")}, folds=2, objective="no-harm",
                        calibrate_on=[tiny_dataset.name])
    rule = results["calibration"]["p"]["early"]
    assert results["calibrated_on_folders"] == [tiny_dataset.name] and rule["objective"] == "no-harm"
    assert [d["folder"] for d in results["calibration"]["p"]["calibrated_on"]["data"]] == [tiny_dataset.name]
    held = results["folders"]["other"]["p"]["summary"]["cross_validated_early"]
    inside = results["folders"][tiny_dataset.name]["p"]["summary"]["cross_validated_early"]
    assert held["held_out"] and not inside["held_out"]
    assert {r["threshold"] for r in held["rules"]} == {rule["threshold"]}  # the rule as calibrated
    assert held["objective"] == "no-harm" and len(inside["rules"]) == 2
    assert "calibrates nothing" in (tmp_path / "c" / "report.md").read_text()
    with pytest.raises(ValueError, match="not among the data folders"):
        mar_check({"p": mar}, str(tiny_dataset), "val", 1, 2, tmp_path / "x", calibrate_on=["elsewhere"])


def test_a_stored_early_rule_serves_its_slices_as_they_come(tiny_dataset, perturbed_mar, tmp_path):
    """A checkpoint's own early rule (no calibration on the slices checked): every slice scoring
    above its threshold is switched, the others are served their network's image."""
    from masc_gadget.acquisition.policies import make_policy
    from masc_gadget.models.checkpoint import load_mar
    from training.evaluation.marcheck import mar_check

    mar = load_mar(perturbed_mar)[0]
    policies = {"p": make_policy("equispaced")}
    first = mar_check({"p": mar}, str(tiny_dataset), "train", 1, 2, tmp_path / "a", policies=policies, folds=2)
    assert "served_early" not in first["folders"][tiny_dataset.name]["p"]["summary"]  # no stored rule
    rule = {"score": "consistency", "threshold": 1e-6, "after_lines": None}  # flags every slice
    results = mar_check({"p": mar}, str(tiny_dataset), "train", 1, 2, tmp_path / "b", policies=policies,
                        ood={"p": {"early": rule}})
    served = results["folders"][tiny_dataset.name]["p"]["summary"]["served_early"]
    assert served["rule"] == rule and served["fallback_fraction"] == 1.0
    assert served["subject_mean_gain"] == pytest.approx(0.0, abs=1e-9)  # switched at the initial lines: doing nothing
    assert "the stored rule" in (tmp_path / "b" / "report.md").read_text()
    # a rule that scores after other line counts than the check is not served under it
    elsewhere = mar_check({"p": mar}, str(tiny_dataset), "train", 1, 2, tmp_path / "c", policies=policies,
                          ood={"p": {"early": {**rule, "after_lines": 3}}})
    assert "served_early" not in elsewhere["folders"][tiny_dataset.name]["p"]["summary"]
