"""Evaluation harness on the tiny dataset: outputs, consistency, determinism, statistics."""

import json

import numpy as np
import pytest
import torch

from masc_gadget.config import load_config
from masc_gadget.core.kspace import zero_filled
from masc_gadget.core.metrics import slice_metrics
from masc_gadget.acquisition.policies import make_policy, run_episode, slice_rng
from training.cli.evaluate import cmd_eval  # noqa: F401  (the CLI module imports cleanly)
from training.data import load_split
from training.evaluation.evaluate import evaluate
from training.evaluation.stats import paired_tests
from training.evaluation.tables import render_table

from masc_gadget.cli import main

from tests.conftest import CONFIGS


@pytest.fixture(scope="module")
def mar_checkpoint(perturbed_mar):
    return perturbed_mar


@pytest.fixture(scope="module")
def eval_run(tiny_dataset, mar_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    rc = main(["eval", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset), "--split", "test",
               "--methods", "center-out,random,equispaced", "--mar", str(mar_checkpoint), "--out", str(out)])
    assert rc == 0
    return out


def test_writes_all_four_outputs(eval_run):
    for name in ("results.json", "table.md", "curves.png", "examples.png"):
        assert (eval_run / name).stat().st_size > 0
    for name in ("curves.png", "examples.png"):
        assert (eval_run / name).read_bytes()[:4] == b"\x89PNG"


def test_table_is_rendered_from_the_json(eval_run):
    results = json.loads((eval_run / "results.json").read_text())
    assert render_table(results) == (eval_run / "table.md").read_text()
    table = (eval_run / "table.md").read_text()
    for block in results["accelerations"].values():
        for row in block["rows"]:
            s = row["summary"]["ssim"]
            assert f"{s['mean']:.4f} ± {s['std']:.4f}" in table
    shown = table.split("## Summary")[0]
    assert shown.count("**") >= 2 * 3 * len(results["accelerations"])  # a bold best per metric shown (SSIM, PSNR, NMSE)
    assert "MAE" not in shown and "## Summary" in table
    # beside every learned or fixed policy: how many line sets it plays
    from training.evaluation.tables import line_sets

    assert "| line sets |" in shown
    row = results["accelerations"]["10x"]["rows"][0]
    assert line_sets(row) == len({tuple(sorted(x)) for x in row["lines"]}) >= 1
    assert line_sets({"lines": [[1, 2, 3], [3, 2, 1], [1, 2, 4]]}) == 2


def test_results_structure_and_numbers(eval_run, tiny_dataset, tiny_config):
    results = json.loads((eval_run / "results.json").read_text())
    data = load_split(tiny_dataset, "test")
    assert results["n_slices"] == len(data)
    assert set(results["accelerations"]) == set(tiny_config["eval"].accelerations)
    for acc, block in results["accelerations"].items():
        initial, budget = tiny_config["eval"].accelerations[acc]
        keys = [row["key"] for row in block["rows"]]
        assert keys == ["center-out+nomar", "center-out", "random+nomar", "random", "equispaced+nomar", "equispaced"]
        for row in block["rows"]:
            lines = np.asarray(row["lines"])
            assert lines.shape == (len(data), initial + budget)
            assert all(len(set(l)) == initial + budget for l in lines.tolist())  # never re-acquired
            for metric in ("ssim", "psnr", "mse", "nmse", "mae"):
                per = np.asarray(row["per_slice"][metric])
                assert per.shape == (len(data),)
                assert row["summary"][metric]["mean"] == pytest.approx(per.mean())
                assert row["curves"][metric]["mean"][-1] == pytest.approx(per.mean())
                assert len(row["curves"][metric]["mean"]) == budget + 1
            assert row["curves"]["n_lines"] == list(range(initial, initial + budget + 1))
        # no-MAR final SSIM of a random policy equals a direct offline recomputation
        row = next(r for r in block["rows"] if r["key"] == "random+nomar")
        for i in range(len(data)):
            lines = run_episode(make_policy("random"), data.n_pe, initial, budget,
                                slice_rng(tiny_config["eval"].seed, i))
            np.testing.assert_array_equal(lines, row["lines"][i])
            mask = torch.zeros(1, data.n_pe, dtype=torch.bool)
            mask[0, lines] = True
            direct = slice_metrics(zero_filled(data.kspace_metal[i : i + 1], mask), data.target[i : i + 1])
            assert row["per_slice"]["ssim"][i] == pytest.approx(float(direct["ssim"][0]), abs=1e-6)
        # MAR changes the images; with and without MAR share the acquisition
        nomar, mar = (next(r for r in block["rows"] if r["key"] == k) for k in ("center-out+nomar", "center-out"))
        assert nomar["lines"] == mar["lines"]
        assert nomar["per_slice"]["ssim"] != mar["per_slice"]["ssim"]


