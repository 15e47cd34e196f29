"""The paper's experiments in one command: ``masc eval suite``.

It reads the trained models of each seed ``S`` from one runs folder, by name:

==========================  ==============================================================
``mar_sS.pt``               the pre-trained MAR network (``masc train mar``); required
``masc_sS.pt``              MASC (``masc train masc``); required
``dqn_sS.pt``               DQN (``masc train dqn``); optional
``ss-ddqn_sS.pt``           SS-DDQN (``masc train ss-ddqn``); optional
``loupe_sS.pt``             the learned fixed mask (``masc train loupe``); optional
``ablation-clean_sS.pt``    clean-trained PPO without MAR (Table 2); optional
``ablation-metal_sS.pt``    metal-trained PPO without MAR; optional
``ablation-frozen_sS.pt``   PPO observing the frozen pre-trained MAR; optional
==========================  ==============================================================

and writes, under ``--out``:

* ``table1_sS/``: every method with and without the pre-trained MAR network (MASC and the
  learned mask with their own), the value-based baselines, the population order and, with
  ``--oracle``, the greedy oracle, at every acceleration of ``eval.accelerations`` (the 10x
  table and the 5x appendix table); ``results.json``, ``table.md``, ``curves.png`` (metric vs
  acquired lines with std bands) and ``examples.png`` (reconstructions, masks and error maps:
  Figure 3);
* ``table2_<ablation>_sS/``: each ablation with and without the pre-trained MAR network;
* ``table3_sS/``: with ``--external DIR`` (``masc simulate external``), every method trained on
  the hip simulation, evaluated on the held-out real-image set with the same MAR networks
  (the population order learned on the hip training split);
* ``table1_seeds/``, ``table3_seeds/``: mean and spread over seeds with paired tests within
  each seed (``masc eval --combine``), with two or more seeds;
* ``suite.json`` and ``suite.md``: Table 2 over seeds, each method's training time (from its
  log), and where every table is.

Each table folder also gets ``inputs.json``: the data, split, methods, configuration and the
SHA-256 of the dataset manifest and of every checkpoint it was evaluated with. With
``resume=True`` (``masc eval suite --resume``) a table whose ``inputs.json`` matches the
current inputs is read back instead of evaluated again, so an interrupted suite, or seeds
evaluated one at a time in parallel processes, finish without repeating work; a table whose
inputs changed (a retrained model, another config) is evaluated again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from masc_gadget.config import Config
from training.csvlog import read_rows
from training.evaluation.evaluate import evaluate, write_outputs, write_results
from training.evaluation.seeds import combine_seeds, load_results, write_combined
from training.evaluation.stats import mean_std, subject_tests
from training.evaluation.tables import add_tests, result_subjects

log = logging.getLogger(__name__)

__all__ = ["ABLATIONS", "LEARNED", "render_suite", "run_suite", "training_seconds"]

LEARNED = ("masc", "dqn", "ss-ddqn", "loupe")
"""Learned methods, each read from ``<name>_sS.pt``."""
ABLATIONS = {"clean": "clean-trained PPO, no MAR", "metal": "metal-trained PPO, no MAR",
             "frozen": "PPO observing the frozen MAR"}
"""Table 2's ablations: ``ablation-<key>_sS.pt`` -> label (MASC, joint, is the last row)."""
BASELINE_METHODS = ("random", "random-lowbias", "center-out", "equispaced", "population")


def training_seconds(checkpoint: Path) -> float | None:
    """Training time of a checkpoint from its ``.csv`` log: the sum of the per-epoch ``seconds``
    of an epoch log (MAR, learned mask), the last ``seconds`` of a rollout / transition log
    (MASC, DQN); None without a log. A resumed run counts from its last resume."""
    log_path = checkpoint.with_suffix(".csv")
    if not log_path.is_file():
        return None
    rows = read_rows(log_path)
    if not rows or "seconds" not in rows[0]:
        return None
    if "epoch" in rows[0]:
        return float(sum(r["seconds"] for r in rows if math.isfinite(r["seconds"])))
    finite = [r["seconds"] for r in rows if math.isfinite(r["seconds"])]
    return float(finite[-1]) if finite else None


