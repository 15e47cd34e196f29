"""The diversity command: its numbers on tiny data, and the nearest-training-image lookup."""

import json

import numpy as np
import pytest

from masc_gadget.cli import main
from tests.conftest import CONFIGS
from training.data import load_split
from training.evaluation.diversity import nearest_training_ssim


def test_nearest_training_image_finds_itself_and_ignores_scale(tiny_dataset):
    train = load_split(tiny_dataset, "train")
    assert np.allclose(nearest_training_ssim(train, train, chunk=3), 1.0, atol=1e-5)
    scaled = train.subset(slice(0, 2))
    scaled.target = scaled.target * 7.5  # each image is scaled by its own maximum first
    assert np.allclose(nearest_training_ssim(scaled, train), 1.0, atol=1e-5)
    test = load_split(tiny_dataset, "test")
    near = nearest_training_ssim(test, train)
    assert near.shape == (len(test),) and np.all(near < 1.0 - 1e-3)  # other subjects


def test_diversity_command_reports_every_number(tiny_dataset, perturbed_mar, tmp_path, capsys):
    out = tmp_path / "div.json"
    assert main(["diversity", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset),
                 "--mar", str(perturbed_mar), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    test, train = load_split(tiny_dataset, "test"), load_split(tiny_dataset, "train")
    assert report["n_slices"] == len(test) and report["n_train_slices"] == len(train)
    assert report["nearest_training_ssim"]["mean"] == pytest.approx(
        float(nearest_training_ssim(test, train).mean()), abs=1e-6)
    assert set(report["accelerations"]) == {"10x", "5x"}
    for row in report["accelerations"].values():
        for key in ("zero_filled_initial_ssim", "mar_initial_ssim", "mar_center-out_ssim", "mar_random_ssim",
                    "train_mar_center-out_ssim"):
            assert -1.0 <= row[key]["mean"] <= 1.0 and row[key]["std"] >= 0, key
    printed = capsys.readouterr().out
    assert "nearest training image (no scan)" in printed and "| 10x: 1 + 2 of" in printed


def test_diversity_needs_a_mar_checkpoint(tiny_dataset, capsys):
    with pytest.raises(SystemExit):
        main(["diversity", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset)])
    assert "--mar" in capsys.readouterr().err
