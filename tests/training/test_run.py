"""The trainers' shared run skeleton: files, best / last checkpoints, resume, log, seeding."""

import pytest
import torch

from masc_gadget.models.checkpoint import load_checkpoint
from training.run import TrainingRun, seeded


def test_a_run_keeps_the_best_and_the_last_and_resumes(tmp_path, global_rng_guard):
    out = tmp_path / "runs" / "model.pt"
    net = seeded(3, lambda: torch.nn.Linear(2, 2))
    assert torch.equal(net.weight, seeded(3, lambda: torch.nn.Linear(2, 2)).weight)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "model.csv").write_text("stale\n")
    run = TrainingRun(out, "ssim", higher_is_better=True, kind=None)
    assert not run.csv.exists() and run.checkpoint is None  # a fresh run starts its log anew
    for epoch, ssim in enumerate((0.5, 0.7, 0.6), start=1):
        improved = run.improved({"ssim": ssim}, epoch=epoch)
        run.save(improved, {"net": net}, {"net": net}, {"kind": "toy", "epoch": epoch, "best_val": run.best},
                 {"step": epoch})
        run.log_row({"epoch": epoch, "val_ssim": ssim})
    assert run.best == {"epoch": 2, "ssim": 0.7}
    assert load_checkpoint(out).metadata["epoch"] == 2 and load_checkpoint(run.last).metadata["epoch"] == 3
    assert run.csv.read_text().splitlines() == ["epoch,val_ssim", "1,0.5", "2,0.7", "3,0.6"]

    again = TrainingRun(out, "ssim", higher_is_better=True, resume=run.last, kind="toy")
    assert again.best == {"epoch": 2, "ssim": 0.7} and again.checkpoint.extra["step"] == 3
    assert again.csv.exists()  # a resumed run appends to its log
    assert not again.improved({"ssim": 0.69}) and again.improved({"ssim": 0.71})
    with pytest.raises(ValueError, match="is a 'toy' checkpoint, not a 'masc' one"):
        TrainingRun(out, "ssim", higher_is_better=True, resume=run.last, kind="masc")


def test_lower_is_better_and_finish_and_other_ranks_write_nothing(tmp_path):
    net = torch.nn.Linear(1, 1)
    run = TrainingRun(tmp_path / "m.pt", "loss", higher_is_better=False, main=False)
    assert run.improved({"loss": 1.0}) and run.improved({"loss": 0.5}) and not run.improved({"loss": 0.6})
    run.save(True, {"net": net}, {"net": net}, {"kind": "toy"}, {})
    run.log_row({"loss": 0.5})
    run.finish({"net": net}, {"kind": "toy"})
    assert not any(tmp_path.iterdir())  # rank != 0
    main = TrainingRun(tmp_path / "m.pt", "loss", higher_is_better=False)
    main.finish({"net": net}, {"kind": "toy", "epoch": 9})
    assert load_checkpoint(tmp_path / "m.pt").metadata["epoch"] == 9
