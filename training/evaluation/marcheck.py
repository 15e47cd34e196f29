"""``masc check mar``: does a MAR network do no harm, and does its OOD score know when it does?

For every slice of a split, per dataset folder and per MAR network:

* **identity**: the network's output for the fully sampled *clean* image (no implant, every
  line), against that image. An image that needs no correction should come back unchanged
  (target SSIM >= 0.98);
* **correction**: the zero-filled image of the lines a fixed policy acquires (``center-out`` by
  default, 2 + 11 of 128 lines on the small config) from the metal k-space, and the network's
  served image of it (:func:`~masc_gadget.core.served.served_images`), both against the clean
  fully sampled image; paired tests over subjects (a real volume is one subject);
* **harm** (:func:`training.scoring.harmed`): a served image harms its slice when it scores
  below doing nothing, the zero-filled image of centre-out's lines with the same line count
  (``nothing_ssim``), whatever lines the policy chose;
* **OOD scores** (:mod:`masc_gadget.core.ood`) of each corrected slice, and how well each
  separates the slices the network harmed from those it helped: the ROC and its area.

``--calibrate`` (on the validation split) picks the score with the largest pooled area and the
threshold that maximises the mean served SSIM when slices scoring above it are served
zero-filled, and writes them to ``OUT/ood.json`` for ``masc models export --ood``. A score depends on
the lines acquired, so a network whose checkpoint carries its own policy (MASC) is calibrated on
the fixed policy's lines *and* on the lines its policy plays on each slice, the ones the gadget
will serve it with.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from masc_gadget.acquisition.policies import center_out_rank, make_policy, run_episode
from masc_gadget.core.metrics import slice_metrics
from masc_gadget.core.ood import EARLY_SCORES, SCORES, ood_score
from training.data import SliceSet, data_dirs, load_split
from training.evaluation.calibration import auc_interval, calibrate, cross_validated, fallback_rows, roc, served_under
from training.evaluation.stats import mean_std, subject_tests
from training.scoring import do_nothing, harmed, line_masks, score_masks

log = logging.getLogger(__name__)

__all__ = ["mar_check", "slice_rows"]


def policy_masks(name: str, n: int, n_pe: int, initial: int, budget: int) -> torch.Tensor:
    """(n, n_pe) bool: the lines ``name`` acquires on each of n slices (seeded per slice)."""
    policy = make_policy(name)
    masks = torch.zeros(n, n_pe, dtype=torch.bool)
    for i in range(n):
        masks[i, torch.as_tensor(run_episode(policy, n_pe, initial, budget, np.random.default_rng(i)))] = True
    return masks


@torch.no_grad()
def slice_rows(mar: torch.nn.Module, data: SliceSet, masks: torch.Tensor, nothing: dict[str, np.ndarray],
               batch_size: int = 32) -> dict[str, np.ndarray]:
    """Per-slice metrics of ``mar`` on ``data`` under line ``masks`` (module docstring);
    ``nothing``: the slices' :func:`~training.scoring.do_nothing` metrics, the reference of harm,
    kept as ``nothing_ssim`` and ``nothing_psnr``."""
    out: dict[str, list[np.ndarray]] = {}

    def add(key: str, value: torch.Tensor) -> None:
        out.setdefault(key, []).append(value.detach().cpu().double().numpy())

    for start in range(0, len(data), batch_size):
        index = torch.arange(start, min(start + batch_size, len(data)))
        target = data.target[index]
        identity = mar(target)
        for key, value in slice_metrics(identity, target).items():
            add(f"identity_{key}", value)
        every = torch.ones(len(index), data.n_pe, dtype=torch.bool)
        for kind in SCORES:  # what the fallback rule makes of an image that needs no change
            add(f"identity_score_{kind}", ood_score(kind, target, identity, every, mar))
    scored = score_masks(data, masks, mar, metrics=("ssim", "psnr", "nmse"), kinds=SCORES, batch_size=batch_size,
                         device=torch.device("cpu"))
    return {**{key: np.concatenate(values) for key, values in out.items()},
            **{f"nothing_{key}": value for key, value in nothing.items()},
            **{f"zf_{key}": value for key, value in scored.zero_filled.items()},
            **{f"mar_{key}": value for key, value in scored.image.items()},
            **{f"score_{kind}": value for kind, value in scored.ood.items()}}


PROMISES = {"identity_ssim": 0.98, "noise_share": 0.95, "center_out_margin": 0.005}
"""What every shipped network keeps (docs/mar-safety.md): the mean identity SSIM on fully
sampled, metal-free, noiseless input; the share of slices whose output, for that input with
acquisition noise across the config's SNR range, is no further from the noiseless image (NMSE)
than the noisy input; how far below the pre-trained network (``--reference``) its mean SSIM on
centre-out's lines (the deadline fallback's) may fall."""


@torch.no_grad()
def noise_rows(mar: torch.nn.Module, data: SliceSet, snr: tuple[float, float], seed: int = 0,
               batch_size: int = 32) -> dict[str, np.ndarray]:
    """Per slice: the fully sampled clean k-space with complex Gaussian noise at an SNR drawn
    uniformly from ``snr`` (the mean tissue signal over the noise std, the simulator's
    definition), and the NMSE of the noisy image and of the network's output for it against
    the noiseless image (``noise_input_nmse``, ``noise_output_nmse``, ``noise_snr``): a network
    may denoise, it must not invent."""
    from masc_gadget.core.kspace import ifft2c
    from masc_gadget.core.metrics import nmse

    from training.mar import acquisition_noise

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[torch.Tensor]] = {"noise_snr": [], "noise_input_nmse": [], "noise_output_nmse": []}
    for start in range(0, len(data), batch_size):
        index = torch.arange(start, min(start + batch_size, len(data)))
        k = data.kspace_clean[index]
        clean = ifft2c(k).abs()
        drawn = snr[0] + (snr[1] - snr[0]) * torch.rand(len(index), generator=gen, dtype=torch.float64)
        noisy = ifft2c(k + acquisition_noise(k, drawn, gen)).abs()
        out["noise_snr"].append(drawn)
        out["noise_input_nmse"].append(nmse(noisy, clean))
        out["noise_output_nmse"].append(nmse(mar(noisy), clean))
    return {k: torch.cat(v).double().numpy() for k, v in out.items()}


def promises(summary: dict[str, Any], rows: dict[str, np.ndarray],
             reference_mar_ssim: float | None) -> dict[str, Any]:
    """Whether a network keeps each of :data:`PROMISES` on these slices (None: not measured)."""
    share = float(np.mean(rows["noise_output_nmse"] <= rows["noise_input_nmse"])) if "noise_output_nmse" in rows \
        else None
    kept = {"identity_ssim": {"value": summary["identity_ssim"]["mean"],
                              "kept": summary["identity_ssim"]["mean"] >= PROMISES["identity_ssim"]},
            "noise_share": {"value": share, "kept": None if share is None else share >= PROMISES["noise_share"]},
            "center_out": {"value": None if reference_mar_ssim is None
                           else summary["mar_ssim"]["mean"] - reference_mar_ssim,
                           "kept": None if reference_mar_ssim is None
                           else summary["mar_ssim"]["mean"] >= reference_mar_ssim - PROMISES["center_out_margin"]}}
    kept["all"] = all(v["kept"] is not False for v in kept.values()) and all(v["kept"] is not None
                                                                            for v in kept.values())
    return kept


def switched_lines(lines: np.ndarray, after: int, n_pe: int) -> np.ndarray:
    """(n, L) each row's first ``after`` lines (acquisition order), then centre-out's lines not
    acquired yet, as many as the row has in all: what a slice switched after ``after`` lines
    acquires."""
    order = np.argsort(center_out_rank(n_pe), kind="stable")
    out = np.empty_like(lines)
    for i, row in enumerate(lines):
        kept = list(row[:after])
        rest = [line for line in order if line not in set(kept)]
        out[i] = kept + rest[:len(row) - after]
    return out


@torch.no_grad()
def early_rows(mar: torch.nn.Module, data: SliceSet, initial: int, batch_size: int = 32,
               lines: np.ndarray | None = None, after: int | None = None) -> dict[str, np.ndarray]:
    """Per slice: every OOD score of the network's output for the image of the initial centre
    lines (``early_score_<kind>``), what the early rule reads at the policy's first decision.
    With the slices' own ``lines`` ((n, initial + budget), acquisition order) and ``after`` >
    ``initial``: the scores (``holdout`` among them) of the image of each slice's first ``after``
    lines instead, and the
    SSIM and PSNR of the image it is served when switched then (``switched_ssim``, ``switched_psnr``,
    :func:`switched_lines`)."""
    if lines is None or after is None or after <= initial:
        masks = line_masks(len(data), data.n_pe, initial, np.zeros(0, dtype=np.int64))
    else:
        masks = line_masks(len(data), data.n_pe, initial, lines[:, :after])
    later = lines is not None and after is not None and after > initial  # lines beyond the initial: holdout
    scored = score_masks(data, masks, mar, metrics=("ssim",), kinds=EARLY_SCORES if later else SCORES,
                         batch_size=batch_size, device=torch.device("cpu"), initial=initial)
    rows = {f"early_score_{kind}": value for kind, value in scored.ood.items()}
    if lines is not None and after is not None and after > initial:
        kept = switched_lines(lines, after, data.n_pe)
        switched = score_masks(data, line_masks(len(data), data.n_pe, initial, kept), None,
                               metrics=("ssim", "psnr"), batch_size=batch_size, device=torch.device("cpu"))
        rows.update({f"switched_{key}": value for key, value in switched.flat().items()})
    return rows


def _summary(rows: dict[str, np.ndarray], subjects: list[str], reference: dict[str, np.ndarray] | None,
             ood: dict[str, Any] | None) -> dict[str, Any]:
    harm = harmed(rows["mar_ssim"], rows["nothing_ssim"])
    summary: dict[str, Any] = {
        "n_slices": int(len(subjects)), "n_subjects": len(set(subjects)),
        **{key: mean_std(rows[key]) for key in ("identity_ssim", "identity_psnr", "zf_ssim", "mar_ssim",
                                                 "zf_psnr", "mar_psnr")},
        "mar_vs_zf_ssim": subject_tests(rows["mar_ssim"], rows["zf_ssim"], subjects),
        "mar_vs_zf_psnr": subject_tests(rows["mar_psnr"], rows["zf_psnr"], subjects),
        "nothing_ssim": mean_std(rows["nothing_ssim"]),
        "mar_vs_nothing_ssim": subject_tests(rows["mar_ssim"], rows["nothing_ssim"], subjects),
        "harmed_fraction": float(harm.mean()),
        "roc": {kind: {**roc(rows[f"score_{kind}"], harm),
                       "auc_interval": auc_interval(rows[f"score_{kind}"], harm, subjects)} for kind in SCORES},
    }
    if ood is not None and "score" in ood:  # the end-of-scan rule
        served = fallback_rows(rows, ood["score"], ood["threshold"])
        kept = rows[f"identity_score_{ood['score']}"] > ood["threshold"]  # served as acquired: SSIM 1
        summary["fallback"] = {"score": ood["score"], "threshold": ood["threshold"],
                               "fraction": float((rows[f"score_{ood['score']}"] > ood["threshold"]).mean()),
                               "identity_ssim": mean_std(np.where(kept, 1.0, rows["identity_ssim"])),
                               "identity_fraction": float(kept.mean()),
                               "ssim": mean_std(served),
                               "vs_zf_ssim": subject_tests(served, rows["zf_ssim"], subjects),
                               "vs_nothing_ssim": subject_tests(served, rows["nothing_ssim"], subjects),
                               "harmed_fraction": float(harmed(served, rows["nothing_ssim"]).mean()),
                               "vs_mar_ssim": subject_tests(served, rows["mar_ssim"], subjects)}
    if reference is not None:
        summary["vs_reference_ssim"] = subject_tests(rows["mar_ssim"], reference["mar_ssim"], subjects)
        summary["vs_reference_psnr"] = subject_tests(rows["mar_psnr"], reference["mar_psnr"], subjects)
    return summary


@torch.no_grad()
def own_lines(policy: Any, mar: torch.nn.Module, data: SliceSet, initial: int, budget: int,
              batch_size: int = 32) -> np.ndarray:
    """(n, initial + budget): the lines a learned ``policy`` plays on each slice of ``data``
    under its ``mar`` network, in acquisition order, as ``masc eval`` and the gadget play them
    (seed 0)."""
    from training.evaluation.evaluate import run_method

    return np.asarray(run_method(policy, data, initial, budget, mar, seed=0, batch_size=batch_size,
                                 device=torch.device("cpu"), score=False).lines)


def mar_check(mars: dict[str, torch.nn.Module], data: str | list[str], split: str, initial: int, budget: int,
              out: str | Path, policy: str = "center-out", reference: str | None = None,
              ood: dict[str, dict[str, Any]] | None = None, do_calibrate: bool = False,
              batch_size: int = 32, policies: dict[str, Any] | None = None, folds: int = 0,
              snr: tuple[float, float] | None = None, early_lines: int | None = None,
              objective: str = "served", calibrate_on: list[str] | None = None,
              early_scores: list[str] | None = None) -> dict[str, Any]:
    """Run the check of every network in ``mars`` (name -> MarNet) on ``split`` of each folder of
    ``data``; ``reference`` names the network the others are compared with; ``ood`` gives each
    network's stored calibration (name -> {score, threshold}); ``policies``: the learned policy
    of a network whose checkpoint carries one (name -> policy), whose own lines join the
    calibration. ``snr``: the acquisition SNR range of the noise promise (:func:`noise_rows`;
    None skips it). ``folds`` > 1: also the served image under a rule calibrated without the
    subject it serves, per folder (:func:`~training.evaluation.calibration.cross_validated`).
    ``early_lines`` > ``initial``: a later switch: the early rule scores the image of each
    slice's first ``early_lines`` own lines and a flagged slice continues with centre-out's
    lines (:func:`early_rows`); its calibration records ``after_lines``, which the gadget and
    ``masc eval`` play (:func:`masc_gadget.core.ood.switch_point`). ``objective``: how the
    threshold is picked (:data:`~training.evaluation.calibration.OBJECTIVES`);
    ``calibrate_on``: the folders (names) whose slices calibrate the rule (None: every one); a
    folder left out is a held-out domain, served under the rule as calibrated; ``early_scores``:
    the scores the early rule may be calibrated with (None: every one, the best ROC area). Writes
    ``OUT/results.json``, ``OUT/report.md``, ``OUT/roc.png`` (and ``OUT/ood.json`` with
    ``do_calibrate``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if early_lines is not None and not initial <= early_lines <= initial + budget:
        raise ValueError(f"early_lines must be in [{initial}, {initial + budget}] (initial, initial + budget), "
                         f"got {early_lines}")
    names = [folder.name for folder in data_dirs(data)]
    unknown = sorted(set(calibrate_on or []) - set(names))
    if unknown:
        raise ValueError(f"calibrate_on names {', '.join(unknown)}, not among the data folders ({', '.join(names)})")
    after = early_lines if early_lines is not None and early_lines > initial else None
    offered = EARLY_SCORES if after else SCORES
    if early_scores is not None and (not early_scores or set(early_scores) - set(offered)):
        raise ValueError(f"early_scores must name scores of this early rule ({', '.join(offered)}; holdout and "
                         f"halves with early_lines > initial), got {', '.join(early_scores) or 'none'}")
    results: dict[str, Any] = {"split": split, "policy": policy, "lines": [initial, budget], "folders": {},
                               "objective": objective, "calibrated_on_folders": list(calibrate_on or names),
                               **({"early_scores": list(early_scores)} if early_scores else {}),
                               **({"early_lines": after} if after else {})}
    stored_early = any("early" in (entry or {}) for entry in (ood or {}).values())
    own_policies = policies if (do_calibrate or folds > 1 or stored_early) else None
    measured = _measure(mars, data, split, initial, budget, policy, batch_size, own_policies, snr, after)
    measured.calibrate_on = list(calibrate_on or names)
    measured.early_scores = list(early_scores) if early_scores else None
    stored = {name: entry["early"] for name, entry in (ood or {}).items() if "early" in (entry or {})}
    for name, rule in list(stored.items()):  # a stored rule is served only where it scores
        if (rule.get("after_lines") or initial) != (after or initial):
            log.warning("mar-check: %s's stored early rule scores after %s lines, this check after %s: not served "
                        "under it (give --early-lines %s)", name, rule.get("after_lines") or initial,
                        after or initial, rule.get("after_lines") or initial)
            del stored[name]
    calibration = None
    if do_calibrate:
        calibration = _calibration(mars, measured, data, split, after, objective)
        (out / "ood.json").write_text(json.dumps(calibration, indent=1) + "\n")
        ood = {**(ood or {}), **calibration}
    for folder, by_name in measured.rows.items():
        results["folders"][folder] = _folder_summaries(measured, folder, reference, ood, policy, folds, objective,
                                                       stored)
    if calibration is not None:
        results["calibration"] = calibration
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "report.md").write_text(render_report(results))
    roc_figure(results, out / "roc.png")
    return results


