"""The fair comparison: two policies under two MAR fine-tuning recipes, judged apart.

``masc train finetune`` writes one checkpoint per cell (policy x recipe x seed) from the same
pre-trained network per seed; ``masc eval`` scores each recipe's two checkpoints on the test
split (both policies in one run, each under its cell's network). :func:`fair_report` reads them:

* the **default** is the cell with the best validation SSIM (the checkpoint's selection figure),
  averaged over the seeds; no test figure chooses anything;
* each cell's test SSIM and PSNR (mean ± sd over seeds) and its gap to the default, with the
  paired t-test over subjects per seed (slices of one subject are not independent);
* the **policy effect** (MASC - fixed order, within each recipe) and the **recipe effect**
  (served masks - pre-action masks, within each policy), each per seed with its subject-level p;
* how many distinct line sets each policy plays on the test split.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from masc_gadget.models.checkpoint import load_checkpoint
from training.evaluation.stats import subject_of, subject_tests

__all__ = ["Cell", "FairReport", "fair_report"]

POLICIES = {"fixed": "fixed-order", "masc": "masc"}
"""Cell prefix -> the method's row in ``masc eval``'s results."""
RECIPES = ("finetune", "finetune_joint")


@dataclass
class Cell:
    """One policy under one recipe, over the seeds."""

    policy: str
    recipe: str
    val_ssim: list[float]
    test_ssim: list[float]
    test_psnr: list[float]
    line_sets: list[int]
    per_slice: dict[int, dict[str, list[float]]] = field(default_factory=dict, repr=False)


@dataclass
class FairReport:
    """:func:`fair_report`'s result (``to_json`` / ``from_json``)."""

    seeds: list[int]
    cells: dict[str, Cell]
    default: str
    gaps: dict[str, list[dict[str, float]]]
    policy_effect: dict[str, list[dict[str, float]]]
    recipe_effect: dict[str, list[dict[str, float]]]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "FairReport":
        data = json.loads(text)
        cells = {k: Cell(**{**v, "per_slice": {int(s): p for s, p in v["per_slice"].items()}})
                 for k, v in data.pop("cells").items()}
        return cls(cells=cells, **data)


def _row(results: dict[str, Any], method: str) -> dict[str, Any]:
    for acc in results["accelerations"].values():
        for row in acc["rows"]:
            if row["method"] == method and row["mar"]:
                return row
    raise ValueError(f"{results.get('data')}: no MAR row of method {method!r} in the evaluation")


def fair_report(folder: str | Path, seeds: list[int]) -> FairReport:
    """Read ``FOLDER/{fixed,masc}_{finetune,finetune_joint}_sS.pt`` and
    ``FOLDER/eval_{finetune,finetune_joint}_sS/results.json`` (module docstring)."""
    folder = Path(folder)
    cells: dict[str, Cell] = {}
    subjects: dict[int, list[str]] = {}
    for prefix, method in POLICIES.items():
        for recipe in RECIPES:
            cell = Cell(prefix, recipe, [], [], [], [])
            for seed in seeds:
                meta = load_checkpoint(folder / f"{prefix}_{recipe}_s{seed}.pt").metadata
                results = json.loads((folder / f"eval_{recipe}_s{seed}" / "results.json").read_text())
                row = _row(results, method)
                subjects[seed] = [subject_of(label) for label in results["slices"]]
                cell.val_ssim.append(float(meta["best_val"]["ssim"]))
                cell.test_ssim.append(float(np.mean(row["per_slice"]["ssim"])))
                cell.test_psnr.append(float(np.mean(row["per_slice"]["psnr"])))
                cell.line_sets.append(len({tuple(sorted(lines)) for lines in row["lines"]}))
                cell.per_slice[seed] = {k: row["per_slice"][k] for k in ("ssim", "psnr")}
            cells[f"{prefix}/{recipe}"] = cell
    default = max(cells, key=lambda k: float(np.mean(cells[k].val_ssim)))

    def tests(a: str, b: str) -> list[dict[str, float]]:
        return [subject_tests(np.asarray(cells[a].per_slice[s]["ssim"]), np.asarray(cells[b].per_slice[s]["ssim"]),
                              subjects[s]) for s in seeds]

    return FairReport(seeds=list(seeds), cells=cells, default=default,
                      gaps={k: tests(k, default) for k in cells if k != default},
                      policy_effect={r: tests(f"masc/{r}", f"fixed/{r}") for r in RECIPES},
                      recipe_effect={p: tests(f"{p}/finetune", f"{p}/finetune_joint") for p in POLICIES})


def _spread(values: list[float], digits: int = 3) -> str:
    """Mean ± sd over the seeds; one seed has no spread to show."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{values.mean():.{digits}f} ± {values.std(ddof=1):.{digits}f}"


def _effect(per_seed: list[dict[str, float]]) -> str:
    diffs = [t["diff"] for t in per_seed]
    ps = " / ".join(f"{t['p_ttest']:.1e}" if t["p_ttest"] < 1e-3 else f"{t['p_ttest']:.3f}" for t in per_seed)
    if len(diffs) == 1:
        return f"{diffs[0]:+.4f} (p {ps})"
    return f"{np.mean(diffs):+.3f} (per seed {' / '.join(f'{d:+.3f}' for d in diffs)}; p {ps})"


def render_fair(report: FairReport) -> str:
    """The Markdown tables of a :class:`FairReport`."""
    names = {"fixed": "fixed order", "masc": "MASC", "finetune": "A: served masks", "finetune_joint": "B: pre-action"}
    spread = "mean ± sd over seeds" if len(report.seeds) > 1 else "one seed, no spread"
    lines = [f"Seeds {', '.join(map(str, report.seeds))}; {spread}. Default (best mean validation SSIM): "
             f"**{names[report.default.split('/')[0]]}, recipe {names[report.default.split('/')[1]]}**.", "",
             "| policy | recipe | val SSIM | test SSIM | test PSNR (dB) | against the default (test SSIM, p over subjects) "
             "| line sets on test |", "| --- | --- | ---: | ---: | ---: | --- | --- |"]
    for key, cell in report.cells.items():
        gap = "default" if key == report.default else _effect(report.gaps[key])
        lines.append(f"| {names[cell.policy]} | {names[cell.recipe]} | {_spread(cell.val_ssim, 4)} | "
                     f"{_spread(cell.test_ssim)} | {_spread(cell.test_psnr, 2)} | {gap} | "
                     f"{' / '.join(map(str, cell.line_sets))} |")
    lines += ["", "| effect | within | test SSIM difference |", "| --- | --- | --- |"]
    for recipe, tests in report.policy_effect.items():
        lines.append(f"| policy: MASC - fixed order | recipe {names[recipe]} | {_effect(tests)} |")
    for policy, tests in report.recipe_effect.items():
        lines.append(f"| recipe: A - B | {names[policy]} | {_effect(tests)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m training.evaluation.fair RUNS --seeds 0 1 2 --out DIR``: fair.json and fair.md."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m training.evaluation.fair", description=__doc__.split("\n")[0])
    parser.add_argument("runs", help="the folder of the cells' checkpoints and evaluations")
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--out", required=True, help="where fair.json and fair.md go")
    args = parser.parse_args(argv)
    report = fair_report(args.runs, args.seeds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fair.json").write_text(report.to_json() + "\n")
    text = render_fair(report)
    (out / "fair.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