def _row(results: dict[str, Any], key: str, acc: str | None = None) -> dict[str, Any] | None:
    block = results["accelerations"][acc or next(iter(results["accelerations"]))]
    return next((r for r in block["rows"] if r["key"] == key), None)


def _sha256(path: str | Path) -> str | None:
    path = Path(path)
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _table_inputs(config: Config, data_dir: str | Path, methods: list[str], mar: str | Path,
                 checkpoints: list[str]) -> dict[str, Any]:
    """What a table's numbers depend on: recorded in its ``inputs.json``, compared on resume."""
    return {"data": str(data_dir), "manifest_sha256": _sha256(Path(data_dir) / "manifest.json"), "split": "test",
            "methods": list(methods), "config": config.to_dict(),
            "mar": {"path": str(mar), "sha256": _sha256(mar)},
            "checkpoints": [{"path": str(c), "sha256": _sha256(c)} for c in checkpoints]}


def _evaluate_table(config: Config, data_dir: str | Path, methods: list[str], mar: str | Path,
                    checkpoint: str | list[str], folder: Path, resume: bool, progress: bool) -> dict[str, Any]:
    """One table: read back from ``folder`` when resuming and its inputs match, else evaluated."""
    inputs = _table_inputs(config, data_dir, methods, mar, [checkpoint] if isinstance(checkpoint, str) else checkpoint)
    stamp = folder / "inputs.json"
    if resume and stamp.is_file() and (folder / "results.json").is_file():
        if json.loads(stamp.read_text()) == json.loads(json.dumps(inputs)):
            log.info("resume: %s already evaluated with these inputs, read back", folder)
            return load_results(folder)
        log.info("resume: %s was evaluated with other inputs (a model or the config changed): evaluating again", folder)
    results, figures = evaluate(config, data_dir, "test", methods, mar, progress=progress, checkpoint=checkpoint)
    write_outputs(results, figures, folder)
    stamp.write_text(json.dumps(inputs, indent=1) + "\n")
    return results