@dataclass
class _Measured:
    """:func:`mar_check`'s per-slice rows: per folder and network on the fixed policy's lines
    (``rows``) and on the network's own (``own``), each folder's subjects, and the folders whose
    slices calibrate the rule (``calibrate_on``)."""

    rows: dict[str, dict[str, dict[str, np.ndarray]]] = field(default_factory=dict)
    own: dict[str, dict[str, dict[str, np.ndarray]]] = field(default_factory=dict)
    subjects: dict[str, list[str]] = field(default_factory=dict)
    calibrate_on: list[str] = field(default_factory=list)
    early_scores: list[str] | None = None
    """The scores the early rule may be calibrated with (None: every one)."""

    def pooled(self, name: str, stage: str) -> tuple[dict[str, np.ndarray], list[str]]:
        """The rows network ``name`` is calibrated on over the :attr:`calibrate_on` folders, and
        each one's subject named with its folder (``folder/sub-0001``): for the end-of-scan rule
        the fixed policy's rows and its own (both line sets it may be served on), for the early
        rule its own alone (empty when it has none)."""
        parts, subjects = [], []
        for folder in self.calibrate_on:
            own = [self.own[folder][name]] if name in self.own[folder] else []
            for rows in own if stage == "early" else [self.rows[folder][name], *own]:
                parts.append(rows)
                subjects += [f"{folder}/{s}" for s in self.subjects[folder]]
        if not parts:
            return {}, []
        keys = set.intersection(*(set(p) for p in parts))
        if stage == "end":  # not the early rule's rows
            keys = {k for k in keys if not k.startswith(("early_", "switched_"))}
        return {k: np.concatenate([p[k] for p in parts]) for k in sorted(keys)}, subjects


