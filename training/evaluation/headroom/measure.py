"""The measurement: the oracle, the cross-fitted fixed order and centre-out per MAR network and
fold, and learned policies judged by the share of the lead they capture."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from masc_gadget.acquisition.episode import AcquisitionConfig, initial_lines
from masc_gadget.acquisition.policies import center_out_rank
from masc_gadget.config import Config, to_dict
from masc_gadget.core.kspace import zero_filled
from masc_gadget.device import resolve_device
from masc_gadget.models.checkpoint import load_mar
from sim_scanner.physics.coils import body_array
from training.data import SliceSet, load_split
from training.evaluation.headroom.config import METHODS, HeadroomConfig, corruption_of, measured_slices
from training.evaluation.headroom.summary import better_fixed, captured_share, summarise
from training.evaluation.sense import SenseRecon
from training.evaluation.stats import subject_folds, subject_tests
from training.oracle import BeamOracle, ReacquireOracle, kspace_of
from training.population import population_order
from training.rl.corruption import GatedOrder, draw_attempts
from training.rl.env import BatchedAcquisitionEnv
from training.scoring import Recon, line_masks, score_masks
from training.evaluation.headroom.types import HeadroomReport, HeadroomRun

log = logging.getLogger("training.evaluation.headroom")


def _scores(data: SliceSet, masks: np.ndarray, mar: torch.nn.Module | None, roi: torch.Tensor,
            device: torch.device, batch_size: int, recon: Recon = zero_filled) -> dict[str, np.ndarray]:
    """Per slice: SSIM and PSNR of the served image of ``masks`` over the whole image and in
    ``roi`` (``roi_ssim``, ``roi_psnr``): :func:`training.scoring.score_masks`."""
    return score_masks(data, masks, mar, roi=roi, recon=recon, metrics=("ssim", "psnr"), batch_size=batch_size,
                       device=device).flat()


def _measure_one(data: SliceSet, mar: torch.nn.Module | None, acq: AcquisitionConfig, hcfg: HeadroomConfig,
                 roi: torch.Tensor, device: torch.device, progress: bool,
                 recon: Recon = zero_filled,
                 fit_data: SliceSet | None = None, fit_roi: torch.Tensor | None = None
                 ) -> tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """The three methods' lines and scores under one MAR network (or none): (the
    :class:`HeadroomRun` fields of the lines played, the scores by method)."""
    n, n_pe = len(data), data.n_pe
    initial, budget = acq.initial, acq.budget
    objective = roi if hcfg.region == "implant" else None
    oracle = BeamOracle(hcfg.beam, recon=recon)
    attempts = None
    model = hcfg.corruption
    if model.enabled:  # every method's first acquisitions; the oracle may repeat a line
        attempts, corrupted = draw_attempts(data.kspace_metal, data.slices, model, model.attempts, model.seed)
        clean = data
        data = replace(data, kspace_metal=attempts[:, 0].contiguous())
    folds, fixed, orders = _fixed_orders(data, mar, acq, hcfg, oracle, objective, device, progress, fit_data, fit_roi)
    chosen, count = _oracle_lines(data, mar, acq, hcfg, oracle, objective, attempts, device, progress)
    free = np.ones(n_pe, dtype=bool)
    free[initial_lines(n_pe, initial)] = False
    centre = np.flatnonzero(free)[np.argsort(center_out_rank(n_pe)[free], kind="stable")][:budget]
    lines = {"oracle": chosen, "fixed": fixed, "center-out": np.broadcast_to(centre, (n, budget))}
    scores = {m: _scores(data, line_masks(n, n_pe, initial, lines[m]), mar, roi, device, hcfg.batch_size, recon)
              for m in METHODS}
    record: dict[str, Any] = {"orders": orders, "folds": folds.tolist(), "oracle_lines": chosen.tolist()}
    if attempts is not None:  # the oracle's own acquisitions, repeats included, and the gated order's
        record.update(_with_repeats(clean, mar, acq, hcfg, roi, device, attempts, corrupted, folds, fixed, count,
                                    scores))
    return record, scores


def _fixed_orders(data: SliceSet, mar: torch.nn.Module | None, acq: AcquisitionConfig, hcfg: HeadroomConfig,
                  oracle: BeamOracle, objective: torch.Tensor | None, device: torch.device, progress: bool,
                  fit_data: SliceSet | None, fit_roi: torch.Tensor | None
                  ) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """(each slice's fold, (n, budget) the fixed order it plays, the order of each fold): one
    order fitted on ``fit_data``, or each fold's fitted on the other folds' slices."""
    n, initial, budget = len(data), acq.initial, acq.budget
    fixed = np.zeros((n, budget), dtype=np.int64)
    orders = []
    if fit_data is not None:  # one order, fitted on another split
        order = population_order(fit_data, initial, budget, mar, device, hcfg.batch_size, oracle, progress=progress,
                                 roi=fit_roi if objective is not None else None)
        fixed[:] = order
        return np.zeros(n, dtype=np.int64), fixed, [order.tolist()]
    folds = subject_folds(data.subjects, hcfg.folds)
    for k in range(hcfg.folds):
        fit = np.flatnonzero(folds != k)
        order = population_order(data.subset(fit), initial, budget, mar, device, hcfg.batch_size, oracle,
                                 progress=progress, roi=None if objective is None else objective[fit])
        fixed[folds == k] = order
        orders.append(order.tolist())
    return folds, fixed, orders


def _oracle_lines(data: SliceSet, mar: torch.nn.Module | None, acq: AcquisitionConfig, hcfg: HeadroomConfig,
                  oracle: BeamOracle, objective: torch.Tensor | None, attempts: torch.Tensor | None,
                  device: torch.device, progress: bool) -> tuple[np.ndarray, np.ndarray]:
    """((n, budget) the oracle's lines, (n, n_pe) its acquisitions of each line: with
    ``attempts``, the oracle that may acquire a line again)."""
    from tqdm.auto import tqdm

    n, n_pe, budget = len(data), data.n_pe, acq.budget
    start = line_masks(n, n_pe, acq.initial, np.zeros((0,), dtype=np.int64))
    chosen = np.zeros((n, budget), dtype=np.int64)
    count = np.zeros((n, n_pe), dtype=np.int64)
    bar = tqdm(total=n, desc=oracle.name if attempts is None else ReacquireOracle.name, unit="slice",
               disable=not progress)
    step = 1 if attempts is None else hcfg.batch_size  # the beam searches slice by slice: the bar moves each
    for s in range(0, n, step):
        index = list(range(s, min(s + step, n)))
        region = None if objective is None else objective[index].to(device)
        target = data.target[index].to(device)
        if attempts is None:
            chosen[index], _ = oracle.plan(start[index], budget, data.kspace_metal[index].to(device), target, mar,
                                           region)
        else:
            chosen[index], count[index] = ReacquireOracle().plan(attempts[index].to(device), start[index], budget,
                                                                 target, mar, region)
        bar.update(len(index))
    bar.close()
    return chosen, count


def _with_repeats(clean: SliceSet, mar: torch.nn.Module | None, acq: AcquisitionConfig, hcfg: HeadroomConfig,
                  roi: torch.Tensor, device: torch.device, attempts: torch.Tensor, corrupted: torch.Tensor,
                  folds: np.ndarray, fixed: np.ndarray, count: np.ndarray,
                  scores: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """With corruption: the oracle scored on what it acquired (repeats included), the fitted
    order with navigator gating (:class:`GatedOrder`, each fold its own order) played and
    scored; into ``scores``. Returns the run's ``gated_counts`` and ``corruption`` fields."""
    n, n_pe, initial = len(clean), clean.n_pe, acq.initial
    scores["oracle"] = _scores(replace(clean, kspace_metal=kspace_of(attempts, count)), count > 0, mar, roi, device,
                               hcfg.batch_size)
    env = BatchedAcquisitionEnv(clean, hcfg.env_config(), initial, acq.budget, mar, device)
    gated_count = np.zeros_like(count)
    for k in np.unique(folds):
        rows = np.flatnonzero(folds == k)
        played = env.evaluate(GatedOrder(fixed[rows[0]], n_pe), indices=rows, batch_size=hcfg.batch_size)
        gated_count[rows] = played["counts"].numpy()
    scores["gated"] = _scores(replace(clean, kspace_metal=kspace_of(attempts, gated_count)), gated_count > 0,
                              mar, roi, device, hcfg.batch_size)
    first = corrupted[:, 0]
    return {"gated_counts": gated_count.tolist(), "corruption": {
        "repeats_per_slice": float((count.sum(axis=1) - count.astype(bool).sum(axis=1)).mean()),
        "repeats_per_slice_gated": float((gated_count.sum(axis=1) - (gated_count > 0).sum(axis=1)).mean()),
        "corrupted_lines_fixed": float(np.mean([first[i, line_masks(1, n_pe, initial, fixed[i])[0]].sum()
                                                for i in range(n)])),
        "corrupted_lines_oracle": float(np.mean([corrupted[i, np.clip(count[i] - 1, 0, None), np.arange(n_pe)]
                                                 [count[i] > 0].sum() for i in range(n)])),
    }}


def _key(region: str) -> str:
    return "ssim" if region == "image" else "roi_ssim"


def headroom(config: Config, data_dir: str | Path, split: str, mar_paths: list[str | Path],
             progress: bool = True, policy_paths: list[str | Path] | None = None) -> HeadroomReport:
    """Measure the oracle's lead over the fixed order (module docstring) on ``split`` of
    ``data_dir`` under each MAR network of ``mar_paths``; returns the report.

    ``policy_paths``: one learned-policy checkpoint per MAR network (same order), e.g. MASC
    trained under that frozen network: each plays the measured slices under its network, and the
    report gives how much of the oracle's lead over the fixed order it captures."""
    hcfg: HeadroomConfig = config["headroom"]
    acq: AcquisitionConfig = config["acquisition"]
    policy_paths = _check_paths(hcfg, mar_paths, policy_paths)
    device = resolve_device(hcfg.device)
    full = load_split(data_dir, split)
    if acq.initial + acq.budget > full.n_pe:
        raise ValueError(f"acquisition initial + budget ({acq.initial} + {acq.budget}) exceeds the data's "
                         f"{full.n_pe} phase-encoding lines")
    data = full.subset(measured_slices(full, hcfg.slices_per_subject))
    roi = data.periprosthetic_roi(hcfg.margin)
    hcfg, fit_data, fit_roi = _fit_split(hcfg, data, data_dir, split, full.n_pe)
    log.info("headroom on %s/%s: %d slices of %d subjects, %d + %d of %d lines, region %s, beam %d, corruption "
             "%g (%s), %d MAR network(s)", data_dir, split, len(data), len(set(data.subjects)), acq.initial,
             acq.budget, data.n_pe, hcfg.region, hcfg.beam, hcfg.corruption.probability, hcfg.corruption.kind, len(mar_paths))
    key = _key(hcfg.region)
    recon = zero_filled
    if hcfg.recon == "sense":
        maps = torch.from_numpy(body_array(hcfg.coils, tuple(data.target.shape[1:]), config["sequence"].fov_mm))
        recon = SenseRecon(maps.to(device), hcfg.sense_iterations)
    runs = []
    for j, path in enumerate(mar_paths or [None]):
        mar, meta = (None, {}) if path is None else load_mar(path, device)
        if mar is not None:
            mar.eval()
        record, scores = _measure_one(data, mar, acq, hcfg, roi, device, progress, recon, fit_data, fit_roi)
        one = _run_of(f"none ({hcfg.coils}-coil SENSE)" if path is None else str(path), meta, record, scores, key,
                      data.subjects)
        if policy_paths:
            _attach_policy(one, scores, policy_paths[j], data, mar, acq, roi, device, hcfg, key, progress)
            one.slices["policy"] = {k: v.tolist() for k, v in scores["policy"].items()}
            one.means["policy"] = {k: float(np.mean(v)) for k, v in scores["policy"].items()}
        log.info("headroom under %s: oracle %.4f, fixed %.4f, centre-out %.4f %s; lead %+.4f (subject p %.2g)",
                 one.mar, one.means["oracle"][key], one.means["fixed"][key], one.means["center-out"][key],
                 key, one.lead["diff"], one.lead["p_ttest"])
        runs.append(one)
    report = HeadroomReport(
        data=str(data_dir), split=split, n_slices=len(data), n_subjects=len(set(data.subjects)),
        labels=[data.label(i) for i in range(len(data))],
        acquisition={"initial": acq.initial, "budget": acq.budget, "n_pe": data.n_pe},
        config={"headroom": to_dict(hcfg)}, metric=key, runs=runs,
    )
    report.summary = summarise(report)
    return report


def _check_paths(hcfg: HeadroomConfig, mar_paths: list[str | Path],
                 policy_paths: list[str | Path] | None) -> list[str | Path]:
    """The networks and policies a measurement asks for, checked; the policies as a list."""
    sense = hcfg.recon == "sense"
    if sense and mar_paths:
        raise ValueError("recon sense is scored without a MAR network (none is trained on SENSE images): drop --mar")
    if not sense and not mar_paths:
        raise ValueError("the headroom is measured under a MAR network: give at least one --mar")
    policy_paths = list(policy_paths or [])
    if policy_paths and len(policy_paths) != len(mar_paths):
        raise ValueError(f"give one policy checkpoint per MAR network (the network it was trained under): "
                         f"{len(policy_paths)} --policy for {len(mar_paths)} --mar")
    return policy_paths


def _fit_split(hcfg: HeadroomConfig, data: SliceSet, data_dir: str | Path, split: str, n_pe: int
               ) -> tuple[HeadroomConfig, SliceSet | None, torch.Tensor | None]:
    """Where the fixed order is fitted: cross-fitted over the measured subjects (None, None), or
    on ``hcfg.fit_split`` (its measured slices and their region), which a split with fewer
    subjects than folds falls back to (the settings returned say so)."""
    if not hcfg.fit_split and len(set(data.subjects)) < hcfg.folds and split != "train":
        log.warning("%s/%s has %d subject(s), fewer than the %d folds the cross-fitted order needs: the fixed order "
                    "is fitted on the train split instead (headroom.fit_split=train)", data_dir, split,
                    len(set(data.subjects)), hcfg.folds)
        hcfg = dataclasses.replace(hcfg, fit_split="train")
    if not hcfg.fit_split:
        return hcfg, None, None
    if hcfg.fit_split == split:
        raise ValueError(f"headroom.fit_split {split!r} is the measured split: fit the fixed order on another "
                         "split (train), or leave fit_split empty to cross-fit it over subject folds")
    fit_full = load_split(data_dir, hcfg.fit_split)
    if fit_full.n_pe != n_pe:
        raise ValueError(f"split {hcfg.fit_split!r} has {fit_full.n_pe} phase-encoding lines, split {split!r} "
                         f"{n_pe}: the fixed order must be fitted on the measured protocol")
    fit_data = fit_full.subset(measured_slices(fit_full, hcfg.slices_per_subject))
    log.info("fixed order fitted on %s/%s: %d slices of %d subjects", data_dir, hcfg.fit_split, len(fit_data),
             len(set(fit_data.subjects)))
    return hcfg, fit_data, fit_data.periprosthetic_roi(hcfg.margin)


def _run_of(mar: str, meta: dict[str, Any], record: dict[str, Any], scores: dict[str, dict[str, np.ndarray]],
            key: str, subjects: list[str]) -> HeadroomRun:
    """One network's :class:`HeadroomRun` from its lines (``record``) and scores: the means, the
    lead over the fitted order and over the better fixed order, the gated order's tests."""
    psnr = key.replace("ssim", "psnr")
    one = HeadroomRun(
        mar=mar,
        mar_metadata={k: meta.get(k) for k in ("kind", "epoch", "code_version") if k in meta},
        slices={m: {k: v.tolist() for k, v in scores[m].items()} for m in scores},
        means={m: {k: float(np.mean(v)) for k, v in scores[m].items()} for m in scores},
        lead=subject_tests(scores["oracle"][key], scores["fixed"][key], subjects),
        lead_psnr=subject_tests(scores["oracle"][psnr], scores["fixed"][psnr], subjects),
        fixed_vs_center_out=subject_tests(scores["fixed"][key], scores["center-out"][key], subjects),
        **record,
    )
    _judge_against_best(one, scores, key, subjects)
    if "gated" in scores:
        one.gated_vs_fixed = subject_tests(scores["gated"][key], scores["fixed"][key], subjects)
        one.lead_gated = subject_tests(scores["oracle"][key], scores["gated"][key], subjects)
    return one


def _attach_policy(run: HeadroomRun, scores: dict[str, dict[str, np.ndarray]], path: str | Path,
                   data: SliceSet, mar: torch.nn.Module | None, acq: AcquisitionConfig, roi: torch.Tensor,
                   device: torch.device, hcfg: HeadroomConfig, key: str, progress: bool) -> None:
    """Play the learned policy ``path`` under ``mar`` and add its lines, tests against the
    fitted and the better fixed order (``run.best_fixed``, :func:`_judge_against_best`) and
    captured share to ``run``, its scores to ``scores``. With corruption the policy plays the
    measurement's draws, sees the scanner's flags and may acquire a flagged line again; it is
    also tested against the gated order."""
    best = run.best_fixed
    run.policy = str(path)
    if hcfg.corruption.enabled:
        run.policy_lines, scores["policy"] = _play_reacquiring(path, data, mar, acq, roi, device, hcfg)
        run.policy_vs_gated = subject_tests(scores["policy"][key], scores["gated"][key], data.subjects)
    else:
        run.policy_lines, scores["policy"] = _play_policy(path, data, mar, acq, roi, device, hcfg.batch_size,
                                                          progress)
    run.policy_vs_fixed = subject_tests(scores["policy"][key], scores["fixed"][key], data.subjects)
    run.policy_vs_best = subject_tests(scores["policy"][key], scores[best][key], data.subjects)
    run.captured = _captured(scores, key, best)
    log.info("policy %s: %.4f %s, %+.4f over the better fixed order (%s, subject p %.2g), %.0f%% of the oracle's "
             "lead", path, float(np.mean(scores["policy"][key])), key, run.policy_vs_best["diff"], best,
             run.policy_vs_best["p_ttest"], 100 * run.captured)


def _judge_against_best(run: HeadroomRun, scores: dict[str, dict[str, np.ndarray]], key: str,
                        subjects: list[str]) -> None:
    """Name the run's better fixed order (:func:`better_fixed`) and test the oracle's lead over
    it over subjects (``best_fixed``, ``lead_best``)."""
    best = better_fixed({m: {key: float(np.mean(scores[m][key]))} for m in ("fixed", "center-out")}, key)
    run.best_fixed = best
    run.lead_best = subject_tests(scores["oracle"][key], scores[best][key], subjects)


def add_policies(config: Config, report: HeadroomReport, policy_paths: list[str | Path],
                 progress: bool = True) -> HeadroomReport:
    """A headroom report with learned policies scored on its slices, one per MAR network (same
    order), without measuring the oracle and the fixed order again: how a policy trained after
    the gate is judged against the headroom it was trained for. Returns a new report."""
    import copy

    runs = report.runs
    if len(policy_paths) != len(runs):
        raise ValueError(f"give one policy checkpoint per MAR network of the report: {len(policy_paths)} --policy "
                         f"for {len(runs)} network(s) ({', '.join(r.mar for r in runs)})")
    h, rec = report.settings, report.acquisition
    if h.get("recon") == "sense":
        raise ValueError("learned policies are scored on the zero-filled image: this report measured SENSE")
    if corruption_of(h).enabled and "gated" not in runs[0].slices:
        raise ValueError("this corruption report has no gated order (it was measured before the scanner's flags "
                         "were modelled): measure it again, with --policy")
    acq: AcquisitionConfig = config["acquisition"]
    if (acq.initial, acq.budget) != (rec["initial"], rec["budget"]):
        raise ValueError(f"the report measured {rec['initial']} + {rec['budget']} lines, the config gives "
                         f"{acq.initial} + {acq.budget}: pass the same --set acquisition.* as the measurement")
    full = load_split(report.data, report.split)
    where = {full.label(i): i for i in range(len(full))}
    missing = [lab for lab in report.labels if lab not in where]
    if missing:
        raise ValueError(f"{report.data}/{report.split} no longer holds the measured slices "
                         f"({len(missing)} missing, e.g. {missing[0]})")
    data = full.subset(np.asarray([where[lab] for lab in report.labels]))
    roi = data.periprosthetic_roi(h["margin"])
    hcfg = HeadroomConfig.from_settings(h)  # the measurement's settings
    device = resolve_device(h.get("device", "auto"))
    key = report.metric
    out = copy.deepcopy(report)
    for run, path in zip(out.runs, policy_paths):
        mar = load_mar(run.mar, device)[0].eval()
        scores = {m: v for m, v in run.scores().items() if m in (*METHODS, "gated")}
        _judge_against_best(run, scores, key, data.subjects)  # a report written before the rule has none
        _attach_policy(run, scores, path, data, mar, acq, roi, device, hcfg, key, progress)
        run.slices["policy"] = {k: v.tolist() for k, v in scores["policy"].items()}
        run.means["policy"] = {k: float(np.mean(v)) for k, v in scores["policy"].items()}
    out.summary = summarise(out)
    return out


@torch.no_grad()
def _play_policy(path: str | Path, data: SliceSet, mar: torch.nn.Module | None, acq: AcquisitionConfig,
                 roi: torch.Tensor, device: torch.device, batch_size: int, progress: bool
                 ) -> tuple[list[list[int]], dict[str, np.ndarray]]:
    """A learned policy's chosen lines on every slice, played under ``mar`` as the gadget plays
    it, and their scores (:func:`training.scoring.score_masks`)."""
    from masc_gadget.acquisition.learned import load_learned
    from training.evaluation.evaluate import run_method

    policy, _, _ = load_learned(path, device)
    traj = run_method(policy, data, acq.initial, acq.budget, mar, 0, batch_size, device, progress=progress,
                      lines_per_decision=acq.lines_per_decision)
    chosen = traj.lines[:, acq.initial:]
    return chosen.tolist(), _scores(data, line_masks(len(data), data.n_pe, acq.initial, chosen), mar, roi, device,
                                        batch_size)


@torch.no_grad()
def _play_reacquiring(path: str | Path, data: SliceSet, mar: torch.nn.Module | None, acq: AcquisitionConfig,
                      roi: torch.Tensor, device: torch.device, hcfg: HeadroomConfig
                      ) -> tuple[list[list[int]], dict[str, np.ndarray]]:
    """A learned policy played greedily on the measurement's corrupted acquisitions (the same
    draws and flags as the oracle and the gated order), and the scores of what it served."""
    from masc_gadget.acquisition.learned import load_learned
    from training.rl.ppo import greedy_actions

    policy, _, _ = load_learned(path, device)
    net = getattr(policy, "net", None)
    if net is None or not getattr(net.config, "reacquire", False):
        raise ValueError(f"{path} is not a policy that acquires flagged lines again (policy_net.reacquire): "
                         "score it on a measurement without headroom.corruption")
    env = BatchedAcquisitionEnv(data, hcfg.env_config(observe_mar=policy.observes_mar), acq.initial, acq.budget,
                                mar, device)
    played = env.evaluate(lambda obs: greedy_actions(net, obs, acq.budget), batch_size=hcfg.batch_size)
    count = played["counts"].numpy()
    model = hcfg.corruption
    attempts, _ = draw_attempts(data.kspace_metal, data.slices, model, model.attempts, model.seed)
    served = replace(data, kspace_metal=kspace_of(attempts, count))
    return played["lines"].tolist(), _scores(served, count > 0, mar, roi, device, hcfg.batch_size)


def _captured(scores: dict[str, dict[str, np.ndarray]], key: str, best: str) -> float:
    """The share of the oracle's lead over the better fixed order ``best`` that the policy
    captures (NaN when the oracle does not lead)."""
    lead = float(np.mean(scores["oracle"][key]) - np.mean(scores[best][key]))
    gain = float(np.mean(scores["policy"][key]) - np.mean(scores[best][key]))
    return captured_share(gain, lead)
