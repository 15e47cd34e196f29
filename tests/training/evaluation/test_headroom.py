"""The headroom gate: a fixed order cross-fitted over subject folds, the oracle, centre-out,
under one or several MAR networks, with tests over subjects and a verdict."""

import json

import numpy as np
import pytest
import torch

from masc_gadget.cli import main
from masc_gadget.config import load_config
from masc_gadget.models.checkpoint import load_mar
from tests.conftest import CONFIGS, write_perturbed_mar
from training.data import load_split
from training.evaluation.headroom import (HeadroomConfig, headroom, measured_slices, read_headroom, render_headroom,
                                          subject_folds, write_headroom)
from training.population import population_order


def test_folds_keep_each_subject_whole_and_need_enough_subjects():
    subjects = ["b", "a", "c", "a", "b", "d", "c"]
    folds = subject_folds(subjects, 2)
    for s in set(subjects):
        assert len({int(f) for f, x in zip(folds, subjects) if x == s}) == 1
    assert sorted({x: int(f) for f, x in zip(folds, subjects)}.values()) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="at least 3 subjects"):
        subject_folds(["a", "b", "a"], 3)


def test_the_periprosthetic_region_grows_the_implant_and_covers_slices_it_misses(tiny_dataset):
    data = load_split(tiny_dataset, "train")
    mask = data.implant_mask.bool()
    assert mask.any()
    roi0, roi3 = data.periprosthetic_roi(0), data.periprosthetic_roi(3)
    assert torch.all(roi3 >= roi0) and int(roi3.sum()) > int(roi0.sum())
    hit = mask.reshape(len(data), -1).any(dim=1)
    assert torch.equal(roi0[hit], mask[hit])
    data.implant_mask[1] = 0  # a slice the implant misses: its subject's footprint
    footprint = data.implant_mask[[i for i, s in enumerate(data.subjects) if s == data.subjects[1]]].bool().any(dim=0)
    assert torch.equal(data.periprosthetic_roi(0)[1], footprint)
    data.implant_mask.zero_()  # no implant anywhere: the whole image
    assert bool(data.periprosthetic_roi(2).all())
    picked = measured_slices(load_split(tiny_dataset, "train"), 1)
    assert len(picked) == len(set(data.subjects))


def test_headroom_cross_fits_the_order_and_reports_over_subjects(tiny_dataset, perturbed_mar, tmp_path):
    second = write_perturbed_mar(tmp_path / "mar2.pt", seed=7)
    config = load_config(CONFIGS / "tiny.yaml", ["headroom.slices_per_subject=0", "headroom.batch_size=4"])
    report = headroom(config, tiny_dataset, "train", [perturbed_mar, second], progress=False)
    data = load_split(tiny_dataset, "train")
    assert report.n_slices == len(data) and len(report.runs) == 2
    run = report.runs[0]
    folds = np.asarray(run.folds)
    mar = load_mar(perturbed_mar, "cpu")[0].eval()
    for k in (0, 1):  # fold k plays the order fitted on the other fold only
        refit = population_order(data.subset(np.flatnonzero(folds != k)), 1, 2, mar, torch.device("cpu"))
        assert run.orders[k] == refit.tolist()
    for method in ("oracle", "fixed", "center-out"):
        assert len(run.slices[method]["ssim"]) == len(data)
        assert run.means[method]["ssim"] == pytest.approx(np.mean(run.slices[method]["ssim"]))
    lead = np.subtract(run.slices["oracle"]["ssim"], run.slices["fixed"]["ssim"])
    assert run.lead["diff"] == pytest.approx(lead.mean()) and run.lead["n_subjects"] == 2
    summary = report.summary
    assert summary["lead"]["mean"] == pytest.approx(np.mean([r.lead["diff"] for r in report.runs]))
    assert summary["passes"] == (summary["lead"]["mean"] >= 0.03) and summary["n_subjects"] == 2
    text = render_headroom(report)
    assert "Gate (0.03 ssim)" in text and summary["verdict"] in text
    # the typed report is what headroom.json holds, and reads back equal
    paths = write_headroom(report, tmp_path / "hr")
    written = json.loads(paths["json"].read_text())
    assert written["runs"][0]["lead"] == run.lead and "policy" not in written["runs"][0]  # not measured: absent
    again = read_headroom(tmp_path / "hr")
    assert again.runs[0].orders == run.orders and again.summary["lead"] == pytest.approx(summary["lead"])
    assert render_headroom(again) == text
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "headroom.json").write_text(json.dumps({"data": "x"}))
    with pytest.raises(ValueError, match="has no 'split': not a headroom report"):
        read_headroom(tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="run masc check headroom --out"):
        read_headroom(tmp_path / "none")