def _measure(mars: dict[str, torch.nn.Module], data: str | list[str], split: str, initial: int, budget: int,
             policy: str, batch_size: int, policies: dict[str, Any] | None, snr: tuple[float, float] | None,
             after: int | None) -> _Measured:
    """Every network's rows on every folder (:class:`_Measured`); ``policies`` (None: none)
    add each network's own lines and the early rule's scores on them."""
    m = _Measured()
    for folder in data_dirs(data):
        sliceset = load_split(folder, split)
        masks = policy_masks(policy, len(sliceset), sliceset.n_pe, initial, budget)
        nothing = do_nothing(sliceset, initial, budget, batch_size=batch_size)
        m.subjects[folder.name] = list(sliceset.subjects)
        m.rows[folder.name], m.own[folder.name] = {}, {}
        for name, mar in mars.items():
            log.info("mar-check: %s on %s/%s (%d slices)", name, folder, split, len(sliceset))
            rows = slice_rows(mar, sliceset, masks, nothing, batch_size)
            if snr is not None:
                rows.update(noise_rows(mar, sliceset, snr, batch_size=batch_size))
            m.rows[folder.name][name] = rows
            if (policies or {}).get(name) is None:
                continue
            log.info("mar-check: %s on the lines its own policy plays", name)
            played = own_lines(policies[name], mar, sliceset, initial, budget, batch_size)
            own = slice_rows(mar, sliceset, torch.from_numpy(line_masks(len(sliceset), sliceset.n_pe, initial, played)),
                             nothing, batch_size)
            own.update(early_rows(mar, sliceset, initial, batch_size, played, after))  # any policy
            m.own[folder.name][name] = own
    return m


