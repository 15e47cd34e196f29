"""The evaluation's tables: paired tests of every row against the reference row
(:func:`add_tests`) and the paper's Table 1 layout in Markdown (:func:`render_table`), both
from the results dict of :func:`training.evaluation.evaluate.evaluate` only."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from masc_gadget.core.metrics import HIGHER_IS_BETTER, METRICS
from training.evaluation.stats import subject_of, subject_tests

DISPLAY_NAMES = {
    "center-out": "Center-out",
    "random": "Random",
    "random-lowbias": "Random-LowBias",
    "equispaced": "Equispaced",
    "masc": "MASC",
    "oracle": "Oracle (greedy, uses the ground truth)",
    "population": "Population order (fixed, learned on train)",
    "dqn": "DQN",
    "ss-ddqn": "SS-DDQN",
    "loupe": "Learned mask (LOUPE-style, fixed)",
    "fixed-order": "Fixed order (population, MAR co-adapted)",
}

BASELINES = ("random", "random-lowbias", "center-out", "equispaced", "population")
"""The non-adaptive baselines: "the best baseline" of a table is the best of these present."""

TABLE_METRICS = ("ssim", "psnr", "nmse")
"""The metrics the Markdown table shows (results.json holds every one of :data:`METRICS`)."""

MIN_ORACLE_GAIN = 0.005
"""The oracle's SSIM gain over the base row below which the share of it a row captures is not
shown: divided by a gain near zero, it means nothing (it read -1158 % once)."""

ALPHA = 0.05
"""The level of the closing summary's statements (a difference at p >= ALPHA is a tie)."""


def oracle_gain(block: dict[str, Any], over: str = "random") -> dict[str, float | None]:
    """Per row key: the fraction of the oracle's SSIM gain over a base row that the row
    captures, ``(SSIM_row - SSIM_base) / (SSIM_oracle - SSIM_base)``, in the MAR setting the
    oracle chose its lines in (under the MAR network when the block has one: its lines are then
    no bound without MAR); None elsewhere, when the block lacks the oracle or the base row, or
    when the oracle gains less than :data:`MIN_ORACLE_GAIN` over it.

    ``over``: "random" (the Random row) or "best" (the best of the :data:`BASELINES` rows in
    that setting, by mean SSIM)."""
    by_key = {row["key"]: row for row in block["rows"]}
    chose_under_mar = "oracle" in by_key
    suffix = "" if chose_under_mar else "+nomar"
    ssim = {key: row["summary"]["ssim"]["mean"] for key, row in by_key.items()}
    names = ("random",) if over == "random" else BASELINES
    bases = [ssim[n + suffix] for n in names if n + suffix in ssim]
    out: dict[str, float | None] = {key: None for key in by_key}
    if "oracle" + suffix not in ssim or not bases:
        return out
    base = max(bases)
    gain = ssim["oracle" + suffix] - base
    for key, row in by_key.items():
        if row["mar"] == chose_under_mar and gain >= MIN_ORACLE_GAIN:
            out[key] = (ssim[key] - base) / gain
    return out


def result_subjects(results: dict[str, Any]) -> list[str]:
    """The subject of each evaluated slice of a results dict (from its slice labels)."""
    return [subject_of(label) for label in results["slices"]]


def add_tests(results: dict[str, Any]) -> None:
    """Paired tests of every row against the reference row, per metric, over the subjects'
    mean metrics (:func:`~training.evaluation.stats.subject_tests`; the tests over slices are
    kept beside them). Replaces any tests the rows had, so a results dict of an older version
    is brought up to date by calling it again."""
    subjects = result_subjects(results)
    for block in results["accelerations"].values():
        by_key = {row["key"]: row for row in block["rows"]}
        ref = by_key.get(results["reference"])
        for row in block["rows"]:
            if ref is None or row is ref:
                row["tests"] = None
                continue
            row["tests"] = {k: subject_tests(np.asarray(row["per_slice"][k]), np.asarray(ref["per_slice"][k]),
                                             subjects)
                            for k in METRICS}