def test_pvalues_against_reference(eval_run):
    results = json.loads((eval_run / "results.json").read_text())
    assert results["reference"] == "center-out"
    block = next(iter(results["accelerations"].values()))
    rows = {r["key"]: r for r in block["rows"]}
    assert rows["center-out"]["tests"] is None
    a, b = (np.asarray(rows[k]["per_slice"]["ssim"]) for k in ("random", "center-out"))
    got = rows["random"]["tests"]["ssim"]
    # the tests over slices are the secondary figure; those over subjects decide (one subject
    # in the tiny test split: undefined, never a slice-level p in disguise)
    assert got["p_ttest_slices"] == pytest.approx(paired_tests(a, b)["p_ttest"], nan_ok=True)
    subjects = {label.rsplit("/", 1)[0] for label in results["slices"]}
    assert got["n_subjects"] == len(subjects) == 1 and got["n_slices"] == len(a)
    assert np.isnan(got["p_ttest"]) and np.isnan(got["p_wilcoxon"])
    assert got["diff"] == pytest.approx(float(np.mean(a - b)))


def test_deterministic_and_batch_size_independent(tiny_dataset, mar_checkpoint):
    a, _ = evaluate(load_config(CONFIGS / "tiny.yaml"), tiny_dataset, "test", ["random"], mar_checkpoint,
                    progress=False)
    b, _ = evaluate(load_config(CONFIGS / "tiny.yaml", ["eval.batch_size=1"]), tiny_dataset, "test", ["random"],
                    mar_checkpoint, progress=False)
    for acc in a["accelerations"]:
        for ra, rb in zip(a["accelerations"][acc]["rows"], b["accelerations"][acc]["rows"]):
            assert ra["lines"] == rb["lines"]
            np.testing.assert_allclose(ra["per_slice"]["ssim"], rb["per_slice"]["ssim"], atol=1e-5)


def test_paired_tests_hand_case():
    a = np.array([0.5, 0.6, 0.7, 0.8, 0.9])
    b = a - np.array([0.1, 0.12, 0.09, 0.11, 0.1])
    out = paired_tests(a, b)
    assert out["p_ttest"] < 0.001 and out["t"] > 0
    assert out["p_wilcoxon"] == pytest.approx(0.0625)  # exact two-sided, n = 5, all positive
    assert np.isnan(paired_tests(a, a)["p_ttest"])


def test_bad_inputs(tiny_dataset, tmp_path, capsys, mar_checkpoint):
    assert main(["eval", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset), "--methods", "nope",
                 "--out", str(tmp_path)]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
    assert main(["eval", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset), "--mar",
                 str(mar_checkpoint), "--reference", "zzz", "--out", str(tmp_path)]) == 2
    assert "reference 'zzz' is not an evaluated row" in capsys.readouterr().err
    assert main(["eval", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset),
                 "--set", "eval.accelerations={big: [10, 40]}", "--out", str(tmp_path)]) == 2
    assert "must be <= number of PE lines (32)" in capsys.readouterr().err
    assert main(["eval", "--config", str(CONFIGS / "tiny.yaml"), "--data", str(tiny_dataset), "--resume",
                 "--out", str(tmp_path)]) == 2
    assert "--resume goes with --suite" in capsys.readouterr().err


