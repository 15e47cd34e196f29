"""masc eval --combine: mean and spread over seeds, paired tests within each seed, the wins,
and the errors for results that do not pair."""

import json
import subprocess
import sys

import numpy as np
import pytest

from training.evaluation.seeds import combine_seeds, render_combined, write_combined

N = 40


def _results(seed, shift):
    """A results dict of 40 slices: random < masc < oracle under MAR; masc ahead of random by
    ``shift`` SSIM (0 = the same lines' scores plus tiny noise)."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.5, 0.6, N)

    def row(key, ssim):
        return {"key": key, "method": key.partition("+")[0], "mar": not key.endswith("+nomar"),
                "per_slice": {"ssim": list(ssim), "psnr": list(20 + 10 * ssim)},
                "summary": {"ssim": {"mean": float(np.mean(ssim))}}}

    masc = base + shift + rng.normal(0, 1e-4, N)
    rows = [row("random", base), row("masc", masc), row("oracle", base + 0.05),
            row("random+nomar", base - 0.2), row("masc+nomar", base - 0.19)]
    return {"split": "test", "n_slices": N, "slices": [f"s{i}" for i in range(N)],
            "accelerations": {"10x": {"initial": 2, "budget": 3, "n_pe": 32, "rows": rows}}}


def test_mean_spread_and_wins():
    report = combine_seeds([_results(0, 0.02), _results(1, 0.03), _results(2, 0.0)], ["a", "b", "c"])
    block = report["accelerations"]["10x"]
    rows = {r["key"]: r for r in block["rows"]}
    per_seed = [float(np.mean(_results(s, d)["accelerations"]["10x"]["rows"][1]["per_slice"]["ssim"]))
                for s, d in ((0, 0.02), (1, 0.03), (2, 0.0))]
    assert rows["masc"]["ssim"]["per_seed"] == pytest.approx(per_seed)
    assert rows["masc"]["ssim"]["mean"] == pytest.approx(np.mean(per_seed))
    assert rows["masc"]["ssim"]["std"] == pytest.approx(np.std(per_seed, ddof=1))
    # share of the oracle's gain (0.05 over random): 40 %, 60 %, ~0 %
    gains = rows["masc"]["oracle_gain_random"]["per_seed"]
    assert gains == pytest.approx([0.4, 0.6, 0.0], abs=0.01)
    comps = {(c["row"], c["against"]): c for c in block["comparisons"]}
    assert set(comps) == {("masc", "random"), ("masc", "oracle"), ("masc+nomar", "random+nomar")}
    vs_random = comps[("masc", "random")]["ssim"]
    assert [s["win"] for s in vs_random["per_seed"]][:2] == [True, True]
    assert vs_random["wins"] in (2, 3) and vs_random["per_seed"][2]["diff"] == pytest.approx(0, abs=1e-4)
    assert comps[("masc", "oracle")]["ssim"]["wins"] == 0  # worse than the oracle: never a win
    md = render_combined(report)
    assert "| MASC | ✓ |" in md and "seeds won" in md and "a, b, c" in md


def test_seeds_must_pair(tmp_path):
    a, b = _results(0, 0.01), _results(1, 0.01)
    b["slices"] = b["slices"][::-1]
    with pytest.raises(ValueError, match="other slices"):
        combine_seeds([a, b])
    with pytest.raises(ValueError, match="at least 2"):
        combine_seeds([a])


def test_cli_combine(tmp_path):
    folders = []
    for s in range(2):
        d = tmp_path / f"seed{s}"
        d.mkdir()
        (d / "results.json").write_text(json.dumps(_results(s, 0.02)))
        folders.append(str(d))
    out = tmp_path / "combined"
    cmd = [sys.executable, "-m", "masc_gadget.cli", "eval", "--combine", ",".join(folders), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    saved = json.loads((out / "combined.json").read_text())
    assert saved["labels"] == ["seed0", "seed1"]
    assert (out / "combined.md").read_text().startswith("# 2 training seeds")
    bad = subprocess.run(cmd + ["--data", "x"], capture_output=True, text=True)
    assert bad.returncode != 0 and "drop --data" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "masc_gadget.cli", "eval", "--out", str(out)],
                             capture_output=True, text=True)
    assert missing.returncode != 0 and "--data" in missing.stderr
    assert write_combined(saved, tmp_path / "again")["table"].is_file()


def test_a_seed_is_won_only_at_subject_level():
    """Slices grouped into 4 subjects whose MASC margin is a subject effect of mixed sign: every
    slice-level test is tiny, no seed is won."""
    results = []
    for seed in range(2):
        res = _results(seed, 0.0)
        res["slices"] = [f"sub-{i // 10}/{i % 10}" for i in range(N)]
        masc = res["accelerations"]["10x"]["rows"][1]
        effect = np.repeat([0.03, -0.01, 0.02, 0.015], 10)
        masc["per_slice"]["ssim"] = list(np.asarray(res["accelerations"]["10x"]["rows"][0]["per_slice"]["ssim"]) + effect)
        results.append(res)
    report = combine_seeds(results)
    assert report["n_subjects"] == 4
    comp = next(c for c in report["accelerations"]["10x"]["comparisons"] if (c["row"], c["against"]) == ("masc", "random"))
    assert all(s["p_ttest_slices"] < 1e-6 for s in comp["ssim"]["per_seed"])
    assert all(s["n_subjects"] == 4 and s["p_ttest"] > 0.01 for s in comp["ssim"]["per_seed"])
    assert comp["ssim"]["wins"] == 0
    assert "over the 4 subjects' mean metrics" in render_combined(report)
