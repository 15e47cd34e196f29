"""Golden test: the tiny configuration end to end (train the fixed order and MASC, evaluate,
check the MAR network, measure the headroom) gives the figures it gave before the scoring of a
mask's served image and the trainer loop were rewritten as one function each.

``golden_tiny.json`` beside this file holds the figures of the code before that rewrite; to
write it anew (only when a change is *meant* to alter them, and say so in the commit):

    python -m tests.training.test_golden
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from tests.conftest import CONFIGS

GOLDEN = Path(__file__).with_name("golden_tiny.json")

COMMON = ["--config", str(CONFIGS / "tiny.yaml"), "--log-level", "WARNING"]


def _csv(path: Path, columns: list[str]) -> dict[str, list[float]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return {c: [float(r[c]) if r.get(c) not in (None, "") else math.nan for r in rows] for c in columns}


def _numbers(tree, prefix: str, out: dict[str, float]) -> None:
    """Every number of a JSON tree, keyed by its path."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            _numbers(value, f"{prefix}/{key}", out)
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            _numbers(value, f"{prefix}/{i}", out)
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        out[prefix] = float(tree)


def tiny_outputs(data: Path, mar: Path, tmp: Path) -> dict[str, float]:
    """The figures of the tiny pipeline, flat: name -> value."""
    from masc_gadget.cli import main
    from masc_gadget.models.checkpoint import load_checkpoint

    out: dict[str, float] = {}
    fixed = tmp / "fixed.pt"
    assert main(["train", "fixed-order", *COMMON, "--data", str(data), "--mar", str(mar), "--out", str(fixed),
                 "--set", "fixed_order.population_slices=2", "--set", "finetune.epochs=2",
                 "--set", "fixed_order.device=cpu", "--set", "finetune.batch_size=4"]) == 0
    for key, values in _csv(tmp / "fixed.csv", ["val_ssim", "val_psnr", "loss"]).items():
        for i, v in enumerate(values):
            out[f"fixed/{key}/{i}"] = v
    out["fixed/order"] = float(sum(load_checkpoint(fixed).metadata["order"]))

    masc = tmp / "masc.pt"
    assert main(["train", "masc", *COMMON, "--data", str(data), "--mar", str(mar), "--out", str(masc),
                 "--set", "masc_train.rollouts=2", "--set", "masc_train.val_every=1",
                 "--set", "masc_train.mar_loss=pretrain"]) == 0
    for key, values in _csv(tmp / "masc.csv", ["losses/mar", "val/ssim", "val/psnr", "val/return"]).items():
        for i, v in enumerate(values):
            out[f"masc/{key}/{i}"] = v

    report = tmp / "eval"
    assert main(["eval", *COMMON, "--data", str(data), "--split", "test", "--mar", str(masc),
                 "--checkpoint", f"{masc},{fixed}", "--methods", "center-out,fixed-order,masc",
                 "--out", str(report)]) == 0
    results = json.loads((report / "results.json").read_text())
    _numbers(results.get("rows", results), "eval", out)

    check = tmp / "check"
    assert main(["mar-check", *COMMON, "--data", str(data), "--split", "val", "--mar", f"pre={mar},fixed={fixed}",
                 "--calibrate", "--out", str(check)]) == 0
    checked = json.loads((check / "results.json").read_text())
    for folder, by_name in checked["folders"].items():
        for name, body in by_name.items():
            for key, values in body["slices"].items():
                if key != "subject":
                    for i, v in enumerate(values):
                        out[f"check/{name}/{key}/{i}"] = float(v)
    _numbers(checked["calibration"], "check/calibration", out)

    head = tmp / "headroom"
    assert main(["headroom", *COMMON, "--data", str(data), "--split", "train", "--mar", str(mar),
                 "--set", "headroom.folds=2", "--set", "headroom.slices_per_subject=2",
                 "--out", str(head)]) == 0
    _numbers(json.loads((head / "headroom.json").read_text())["runs"], "headroom", out)

    # the acquisition environment's evaluation and the gated order: MASC under motion, with repeats
    moving = tmp / "moving.pt"
    motion = ["--set", "env.corruption=0.3", "--set", "policy_net.reacquire=true"]
    assert main(["train", "masc", *COMMON, "--data", str(data), "--mar", str(mar), "--out", str(moving),
                 "--set", "masc_train.rollouts=1", *motion]) == 0
    for key, values in _csv(tmp / "moving.csv", ["val/ssim", "val/return"]).items():
        for i, v in enumerate(values):
            out[f"moving/{key}/{i}"] = v
    head = tmp / "headroom-motion"
    assert main(["headroom", *COMMON, "--data", str(data), "--split", "train", "--mar", str(mar),
                 "--policy", str(moving), "--set", "headroom.folds=2", "--set", "headroom.corruption=0.3",
                 "--set", "headroom.region=implant", "--out", str(head)]) == 0
    _numbers(json.loads((head / "headroom.json").read_text())["runs"], "headroom-motion", out)
    # the other trainers: MAR pre-training, the learned mask, DQN
    for name, extra in (("mar", ["--set", "mar_train.clean_fraction=0.25", "--set", "mar_train.input=mixed"]),
                        ("loupe", ["--mar", str(mar), "--set", "loupe.epochs=2", "--set", "loupe.batch_size=4",
                                   "--set", "loupe.run.device=cpu"]),
                        ("dqn", ["--mar", str(mar), "--set", "dqn.steps=16", "--set", "dqn.val_every=8",
                                 "--set", "dqn.batch_size=8", "--set", "dqn.run.device=cpu"])):
        path = tmp / f"{name}.pt"
        assert main(["train", name, *COMMON, "--data", str(data), "--out", str(path), *extra]) == 0
        _numbers(load_checkpoint(path).metadata["best_val"], f"train-{name}/best", out)
        with open(tmp / f"{name}.csv", newline="") as f:
            for i, row in enumerate(csv.DictReader(f)):
                for key, value in row.items():
                    try:
                        out[f"train-{name}/{key}/{i}"] = float(value)
                    except ValueError:
                        pass
    return {k: v for k, v in out.items() if "seconds" not in k and "time" not in k}


