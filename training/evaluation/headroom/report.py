"""A headroom report as Markdown and JSON, and the candidates table over several reports."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from training.evaluation.headroom.config import corruption_of
from training.evaluation.headroom.summary import summarise
from training.evaluation.headroom.types import HeadroomReport


def _fmt(value: float, digits: int = 4) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def render_headroom(report: HeadroomReport) -> str:
    """The report as Markdown (its summary recomputed from the runs: a report written by an
    older version reads as the rules stand)."""
    s, acq, key = summarise(report), report.acquisition, report.metric
    h = report.settings
    region = "whole image" if h["region"] == "image" else f"periprosthetic region (implant + {h['margin']} px)"
    oracle = "greedy oracle" if h["beam"] == 1 else f"beam-{h['beam']} oracle"
    corruption = corruption_of(h)
    if corruption.enabled:
        oracle = (f"{corruption.probability:.0%} of acquisitions corrupted ({corruption.kind}); greedy oracle that "
                  f"may acquire a line again (up to {corruption.attempts} times)")
    if h.get("recon") == "sense":
        oracle += f"; {h['coils']}-coil CG-SENSE ({h['sense_iterations']} iterations), no MAR network"
    lines = [
        f"# Headroom of adaptive line choice: {report.data} / {report.split}",
        "",
        f"{report.n_slices} slices of {report.n_subjects} subjects, {acq['initial']} + {acq['budget']} of "
        f"{acq['n_pe']} lines, scored in the {region} ({key}); {_fitted(h)}; {oracle}"
        + ("." if h.get("recon") == "sense" else f"; {len(report.runs)} MAR network(s)."),
        "",
        f"| MAR | oracle | fixed ({_fitted(h, short=True)}) | centre-out | lead (oracle - fixed) | subject p "
        "| lead, dB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report.runs:
        m = r.means
        lines.append(f"| {Path(r.mar).name} | {_fmt(m['oracle'][key])} | {_fmt(m['fixed'][key])} | "
                     f"{_fmt(m['center-out'][key])} | {r.lead['diff']:+.4f} | {r.lead['p_ttest']:.2g} | "
                     f"{r.lead_psnr['diff']:+.2f} |")
    lead = s["lead"]
    lines += [
        "",
        f"Lead over the MAR networks: **{lead['mean']:+.4f} +- {lead['std']:.4f} {key}** "
        f"({s['lead_psnr']['mean']:+.2f} dB); the oracle is ahead for {s['subjects_oracle_ahead']} of "
        f"{s['n_subjects']} subjects (paired t-test over subjects p {s['p_subjects']:.2g}).",
    ]
    if any(b != "fixed" for b in s["best_fixed"]):
        lines += ["", f"Centre-out, a fixed order too, beats the fitted order under "
                  f"{sum(b != 'fixed' for b in s['best_fixed'])} of {len(s['best_fixed'])} network(s): the lead over "
                  f"the better fixed order is **{s['lead_best']['mean']:+.4f} +- {s['lead_best']['std']:.4f} {key}** "
                  f"(ahead for {s['subjects_oracle_ahead_best']} of {s['n_subjects']} subjects, p "
                  f"{s['p_subjects_best']:.2g}), and the gate reads that."]
    lines += [
        "",
        f"Gate ({s['gate']:.2f} {key}): **{s['verdict']}**.",
    ]
    if "gated" in s:
        g = s["gated"]
        lines += ["", f"The fitted order with navigator gating (each flagged line acquired again before the next line, "
                  f"the scanner flagging {h.get('detection', 0.9):.0%} of corrupted and {h.get('false_alarm', 0.02):.0%} "
                  f"of clean acquisitions) serves **{g['means']['mean']:.4f} +- {g['means']['std']:.4f} {key}**, "
                  f"{g['gain']['mean']:+.4f} over the better fixed order ({_percent(g['captured']['mean'])} of the "
                  "oracle's lead): a rule, not a learned policy, and the bar a learned one has to clear here."]
    if "policy" in s:
        p = s["policy"]
        lines += ["", "| MAR | learned policy | policy - fitted order | policy - better fixed order | subject p "
                  "| share of the oracle's lead |", "| --- | --- | --- | --- | --- | --- |"]
        for r in report.runs:
            lines.append(f"| {Path(r.mar).name} | {_fmt(r.means['policy'][key])} | "
                         f"{r.policy_vs_fixed['diff']:+.4f} | {r.policy_vs_best['diff']:+.4f} "
                         f"({r.best_fixed}) | {r.policy_vs_best['p_ttest']:.2g} | {_percent(r.captured)} |")
        lines += ["", f"The learned policies ({', '.join(Path(r.policy).name for r in report.runs)}) gain "
                  f"**{p['gain']['mean']:+.4f} +- {p['gain']['std']:.4f} {key}** over the better fixed order, "
                  f"{_percent(p['captured']['mean'])} of the oracle's lead; ahead for {p['subjects_ahead']} of "
                  f"{s['n_subjects']} subjects (paired t-test over subjects p {p['p_subjects']:.2g})."]
        if "vs_gated" in p:
            v = p["vs_gated"]
            lines += ["", f"Against the gated order: **{v['diff']['mean']:+.4f} +- {v['diff']['std']:.4f} {key}**, "
                      f"ahead for {v['subjects_ahead']} of {s['n_subjects']} subjects (p {v['p_subjects']:.2g})."]
    return "\n".join(lines) + "\n"


def _percent(share: float) -> str:
    return "-" if share is None or not math.isfinite(share) else f"{100 * share:.0f} %"


def _fitted(h: dict[str, Any], short: bool = False) -> str:
    """How the report's fixed order was fitted, in words."""
    if h.get("fit_split"):
        return f"fitted on {h['fit_split']}" if short else f"fixed order fitted on the {h['fit_split']} split"
    return "cross-fitted" if short else f"fixed order cross-fitted over {h['folds']} subject folds"