def test_retest_rewrites_older_results_with_tests_over_subjects(eval_run, tmp_path):
    """An output of an older version (tests over slices, no subject fields) is brought up to date
    in place; the scores are untouched."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(eval_run, old)
    results = json.loads((old / "results.json").read_text())
    for block in results["accelerations"].values():
        for row in block["rows"]:
            if row["tests"] is not None:
                row["tests"] = {k: {key: v[key] for key in ("t", "p_ttest", "w", "p_wilcoxon")}
                                for k, v in row["tests"].items()}
    (old / "results.json").write_text(json.dumps(results))
    assert main(["eval", "--retest", str(old)]) == 0
    again = json.loads((old / "results.json").read_text())
    fresh = json.loads((eval_run / "results.json").read_text())
    assert again["accelerations"] == json.loads(json.dumps(fresh["accelerations"]))
    assert (old / "table.md").read_text() == (eval_run / "table.md").read_text()
    assert main(["eval", "--retest", str(old), "--out", str(tmp_path / "x")]) == 2  # in place, no --out
    assert not (tmp_path / "x").exists()


def test_several_data_folders_in_one_run(tiny_dataset, mar_checkpoint, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_dataset, other)
    out = tmp_path / "out"
    rc = main(["eval", "--config", str(CONFIGS / "tiny.yaml"), "--data", f"{tiny_dataset},{other}", "--split", "test",
               "--methods", "center-out", "--mar", str(mar_checkpoint), "--out", str(out)])
    assert rc == 0
    for name in (tiny_dataset.name, "other"):
        assert (out / name / "results.json").is_file() and (out / name / "table.md").is_file()
    summary = (out / "summary.md").read_text()
    a = json.loads((out / tiny_dataset.name / "results.json").read_text())
    row = a["accelerations"]["10x"]["rows"][0]
    assert f"| {tiny_dataset.name} | 10x | Center-out |" in summary and "| other | 10x |" in summary
    assert f"{row['summary']['ssim']['mean']:.4f}" in summary
    assert main(["eval", "--config", str(CONFIGS / "tiny.yaml"), "--data", f"{tiny_dataset},{tiny_dataset}",
                 "--out", str(tmp_path / "x")]) == 2  # two folders of one name


def _row(method, mar, ssim):
    ssim = np.asarray(ssim, dtype=float)
    return {"key": method + ("" if mar else "+nomar"), "method": method, "mar": mar,
            "summary": {"ssim": {"mean": float(ssim.mean()), "std": float(ssim.std())}},
            "per_slice": {"ssim": ssim.tolist()}}


def test_the_closing_summary_ranks_and_tests_against_the_best_baseline():
    from training.evaluation.tables import closing_summary

    rng = np.random.default_rng(0)
    base = 0.6 + 0.05 * rng.standard_normal(12)
    results = {"slices": [f"sub-{i // 2}/{i % 2}" for i in range(12)], "accelerations": {"10x": {"rows": [
        _row("random", True, base - 0.1), _row("center-out", True, base),
        _row("masc", True, base + 0.02 + 0.002 * rng.standard_normal(12)),
        _row("center-out", False, base - 0.2)]}}}
    text = "\n".join(closing_summary(results))
    assert "best first: MASC" in text and "Center-out" in text.split("best first: MASC")[1]
    assert "MASC against the best baseline, Center-out: +0.019" in text and "over 6 subjects" in text
    assert "better" in text and "beats every fixed schedule" in text
    results["accelerations"]["10x"]["rows"][2] = _row("masc", True, base + 0.001 * rng.standard_normal(12))
    text = "\n".join(closing_summary(results))
    assert "no significant difference" in text and "does no better than Center-out" in text


def test_the_summary_puts_masc_beside_the_fixed_order():
    from training.evaluation.tables import closing_summary

    rng = np.random.default_rng(1)
    base = 0.6 + 0.05 * rng.standard_normal(12)
    rows = [_row("center-out", True, base), _row("masc", True, base + 0.01 + 0.002 * rng.standard_normal(12)),
            _row("fixed-order", True, base + 0.03 + 0.002 * rng.standard_normal(12))]
    results = {"slices": [f"sub-{i // 2}/{i % 2}" for i in range(12)], "accelerations": {"10x": {"rows": rows}}}
    text = "\n".join(closing_summary(results))
    assert "MASC against the fixed order: -0.019" in text and "deploy the fixed order for this protocol" in text
    rows[2] = _row("fixed-order", True, rows[1]["per_slice"]["ssim"] + 0.0005 * rng.standard_normal(12))
    text = "\n".join(closing_summary(results))
    assert "adds nothing a fixed order does not" in text


def test_the_summary_says_when_a_network_harms_and_when_two_methods_play_the_same_lines():
    from training.evaluation.tables import closing_summary

    rng = np.random.default_rng(2)
    nothing = 0.66 + 0.02 * rng.standard_normal(12)
    harmful = _row("fixed-order", True, nothing - 0.12 + 0.01 * rng.standard_normal(12))
    harmful["fallback"] = 2
    masc = _row("masc", True, nothing - 0.01 + 0.02 * rng.standard_normal(12))
    same = [[7, 8, 3, 20]] * 12
    harmful["lines"], masc["lines"] = same, same[:10] + [[7, 8, 4, 21]] * 2
    block = {"rows": [_row("center-out", True, nothing + 0.05), harmful, masc], "nothing": {"ssim": nothing.tolist()}}
    results = {"slices": [f"sub-{i // 2}/{i % 2}" for i in range(12)], "accelerations": {"10x": block}}
    text = "\n".join(closing_summary(results))
    assert "**Fixed order harms the image here**" in text and "by -0.1" in text
    assert "on 12 of 12 slices; its fallback served 2 of 12 slices zero-filled" in text
    assert "masc check mar" in text
    assert "plays the same lines as MASC on 10 of 12 slices: the gap between them is the networks'" in text
    assert "Center-out harms" not in text  # centre-out's network helps: no harm line
    # the same lines: the gap is not credited to MASC's per-slice choice
    assert "MASC plays the fixed order's lines on 10 of 12 slices" in text and "per-slice choice of lines beats" not in text


def test_the_table_counts_the_slices_served_through_the_fallback(eval_run):
    from training.evaluation.tables import render_table

    results = json.loads((eval_run / "results.json").read_text())
    for block in results["accelerations"].values():
        assert len(block["nothing"]["ssim"]) == results["n_slices"]
        for row in block["rows"]:
            assert ("fallback" in row) == row["mar"]
    table = render_table(results)
    assert "| line sets | fallback |" in table and f"| 0 / {results['n_slices']} |" in table


def test_closed_loop_scans_are_shown_beside_the_row_of_the_policy_they_were_served(tmp_path):
    from training.evaluation.tables import closed_loop, render_table

    ssim = [0.7, 0.6, 0.65, 0.5]
    row = {**_row("fixed-order", True, ssim), "lines": [[1, 2, 5]] * 4}
    results = {"split": "test", "n_slices": 4, "reference": "fixed-order", "slices": ["s0/0", "s0/1", "s1/0", "s1/1"],
               "accelerations": {"10x": {"initial": 2, "budget": 1, "n_pe": 8, "factor": 2.7, "rows": [row]}}}
    row["summary"].update({m: {"mean": 0.0, "std": 0.0} for m in ("psnr", "nmse")})
    scan = tmp_path / "scan"
    scan.mkdir()
    subjects = [{"subject": f"s{j}", "slices": [{"slice": k, "lines": [1, 2, 5] if (j, k) != (1, 1) else [1, 2, 6],
                                                 "policy": "fixed-order", "served": "shipped:fixed_small",
                                                 "fallbacks": 0, "metrics": {"ssim": ssim[2 * j + k] + (0.01 if j else 0)}}
                                                for k in range(2)]} for j in range(2)]
    (scan / "report.json").write_text(json.dumps({"acquisition": {"initial": 2, "budget": 1}, "subjects": subjects}))
    (entry,) = closed_loop(results, [str(scan)])
    assert entry["row"] == "fixed-order" and entry["matched"] == 4 and entry["same_lines"] == 3
    assert entry["max_abs_gap"] == pytest.approx(0.01) and entry["line_sets"] == 2
    results["closed_loop"] = [entry]
    assert "## Closed loop against masc serve" in render_table(results)
    (other,) = closed_loop({**results, "accelerations": {"5x": {**results["accelerations"]["10x"], "budget": 9}}},
                           [str(scan)])
    assert "row" not in other
