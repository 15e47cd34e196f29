"""masc train adapt: import a site's volumes, simulate implants, fine-tune by the shared recipe,
calibrate, export, and judge on held-out volumes (tiny sizes)."""

import json

import numpy as np
import pytest

from masc_gadget.cli import main
from masc_gadget.config import to_dict
from masc_gadget.models.checkpoint import load_checkpoint, save_checkpoint
from masc_gadget.models.unet import MarModelConfig, build_mar
from training.adapt import HARM_VOLUME, default_splits

from tests.conftest import CONFIGS


def _phantom(n, seed):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:n, :n]
    image = ((y - n / 2) ** 2 / (0.4 * n) ** 2 + (x - n / 2) ** 2 / (0.35 * n) ** 2 < 1).astype(float)
    return image * (1.0 + 0.2 * rng.random((n, n)))


def test_volumes_split_by_name_when_none_are_named():
    assert default_splits(["c", "a", "b"]) == ["val", "train", "test"]
    assert default_splits([f"v{i}" for i in range(9)]).count("test") == 2
    with pytest.raises(ValueError, match="at least 3 volumes"):
        default_splits(["a", "b"])


def test_the_adaptation_path_end_to_end(tmp_path, capsys):
    nibabel = pytest.importorskip("nibabel")
    site = tmp_path / "site"
    site.mkdir()
    for v in range(4):  # four metal-free volumes of the site, 3 slices each
        data = np.stack([_phantom(40, 10 * v + s) for s in range(3)], axis=-1)
        nibabel.save(nibabel.Nifti1Image(data.astype(np.float32), np.eye(4)), str(site / f"knee{v}.nii.gz"))
    mar = build_mar(MarModelConfig(width=4)).eval()
    base = save_checkpoint(tmp_path / "base.pt", {"mar": mar}, {
        "kind": "fixed-order", "n_pe": 32, "order": [12, 20], "initial": 1, "mar_model": to_dict(mar.config)})
    out = tmp_path / "adapt"
    code = main(["train", "adapt", "--config", str(CONFIGS / "tiny.yaml"), "--source", str(site), "--base", str(base),
                 "--test", "knee3", "--val", "knee2", "--train", "knee0,knee1", "--draws", "1", "--train-draws", "2",
                 "--set", "finetune.epochs=1", "--device", "cpu", "--out", str(out)])
    said = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    adapted = report["held_out"]["models"]["adapted"]
    assert code == (0 if adapted["no_harm"] else 1)
    assert report["volumes"] == {"knee0": "train", "knee1": "train", "knee2": "val", "knee3": "test"}
    assert list(adapted["per_volume"]) == ["sub-0003"] and adapted["per_volume"]["sub-0003"]["slices"] == 3
    assert ("does no harm" in said) == adapted["no_harm"] and "held-out volume" in said
    assert adapted["no_harm"] == (adapted["volume_mean_gain"] >= -0.005)  # one volume under 4 slices
    shipped = load_checkpoint(out / "adapted_shipped.pt")
    assert shipped.metadata["ood"]["score"] in ("consistency", "residual", "flip")
    assert json.loads((out / "adapted_shipped.json").read_text())["adapted_from"] == str(base)
    assert set(report["promises"]) >= {"identity_ssim", "noise_share", "center_out"}
    assert HARM_VOLUME == 0.02