def _fmt(metric: str, stats: dict[str, float]) -> str:
    digits = 2 if metric == "psnr" else 4
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def _fmt_p(p: float) -> str:
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return "–"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def line_sets(row: dict[str, Any]) -> int:
    """How many distinct sets of lines a results row plays over its slices."""
    return len({tuple(sorted(lines)) for lines in row["lines"]})


def render_table(results: dict[str, Any]) -> str:
    """The paper's Table 1 layout in Markdown, computed from the results dict only."""
    out = [f"# Evaluation on split `{results['split']}` ({results['n_slices']} slices)", ""]
    for warning in results.get("warnings", []):  # what the provenance says touched these slices
        out += [f"> **Warning**: {warning}", ""]
    ref = results["reference"]
    for acc, block in results["accelerations"].items():
        out.append(f"## {acc}: {block['initial']} initial + {block['budget']} chosen of "
                   f"{block['n_pe']} lines ({block['factor']:.1f}x)")
        out.append("")
        header = ["Method", "MAR"] + [f"{m.upper()} {'↑' if HIGHER_IS_BETTER[m] else '↓'}" for m in TABLE_METRICS]
        header += ["p subjects (t / Wilcoxon, SSIM)", "p slices (t-test, SSIM)"]
        captured = {over: oracle_gain(block, over) for over in ("random", "best")}
        shown = [over for over, v in captured.items() if any(x is not None for x in v.values())]
        header += [f"oracle gain captured over {'Random' if over == 'random' else 'the best baseline'} (SSIM)"
                   for over in shown]
        header += ["line sets", "fallback"]
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|")
        best = {}
        for m in TABLE_METRICS:
            means = [row["summary"][m]["mean"] for row in block["rows"]]
            finite = [v for v in means if not math.isnan(v)]
            if finite:
                best[m] = max(finite) if HIGHER_IS_BETTER[m] else min(finite)
        for row in block["rows"]:
            cells = [DISPLAY_NAMES.get(row["method"], row["method"]), "✓" if row["mar"] else "✗"]
            for m in TABLE_METRICS:
                text = _fmt(m, row["summary"][m])
                cells.append(f"**{text}**" if row["summary"][m]["mean"] == best.get(m) else text)
            tests = row.get("tests")
            if tests is None:
                cells += ["reference", "reference"] if row["key"] == ref else ["–", "–"]
            else:
                cells += [f"{_fmt_p(tests['ssim']['p_ttest'])} / {_fmt_p(tests['ssim']['p_wilcoxon'])}",
                          _fmt_p(tests["ssim"].get("p_ttest_slices"))]
            for over in shown:
                share = captured[over].get(row["key"])
                cells.append("–" if share is None else f"{100 * share:.0f} %")
            cells.append(str(line_sets(row)) if "lines" in row else "–")
            cells.append(f"{row['fallback']} / {len(row['per_slice']['ssim'])}" if "fallback" in row else "–")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    n_subjects = len(set(result_subjects(results)))
    note = (f"Line sets: how many distinct sets of lines the method plays over the {results['n_slices']} "
            f"slices (1: one line set for every slice, however it was chosen). Fallback: slices whose MAR "
            f"image the OOD rule replaced by the zero-filled one (docs/mar-safety.md). Mean ± std over slices; metrics per slice against the clean fully sampled image, both "
            f"scaled by its maximum, on the image the gadget serves. Best in bold. p-values: paired "
            f"two-sided tests of SSIM against the reference row `{ref}`, over the subjects' mean SSIM "
            f"({n_subjects} {'subject: no test' if n_subjects == 1 else 'subjects'}; these decide: slices of "
            f"one subject are not independent); over the slices as a secondary figure.")
    if any(row["method"] == "oracle" for block in results["accelerations"].values() for row in block["rows"]):
        note += (f" Oracle gain captured: the share of the greedy oracle's mean-SSIM gain over Random (or over "
                 f"the best non-adaptive baseline of the table: {', '.join(BASELINES)}) that a row reaches, in "
                 f"the setting the oracle chose its lines in (with MAR when evaluated with a MAR network).")
    out.append(note)
    out += ["", "## Summary", ""] + closing_summary(results)
    out += render_closed_loop(results.get("closed_loop", []))
    return "\n".join(out) + "\n"


