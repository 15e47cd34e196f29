"""masc mar-check: identity, correction with tests over subjects, OOD ROC and calibration."""

import json
import math

import numpy as np
import torch
import pytest

from masc_gadget.cli import main
from masc_gadget.models.checkpoint import load_mar
from training.evaluation.calibration import calibrate, roc

from tests.conftest import CONFIGS


def test_roc_area_counts_pairs_and_ties_half():
    harmed = np.array([True, True, False, False])
    assert roc(np.array([3.0, 4.0, 1.0, 2.0]), harmed)["auc"] == 1.0
    assert roc(np.array([1.0, 2.0, 3.0, 4.0]), harmed)["auc"] == 0.0
    assert roc(np.ones(4), harmed)["auc"] == 0.5
    assert np.isnan(roc(np.ones(3), np.zeros(3, dtype=bool))["auc"])
    curve = roc(np.array([3.0, 4.0, 1.0, 2.0]), harmed)
    assert curve["tpr"][0] == curve["fpr"][0] == 0.0 and curve["tpr"][-1] == curve["fpr"][-1] == 1.0


def test_calibration_serves_zero_filled_exactly_where_it_pays():
    rows = {"zf_ssim": np.array([0.5, 0.5, 0.5, 0.5]), "nothing_ssim": np.array([0.5, 0.5, 0.5, 0.5]),
            "mar_ssim": np.array([0.7, 0.6, 0.3, 0.2]), "score_consistency": np.array([0.1, 0.2, 0.3, 0.4]), "score_residual": np.array([0.4, 0.1, 0.2, 0.3]),
            "score_flip": np.array([0.2, 0.1, 0.4, 0.3])}
    c = calibrate(rows)
    assert c["score"] == "consistency" and c["auc"]["consistency"] == 1.0
    assert 0.2 < c["threshold"] < 0.3 and c["fallback_fraction"] == 0.5
    assert c["val_served_ssim"] == pytest.approx(np.mean([0.7, 0.6, 0.5, 0.5]))


def test_harm_is_judged_against_doing_nothing_not_the_chosen_lines_zero_filled_image():
    # scattered lines: their zero-filled image (0.3) is far below centre-out's (0.5); a network
    # at 0.4 beats the first and still harms the slice
    rows = {"zf_ssim": np.full(4, 0.3), "nothing_ssim": np.full(4, 0.5), "mar_ssim": np.array([0.4, 0.45, 0.6, 0.7]),
            "score_consistency": np.array([0.4, 0.3, 0.2, 0.1]), "score_residual": np.array([0.1, 0.2, 0.3, 0.4]),
            "score_flip": np.array([0.2, 0.1, 0.4, 0.3])}
    c = calibrate(rows)
    assert c["auc"]["consistency"] == 1.0 and c["auc"]["residual"] == 0.0  # ranks the two harmed slices first
    # serving the chosen lines zero-filled never pays here, and the calibration says so
    assert c["fallback_fraction"] == 0.0 and c["val_served_harmed"] == 0.5


def test_the_roc_area_has_a_subject_bootstrap_interval():
    from training.evaluation.calibration import auc_interval

    subjects = [f"s{i // 4}" for i in range(24)]
    harm = np.tile([True, True, False, False], 6)
    perfect = np.where(harm, 1.0, 0.0)
    assert auc_interval(perfect, harm, subjects) == (1.0, 1.0)
    rng = np.random.default_rng(1)
    low, high = auc_interval(rng.random(24), harm, subjects)
    assert 0.0 <= low < high <= 1.0  # an uninformative score: a wide interval
    assert all(np.isnan(auc_interval(perfect, np.ones(24, dtype=bool), subjects)))  # one class: no area