def _calibration(mars: dict[str, torch.nn.Module], m: _Measured, data: str | list[str], split: str,
                 after: int | None, objective: str = "served") -> dict[str, Any]:
    """Each network's OOD rule picked on the pooled rows (:func:`calibrate`; its early switch
    on its own lines when it has them), with what it was calibrated on."""
    from training.data import data_identity
    from training.run import command_line

    used = [folder for folder in data_dirs(data) if folder.name in m.calibrate_on]
    calibrated_on = {"command": command_line(), "split": split, "objective": objective,
                     "subjects": sorted({s for f in used for s in m.subjects[f.name]}),
                     "data": [{"folder": folder.name, "manifest_sha256": data_identity(folder)["manifest_sha256"],
                               "subjects": m.subjects[folder.name]} for folder in used]}
    calibration = {}
    for name in mars:
        rows, subjects = m.pooled(name, "end")
        calibration[name] = {**calibrate(rows, "end", objective, subjects), "calibrated_on": calibrated_on}
        rows, subjects = m.pooled(name, "early")
        if rows:  # the early switch, for a network that carries its policy
            calibration[name]["early"] = {**calibrate(rows, "early", objective, subjects, m.early_scores),
                                          **({"after_lines": after} if after else {})}
    return calibration


def _folder_summaries(m: _Measured, folder: str, reference: str | None, ood: dict[str, Any] | None, policy: str,
                      folds: int, objective: str = "served", stored: dict[str, dict[str, Any]] | None = None
                      ) -> dict[str, Any]:
    """One folder's entry of ``results.json``: per network its summary (:func:`_summary`, the
    promises, the cross-validated rules, the early scores' ROC within the folder) and slices.
    Each fold of the cross-validation is calibrated as the shipped rule is, on every
    calibration folder (:attr:`_Measured.calibrate_on`), less the fold's subjects
    (:func:`~training.evaluation.calibration.cross_validated`): a folder that does not calibrate
    the rule is served under the rule itself. ``stored``: per network the early rule its
    checkpoint carries, under which its slices are also served as they come (``served_early``)."""
    by_name, own_rows, subjects = m.rows[folder], m.own[folder], m.subjects[folder]
    ref_rows = by_name.get(reference) if reference else None
    entries = {name: {"summary": _summary(rows, subjects, ref_rows if name != reference else None,
                                          (ood or {}).get(name)),
                      "slices": {"subject": subjects, **{k: v.tolist() for k, v in rows.items()}}}
               for name, rows in by_name.items()}
    for name, rows in by_name.items():
        reference_ssim = (float(ref_rows["mar_ssim"].mean()) if ref_rows is not None and name != reference
                          and policy == "center-out" else None)
        summary = entries[name]["summary"]
        summary["promises"] = promises(summary, rows, reference_ssim)
        if folds > 1 and len(set(subjects)) >= folds:  # on the lines the network is served with
            served_rows = own_rows.get(name, rows)
            held_out = folder not in m.calibrate_on
            for key, stage, lines in (("cross_validated", "end", "own" if name in own_rows else policy),
                                      ("cross_validated_early", "early", "own, switched")):
                pool, pool_subjects = m.pooled(name, stage)
                if stage == "early" and ("early_score_flip" not in served_rows or not pool):
                    continue
                summary[key] = {"lines": lines, "held_out": held_out,
                                **cross_validated(served_rows, subjects, folds, stage, objective=objective,
                                                  pool=pool, pool_subjects=pool_subjects, prefix=f"{folder}/",
                                                  scores=m.early_scores if stage == "early" else None)}
    if folds > 1 and len(set(subjects)) < folds:
        log.warning("mar-check: %s has %d subjects, fewer than %d folds: not cross-validated", folder,
                    len(set(subjects)), folds)
    for name, own in own_rows.items():  # within this domain: do the early scores find the harm?
        if "early_score_flip" not in own:
            continue
        rule = (stored or {}).get(name)
        if rule is not None:  # as the gadget serves it, no refit
            entries[name]["summary"]["served_early"] = {
                "lines": "own, switched (stored rule)", "rule": rule,
                **served_under(own, subjects, [{"score": rule["score"], "threshold": rule["threshold"]}],
                               np.zeros(len(subjects), dtype=np.int64), "early")}
        harm = harmed(own["mar_ssim"], own["nothing_ssim"])
        if "switched_ssim" in own:  # a later switch: is the image of the lines it keeps still safe?
            entries[name]["summary"]["switched_vs_nothing"] = subject_tests(own["switched_ssim"], own["nothing_ssim"],
                                                                            subjects)
        entries[name]["summary"]["early_roc"] = {
            kind: {**roc(own[f"early_score_{kind}"], harm),
                   "auc_interval": auc_interval(own[f"early_score_{kind}"], harm, subjects)}
            for kind in EARLY_SCORES if f"early_score_{kind}" in own}
        entries[name]["summary"]["early_roc_within"] = _within_subjects(own, harm, subjects)
    return entries