def closing_summary(results: dict[str, Any]) -> list[str]:
    """What the numbers say, per acceleration: the ranking of the served images (with MAR where
    the evaluation had a MAR network) by mean SSIM, each other method against the best
    non-adaptive baseline (:data:`BASELINES`) with a paired t-test over subjects, and one
    sentence on the method evaluated (the first learned one, else the best row)."""
    subjects = result_subjects(results)
    n_subjects = len(set(subjects))
    lines: list[str] = []
    for acc, block in results["accelerations"].items():
        with_mar = any(row["mar"] for row in block["rows"])
        rows = [row for row in block["rows"] if row["mar"] == with_mar]
        rows.sort(key=lambda r: -r["summary"]["ssim"]["mean"])
        name = {r["key"]: DISPLAY_NAMES.get(r["method"], r["method"]).split(" (")[0] for r in rows}
        ranking = ", ".join(f"{name[r['key']]} {r['summary']['ssim']['mean']:.4f}" for r in rows)
        lines.append(f"- **{acc}**, SSIM of the served images{' (MAR)' if with_mar else ''}, best first: {ranking}.")
        lines += harm_lines(block, subjects, name) + same_lines(block, name)
        baselines = [r for r in rows if r["method"] in BASELINES]
        if not baselines:
            continue
        base = baselines[0]
        others = [r for r in rows if r["method"] not in BASELINES]
        verdicts = []
        for r in others:
            test = subject_tests(np.asarray(r["per_slice"]["ssim"]), np.asarray(base["per_slice"]["ssim"]), subjects)
            p, diff = test["p_ttest"], test["diff"]
            word = _verdict(diff, p, n_subjects)
            verdicts.append((r, diff, p, word))
            lines.append(f"  - {name[r['key']]} against the best baseline, {name[base['key']]}: {diff:+.4f} SSIM "
                         f"(paired t-test over {n_subjects} subjects, p {_fmt_p(p)}): {word}.")
        by_method = {v[0]["method"]: v for v in verdicts}
        learned = [v for v in verdicts if v[0]["method"] != "oracle"]
        if not learned:
            continue
        r, diff, p, word = by_method.get("masc", learned[0])
        if r["method"] == "masc" and "fixed-order" in by_method:  # the two learned answers side by side
            fixed = by_method["fixed-order"][0]
            test = subject_tests(np.asarray(r["per_slice"]["ssim"]), np.asarray(fixed["per_slice"]["ssim"]), subjects)
            vs = _verdict(test["diff"], test["p_ttest"], n_subjects)
            lines.append(f"  - MASC against the fixed order: {test['diff']:+.4f} SSIM (p {_fmt_p(test['p_ttest'])}): {vs}.")
            shared = _shared_lines(r, fixed)
            if shared is not None and shared * 2 >= len(r["lines"]):
                lines.append(f"  - In one sentence: MASC plays the fixed order's lines on {shared} of {len(r['lines'])} "
                             f"slices, so the difference ({vs}) is their MAR networks', not a per-slice choice of lines.")
                continue
            if vs == "worse":
                lines.append("  - In one sentence: here the fixed order serves better images than MASC's per-slice "
                             "choice: deploy the fixed order for this protocol.")
                continue
            if vs == "better":
                lines.append("  - In one sentence: here MASC's per-slice choice of lines beats the fixed order.")
                continue
            if vs == "no significant difference":
                lines.append("  - In one sentence: here MASC and the fixed order serve images of the same quality: "
                             "the per-slice choice of lines adds nothing a fixed order does not.")
                continue
        meaning = {"better": f"here {name[r['key']]} beats every fixed schedule evaluated",
                   "worse": f"here {name[r['key']]} loses to {name[base['key']]}, a fixed schedule",
                   "no significant difference": f"here {name[r['key']]} does no better than "
                                                f"{name[base['key']]}, a fixed schedule",
                   "too few subjects to test": "scan more subjects before reading anything into the gap"}[word]
        lines.append(f"  - In one sentence: {meaning}.")
    return lines