def test_cross_validation_never_calibrates_on_the_subject_it_serves():
    from training.evaluation.calibration import cross_validated

    # subject a: the network harms every slice and scores high; b, c, d: it helps and scores low
    subjects = ["a"] * 3 + ["b"] * 3 + ["c"] * 3 + ["d"] * 3
    rows = {"mar_ssim": np.array([0.3] * 3 + [0.8] * 9), "zf_ssim": np.full(12, 0.4), "nothing_ssim": np.full(12, 0.5),
            "score_consistency": np.array([0.9] * 3 + [0.1] * 9), "score_residual": np.full(12, 0.5),
            "score_flip": np.linspace(0, 1, 12)}
    cv = cross_validated(rows, subjects, 4)
    # a's fold is calibrated on b, c, d alone, which the network never harms: nothing is flagged there
    assert cv["per_subject"]["a"]["fallback_fraction"] == 0.0 and cv["per_subject"]["a"]["served_ssim"] == 0.3
    assert cv["worst_subject_gain"] == pytest.approx(-0.2) and cv["harmed_fraction"] == 0.25
    assert cv["per_subject"]["b"]["served_ssim"] == pytest.approx(0.8) and len(cv["rules"]) == 4


def test_the_noise_promise_tells_denoising_from_inventing(tiny_dataset):
    from training.data import load_split
    from training.evaluation.marcheck import noise_rows

    data = load_split(tiny_dataset, "train")
    identity = noise_rows(lambda x: x, data, (20.0, 40.0))
    np.testing.assert_array_equal(identity["noise_output_nmse"], identity["noise_input_nmse"])  # kept, just
    assert ((identity["noise_snr"] >= 20) & (identity["noise_snr"] <= 40)).all()
    assert (identity["noise_input_nmse"] > 0).all()
    inventing = noise_rows(lambda x: x + 0.2 * x.amax(dim=(-2, -1), keepdim=True), data, (20.0, 40.0))
    assert (inventing["noise_output_nmse"] > inventing["noise_input_nmse"]).all()


def test_the_command_checks_calibrates_and_the_export_carries_the_calibration(tiny_dataset, perturbed_mar, tmp_path,
                                                                              capsys):
    out = tmp_path / "check"
    assert main(["mar-check", "--config", str(CONFIGS / "tiny.yaml"), "--mar", f"p={perturbed_mar}",
                 "--data", f"{tiny_dataset}", "--split", "val", "--calibrate", "--out", str(out),
                 "--set", "variation.snr=[20, 40]"]) == 0
    report = capsys.readouterr().out
    assert f"## {tiny_dataset.name}" in report and "| p | 1 / 4 |" in report
    results = json.loads((out / "results.json").read_text())
    summary = results["folders"][tiny_dataset.name]["p"]["summary"]
    assert 0 < summary["identity_ssim"]["mean"] < 1 and summary["mar_vs_zf_ssim"]["n_subjects"] >= 1
    assert set(summary["roc"]) == {"consistency", "residual", "flip"} and (out / "roc.png").stat().st_size > 0
    ood = json.loads((out / "ood.json").read_text())["p"]
    assert ood["score"] in summary["roc"] and ood["threshold"] > 0
    assert set(summary["promises"]) == {"identity_ssim", "noise_share", "center_out", "all"}
    assert summary["promises"]["noise_share"]["kept"] is not None  # an SNR range is set
    assert "Promises" in (out / "report.md").read_text()
    nothing = results["folders"][tiny_dataset.name]["p"]["slices"]["nothing_ssim"]
    assert nothing == results["folders"][tiny_dataset.name]["p"]["slices"]["zf_ssim"]  # centre-out's lines checked
    assert summary["harmed_fraction"] == pytest.approx(np.mean(np.less(
        results["folders"][tiny_dataset.name]["p"]["slices"]["mar_ssim"], nothing)))
    fallback = summary["fallback"]  # a flagged clean image is served as acquired
    assert fallback["identity_ssim"]["mean"] >= summary["identity_ssim"]["mean"] and 0 <= fallback["fraction"] <= 1
    crossed = tmp_path / "crossed"
    assert main(["mar-check", "--config", str(CONFIGS / "tiny.yaml"), "--mar", f"p={perturbed_mar}",
                 "--data", f"{tiny_dataset}", "--split", "train", "--cross-validate", "2", "--out", str(crossed)]) == 0
    crossed_results = json.loads((crossed / "results.json").read_text())["folders"][tiny_dataset.name]["p"]
    assert set(crossed_results["summary"]["cross_validated"]["per_subject"]) == set(crossed_results["slices"]["subject"])
    assert len(crossed_results["summary"]["cross_validated"]["per_subject"]) == 2
    assert "less the subject served" in (crossed / "report.md").read_text()
    shipped = tmp_path / "shipped.pt"
    assert main(["export", str(perturbed_mar), "--out", str(shipped), "--ood", f"{out / 'ood.json'}:p"]) == 0
    mar, meta = load_mar(shipped)
    assert mar.ood.score == ood["score"] and mar.ood.threshold == pytest.approx(ood["threshold"])
    # the check's promises go into the provenance; a broken one is said at the export
    capsys.readouterr()
    assert main(["export", str(perturbed_mar), "--out", str(shipped), "--check", f"{out / 'results.json'}:p"]) == 0
    kept = json.loads(shipped.with_suffix(".json").read_text())["mar_check"]
    folder = kept["folders"][tiny_dataset.name]
    assert folder["promises"] == summary["promises"] and kept["split"] == "val" and kept["results"] == "results.json"
    assert kept["promises_kept"] is summary["promises"]["all"]
    assert ("does not keep its promises" in capsys.readouterr().err) is not summary["promises"]["all"]
    assert main(["export", str(perturbed_mar), "--out", str(shipped), "--check", f"{out / 'results.json'}:q"]) == 2
    assert "no network 'q'; it holds p" in capsys.readouterr().err
    assert kept["promised_on"] == [tiny_dataset.name]  # by default every folder of the check
    assert main(["export", str(perturbed_mar), "--out", str(shipped), "--check", f"{out / 'results.json'}:p",
                 "--promise-on", "real"]) == 2
    assert f"no folder real; it has {tiny_dataset.name}" in capsys.readouterr().err
    assert main(["mar-check", "--config", str(CONFIGS / "tiny.yaml"), "--mar", f"p={perturbed_mar}",
                 "--data", f"{tiny_dataset}", "--split", "test", "--calibrate", "--out", str(out)]) == 2
    assert "use it on the validation split" in capsys.readouterr().err


