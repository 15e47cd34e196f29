"""masc eval --suite paper on the tiny dataset: every table from the models of a runs folder."""

import json
import shutil

import numpy as np
import pytest

from masc_gadget.config import load_config
from sim_scanner.dataset.external import Volume, simulate_external
from training.coadapt import train_masc
from training.evaluation.suite import render_suite, retest_suite, run_suite, training_seconds
from training.loupe import train_loupe

from tests.conftest import CONFIGS


def test_suite_writes_every_table_from_a_runs_folder(tiny_dataset, tmp_path, perturbed_mar, monkeypatch):
    runs = tmp_path / "runs"
    runs.mkdir()
    config = load_config(CONFIGS / "tiny.yaml", ["masc_train.rollouts=2", "loupe.epochs=1", "loupe.run.device=cpu",
                                                 "eval.accelerations={10x: [1, 2], 5x: [2, 4]}"])
    for seed in (0, 1):
        shutil.copy(perturbed_mar, runs / f"mar_s{seed}.pt")
        train_masc(load_config(CONFIGS / "tiny.yaml", ["masc_train.rollouts=2", f"masc_train.run.seed={seed}"]),
                   tiny_dataset, perturbed_mar, runs / f"masc_s{seed}.pt", progress=False)
    train_loupe(config, tiny_dataset, perturbed_mar, runs / "loupe_s0.pt", progress=False)
    train_masc(load_config(CONFIGS / "tiny.yaml", ["masc_train.rollouts=2", "masc_train.mar_mode=none"]),
               tiny_dataset, None, runs / "ablation-metal_s0.pt", progress=False)
    rng = np.random.default_rng(0)
    simulate_external(config, [Volume("x", rng.random((2, 40, 40)), "test")], tmp_path / "ext", progress=False)

    report = run_suite(config, tiny_dataset, runs, tmp_path / "out", [0, 1], external=tmp_path / "ext",
                       progress=False)
    out = tmp_path / "out"
    table1 = json.loads((out / "table1_s0" / "results.json").read_text())
    assert set(table1["accelerations"]) == {"10x", "5x"}  # Table 1 and the 5x appendix table
    keys = {r["key"] for r in table1["accelerations"]["10x"]["rows"]}
    assert {"masc", "masc+nomar", "loupe", "population", "random+nomar", "center-out"} <= keys
    seed1 = {r["key"] for r in json.loads((out / "table1_s1" / "results.json").read_text())["accelerations"]["10x"]["rows"]}
    assert "loupe" not in seed1  # seed 1 has no learned mask: left out, not an error
    assert (out / "table1_s0" / "examples.png").is_file() and (out / "table1_s0" / "curves.png").is_file()
    assert (out / "table1_seeds" / "combined.md").is_file() and (out / "table3_seeds" / "combined.md").is_file()
    table3 = json.loads((out / "table3_s0" / "results.json").read_text())
    assert table3["n_slices"] == 2 and table3["population"]["data"] == str(tiny_dataset)
    assert report["table2"]["metal"]["label"].startswith("metal-trained") and len(report["table2"]["joint"]["mar"]) == 2
    versus = report["table2"]["metal"]["joint_minus"]  # MASC - ablation, paired over the subjects
    # one test subject in the tiny set: the subject-level test is undefined, the slices' test is not
    assert [v["seed"] for v in versus] == [0] and versus[0]["n_subjects"] == 1 and np.isnan(versus[0]["p_ttest"])
    assert 0 <= versus[0]["p_ttest_slices"] <= 1
    metal = json.loads((out / "table2_metal_s0" / "results.json").read_text())
    metal_rows = {r["key"]: r for r in metal["accelerations"]["10x"]["rows"]}
    joint_rows = {r["key"]: r for r in table1["accelerations"]["10x"]["rows"]}
    assert versus[0]["diff"] == pytest.approx(np.mean(np.subtract(joint_rows["masc"]["per_slice"]["ssim"],
                                                                   metal_rows["masc"]["per_slice"]["ssim"])))
    assert f"s0 {versus[0]['diff']:+.4f}" in (out / "suite.md").read_text()
    assert report["training_seconds"]["masc"][0] > 0 and report["training_seconds"]["loupe"][0] > 0
    assert (out / "suite.md").read_text() == render_suite(json.loads((out / "suite.json").read_text()))

    # --retest of a suite folder, from its tables alone (the models may be gone): written by an
    # older version (tests over slices), it is brought back to what the suite writes now
    written = {p: p.read_text() for p in sorted(out.rglob("*")) if p.suffix in (".json", ".md")}
    stale = json.loads((out / "suite.json").read_text())
    for entry in stale["table2"].values():
        for d in entry["joint_minus"]:
            del d["p_ttest_slices"], d["n_subjects"]
    (out / "suite.json").write_text(json.dumps(stale))
    shutil.rmtree(out / "table1_seeds")
    retested = retest_suite(out)
    assert json.loads(json.dumps(retested["table2"])) == json.loads(json.dumps(report["table2"]))
    assert {p: p.read_text() for p in written} == written

    # --resume reads back every table evaluated with the same inputs, and evaluates again only the
    # one whose model changed (here: the metal ablation retrained with another seed)
    import training.evaluation.suite as suite_module
    real_evaluate, evaluated = suite_module.evaluate, []

    def counting_evaluate(cfg, data, split, methods, mar, **kwargs):
        evaluated.append((str(data), tuple(methods), str(kwargs.get("checkpoint"))))
        return real_evaluate(cfg, data, split, methods, mar, **kwargs)

    monkeypatch.setattr(suite_module, "evaluate", counting_evaluate)
    again = run_suite(config, tiny_dataset, runs, out, [0, 1], external=tmp_path / "ext", progress=False, resume=True)
    assert evaluated == [] and again["table2"] == report["table2"]
    assert json.loads((out / "table1_s1" / "inputs.json").read_text())["checkpoints"][0]["path"].endswith("masc_s1.pt")
    train_masc(load_config(CONFIGS / "tiny.yaml", ["masc_train.rollouts=2", "masc_train.mar_mode=none",
                                                   "masc_train.run.seed=3"]),
               tiny_dataset, None, runs / "ablation-metal_s0.pt", progress=False)
    run_suite(config, tiny_dataset, runs, out, [0, 1], external=tmp_path / "ext", progress=False, resume=True)
    assert [e[1] for e in evaluated] == [("masc",)] and evaluated[0][2].endswith("ablation-metal_s0.pt")
    run_suite(config, tiny_dataset, runs, out, [1], progress=False)  # without resume: evaluated again
    assert len(evaluated) == 2 and evaluated[1][2].endswith("masc_s1.pt']")

    with pytest.raises(FileNotFoundError, match="mar_s5.pt is missing"):
        run_suite(config, tiny_dataset, runs, tmp_path / "o2", [5], progress=False)
    assert training_seconds(runs / "nothing.pt") is None