def run_suite(config: Config, data_dir: str | Path, runs: str | Path, out: str | Path, seeds: list[int],
              external: str | Path | None = None, oracle: bool = False, progress: bool = True,
              resume: bool = False) -> dict[str, Any]:
    """Evaluate every table of the module docstring; returns the suite report (also written).
    ``resume``: read back tables already evaluated with the same inputs (module docstring)."""
    runs, out = Path(runs), Path(out)
    if not seeds:
        raise ValueError("name at least one seed")
    report: dict[str, Any] = {"data": str(data_dir), "runs": str(runs), "external": str(external) if external else None,
                              "seeds": seeds, "oracle": oracle, "tables": {}, "table2": {}, "training_seconds": {}}
    table1, table3 = [], []
    for seed in seeds:
        mar = runs / f"mar_s{seed}.pt"
        files = {name: runs / f"{name}_s{seed}.pt" for name in LEARNED}
        for required in (mar, files["masc"]):
            if not required.is_file():
                raise FileNotFoundError(f"{required} is missing: the suite needs the pre-trained MAR network and MASC "
                                        f"of every seed (see masc eval --suite's naming in docs/evaluation.md)")
        learned = [name for name in LEARNED if files[name].is_file()]
        missing = [name for name in LEARNED if name not in learned]
        if missing:
            log.warning("seed %d: no %s checkpoint in %s: left out of the tables", seed, ", ".join(missing), runs)
        methods = [*BASELINE_METHODS, *(["oracle"] if oracle else []), *learned]
        checkpoints = [str(files[name]) for name in learned]
        for name, path in [("mar", mar), *((n, files[n]) for n in learned)]:
            report["training_seconds"].setdefault(name, []).append(training_seconds(path))
        log.info("suite, seed %d: Table 1 (%s)", seed, ", ".join(methods))
        results = _evaluate_table(config, data_dir, methods, mar, checkpoints, out / f"table1_s{seed}", resume, progress)
        table1.append((f"seed {seed}", results))
        ablation_rows: dict[str, dict[str, Any] | None] = {}
        for key, label in {**ABLATIONS, "joint": "MASC (joint)"}.items():
            path = files["masc"] if key == "joint" else runs / f"ablation-{key}_s{seed}.pt"
            if not path.is_file():
                continue
            if key == "joint":
                res = results
            else:
                res = _evaluate_table(config, data_dir, ["masc"], mar, str(path), out / f"table2_{key}_s{seed}",
                                      resume, progress)
                report["training_seconds"].setdefault(f"ablation-{key}", []).append(training_seconds(path))
            entry = report["table2"].setdefault(key, {"label": label, "nomar": [], "mar": [], "joint_minus": []})
            for setting, row_key in (("nomar", "masc+nomar"), ("mar", "masc")):
                row = _row(res, row_key)
                entry[setting].append(row["summary"]["ssim"]["mean"] if row else math.nan)
            ablation_rows[key] = _row(res, "masc")
        joint = ablation_rows.get("joint")
        for key, row in ablation_rows.items():
            if key != "joint":
                report["table2"][key]["joint_minus"].append(
                    {"seed": seed, **_joint_minus(joint, row, result_subjects(results))})
        if external:
            ext_config = _with_population_data(config, data_dir)
            log.info("suite, seed %d: Table 3 on %s", seed, external)
            res = _evaluate_table(ext_config, external, [m for m in methods if m != "oracle"], mar, checkpoints,
                                  out / f"table3_s{seed}", resume, progress)
            table3.append((f"seed {seed}", res))
    for name, runs_of in (("table1", table1), ("table3", table3)):
        if not runs_of:
            continue
        report["tables"][name] = [str(out / f"{name}_s{s}") for s in seeds]
        if len(runs_of) >= 2:
            combined = combine_seeds([r for _, r in runs_of], [label for label, _ in runs_of])
            write_combined(combined, out / f"{name}_seeds")
            report["tables"][f"{name}_seeds"] = str(out / f"{name}_seeds")
    out.mkdir(parents=True, exist_ok=True)
    (out / "suite.json").write_text(json.dumps(report, indent=1, allow_nan=True) + "\n")
    (out / "suite.md").write_text(render_suite(report))
    return report


def retest_suite(out: str | Path) -> dict[str, Any]:
    """Recompute the paired tests of a finished suite folder over subjects, from its tables'
    results.json alone (no model is needed): each table (:func:`~training.evaluation.tables.add_tests`),
    Table 2's MASC - ablation tests, the combined reports over seeds; rewrites them and
    suite.json / suite.md in place, scores untouched. Returns the suite report."""
    out = Path(out)
    path = out / "suite.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --retest of a suite needs the folder masc eval --suite wrote")
    report = json.loads(path.read_text())
    seeds = report["seeds"]
    tables: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for name in ("table1", "table3"):
        for seed in seeds:
            folder = out / f"{name}_s{seed}"
            if (folder / "results.json").is_file():
                results = load_results(folder)
                add_tests(results)
                write_results(results, folder)
                tables.setdefault(name, []).append((seed, results))
    table1 = dict(tables.get("table1", []))
    for key, entry in report["table2"].items():
        if key == "joint":
            continue
        entry["joint_minus"] = []
        for seed in seeds:
            folder = out / f"table2_{key}_s{seed}"
            if seed not in table1 or not (folder / "results.json").is_file():
                continue
            results = load_results(folder)
            add_tests(results)
            write_results(results, folder)
            entry["joint_minus"].append({"seed": seed, **_joint_minus(
                _row(table1[seed], "masc"), _row(results, "masc"), result_subjects(table1[seed]))})
    for name, runs_of in tables.items():
        if len(runs_of) >= 2:
            combined = combine_seeds([r for _, r in runs_of], [f"seed {seed}" for seed, _ in runs_of])
            write_combined(combined, out / f"{name}_seeds")
    path.write_text(json.dumps(report, indent=1, allow_nan=True) + "\n")
    (out / "suite.md").write_text(render_suite(report))
    return report