def test_networks_named_by_seed_are_summarised_over_their_seeds():
    from training.evaluation.marcheck import _seed_rows, seed_groups

    assert seed_groups(["new_s0", "new_s1", "old", "x_s3"]) == {"new": ["new_s0", "new_s1"]}
    stat = lambda m, d, p: {"mean": m, "diff": d, "p_ttest": p}  # noqa: E731
    by_name = {f"new_s{i}": {"summary": {"identity_ssim": stat(0.9 + i / 100, 0, 1), "zf_ssim": stat(0.5, 0, 1),
                                          "mar_ssim": stat(0.6, 0, 1), "mar_vs_zf_ssim": stat(0, 0.1 * (i + 1), 10.0 ** -i),
                                          "mar_vs_zf_psnr": stat(0, 1.0, 0.01), "harmed_fraction": 0.5 * i}}
               for i in range(2)}
    (row,) = _seed_rows(by_name)
    assert row.startswith("| **new, 2 seeds**") and "0.905 ± 0.007" in row and "+0.150 ± 0.071 (max 1.000)" in row
    assert "25 %" in row


def test_a_network_with_its_own_policy_is_calibrated_on_its_lines_too(tiny_dataset, perturbed_mar, tmp_path):
    """Regression: a score calibrated on centre-out's lines alone flagged most of the slices MASC
    served with its own lines (one seed's hip test fell from 0.69 to 0.42)."""
    from masc_gadget.acquisition.policies import make_policy
    from training.data import load_split
    from training.evaluation.marcheck import mar_check, own_lines, policy_masks

    mar = load_mar(perturbed_mar)[0]
    data = load_split(tiny_dataset, "val")
    lines = own_lines(make_policy("center-out"), mar, data, 1, 2)  # (slices, 3), acquisition order
    played = torch.zeros(len(data), data.n_pe, dtype=torch.bool)
    played[torch.arange(len(data))[:, None], torch.as_tensor(lines)] = True
    assert lines.shape == (len(data), 3) and torch.equal(played, policy_masks("center-out", len(data), data.n_pe, 1, 2))
    alone = mar_check({"p": mar}, str(tiny_dataset), "val", 1, 2, tmp_path / "a", do_calibrate=True)
    both = mar_check({"p": mar}, str(tiny_dataset), "val", 1, 2, tmp_path / "b", do_calibrate=True,
                     policies={"p": make_policy("equispaced")})
    assert both["calibration"]["p"]["n_slices"] == 2 * alone["calibration"]["p"]["n_slices"] == 2 * len(data)
    # without a policy there are no own lines: no early switch; any policy gets one on its own
    # lines (one that reads no image too: the engine scores the initial lines for it and sends
    # the whole plan ahead, its order's or centre-out's)
    assert "early" not in alone["calibration"]["p"]
    assert both["calibration"]["p"]["early"]["n_slices"] == len(data)
    from masc_gadget.acquisition.learned import LearnedPolicy
    from masc_gadget.models.policy_net import PolicyNet, PolicyNetConfig

    net = PolicyNet(data.n_pe, data.n_pe, data.n_pe, PolicyNetConfig(channels=(4, 8), hidden=16, pool_size=4),
                    generator=torch.Generator().manual_seed(3))
    reads = mar_check({"p": mar}, str(tiny_dataset), "val", 1, 2, tmp_path / "c", do_calibrate=True,
                      policies={"p": LearnedPolicy(net.eval(), observes_mar=True)}, folds=2)
    early = reads["calibration"]["p"]["early"]
    assert early["stage"] == "early" and early["n_slices"] == len(data)
    summary = reads["folders"][tiny_dataset.name]["p"]["summary"]
    assert set(summary["early_roc"]) == {"consistency", "residual", "flip"}