def test_headroom_command_and_eval_flag(tiny_dataset, perturbed_mar, tmp_path, capsys):
    args = ["--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset), "--split", "train",
            "--set", "headroom.region=implant", "--set", "headroom.margin=2"]
    assert main(["headroom", *args, "--mar", str(perturbed_mar), "--out", str(tmp_path / "hr")]) == 0
    report = json.loads((tmp_path / "hr" / "headroom.json").read_text())
    assert report["metric"] == "roi_ssim" and report["n_slices"] == 4  # two slices per subject by default
    assert "periprosthetic region (implant + 2 px)" in (tmp_path / "hr" / "headroom.md").read_text()
    assert main(["headroom", "--combine", str(tmp_path / "hr"), "--out", str(tmp_path / "all")]) == 0
    table = (tmp_path / "all" / "candidates.md").read_text()
    assert "| hr | 1 + 2 lines, implant + 2 px |" in table and f"{report['summary']['lead']['mean']:+.4f}" in table
    assert main(["headroom", "--combine", str(tmp_path / "none"), "--out", str(tmp_path / "all")]) == 2
    assert main(["eval", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset), "--split", "train",
                 "--methods", "center-out", "--headroom", "--out", str(tmp_path / "ev")]) == 2
    assert "--headroom measures under one MAR network" in capsys.readouterr().err
    with pytest.raises(ValueError, match="region must be one of image, implant"):
        HeadroomConfig(region="knee")
    with pytest.raises(ValueError, match="folds must be >= 2"):
        HeadroomConfig(folds=1)


def test_headroom_can_fit_the_order_on_another_split(tiny_dataset, perturbed_mar):
    config = load_config(CONFIGS / "tiny.yaml", ["headroom.slices_per_subject=1", "headroom.fit_split=train",
                                                 "headroom.region=implant", "headroom.margin=2"])
    report = headroom(config, tiny_dataset, "val", [perturbed_mar], progress=False)
    run = report.runs[0]
    train = load_split(tiny_dataset, "train")
    fit = train.subset(measured_slices(train, 1))
    mar = load_mar(perturbed_mar, "cpu")[0].eval()
    refit = population_order(fit, 1, 2, mar, torch.device("cpu"), roi=fit.periprosthetic_roi(2))
    assert run.orders == [refit.tolist()]  # one order, the train split's, region objective included
    assert np.all(np.asarray(run.folds) == 0)
    text = render_headroom(report)
    assert "fixed order fitted on the train split" in text and "| fixed (fitted on train) |" in text
    with pytest.raises(ValueError, match="is the measured split"):
        headroom(config, tiny_dataset, "train", [perturbed_mar], progress=False)