def write_headroom(report: HeadroomReport, out_dir: str | Path) -> dict[str, Path]:
    """``headroom.json`` and ``headroom.md`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "headroom.json", "md": out / "headroom.md"}
    paths["json"].write_text(json.dumps(report.to_json(), indent=1))
    paths["md"].write_text(render_headroom(report))
    return paths


def read_headroom(folder: str | Path) -> HeadroomReport:
    """``FOLDER/headroom.json`` (:func:`write_headroom`); FileNotFoundError naming the command
    that writes it, ValueError when it is not a headroom report."""
    path = Path(folder) / "headroom.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no headroom.json (run masc check headroom --out {folder} first)")
    try:
        return HeadroomReport.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a headroom report ({err})") from None


def describe(report: HeadroomReport) -> str:
    """What a headroom report measured, in a few words (its row of :func:`render_candidates`)."""
    h, acq = report.settings, report.acquisition
    parts = [f"{acq['initial']} + {acq['budget']} lines"]
    parts.append("whole image" if h["region"] == "image" else f"implant + {h['margin']} px")
    if h.get("recon") == "sense":
        parts.append(f"{h['coils']}-coil SENSE, no MAR")
    corruption = corruption_of(h)
    if corruption.enabled:
        parts.append(f"{corruption.probability:.0%} {corruption.kind}, repeats allowed")
    if h["beam"] > 1:
        parts.append(f"beam {h['beam']}")
    if h.get("fit_split"):
        parts.append(f"fixed order fitted on {h['fit_split']}")
    return ", ".join(parts)


def render_candidates(reports: dict[str, HeadroomReport]) -> str:
    """One Markdown table over several headroom reports (name -> report): per candidate, the
    oracle, the fixed order (cross-fitted, or fitted on another split) and centre-out (mean over
    the MAR networks), the lead over the fitted order and over the better fixed order (the gate's),
    the subjects where the oracle leads that one and its test over subjects, and the gate. Each
    summary is recomputed from the report's per-slice scores."""
    lines = ["| candidate | what differs | oracle | fixed | centre-out | lead over the fitted order | "
             "lead over the better fixed order | subjects ahead | subject p | gate |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, report in reports.items():
        s = summarise(report)
        m = s["means"]
        lines.append(f"| {name} | {describe(report)} | {m['oracle']['mean']:.4f} | {m['fixed']['mean']:.4f} | "
                     f"{m['center-out']['mean']:.4f} | {s['lead']['mean']:+.4f} ± {s['lead']['std']:.4f} | "
                     f"{s['lead_best']['mean']:+.4f} ± {s['lead_best']['std']:.4f} {s['metric']} | "
                     f"{s['subjects_oracle_ahead_best']} / {s['n_subjects']} | {s['p_subjects_best']:.2g} | "
                     f"{'passes' if s['passes'] else 'below'} ({s['gate']:.2f}) |")
    return "\n".join(lines) + "\n"