def test_the_early_switch_serves_doing_nothing_and_never_harms():
    # scattered lines whose zero-filled image (0.3) is far below doing nothing (0.5): the end rule
    # cannot help the harmed slices, the early switch serves them exactly doing nothing
    rows = {"zf_ssim": np.full(4, 0.3), "nothing_ssim": np.full(4, 0.5), "mar_ssim": np.array([0.4, 0.45, 0.6, 0.7]),
            **{f"{p}{k}": v for p in ("score_", "early_score_") for k, v in (
                ("consistency", np.array([0.4, 0.3, 0.2, 0.1])), ("residual", np.array([0.1, 0.2, 0.3, 0.4])),
                ("flip", np.array([0.2, 0.1, 0.4, 0.3])))}}
    end, early = calibrate(rows), calibrate(rows, "early")
    assert end["val_served_harmed"] == 0.5 and end["fallback_fraction"] == 0.0
    assert early["score"] == "consistency" and early["fallback_fraction"] == 0.5
    assert early["val_served_harmed"] == 0.0 and early["val_served_ssim"] == pytest.approx(np.mean([0.5, 0.5, 0.6, 0.7]))
    from training.evaluation.calibration import cross_validated

    cv = cross_validated({k: np.tile(v, 2) for k, v in rows.items()}, ["a"] * 4 + ["b"] * 4, 2, "early")
    assert cv["stage"] == "early" and cv["harmed_fraction"] == 0.0
    # a later switch's rows carry the holdout score: chosen when it ranks harm best, never at the end
    rows["early_score_holdout"] = np.array([0.9, 0.8, 0.1, 0.2])
    rows["early_score_consistency"] = np.array([0.4, 0.1, 0.2, 0.3])
    assert calibrate(rows, "early")["score"] == "holdout" and calibrate(rows)["score"] != "holdout"
    # --early-scores: the calibration chooses among the scores it is given, and names what it lacks
    assert calibrate(rows, "early", scores=["consistency", "flip"])["score"] == "consistency"
    with pytest.raises(ValueError, match="none of the scores halves is measured at this stage"):
        calibrate(rows, "early", scores=["halves"])
    cv = cross_validated({k: np.tile(v, 2) for k, v in rows.items()}, ["a"] * 4 + ["b"] * 4, 2, "early",
                         scores=["flip"])
    assert {rule["score"] for rule in cv["rules"]} == {"flip"}