def harm_lines(block: dict[str, Any], subjects: list[str], name: dict[str, str]) -> list[str]:
    """One line per MAR row that harms the image, by the one definition of harm (served below
    doing nothing, centre-out's zero-filled image with as many lines: ``block["nothing"]``), and
    one per row whose fallback fired."""
    if "nothing" not in block:
        return []
    nothing = np.asarray(block["nothing"]["ssim"])
    out = []
    for row in block["rows"]:
        if not row["mar"]:
            continue
        served = np.asarray(row["per_slice"]["ssim"])
        harmed = int((served < nothing).sum())
        label = name.get(row["key"], row["method"])
        fell_back = row.get("fallback", 0)
        fallback = f"; its fallback served {fell_back} of {len(served)} slices zero-filled" if fell_back else ""
        if served.mean() < nothing.mean():
            test = subject_tests(served, nothing, subjects)
            out.append(f"  - **{label} harms the image here**: its served image is below doing nothing "
                       f"(centre-out's zero-filled image with as many lines) by {test['diff']:+.4f} SSIM on average "
                       f"(p {_fmt_p(test['p_ttest'])} over subjects), on {harmed} of {len(served)} slices{fallback}; "
                       "check the network on this data with masc check mar.")
        elif harmed or fell_back:
            out.append(f"  - {label}: below doing nothing on {harmed} of {len(served)} slices{fallback}.")
    return out


def _shared_lines(a: dict[str, Any], b: dict[str, Any]) -> int | None:
    """On how many slices two rows play the same set of lines (None without their lines)."""
    if "lines" not in a or "lines" not in b:
        return None
    return sum(sorted(x) == sorted(y) for x, y in zip(a["lines"], b["lines"]))


def same_lines(block: dict[str, Any], name: dict[str, str]) -> list[str]:
    """A line for each pair of methods that play the same lines on most slices: their gap is the
    networks', not the line choice."""
    rows = [r for r in block["rows"] if r["mar"] and "lines" in r] or [r for r in block["rows"] if "lines" in r]
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            same = _shared_lines(a, b)
            if same * 2 >= len(a["lines"]) > 0:
                out.append(f"  - {name.get(a['key'], a['method'])} plays the same lines as {name.get(b['key'], b['method'])} "
                           f"on {same} of {len(a['lines'])} slices: the gap between them is the networks', not the line choice.")
    return out


def _verdict(diff: float, p: float, n_subjects: int) -> str:
    """A paired difference in words, at level :data:`ALPHA` over subjects."""
    if n_subjects < 3 or math.isnan(p):
        return "too few subjects to test"
    if p < ALPHA:
        return "better" if diff > 0 else "worse"
    return "no significant difference"