def compare(now: dict[str, float], golden: dict[str, float], rel: float = 1e-4, abs_: float = 1e-5) -> list[str]:
    """The differences between two sets of figures, as lines (none when they agree)."""
    problems = [f"missing: {k}" for k in sorted(set(golden) - set(now))]
    problems += [f"new: {k}" for k in sorted(set(now) - set(golden))]
    for key in sorted(set(now) & set(golden)):
        a, b = now[key], golden[key]
        if math.isnan(a) and math.isnan(b):
            continue
        if not math.isclose(a, b, rel_tol=rel, abs_tol=abs_):
            problems.append(f"{key}: {a!r} now, {b!r} before")
    return problems


def test_tiny_end_to_end_matches_golden(tiny_dataset, perturbed_mar, tmp_path):
    golden = json.loads(GOLDEN.read_text())
    problems = compare(tiny_outputs(tiny_dataset, perturbed_mar, tmp_path), golden)
    assert not problems, "\n".join(problems[:40])


if __name__ == "__main__":  # write the golden figures
    import tempfile

    from masc_gadget.config import load_config
    from sim_scanner.dataset.simulate import simulate_dataset
    from tests.conftest import write_perturbed_mar

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "data"
        simulate_dataset(load_config(CONFIGS / "tiny.yaml", ["dataset.workers=2"]), data, progress=False)
        mar = write_perturbed_mar(tmp / "mar.pt")
        (tmp / "run").mkdir()
        figures = tiny_outputs(data, mar, tmp / "run")
    GOLDEN.write_text(json.dumps(figures, indent=0, sort_keys=True) + "\n")
    print(f"{len(figures)} figures written to {GOLDEN}")