def test_a_later_switch_is_calibrated_on_the_first_lines_and_carried_by_the_rule(tiny_dataset, perturbed_mar, tmp_path):
    """``--early-lines N``: the early rule scores the image of each slice's first N own lines, a
    flagged slice keeps them and continues with centre-out's lines; the calibration says so
    (``after_lines``) and the rule a checkpoint loads from it switches there."""
    from masc_gadget.acquisition.policies import make_policy
    from masc_gadget.core.ood import OodCalibration
    from training.evaluation.marcheck import mar_check, switched_lines

    # hand-worked: 8 lines, centre 4; centre-out goes 4, 5, 3, 6, 2, ...
    assert switched_lines(np.array([[4, 0, 7, 1]]), 2, 8).tolist() == [[4, 0, 5, 3]]
    assert switched_lines(np.array([[4, 0, 7, 1]]), 4, 8).tolist() == [[4, 0, 7, 1]]
    mar = load_mar(perturbed_mar)[0]
    policies = {"p": make_policy("equispaced")}
    later = mar_check({"p": mar}, str(tiny_dataset), "val", 1, 2, tmp_path / "l", do_calibrate=True,
                      policies=policies, early_lines=2)
    first = mar_check({"p": mar}, str(tiny_dataset), "val", 1, 2, tmp_path / "f", do_calibrate=True,
                      policies=policies)
    early = later["calibration"]["p"]["early"]
    assert later["early_lines"] == 2 and early["after_lines"] == 2
    assert "after_lines" not in first["calibration"]["p"]["early"]
    # with lines beyond the initial ones the holdout and halves scores join the early scores, not before
    assert set(early["auc"]) == {"consistency", "residual", "flip", "holdout", "halves"}
    assert set(first["calibration"]["p"]["early"]["auc"]) == {"consistency", "residual", "flip"}
    assert "holdout" in later["folders"][tiny_dataset.name]["p"]["summary"]["early_roc"]
    for subject, within in later["folders"][tiny_dataset.name]["p"]["summary"]["early_roc_within"].items():
        assert 0 < within["n_harmed"] < within["n_slices"] and 0 <= within["holdout"] <= 1, subject
    assert "its first 2 lines (--early-lines)" in (tmp_path / "l" / "report.md").read_text()
    kept = later["folders"][tiny_dataset.name]["p"]["summary"]["switched_vs_nothing"]  # the fallback, still safe?
    from training.data import load_split

    assert kept["n_subjects"] == len(set(load_split(tiny_dataset, "val").subjects)) and math.isfinite(kept["diff"])
    assert "switched_vs_nothing" not in first["folders"][tiny_dataset.name]["p"]["summary"]
    assert OodCalibration.early_from_metadata(later["calibration"]["p"], "x.pt").after_lines == 2
    assert OodCalibration.early_from_metadata(first["calibration"]["p"], "x.pt").after_lines is None
    with pytest.raises(ValueError, match=r"early_lines must be in \[1, 3\]"):
        mar_check({"p": mar}, str(tiny_dataset), "val", 1, 2, tmp_path / "x", policies=policies, early_lines=5)
    # --early-scores: the rule is calibrated with the score asked for; one it cannot have is refused first
    forced = mar_check({"p": mar}, str(tiny_dataset), "val", 1, 2, tmp_path / "h", do_calibrate=True,
                       policies=policies, early_lines=2, early_scores=["halves"])
    assert forced["calibration"]["p"]["early"]["score"] == "halves" and forced["early_scores"] == ["halves"]
    with pytest.raises(ValueError, match="early_scores must name scores of this early rule"):
        mar_check({"p": mar}, str(tiny_dataset), "val", 1, 2, tmp_path / "x", policies=policies,
                  early_scores=["holdout"])  # no lines beyond the initial ones: no holdout


def test_the_early_scores_are_also_ranked_within_each_subject_with_both_kinds_of_slice():
    from training.evaluation.marcheck import _within_subjects

    own = {"early_score_holdout": np.array([0.9, 0.1, 0.8, 0.2, 0.5, 0.6]),
           "early_score_flip": np.array([0.1, 0.9, 0.8, 0.2, 0.5, 0.6])}
    harm = np.array([True, False, True, False, True, True])
    within = _within_subjects(own, harm, ["a", "a", "b", "b", "c", "c"])  # c: harmed only, no ranking
    assert set(within) == {"a", "b"}
    assert within["a"] == {"n_slices": 2, "n_harmed": 1, "holdout": 1.0, "flip": 0.0}
    assert within["b"]["holdout"] == within["b"]["flip"] == 1.0