def _within_subjects(own: dict[str, np.ndarray], harm: np.ndarray, subjects: list[str]) -> dict[str, Any]:
    """Per subject with harmed and helped slices: the early scores' ROC area among its slices
    alone (does a score rank harm within one volume, not only between volumes?)."""
    codes = np.asarray(subjects)
    out = {}
    for subject in sorted(set(subjects)):
        rows = codes == subject
        if 0 < harm[rows].sum() < rows.sum():
            out[subject] = {"n_slices": int(rows.sum()), "n_harmed": int(harm[rows].sum()),
                            **{kind: roc(own[f"early_score_{kind}"][rows], harm[rows])["auc"]
                               for kind in EARLY_SCORES if f"early_score_{kind}" in own}}
    return out


def _f(value: float, digits: int = 3) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _p(value: float) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.1e}" if value < 1e-3 else f"{value:.3f}"


def seed_groups(names: list[str]) -> dict[str, list[str]]:
    """Networks named ``RECIPE_sN`` grouped by recipe (two seeds or more)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        match = re.fullmatch(r"(.+)_s\d+", name)
        if match:
            groups.setdefault(match.group(1), []).append(name)
    return {recipe: members for recipe, members in groups.items() if len(members) > 1}


def _seed_rows(by_name: dict[str, Any]) -> list[str]:
    """Mean ± sd over the seeds of each recipe (seed_groups), as extra table rows."""
    rows = []
    for recipe, members in seed_groups(list(by_name)).items():
        def spread(key: str, digits: int = 3) -> str:
            values = np.array([by_name[m]["summary"][key]["mean"] for m in members])
            return f"{values.mean():.{digits}f} ± {values.std(ddof=1):.{digits}f}"

        def diff(key: str, digits: int) -> str:
            values = np.array([by_name[m]["summary"][key]["diff"] for m in members])
            worst = max(by_name[m]["summary"][key]["p_ttest"] for m in members)
            return f"{values.mean():+.{digits}f} ± {values.std(ddof=1):.{digits}f} (max {_p(worst)})"

        harmed = np.array([by_name[m]["summary"]["harmed_fraction"] for m in members])
        rows.append(f"| **{recipe}, {len(members)} seeds** (mean ± sd) | | {spread('identity_ssim')} | "
                    f"{spread('zf_ssim')} | {spread('mar_ssim')} | {diff('mar_vs_zf_ssim', 3)} | "
                    f"{diff('mar_vs_zf_psnr', 2)} | {100 * harmed.mean():.0f} % | | | |")
    return rows


def _switch_point(results: dict[str, Any]) -> str:
    """Where the early rule scores and switches, in words."""
    after = results.get("early_lines")
    return f"its first {after} lines (--early-lines)" if after else "the initial lines"


def _served_table(results: dict[str, Any], folder: str, by_name: dict[str, Any]) -> list[str]:
    """The report's lines on one folder's slices served under a rule no subject chose for itself."""
    crossed = [(n, e["summary"][key]) for n, e in by_name.items()
               for key in ("cross_validated", "cross_validated_early", "served_early") if key in e["summary"]]
    if not crossed:
        return []
    calibrated = ", ".join(results.get("calibrated_on_folders", [])) or "every folder"
    folds = next((cv["folds"] for _, cv in crossed if "folds" in cv), None)
    how = ("the stored rule: the one the checkpoint carries, as the gadget serves it" if folds is None else
           f"this folder calibrates nothing (the rule is calibrated on {calibrated}): served under the rule"
           if crossed[0][1].get("held_out") else
           f"calibrated as the shipped rule, on {calibrated}, less the subject served ({folds} folds by subject)")
    objective = "" if folds is None else f"{results.get('objective', 'served')} objective; "
    lines = ["", f"Served under the OOD rule ({objective}{how}), against doing "
             "nothing (centre-out's zero-filled image, as many lines); lines `own, switched`: the early switch (a "
             f"flagged slice continues with centre-out's lines after {_switch_point(results)} and is served "
             "zero-filled):", "",
             "| MAR network | lines | served SSIM | network always on - nothing | served - nothing (p) | "
             "subject mean / worst | subject mean, dB | harmed | fallback |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, cv in crossed:
        on, served = cv["mar_vs_nothing_ssim"], cv["served_vs_nothing_ssim"]
        lines.append(f"| {name} | {cv['lines']} | {_f(cv['served_ssim']['mean'])} | {on['diff']:+.3f} | "
                     f"{served['diff']:+.3f} ({_p(served['p_ttest'])}) | {cv['subject_mean_gain']:+.3f} / "
                     f"{cv['worst_subject_gain']:+.3f} | {_f(cv.get('subject_mean_gain_psnr'), 2)} | "
                     f"{100 * cv['harmed_fraction']:.0f} % | {100 * cv['fallback_fraction']:.0f} % |")
    return lines


def render_report(results: dict[str, Any]) -> str:
    """The markdown report of :func:`mar_check`."""
    lines = [f"# MAR check: {results['split']} split, {results['policy']} lines ({results['lines'][0]} + "
             f"{results['lines'][1]})", "",
             "Identity: SSIM of the output for the fully sampled clean image against that image. Zero-filled and "
             "MAR: against the clean fully sampled image. p: paired t-test over subjects (volumes). Harmed: slices "
             "whose MAR image scores below doing nothing (the zero-filled image of centre-out's lines, as many). With fallback: as served under the network's OOD "
             "rule (a flagged slice is served zero-filled; a flagged clean, fully sampled image comes back as "
             "acquired).", ""]
    for folder, by_name in results["folders"].items():
        lines += [f"## {folder}", "",
                  "| MAR network | subjects / slices | identity SSIM | zero-filled SSIM | MAR SSIM | dSSIM (p) | "
                  "dPSNR dB (p) | harmed | AUC consistency / residual / flip (95 % over subjects) | with fallback: SSIM (served zero-filled, harmed) "
                  "| with fallback: identity SSIM |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, entry in by_name.items():
            s = entry["summary"]
            ts, tp = s["mar_vs_zf_ssim"], s["mar_vs_zf_psnr"]
            aucs = " / ".join(f"{_f(s['roc'][k]['auc'], 2)} ({_f(s['roc'][k].get('auc_interval', [math.nan] * 2)[0], 2)}-"
                              f"{_f(s['roc'][k].get('auc_interval', [math.nan] * 2)[1], 2)})" for k in SCORES)
            fb = s.get("fallback")
            fallback = (f"{_f(fb['ssim']['mean'])} ({100 * fb['fraction']:.0f} %, harmed {100 * fb['harmed_fraction']:.0f} %)"
                        if fb else "-")
            fallback += f" | {_f(fb['identity_ssim']['mean'])}" if fb else " | -"
            lines.append(f"| {name} | {s['n_subjects']} / {s['n_slices']} | {_f(s['identity_ssim']['mean'])} | "
                         f"{_f(s['zf_ssim']['mean'])} | {_f(s['mar_ssim']['mean'])} | {ts['diff']:+.3f} "
                         f"({_p(ts['p_ttest'])}) | {tp['diff']:+.2f} ({_p(tp['p_ttest'])}) | "
                         f"{100 * s['harmed_fraction']:.0f} % | {aucs} | {fallback} |")
        lines += _seed_rows(by_name)
        lines += ["", "Promises (identity SSIM >= 0.98; output no noisier than its noisy input on >= 95 % of slices; "
                  "on centre-out's lines at most 0.005 below the reference network):", ""]
        for name, entry in by_name.items():
            p = entry["summary"].get("promises", {})
            def word(key: str, digits: int = 3) -> str:
                v = p.get(key, {})
                return "not measured" if v.get("kept") is None else \
                    f"{'kept' if v['kept'] else 'BROKEN'} ({v['value']:.{digits}f})"
            lines.append(f"- {name}: identity {word('identity_ssim')}, noise {word('noise_share', 2)}, "
                         f"centre-out {word('center_out')}")
        lines += _served_table(results, folder, by_name)
        early = [(n, e["summary"]["early_roc"]) for n, e in by_name.items() if "early_roc" in e["summary"]]
        if early:
            lines += ["", f"The early scores (the output for the image of {_switch_point(results)}) against harm on "
                      "the network's own lines, ROC area (95 % over subjects):", ""]
            for name, areas in early:
                kept = by_name[name]["summary"].get("switched_vs_nothing")
                if kept is not None:
                    lines.append(f"- {name}, a slice switched then, against doing nothing: {kept['diff']:+.4f} SSIM "
                                 f"(p {_p(kept['p_ttest'])} over subjects)")
                lines.append(f"- {name}: " + ", ".join(
                    f"{k} {_f(areas[k]['auc'], 2)} ({_f(areas[k]['auc_interval'][0], 2)}-"
                    f"{_f(areas[k]['auc_interval'][1], 2)})" for k in areas)
                    + f" ({areas[SCORES[0]]['n_harmed']} harmed, {areas[SCORES[0]]['n_helped']} helped)")
                within = by_name[name]["summary"].get("early_roc_within", {})
                if within:
                    lines.append("  - within one subject (those with harmed and helped slices): " + "; ".join(
                        f"{subject} ({w['n_slices']} slices, {w['n_harmed']} harmed): "
                        + ", ".join(f"{k} {_f(w[k], 2)}" for k in w if k not in ("n_slices", "n_harmed"))
                        for subject, w in within.items()))
        refs = [(n, e["summary"]) for n, e in by_name.items() if "vs_reference_ssim" in e["summary"]]
        if refs:
            lines += ["", "Against the reference network (same lines, served images):", ""]
            for name, s in refs:
                r, q = s["vs_reference_ssim"], s["vs_reference_psnr"]
                lines.append(f"- {name}: dSSIM {r['diff']:+.4f} (p {_p(r['p_ttest'])}), dPSNR {q['diff']:+.2f} dB "
                             f"(p {_p(q['p_ttest'])}) over {r['n_subjects']} subjects")
        lines.append("")
    if "calibration" in results:
        lines += [f"## Calibration (pooled over {', '.join(results.get('calibrated_on_folders', [])) or 'the folders'}; "
                  f"objective {results.get('objective', 'served')})", ""]
        for name, c in results["calibration"].items():
            for label, rule in (("", c), (" early switch", c.get("early"))):
                if rule is None:
                    continue
                served_as = "switched to centre-out" if label else "served zero-filled"
                lines.append(f"- {name}{label}: score `{rule['score']}` (AUC "
                             f"{', '.join(f'{k} {v:.3f}' for k, v in rule['auc'].items())}), threshold "
                             f"{rule['threshold']:.4g}: {100 * rule['fallback_fraction']:.0f} % of slices {served_as}, "
                             f"mean served SSIM {rule['val_served_ssim']:.4f} (MAR always {rule['val_mar_ssim']:.4f}, "
                             f"doing nothing {rule['val_nothing_ssim']:.4f}), harmed "
                             f"{100 * rule['val_served_harmed']:.0f} %"
                             + ("" if rule.get("keeps_no_harm", True) else "; NO threshold keeps the do-no-harm "
                                "target on these slices: every slice flagged"))
        lines.append("")
    return "\n".join(lines)


def roc_figure(results: dict[str, Any], path: Path) -> None:
    """ROC curves of the OOD scores (one panel per folder, a line per network and score)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {folder: {name: entry["summary"]["roc"] for name, entry in by_name.items()}
              for folder, by_name in results["folders"].items()}
    if len(panels) > 1:  # the pooled slices, on which --calibrate chooses
        names = list(next(iter(results["folders"].values())))
        pooled = {}
        for name in names:
            slices = [results["folders"][f][name]["slices"] for f in results["folders"]]
            harm = np.concatenate([harmed(sl["mar_ssim"], sl["nothing_ssim"]) for sl in slices])
            pooled[name] = {kind: roc(np.concatenate([sl[f"score_{kind}"] for sl in slices]), harm)
                            for kind in SCORES}
        panels["all folders, pooled"] = pooled
    early = {folder: {name: entry["summary"]["early_roc"] for name, entry in by_name.items()
                      if "early_roc" in entry["summary"]} for folder, by_name in results["folders"].items()}
    rows = [("end of scan", panels)] + ([("early switch", early)] if any(early.values()) else [])
    fig, axes = plt.subplots(len(rows), len(panels), figsize=(4.2 * len(panels), 4 * len(rows)), squeeze=False)
    styles = {"consistency": "-", "residual": "--", "flip": ":", "holdout": "-.", "halves": (0, (5, 1))}
    cells = [(ax, stage, folder, by_name) for axs, (stage, row) in zip(axes, rows)
             for ax, (folder, by_name) in zip(axs, row.items())]
    for ax in axes[1][len(early):] if len(rows) > 1 else []:
        ax.axis("off")  # no early panel for the pooled folders
    for ax, stage, folder, by_name in cells:
        for i, (name, curves) in enumerate(by_name.items()):
            for kind, r in curves.items():
                if r["fpr"]:
                    ax.plot(r["fpr"], r["tpr"], linestyle=styles[kind], color=f"C{i}", label=f"{name} {kind} ({r['auc']:.2f})")
        ax.plot([0, 1], [0, 1], color="0.7", lw=0.8)
        ax.set(title=f"{folder}, {stage}: harmed vs helped", xlabel="false positive rate (helped slices flagged)",
               ylabel="true positive rate (harmed slices flagged)", xlim=(0, 1), ylim=(0, 1))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
        else:  # one class only (e.g. no slice harmed): no curve to draw
            ax.text(0.5, 0.5, "no slice harmed\nor none helped", ha="center", va="center", color="0.4")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
