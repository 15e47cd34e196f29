"""The fixed order as a first-class method: trained, refit, served and scored like any policy."""

import json

import numpy as np
import torch

from masc_gadget.acquisition.episode import initial_lines
from masc_gadget.acquisition.learned import FIXED, load_learned
from masc_gadget.acquisition.policies import FixedOrder
from masc_gadget.cli import main
from masc_gadget.config import load_config
from masc_gadget.models.checkpoint import load_checkpoint
from masc_gadget.serving.models import build_engine
from masc_gadget.serving.settings import GadgetSettings

from tests.conftest import CONFIGS

FAST = ["--set", "fixed_order.population_slices=2", "--set", "finetune.epochs=1", "--set", "fixed_order.device=cpu",
        "--set", "finetune.batch_size=4"]


def test_train_refit_serve_and_score(tiny_dataset, perturbed_mar, tmp_path):
    out = tmp_path / "fixed.pt"
    assert main(["train", "fixed-order", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset),
                 "--mar", str(perturbed_mar), "--out", str(out), *FAST]) == 0
    meta = load_checkpoint(out).metadata
    acq = load_config(CONFIGS / "tiny.yaml")["acquisition"]
    assert meta["kind"] == FIXED and len(meta["order"]) == acq.budget and meta["mar_pretrained"] == str(perturbed_mar)
    rows = (tmp_path / "fixed.csv").read_text().splitlines()
    assert len(rows) == 3  # header, epoch 0 (the order under the pre-trained network), epoch 1
    assert meta["best_val"]["ssim"] >= float(rows[1].split(",")[1]) - 1e-9  # the best epoch is kept

    policy, mar, _ = load_learned(out, "cpu")
    assert isinstance(policy, FixedOrder) and policy.order.tolist() == meta["order"] and mar is not None

    # the gadget serves it like any policy: its decisions are the order, all of it at the first
    # decision (a policy that reads no image decides ahead)
    settings = GadgetSettings(policy=FIXED, policy_checkpoint=str(out), device="cpu", initial=acq.initial,
                              budget=acq.budget)
    engine = build_engine(settings, meta["n_pe"], meta["n_pe"])
    rng = np.random.default_rng(0)
    n_pe = meta["n_pe"]
    decisions = []
    for line in initial_lines(n_pe, acq.initial):
        decisions = engine.on_line(0, line, (rng.standard_normal(n_pe) + 1j * rng.standard_normal(n_pe))
                                   .astype(np.complex64))
    assert [d.line for d in decisions] == meta["order"][:acq.budget]
    assert [d.step for d in decisions] == list(range(acq.budget))

    # refit on another protocol, network kept bit for bit
    refit = tmp_path / "refit.pt"
    assert main(["refit", str(out), "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset),
                 "--out", str(refit), *FAST, "--set", "acquisition.budget=1"]) == 0
    again = load_checkpoint(refit)
    assert len(again.metadata["order"]) == 1 and again.metadata["refit_from"] == str(out)
    before = load_checkpoint(out).state_dicts["mar"]
    assert all(torch.equal(before[k], again.state_dicts["mar"][k]) for k in before)

    # and masc eval scores it as a method
    report = tmp_path / "eval"
    assert main(["eval", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset), "--split", "test",
                 "--methods", f"center-out,{FIXED}", "--checkpoint", str(out), "--mar", str(perturbed_mar),
                 "--out", str(report)]) == 0
    keys = [r["key"] for r in json.loads((report / "results.json").read_text())["accelerations"]["10x"]["rows"]]
    assert FIXED in keys and f"{FIXED}+nomar" in keys


def test_calibrated_on_its_own_order_exported_and_served_with_the_fallback(tiny_dataset, perturbed_mar, tmp_path):
    from training.data import load_split

    out = tmp_path / "fixed.pt"
    assert main(["train", "fixed-order", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset),
                 "--mar", str(perturbed_mar), "--out", str(out), *FAST, "--set", "finetune.epochs=0"]) == 0
    check = tmp_path / "check"
    assert main(["mar-check", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset), "--split", "val",
                 "--calibrate", "--mar", f"fixed={out}", "--out", str(check)]) == 0
    calibration = json.loads((check / "ood.json").read_text())["fixed"]
    assert calibration["n_slices"] == 2 * len(load_split(tiny_dataset, "val"))  # centre-out's lines and its own
    shipped = tmp_path / "shipped.pt"
    assert main(["export", str(out), "--out", str(shipped), "--ood", f"{check / 'ood.json'}:fixed"]) == 0
    meta = load_checkpoint(shipped).metadata
    assert meta["kind"] == FIXED and meta["ood"]["score"] == calibration["score"]
    assert json.loads(shipped.with_suffix(".json").read_text())["seed"] == 0  # finetune.run.seed
    assert json.loads(shipped.with_suffix(".json").read_text())["ood"]["threshold"] == calibration["threshold"]
    _, mar, _ = load_learned(shipped, "cpu")
    assert mar.ood is not None and mar.ood.threshold == calibration["threshold"]


def test_order_from_an_earlier_checkpoint_skips_learning_it(tiny_dataset, perturbed_mar, tmp_path):
    first = tmp_path / "first.pt"
    assert main(["train", "fixed-order", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset),
                 "--mar", str(perturbed_mar), "--out", str(first), *FAST, "--set", "finetune.epochs=0"]) == 0
    again = tmp_path / "again.pt"
    assert main(["train", "fixed-order", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset),
                 "--mar", str(perturbed_mar), "--out", str(again), *FAST, "--order-from", str(first)]) == 0
    meta = load_checkpoint(again).metadata
    assert meta["order"] == load_checkpoint(first).metadata["order"] and meta["order_from"] == str(first)
    assert main(["train", "fixed-order", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset),
                 "--mar", str(perturbed_mar), "--out", str(tmp_path / "x.pt"), *FAST, "--order-from", str(first),
                 "--set", "acquisition.budget=1"]) == 2  # an order of another protocol is refused


def test_a_fixed_order_exports_as_the_ky_list_a_sequence_plays(tmp_path, capsys):
    """masc models export --lines: the shipped fixed order's lines, initial centre lines first, as the
    closed loop plays them; a checkpoint whose lines depend on the image is refused by name."""
    from masc_gadget.acquisition.learned import load_learned
    from masc_gadget.acquisition.policies import run_episode
    from masc_gadget.cli import main
    from masc_gadget.models.shipped import resolve

    assert main(["export", "shipped:fixed_small", "--lines", str(tmp_path / "order.txt")]) == 0
    text = (tmp_path / "order.txt").read_text().splitlines()
    lines = [int(x) for x in text if not x.startswith("#")]
    policy, _, meta = load_learned(resolve("shipped:fixed_small"), "cpu")
    played = run_episode(policy, meta["n_pe"], 2, len(meta["order"]))
    assert lines == [int(x) for x in played]
    mask = text[1].split("mask ")[1]
    assert len(mask) == meta["n_pe"] and mask.count("1") == len(lines) and all(mask[k] == "1" for k in lines)
    assert main(["export", "shipped:masc_small", "--lines", str(tmp_path / "x.txt")]) == 2
    assert "masc models export: error: shipped:masc_small is a masc checkpoint" in capsys.readouterr().err
    assert main(["export", "shipped:fixed_small"]) == 2