def render_summary(every: dict[str, dict[str, Any]]) -> str:
    """One table over several evaluations (``masc eval --data A,B``): per data set, acceleration
    and row, the mean SSIM and PSNR and the test against the set's reference row over subjects."""
    out = ["# Evaluation of several data sets", "",
           "| data | acceleration | method | MAR | slices | subjects | SSIM | PSNR | p subjects (t, SSIM) |",
           "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for name, results in every.items():
        n_subjects = len(set(result_subjects(results)))
        for acc, block in results["accelerations"].items():
            for row in block["rows"]:
                tests = row.get("tests")
                p = ("reference" if row["key"] == results["reference"] else
                     "–" if tests is None else _fmt_p(tests["ssim"]["p_ttest"]))
                out.append(f"| {name} | {acc} | {DISPLAY_NAMES.get(row['method'], row['method'])} | "
                           f"{'✓' if row['mar'] else '✗'} | {results['n_slices']} | {n_subjects} | "
                           f"{_fmt('ssim', row['summary']['ssim'])} | {_fmt('psnr', row['summary']['psnr'])} | {p} |")
    return "\n".join(out) + "\n"


def closed_loop(results: dict[str, Any], scan_dirs: list[str]) -> list[dict[str, Any]]:
    """Closed-loop scans (``masc scan`` output folders) beside the evaluated rows: per scan, the
    policy and network the gadget served (from the returned images), the row of that method with
    MAR at the scan's acceleration, and per slice the scan's SSIM against the row's on the same
    slice: the gadget serves what ``masc eval`` scores when the gap is 0."""
    import json
    from collections import Counter
    from pathlib import Path

    out = []
    for folder in scan_dirs:
        report = json.loads((Path(folder) / "report.json").read_text())
        slices = [(f"{sub['subject']}/{sl['slice']}", sl) for sub in report["subjects"] for sl in sub["slices"]]
        policy = Counter(sl.get("policy", "") for _, sl in slices).most_common(1)[0][0]
        served = Counter(sl.get("served", "") for _, sl in slices).most_common(1)[0][0]
        acq = report.get("acquisition", {})
        entry: dict[str, Any] = {"scan": str(folder), "policy": policy, "served": served, "n_slices": len(slices),
                                 "scan_ssim": float(np.mean([sl["metrics"]["ssim"] for _, sl in slices])),
                                 "line_sets": len({tuple(sorted(sl["lines"])) for _, sl in slices}),
                                 "fallbacks": int(sum(sl.get("fallbacks", 0) for _, sl in slices))}
        for acc, block in results["accelerations"].items():
            if (block["initial"], block["budget"]) != (acq.get("initial"), acq.get("budget")):
                continue
            row = next((r for r in block["rows"] if r["method"] == policy and r["mar"]), None)
            if row is None:
                continue
            index = {label: i for i, label in enumerate(results["slices"])}
            pairs = [(sl, index[label]) for label, sl in slices if label in index]
            gaps = [sl["metrics"]["ssim"] - row["per_slice"]["ssim"][i] for sl, i in pairs]
            entry.update({"acceleration": acc, "row": row["key"], "matched": len(pairs),
                          "eval_ssim": float(np.mean([row["per_slice"]["ssim"][i] for _, i in pairs])) if pairs else None,
                          "max_abs_gap": float(np.max(np.abs(gaps))) if gaps else None,
                          "same_lines": int(sum(sorted(sl["lines"]) == sorted(row["lines"][i]) for sl, i in pairs))})
            break
        out.append(entry)
    return out


def render_closed_loop(entries: list[dict[str, Any]]) -> list[str]:
    """The closed-loop section of ``table.md``."""
    if not entries:
        return []
    lines = ["", "## Closed loop against masc serve", "",
             "Each scan's policy and network as the gadget served them (its images' meta), beside this evaluation's "
             "row of that method with MAR on the same slices.", "",
             "| scan | policy | served by | slices | scan SSIM | eval SSIM (row) | largest slice gap | same lines | "
             "line sets | fallback lines |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for e in entries:
        if e.get("row") is None:
            lines.append(f"| {e['scan']} | {e['policy']} | {e['served']} | {e['n_slices']} | {e['scan_ssim']:.4f} | "
                         f"no evaluated row of {e['policy']} at the scan's acceleration | – | – | {e['line_sets']} | "
                         f"{e['fallbacks']} |")
            continue
        gap = "–" if e["max_abs_gap"] is None else f"{e['max_abs_gap']:.1e}"
        lines.append(f"| {e['scan']} | {e['policy']} | {e['served']} | {e['matched']} of {e['n_slices']} | "
                     f"{e['scan_ssim']:.4f} | {e['eval_ssim']:.4f} (`{e['row']}`) | {gap} | {e['same_lines']} | "
                     f"{e['line_sets']} | {e['fallbacks']} |")
    return lines