def test_headroom_scores_a_learned_policy_against_the_oracle_s_lead(tiny_dataset, perturbed_mar, tiny_masc, tmp_path):
    args = ["--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset), "--split", "train",
            "--set", "headroom.slices_per_subject=0"]
    assert main(["headroom", *args, "--mar", str(perturbed_mar), "--policy", str(tiny_masc),
                 "--out", str(tmp_path / "hr")]) == 0
    report = json.loads((tmp_path / "hr" / "headroom.json").read_text())
    run = report["runs"][0]
    scores = {m: np.asarray(run["slices"][m]["ssim"]) for m in ("oracle", "fixed", "policy")}
    gain, lead = scores["policy"].mean() - scores["fixed"].mean(), scores["oracle"].mean() - scores["fixed"].mean()
    assert run["policy_vs_fixed"]["diff"] == pytest.approx(gain)
    # the one captured-share rule: the share of the lead the policy takes, undefined (NaN) without a lead
    assert run["captured"] == pytest.approx(gain / lead if lead > 0 else float("nan"), nan_ok=True)
    lines = np.asarray(run["policy_lines"])
    assert lines.shape == (report["n_slices"], 2) and all(len(set(r)) == 2 for r in lines.tolist())
    assert "learned policy" in (tmp_path / "hr" / "headroom.md").read_text()
    assert main(["headroom", *args, "--mar", str(perturbed_mar), "--policy", f"{tiny_masc},{tiny_masc}",
                 "--out", str(tmp_path / "bad")]) == 2  # one policy per MAR network
    # the same policy scored against the earlier measurement, without measuring it again
    assert main(["headroom", *args, "--mar", str(perturbed_mar), "--out", str(tmp_path / "bare")]) == 0
    assert main(["headroom", "--config", str(CONFIGS / "tiny.yaml"), "--from", str(tmp_path / "bare"),
                 "--policy", str(tiny_masc), "--out", str(tmp_path / "later")]) == 0
    later = json.loads((tmp_path / "later" / "headroom.json").read_text())
    assert later["runs"][0]["slices"]["policy"] == run["slices"]["policy"]
    assert later["runs"][0]["captured"] == pytest.approx(run["captured"], nan_ok=True)
    assert later["summary"]["policy"]["gain"]["mean"] == pytest.approx(report["summary"]["policy"]["gain"]["mean"])
    assert main(["headroom", "--config", str(CONFIGS / "tiny.yaml"), "--from", str(tmp_path / "bare"),
                 "--policy", str(tiny_masc), "--set", "acquisition.budget=3", "--out", str(tmp_path / "x")]) == 2


def test_the_gate_reads_the_lead_over_the_better_fixed_order():
    from training.evaluation.headroom import HeadroomReport, render_candidates, summarise

    rng = np.random.default_rng(0)
    labels = [f"sub-{i:02d}/0" for i in range(6)]
    base = rng.uniform(0.1, 0.2, 6)
    slices = {"oracle": base + 0.05, "fixed": base - 0.01, "center-out": base + 0.03}  # centre-out beats the fit
    run = {"mar": "m.pt", "orders": [], "folds": [], "oracle_lines": [],
           "slices": {m: {"roi_ssim": v.tolist()} for m, v in slices.items()},
           "means": {m: {"roi_ssim": float(v.mean())} for m, v in slices.items()},
           "lead": {"diff": 0.06}, "lead_psnr": {"diff": 1.0}, "fixed_vs_center_out": {"diff": -0.04}}
    report = HeadroomReport.from_json({
        "data": "d", "split": "val", "n_slices": 6, "n_subjects": 6, "metric": "roi_ssim", "labels": labels,
        "runs": [run], "acquisition": {"initial": 2, "budget": 3},
        "config": {"headroom": {"gate": 0.03, "region": "implant", "margin": 8, "beam": 4}}})
    s = summarise(report)
    assert s["best_fixed"] == ["center-out"] and s["lead"]["mean"] == pytest.approx(0.06)
    assert s["lead_best"]["mean"] == pytest.approx(0.02) and not s["passes"]  # 0.06 over the fit, 0.02 over centre-out
    assert s["subjects_oracle_ahead_best"] == 6
    assert "+0.0200 ± 0.0000 roi_ssim | 6 / 6" in render_candidates({"x": report})


def test_one_captured_share_rule_for_every_share():
    """A share of the oracle's lead is gain / lead, and not defined where the oracle does not
    lead (the gated order's share divided by 1e-12 there, the policy's was NaN)."""
    from training.evaluation.headroom.summary import captured_share

    assert captured_share(0.01, 0.04) == pytest.approx(0.25)
    assert np.isnan(captured_share(0.01, 0.0)) and np.isnan(captured_share(0.01, -0.02))
    shares = captured_share(np.array([0.03, 0.01]), np.array([0.06, -0.01]))
    assert shares[0] == pytest.approx(0.5) and np.isnan(shares[1])
