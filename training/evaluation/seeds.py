"""Results of several training seeds in one table (``masc eval --combine``).

Each input is the ``results.json`` of one ``masc eval`` run: the same split, the same slices and
the same settings, with the models of one training seed. The combined table gives, per row, the
mean and the spread (sample standard deviation) over seeds of the per-seed mean metrics, and the
share of the oracle's gain captured; then, for the method under study, the paired tests against
every other row *within* each seed (the slices are paired inside a seed, not across seeds), over
the subjects' mean metrics (slices of one subject are not independent; the tests over slices are
kept as a secondary figure), and in how many seeds it wins at the chosen level: a seed counts as
won only at subject level.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from training.evaluation.stats import mean_std, subject_tests
from training.evaluation.tables import DISPLAY_NAMES, oracle_gain, result_subjects

METRICS_SHOWN = ("ssim", "psnr")


def load_results(folder: str | Path) -> dict[str, Any]:
    """The ``results.json`` of a ``masc eval`` output folder (or the file itself)."""
    path = Path(folder)
    path = path / "results.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --combine takes masc eval output folders")
    return json.loads(path.read_text())


def _check_compatible(results: Sequence[dict[str, Any]], labels: Sequence[str]) -> None:
    first = results[0]
    for res, label in zip(results[1:], labels[1:]):
        if res["split"] != first["split"] or res["slices"] != first["slices"]:
            raise ValueError(f"{label} was evaluated on other slices than {labels[0]} "
                             f"(split {res['split']!r}, {res['n_slices']} slices against "
                             f"{first['split']!r}, {first['n_slices']}); seeds pair only on the same slices")
        if set(res["accelerations"]) != set(first["accelerations"]):
            raise ValueError(f"{label} has accelerations {sorted(res['accelerations'])}, "
                             f"{labels[0]} has {sorted(first['accelerations'])}")


def combine_seeds(results: Sequence[dict[str, Any]], labels: Sequence[str] | None = None,
                  method: str = "masc", alpha: float = 0.01) -> dict[str, Any]:
    """One combined report from the results of several seeds (see the module docstring).

    method: the row name under study (its rows with and without MAR are compared with every
    other row of the same MAR setting); alpha: the level of "wins" (both paired tests below it
    and the mean difference positive)."""
    if len(results) < 2:
        raise ValueError(f"--combine needs the results of at least 2 seeds, got {len(results)}")
    labels = list(labels) if labels else [f"seed {i}" for i in range(len(results))]
    if len(labels) != len(results):
        raise ValueError(f"{len(labels)} labels for {len(results)} results")
    _check_compatible(results, labels)
    subjects = result_subjects(results[0])
    out: dict[str, Any] = {"labels": labels, "split": results[0]["split"],
                           "n_slices": results[0]["n_slices"], "n_subjects": len(set(subjects)),
                           "method": method, "alpha": alpha, "accelerations": {}}
    for acc in results[0]["accelerations"]:
        blocks = [r["accelerations"][acc] for r in results]
        keys = [row["key"] for row in blocks[0]["rows"]]
        missing = {label: sorted(set(keys) - {row["key"] for row in b["rows"]})
                   for label, b in zip(labels, blocks)}
        keys = [k for k in keys if all(k in {row["key"] for row in b["rows"]} for b in blocks)]
        by_key = [{row["key"]: row for row in b["rows"]} for b in blocks]
        gains = {over: [oracle_gain(b, over) for b in blocks] for over in ("random", "best")}
        rows = []
        first = by_key[0]
        for key in keys:
            row: dict[str, Any] = {"key": key, "method": first[key]["method"], "mar": first[key]["mar"]}
            for metric in METRICS_SHOWN:
                per_seed = [float(np.mean(bk[key]["per_slice"][metric])) for bk in by_key]
                row[metric] = {"per_seed": per_seed, **mean_std(np.asarray(per_seed))}
            for over, per_block in gains.items():
                vals = [g.get(key) for g in per_block]
                row[f"oracle_gain_{over}"] = (None if any(v is None for v in vals)
                                              else {"per_seed": vals, **mean_std(np.asarray(vals))})
            rows.append(row)
        comparisons = []
        for key in (k for k in keys if first[k]["method"] == method):
            for other in keys:
                if other == key or first[other]["mar"] != first[key]["mar"]:
                    continue
                comp: dict[str, Any] = {"row": key, "against": other,
                                        "method": first[other]["method"], "mar": first[other]["mar"]}
                for metric in METRICS_SHOWN:
                    per_seed = []
                    for bk in by_key:
                        a = np.asarray(bk[key]["per_slice"][metric], dtype=np.float64)
                        b = np.asarray(bk[other]["per_slice"][metric], dtype=np.float64)
                        tests = subject_tests(a, b, subjects)
                        diff = tests["diff"]
                        per_seed.append({"diff": diff, "p_ttest": tests["p_ttest"],
                                         "p_wilcoxon": tests["p_wilcoxon"],
                                         "p_ttest_slices": tests["p_ttest_slices"],
                                         "n_subjects": tests["n_subjects"],
                                         "win": bool(diff > 0 and tests["p_ttest"] < alpha
                                                     and tests["p_wilcoxon"] < alpha)})
                    comp[metric] = {"per_seed": per_seed,
                                    "diff": mean_std(np.asarray([s["diff"] for s in per_seed])),
                                    "wins": sum(s["win"] for s in per_seed)}
                comparisons.append(comp)
        out["accelerations"][acc] = {
            "initial": blocks[0]["initial"], "budget": blocks[0]["budget"], "n_pe": blocks[0]["n_pe"],
            "rows": rows, "comparisons": comparisons,
            "missing_rows": {k: v for k, v in missing.items() if v},
        }
    return out


def _ms(stats: dict[str, Any] | None, digits: int, pct: bool = False) -> str:
    if stats is None or stats.get("mean") is None or math.isnan(stats["mean"]):
        return "–"
    f = 100.0 if pct else 1.0
    unit = " %" if pct else ""
    return f"{stats['mean'] * f:.{digits}f} ± {stats['std'] * f:.{digits}f}{unit}"


def _p(p: float) -> str:
    if p is None or math.isnan(p):
        return "–"
    return f"{p:.0e}" if p < 0.001 else f"{p:.3f}"


def _name(method: str) -> str:
    return DISPLAY_NAMES.get(method, method)


def _diffs(per_seed: list[dict[str, Any]], digits: int) -> str:
    return " / ".join(f"{x['diff']:+.{digits}f}" for x in per_seed)


def _ps(per_seed: list[dict[str, Any]]) -> str:
    return " ; ".join(f"{_p(x['p_ttest'])} / {_p(x['p_wilcoxon'])}" for x in per_seed)


def render_combined(report: dict[str, Any]) -> str:
    """The combined report as Markdown."""
    n = len(report["labels"])
    lines = [f"# {n} training seeds on split `{report['split']}` ({report['n_slices']} slices)", "",
             f"Seeds: {', '.join(report['labels'])}. Mean ± standard deviation over the seeds of each "
             "seed's mean over slices."]
    for acc, block in report["accelerations"].items():
        lines += ["", f"## {acc}: {block['initial']} initial + {block['budget']} chosen of {block['n_pe']} lines",
                  "", "| Method | MAR | SSIM | PSNR | SSIM per seed | oracle gain captured over Random "
                  "| over the best baseline |", "|---|---|---:|---:|---|---:|---:|"]
        for row in block["rows"]:
            per = " / ".join(f"{v:.4f}" for v in row["ssim"]["per_seed"])
            lines.append(f"| {_name(row['method'])} | {'✓' if row['mar'] else '✗'} | {_ms(row['ssim'], 4)} "
                         f"| {_ms(row['psnr'], 2)} | {per} | {_ms(row['oracle_gain_random'], 0, True)} "
                         f"| {_ms(row['oracle_gain_best'], 0, True)} |")
        if block["comparisons"]:
            method = _name(report["method"])
            n_sub = report.get("n_subjects", "the")
            lines += ["", f"**{method} against each row**, paired within each seed over the {n_sub} subjects' "
                          f"mean metrics (wins: mean better and both the t-test and the Wilcoxon test over "
                          f"subjects p < {report['alpha']:g}); the t-test over slices, which counts the slices "
                          f"of one subject as independent, is the last column:",
                      "", "| against | MAR | ΔSSIM per seed | p (t / Wilcoxon) per seed | ΔPSNR dB per seed "
                      "| p (t / Wilcoxon) per seed | seeds won: SSIM, PSNR | SSIM p over slices per seed |",
                      "|---|---|---|---|---|---|---|---|"]
            for comp in block["comparisons"]:
                s, p = comp["ssim"]["per_seed"], comp["psnr"]["per_seed"]
                lines.append(f"| {_name(comp['method'])} | {'✓' if comp['mar'] else '✗'} | {_diffs(s, 4)} | {_ps(s)} "
                             f"| {_diffs(p, 2)} | {_ps(p)} "
                             f"| {comp['ssim']['wins']} / {n}, {comp['psnr']['wins']} / {n} "
                             f"| {' ; '.join(_p(x.get('p_ttest_slices', math.nan)) for x in s)} |")
        for label, keys in block["missing_rows"].items():
            lines.append(f"\n{label} lacks rows {', '.join(keys)}: they are left out.")
    return "\n".join(lines) + "\n"


def write_combined(report: dict[str, Any], out: str | Path) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "combined.json", "table": out / "combined.md"}
    paths["json"].write_text(json.dumps(report, indent=1) + "\n")
    paths["table"].write_text(render_combined(report))
    return paths