def _joint_minus(joint: dict[str, Any] | None, row: dict[str, Any] | None,
                 subjects: list[str]) -> dict[str, float]:
    """MASC (joint) minus an ablation, both with the pre-trained MAR: mean SSIM difference over the
    slices and the paired tests over the subjects' means, the t-test over slices beside them
    (Table 2's "MASC outperforms all ablation variants")."""
    if joint is None or row is None:
        return {"diff": math.nan, "p_ttest": math.nan, "p_wilcoxon": math.nan, "p_ttest_slices": math.nan}
    a, b = np.asarray(joint["per_slice"]["ssim"]), np.asarray(row["per_slice"]["ssim"])
    tests = subject_tests(a, b, subjects)
    return {k: tests[k] for k in ("diff", "p_ttest", "p_wilcoxon", "p_ttest_slices", "n_subjects")}


def _with_population_data(config: Config, data_dir: str | Path) -> Config:
    """``config`` with ``eval.population_data`` set to the training dataset."""
    sections = dict(config.sections)
    sections["eval"] = dataclasses.replace(config["eval"], population_data=str(data_dir))
    return dataclasses.replace(config, sections=sections)


def _ms(values: list[float]) -> str:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return "–"
    stats = mean_std(np.asarray(finite))
    return f"{stats['mean']:.4f}" + (f" ± {stats['std']:.4f}" if len(finite) > 1 else "")


def _p(p: float) -> str:
    if p is None or not math.isfinite(p):
        return "–"
    return f"{p:.3f}" if p >= 1e-3 else f"{p:.0e}"


def render_suite(report: dict[str, Any]) -> str:
    """suite.md: Table 2 over seeds, training times and the tables' folders (from the report only)."""
    seeds = report["seeds"]
    lines = [f"# The paper's experiments on `{report['data']}` (seeds {', '.join(map(str, seeds))})", ""]
    lines += ["## Tables", ""]
    for name, where in report["tables"].items():
        shown = ", ".join(f"`{w}`" for w in where) if isinstance(where, list) else f"`{where}`"
        lines.append(f"- {name}: {shown}")
    lines += ["", "## Table 2: ablations (test SSIM, mean ± sd over seeds)", "",
              "MASC - ablation: both with the pre-trained MAR network, per seed, paired over the subjects' "
              "mean SSIM (p: t-test / Wilcoxon over subjects; then the t-test over slices).", "",
              "| ablation | without MAR | with MAR | MASC - ablation per seed (p) |", "| --- | --- | --- | --- |"]
    for entry in report["table2"].values():
        versus = " ; ".join(f"s{d['seed']} {d['diff']:+.4f} ({_p(d['p_ttest'])} / {_p(d['p_wilcoxon'])}; "
                            f"slices {_p(d.get('p_ttest_slices', math.nan))})"
                            for d in entry.get("joint_minus", []))
        lines.append(f"| {entry['label']} | {_ms(entry['nomar'])} | {_ms(entry['mar'])} | {versus or '–'} |")
    lines += ["", "## Training time (from each model's log, seconds, mean over seeds)", "",
              "| model | seconds |", "| --- | --- |"]
    for name, values in report["training_seconds"].items():
        finite = [v for v in values if v is not None]
        lines.append(f"| {name} | {np.mean(finite):.0f} |" if finite else f"| {name} | – |")
    return "\n".join(lines) + "\n"
