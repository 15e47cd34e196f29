"""The fair comparison's report: the default chosen on validation, effects judged over subjects."""

import json

import numpy as np
import pytest
import torch

from masc_gadget.models.checkpoint import save_checkpoint
from training.evaluation.fair import FairReport, fair_report, main


def _write(folder, seeds, val, test):
    """Cells whose validation and test SSIM are given (cell -> value); 4 subjects x 2 slices."""
    rng = np.random.default_rng(0)
    labels = [f"d/sub-{i // 2}/{i % 2}" for i in range(8)]
    for seed in seeds:
        for recipe in ("finetune", "finetune_joint"):
            rows = []
            for prefix, method in (("fixed", "fixed-order"), ("masc", "masc")):
                key = f"{prefix}/{recipe}"
                save_checkpoint(folder / f"{prefix}_{recipe}_s{seed}.pt", {"mar": {"w": torch.zeros(1)}},
                                {"best_val": {"ssim": val[key] + 0.001 * seed}})
                ssim = test[key] + 0.01 * rng.standard_normal(8)
                lines = [[0, 1, 2]] * 8 if prefix == "fixed" else [[0, 1, 2 + i % 2] for i in range(8)]
                rows.append({"method": method, "mar": True, "lines": lines,
                             "per_slice": {"ssim": ssim.tolist(), "psnr": (20 + ssim).tolist()}})
            (folder / f"eval_{recipe}_s{seed}").mkdir()
            (folder / f"eval_{recipe}_s{seed}" / "results.json").write_text(json.dumps(
                {"slices": labels, "accelerations": {"10x": {"rows": rows}}}))


def test_the_default_is_chosen_on_validation_and_every_effect_is_reported(tmp_path):
    val = {"fixed/finetune": 0.70, "fixed/finetune_joint": 0.66, "masc/finetune": 0.69, "masc/finetune_joint": 0.65}
    # the test split would pick another cell: it must not matter
    test = {"fixed/finetune": 0.72, "fixed/finetune_joint": 0.68, "masc/finetune": 0.75, "masc/finetune_joint": 0.69}
    _write(tmp_path, [0, 1], val, test)
    report = fair_report(tmp_path, [0, 1])
    assert report.default == "fixed/finetune"
    assert set(report.gaps) == {"fixed/finetune_joint", "masc/finetune", "masc/finetune_joint"}
    assert report.gaps["masc/finetune"][0]["diff"] == pytest.approx(0.03, abs=0.02)
    assert report.recipe_effect["fixed"][1]["diff"] == pytest.approx(0.04, abs=0.02)
    assert report.cells["fixed/finetune"].line_sets == [1, 1] and report.cells["masc/finetune"].line_sets == [2, 2]
    again = FairReport.from_json(report.to_json())
    assert again.cells["masc/finetune"].per_slice[1] == report.cells["masc/finetune"].per_slice[1]
    assert main([str(tmp_path), "--seeds", "0", "1", "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "fair.md").read_text()
    assert "**fixed order, recipe A: served masks**" in text and "policy: MASC - fixed order" in text
