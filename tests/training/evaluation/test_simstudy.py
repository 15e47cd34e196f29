"""The simulation-parameter study: paired test sets per setting, severity, MASC against the best baseline."""

import json

import numpy as np

from training.evaluation.simstudy import STUDIES, render_study, run_study

from tests.conftest import CONFIGS


def test_severity_grows_with_field_strength_and_with_cocr(tmp_path):
    report = run_study(CONFIGS / "tiny.yaml", [], tmp_path / "study", subjects=1,
                       studies=["field strength", "implant material"], progress=False)
    fields = report["studies"]["field strength"]
    assert [r["setting"] for r in fields] == [label for label, _ in STUDIES["field strength"]]
    nmse = [r["nmse"] for r in fields]
    assert all(a < b for a, b in zip(nmse, nmse[1:])), nmse  # 0.55 < 1.5 < 3 < 7 T
    cocr, titanium = report["studies"]["implant material"]
    assert titanium["nmse"] < cocr["nmse"]
    # the same subjects in every setting: only the physics differs
    from training.data import load_split

    a, b = (load_split(r["data"], "test") for r in (cocr, titanium))
    assert a.subjects == b.subjects and np.array_equal(a.implant_mask.numpy(), b.implant_mask.numpy())
    assert (tmp_path / "study" / "study.md").read_text() == render_study(
        json.loads((tmp_path / "study" / "study.json").read_text()))


def test_masc_is_compared_with_the_best_baseline_on_each_set(tiny_dataset, tmp_path, tiny_masc):
    ckpt = tiny_masc
    report = run_study(CONFIGS / "tiny.yaml", ["eval.accelerations={10x: [1, 2]}"], tmp_path / "study", subjects=1,
                       studies=["implant material"], checkpoint=ckpt, population_data=tiny_dataset, progress=False)
    for row in report["studies"]["implant material"]:
        assert row["best_baseline"] in ("random", "center-out", "equispaced", "population")
        assert np.isclose(row["diff"], row["method_ssim"] - row["best_baseline_ssim"])
        assert 0 <= row["p_ttest"] <= 1 or np.isnan(row["p_ttest"])
    assert "MASC - best" in render_study(report)
