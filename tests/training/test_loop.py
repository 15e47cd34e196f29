"""The trainer loop written once (:meth:`training.run.TrainingRun.loop`): a hand-made trainer
keeps its best, logs its rows and resumes exactly; every trainer goes through it."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from masc_gadget.config import load_config
from masc_gadget.models.checkpoint import load_checkpoint
from training.run import Checkpoints, Trainer, TrainingRun, seeded, snapshot

from tests.conftest import CONFIGS

SCORES = (0.5, 0.7, 0.6, 0.65)
"""The toy's validation SSIM after each epoch: the second is the best."""


@dataclass(eq=False)
class Toy(Trainer):
    """A linear fit on noise drawn every epoch (Adam: a resumed run needs its optimizer's and
    its generator's states), validated by a fixed score per epoch."""

    run: TrainingRun
    total: int
    net: torch.nn.Linear = field(default_factory=lambda: seeded(0, lambda: torch.nn.Linear(2, 1)))
    gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    done: int = 0
    reports: list[tuple[int, bool]] = field(default_factory=list)
    name = "toy"
    unit = "epoch"
    clock = None

    def __post_init__(self) -> None:
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=0.1)
        self.done = self.run.restore({"net": self.net}, {"optimizer": self.optimizer, "generator": self.gen,
                                                         "numpy_rng": self.rng}, "epoch")

    def train_period(self, bar: Any) -> dict[str, Any]:
        x = torch.randn(8, 2, generator=self.gen) + float(self.rng.normal())
        loss = ((self.net(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.done += 1
        return {"epoch": self.done, "train_loss": round(float(loss.detach()), 6)}

    def validate(self) -> dict[str, float]:
        return {"ssim": SCORES[self.done - 1]}

    def checkpoints(self, metrics: dict[str, float]) -> Checkpoints:
        meta = {"kind": "toy", "epoch": self.done, "numpy_rng": json.dumps(self.rng.bit_generator.state)}
        return Checkpoints({"epoch": self.done}, {"net": self.net}, {"net": self.net}, meta,
                           snapshot({"optimizer": self.optimizer, "generator": self.gen}))

    def report(self, row: dict[str, Any], metrics: dict[str, float], improved: bool) -> None:
        self.reports.append((self.done, improved))


def _rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_the_loop_keeps_the_best_logs_every_period_and_resumes_exactly(tmp_path, global_rng_guard):
    straight = TrainingRun(tmp_path / "a.pt", "ssim", higher_is_better=True)
    toy = Toy(straight, total=4)
    straight.loop(toy, progress=False)
    assert straight.best == {"epoch": 2, "ssim": 0.7}
    assert toy.reports == [(1, True), (2, True), (3, False), (4, False)]
    assert load_checkpoint(tmp_path / "a.pt").metadata["epoch"] == 2
    assert load_checkpoint(tmp_path / "a.last.pt").metadata["epoch"] == 4
    rows = _rows(tmp_path / "a.csv")
    assert list(rows[0]) == ["epoch", "train_loss", "val_ssim"]  # training columns, then validation's
    assert [(r["epoch"], r["val_ssim"]) for r in rows] == [("1", "0.5"), ("2", "0.7"), ("3", "0.6"), ("4", "0.65")]

    first = TrainingRun(tmp_path / "b.pt", "ssim", higher_is_better=True)
    first.loop(Toy(first, total=2), progress=False)
    again = TrainingRun(tmp_path / "b.pt", "ssim", higher_is_better=True, resume=tmp_path / "b.last.pt", kind="toy")
    resumed = Toy(again, total=4)
    assert resumed.done == 2 and again.best == {"epoch": 2, "ssim": 0.7}
    again.loop(resumed, progress=False)
    assert resumed.reports == [(3, False), (4, False)]  # it went on from epoch 3, the best kept
    assert torch.equal(resumed.net.weight, toy.net.weight) and torch.equal(resumed.net.bias, toy.net.bias)
    assert _rows(tmp_path / "b.csv") == rows  # the same rows, one file
    assert again.best == straight.best


def test_a_period_that_is_not_due_logs_its_row_without_validating(tmp_path):
    class EverySecond(Toy):
        def due(self) -> bool:
            return self.done % 2 == 0

        def fields(self, row: dict[str, Any]) -> list[str]:  # the first row has no validation
            return ["epoch", "train_loss", "val_ssim", "seconds"]

    run = TrainingRun(tmp_path / "c.pt", "ssim", higher_is_better=True)
    toy = EverySecond(run, total=3)
    toy.clock = "run"
    run.loop(toy, progress=False)
    assert toy.reports == [(2, True)]
    rows = _rows(tmp_path / "c.csv")
    assert [r["epoch"] for r in rows] == ["1", "2", "3"] and [r["val_ssim"] for r in rows] == ["", "0.7", ""]
    assert all(float(r["seconds"]) >= 0 for r in rows)


@pytest.fixture
def spy(monkeypatch):
    """The trainers that went through the shared loop, in order (their class names)."""
    seen: list[str] = []
    loop = TrainingRun.loop

    def spying(self, trainer, *args, **kwargs):
        seen.append(type(trainer).__name__)
        return loop(self, trainer, *args, **kwargs)

    monkeypatch.setattr(TrainingRun, "loop", spying)
    return seen


def test_every_trainer_goes_through_the_shared_loop(tiny_dataset, perturbed_mar, tmp_path, spy, one_thread):
    from training.coadapt import train_masc
    from training.fixed_order import train_fixed_order
    from training.loupe import train_loupe
    from training.mar import train_mar
    from training.rl.dqn import train_dqn

    def config(*extra):
        return load_config(CONFIGS / "tiny.yaml", list(extra))

    train_mar(config("mar_train.epochs=1"), tiny_dataset, tmp_path / "mar.pt", progress=False)
    train_loupe(config("loupe.epochs=1", "loupe.run.device=cpu"), tiny_dataset, perturbed_mar, tmp_path / "loupe.pt",
                progress=False)
    train_dqn(config("dqn.steps=8", "dqn.val_every=8", "dqn.batch_size=4", "dqn.run.device=cpu"), tiny_dataset,
              perturbed_mar, tmp_path / "dqn.pt", progress=False)
    train_masc(config("masc_train.rollouts=1"), tiny_dataset, perturbed_mar, tmp_path / "masc.pt", progress=False)
    train_fixed_order(config("fixed_order.population_slices=1", "fixed_order.device=cpu", "finetune.epochs=1"),
                      tiny_dataset, perturbed_mar, tmp_path / "fixed.pt", progress=False)
    assert spy == ["_MarTrainer", "_LoupeTrainer", "_DQNTrainer", "_MascTrainer", "_FinetuneTrainer"]
    for name in ("mar", "loupe", "dqn", "masc", "fixed"):
        assert _rows(tmp_path / f"{name}.csv") and (tmp_path / f"{name}.last.pt").exists()


def test_every_trainer_keeps_its_run_settings_in_one_nested_section(caplog):
    """Seed, device and slice caps are one ``run`` entry of each trainer's section; the flat keys of
    earlier configs still land there, with a note, and giving both spellings is refused."""
    from masc_gadget.config import ConfigError
    from training.run import RunSettings

    trainers = ("mar_train", "masc_train", "dqn", "loupe", "finetune", "finetune_joint")
    config = load_config(CONFIGS / "tiny.yaml", [f"{name}.run.seed=5" for name in trainers])
    assert all(config[name].run == RunSettings(seed=5, device=config[name].run.device) for name in trainers)
    assert config["mar_train"].run.device == "cpu"  # tiny.yaml: run: {device: cpu}
    with caplog.at_level("WARNING", logger="masc_gadget.config"):
        flat = load_config(CONFIGS / "tiny.yaml", ["finetune.seed=3", "dqn.max_val_slices=2"])
    assert flat["finetune"].run.seed == 3 and flat["dqn"].run.max_val_slices == 2
    assert "finetune.seed is now finetune.run.seed" in caplog.text
    with pytest.raises(ConfigError, match="finetune.seed and finetune.run.seed are one setting"):
        load_config(CONFIGS / "tiny.yaml", ["finetune.seed=3", "finetune.run.seed=4"])
    with pytest.raises(ConfigError, match="max_val_slices must be an integer >= 0"):
        load_config(CONFIGS / "tiny.yaml", ["loupe.run.max_val_slices=-1"])
