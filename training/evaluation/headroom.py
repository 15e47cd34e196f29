"""The headroom of adaptive line choice: how far the oracle leads the best fixed order.

An adaptive policy can only beat a fixed line order by what a per-slice choice adds over the best
order a population allows. ``masc check headroom`` (and ``masc check headroom``) measures that lead on
a data set before anyone trains for it:

- **the fixed order, cross-fitted**: the subjects are split into ``folds`` folds; for each fold,
  the population-greedy order (:func:`training.population.population_order`) is fitted on the
  other folds' slices and played on this fold's. No slice is scored by an order fitted on it, so
  the order pays what a refit on a new population pays, and nothing more. With ``fit_split``
  (``train``), one order is fitted on that split instead, the order a deployment ships.
- **the oracle**: per slice, with the clean image, the greedy one-step oracle, or with ``beam``
  > 1 a beam search that keeps the greedy path (:class:`training.oracle.BeamOracle`): a yardstick,
  not a bound on what a policy can reach.
- **centre-out**, the conventional order, for scale.

All three acquire the protocol's ``initial + budget`` lines (section ``acquisition``) under one
MAR network, choose to maximise ``Q`` in the chosen region (``region: image``, or ``implant``:
the periprosthetic region, the implant dilated by ``margin`` pixels, a radiologist's reading
area) and are scored on the served MAR image (:func:`masc_gadget.core.served.served_images`,
without the OOD fallback: a line choice is compared, not a fallback rule). The lead ``oracle -
fixed`` is tested over subjects (:func:`training.evaluation.stats.subject_tests`). With several
MAR networks (``--mar A,B,C``, e.g. three training seeds) each is measured apart, and the
report gives the mean and spread of the lead and a test on the subjects' leads averaged over the
networks. With ``corruption`` > 0, each acquisition of a line is corrupted with that probability
(:mod:`training.rl.corruption`, ``motion`` or ``spike``): the fixed order and centre-out
play their lines' first acquisitions, and the oracle may also acquire a line again. With ``recon:
sense`` the lines are reconstructed with ``coils`` receive coils by CG-SENSE
(:mod:`training.evaluation.sense`) and scored without a MAR network (none is trained on such
images), so that coil encoding can make lines redundant slice by slice. The gate: a lead over
the better fixed order (the fitted one, or centre-out) below ``gate`` (0.03 SSIM) says a fixed
order refit per population is the method to deploy there, and an adaptive policy is not worth
training for it. ``policy_paths`` adds learned policies, judged by the share of that lead they
capture.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from masc_gadget.acquisition.episode import AcquisitionConfig, initial_lines
from masc_gadget.acquisition.policies import center_out_rank
from masc_gadget.config import Config, to_dict
from masc_gadget.core.kspace import zero_filled
from masc_gadget.device import resolve_device
from masc_gadget.models.checkpoint import load_mar
from sim_scanner.physics.coils import body_array
from training.data import REGIONS, SliceSet, load_split
from training.evaluation.sense import SenseRecon
from training.rl.corruption import CorruptionModel, ReacquireOracle, draw_attempts, kspace_of
from training.rl.env import BatchedAcquisitionEnv, EnvConfig
from training.evaluation.stats import mean_std, paired_tests, subject_folds, subject_means, subject_tests
from training.oracle import BeamOracle
from training.population import population_order
from training.scoring import Recon, line_masks, score_masks

__all__ = ["HeadroomConfig", "REGIONS", "add_policies", "headroom", "render_candidates", "render_headroom",
           "subject_folds", "write_headroom"]

log = logging.getLogger(__name__)

RECONS = ("zero-filled", "sense")
"""How the acquired lines become an image: the product's zero-filled image (then MAR), or
multi-coil CG-SENSE (no MAR)."""


METHODS = ("oracle", "fixed", "center-out")
"""The rows of a headroom measurement."""


@dataclass(frozen=True)
class HeadroomConfig:
    """``masc check headroom`` and ``masc check headroom`` (config section ``headroom``)."""

    folds: int = 2
    """Subject folds of the cross-fitted fixed order (>= 2)."""
    fit_split: str = ""
    """Empty: the fixed order is cross-fitted over ``folds`` subject folds of the measured split.
    A split name (``train``): one fixed order is fitted on that split of the same data folder
    (its subjects' ``slices_per_subject`` slices) and played on every measured slice: the order a
    deployment would ship, fitted on many more slices than a fold holds."""
    slices_per_subject: int = 2
    """Slices measured per subject, those with the most implant (0 = every slice). The oracle
    scores every free line at every step, so this sets the run time."""
    region: str = "image"
    """Where ``Q`` is maximised and SSIM decides: ``image`` or ``implant`` (periprosthetic)."""
    margin: int = 8
    """Pixels the implant is dilated by to give the periprosthetic region."""
    beam: int = 1
    """Beams of the oracle's search (1: the greedy oracle)."""
    gate: float = 0.03
    """The SSIM lead at which adaptivity is worth training for."""
    corruption: float = 0.0
    """Probability that an acquisition of a line is corrupted (0: none); the oracle may then
    acquire a line again."""
    corruption_kind: str = "motion"
    """``motion`` (a rigid shift along the readout during that line) or ``spike``."""
    attempts: int = 3
    """With corruption: acquisitions of one line at most (the first and its repeats)."""
    detection: float = 0.9
    """With corruption: the probability that the scanner flags a corrupted acquisition (what the
    gated order and a learned policy see; the oracle knows every draw)."""
    false_alarm: float = 0.02
    """With corruption: the probability that it flags a clean acquisition."""
    seed: int = 0
    """The corruption draws' seed."""
    recon: str = "zero-filled"
    """``zero-filled`` (the product's image, then each MAR network) or ``sense`` (``coils``
    receive coils, CG-SENSE, no MAR network)."""
    coils: int = 8
    """With ``recon: sense``: elements of the body array."""
    sense_iterations: int = 10
    """With ``recon: sense``: conjugate-gradient iterations."""
    batch_size: int = 32
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.folds < 2:
            raise ValueError(f"folds must be >= 2 (the order is fitted on the others), got {self.folds}")
        if self.region not in REGIONS:
            raise ValueError(f"region must be one of {', '.join(REGIONS)}, got {self.region!r}")
        for name in ("slices_per_subject", "margin"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.beam < 1 or self.batch_size < 1:
            raise ValueError(f"beam and batch_size must be >= 1, got {self.beam} and {self.batch_size}")
        if not self.gate > 0:
            raise ValueError(f"gate must be > 0, got {self.gate}")
        self.corruption_model()  # refuses a bad probability or kind
        if self.attempts < 1 or self.seed < 0:
            raise ValueError(f"attempts must be >= 1 and seed >= 0, got {self.attempts} and {self.seed}")
        if self.recon not in RECONS:
            raise ValueError(f"recon must be one of {', '.join(RECONS)}, got {self.recon!r}")
        if self.coils < 1 or self.sense_iterations < 1:
            raise ValueError(f"coils and sense_iterations must be >= 1, got {self.coils} and {self.sense_iterations}")
        if self.corruption > 0 and self.recon != "zero-filled":
            raise ValueError("corruption is measured on the zero-filled image: set recon zero-filled")
        if self.corruption > 0 and self.beam > 1:
            raise ValueError("with corruption the oracle is greedy over new lines and repeats: set beam 1")


    def corruption_model(self) -> CorruptionModel:
        """The corruption and the scanner's flags."""
        return CorruptionModel(self.corruption, self.corruption_kind, detection=self.detection,
                               false_alarm=self.false_alarm)

    def env_config(self, observe_mar: bool = True) -> EnvConfig:
        """The acquisition environment that replays this measurement's draws (the same attempts
        and flags of every line of every slice) for the gated order and learned policies."""
        return EnvConfig(n_envs=1, region=self.region, margin=self.margin, corruption=self.corruption,
                         corruption_kind=self.corruption_kind, attempts=self.attempts, detection=self.detection,
                         false_alarm=self.false_alarm, corruption_seed=self.seed, observe_mar=observe_mar)

def measured_slices(data: SliceSet, per_subject: int) -> np.ndarray:
    """Indices of the ``per_subject`` slices of each subject with the most implant pixels (all
    when 0), in data order."""
    if per_subject <= 0:
        return np.arange(len(data))
    area = data.implant_mask.reshape(len(data), -1).sum(dim=1).numpy()
    keep: list[int] = []
    for s in dict.fromkeys(data.subjects):
        rows = np.array([i for i, x in enumerate(data.subjects) if x == s])
        keep.extend(rows[np.argsort(-area[rows], kind="stable")[:per_subject]].tolist())
    return np.sort(np.asarray(keep, dtype=np.int64))


def _scores(data: SliceSet, masks: np.ndarray, mar: torch.nn.Module | None, roi: torch.Tensor,
            device: torch.device, batch_size: int, recon: Recon = zero_filled) -> dict[str, np.ndarray]:
    """Per slice: SSIM and PSNR of the served image of ``masks`` over the whole image and in
    ``roi`` (``roi_ssim``, ``roi_psnr``): :func:`training.scoring.score_masks`."""
    return score_masks(data, masks, mar, roi=roi, recon=recon, metrics=("ssim", "psnr"), batch_size=batch_size,
                       device=device).flat()


def gated_policy(order: np.ndarray, n_pe: int) -> Callable[[Any], torch.Tensor]:
    """The fixed order with navigator gating, for :meth:`BatchedAcquisitionEnv.evaluate`: while
    an acquired line is flagged (and has attempts left) it is acquired again, the most central
    first; otherwise the next line of ``order`` not yet acquired."""
    order_t = torch.as_tensor(np.asarray(order), dtype=torch.int64)
    distance = (torch.arange(n_pe) - n_pe // 2).abs().float()

    def choose(obs: Any) -> torch.Tensor:
        mask, flagged = obs.mask.cpu(), obs.repeatable.cpu()
        free = ~mask[:, order_t]
        following = order_t[free.to(torch.uint8).argmax(dim=1)]
        central = torch.where(flagged, -distance, torch.tensor(-math.inf)).argmax(dim=1)
        return torch.where(flagged.any(dim=1), central, following)

    return choose


def _measure_one(data: SliceSet, mar: torch.nn.Module | None, acq: AcquisitionConfig, hcfg: HeadroomConfig,
                 roi: torch.Tensor, device: torch.device, progress: bool,
                 recon: Recon = zero_filled,
                 fit_data: SliceSet | None = None, fit_roi: torch.Tensor | None = None) -> dict[str, Any]:
    """The three methods' lines and scores under one MAR network (or none)."""
    from tqdm.auto import tqdm

    n, n_pe = len(data), data.n_pe
    initial, budget = acq.initial, acq.budget
    objective = roi if hcfg.region == "implant" else None
    oracle = BeamOracle(hcfg.beam, recon=recon)
    attempts = None
    if hcfg.corruption > 0:  # every method's first acquisitions; the oracle may repeat a line
        model = hcfg.corruption_model()
        attempts, corrupted = draw_attempts(data.kspace_metal, data.slices, model, hcfg.attempts, hcfg.seed)
        clean = data
        data = replace(data, kspace_metal=attempts[:, 0].contiguous())
    fixed = np.zeros((n, budget), dtype=np.int64)
    orders = []
    if fit_data is not None:  # one order, fitted on another split
        folds = np.zeros(n, dtype=np.int64)
        order = population_order(fit_data, initial, budget, mar, device, hcfg.batch_size, oracle, progress=progress,
                                 roi=fit_roi if objective is not None else None)
        fixed[:] = order
        orders.append(order.tolist())
    else:
        folds = subject_folds(data.subjects, hcfg.folds)
        for k in range(hcfg.folds):
            fit = np.flatnonzero(folds != k)
            order = population_order(data.subset(fit), initial, budget, mar, device, hcfg.batch_size, oracle,
                                     progress=progress, roi=None if objective is None else objective[fit])
            fixed[folds == k] = order
            orders.append(order.tolist())
    start = line_masks(n, n_pe, initial, np.zeros((0,), dtype=np.int64))
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
    free = np.ones(n_pe, dtype=bool)
    free[initial_lines(n_pe, initial)] = False
    centre = np.flatnonzero(free)[np.argsort(center_out_rank(n_pe)[free], kind="stable")][:budget]
    lines = {"oracle": chosen, "fixed": fixed, "center-out": np.broadcast_to(centre, (n, budget))}
    scores = {m: _scores(data, line_masks(n, n_pe, initial, lines[m]), mar, roi, device, hcfg.batch_size, recon)
              for m in METHODS}
    record: dict[str, Any] = {"orders": orders, "folds": folds.tolist(), "oracle_lines": chosen.tolist()}
    if attempts is not None:  # the oracle's own acquisitions, repeats included
        served = replace(clean, kspace_metal=kspace_of(attempts, count))
        scores["oracle"] = _scores(served, count > 0, mar, roi, device, hcfg.batch_size)
        # the fitted order, acquiring each flagged line again first (navigator gating)
        env = BatchedAcquisitionEnv(clean, hcfg.env_config(), initial, budget, mar, device)
        gated_count = np.zeros_like(count)
        for k in np.unique(folds):
            rows = np.flatnonzero(folds == k)
            played = env.evaluate(gated_policy(fixed[rows[0]], n_pe), indices=rows, batch_size=hcfg.batch_size)
            gated_count[rows] = played["counts"].numpy()
        scores["gated"] = _scores(replace(clean, kspace_metal=kspace_of(attempts, gated_count)), gated_count > 0,
                                      mar, roi, device, hcfg.batch_size)
        record["gated_counts"] = gated_count.tolist()
        first = corrupted[:, 0]
        record["corruption"] = {
            "repeats_per_slice": float((count.sum(axis=1) - count.astype(bool).sum(axis=1)).mean()),
            "repeats_per_slice_gated": float((gated_count.sum(axis=1) - (gated_count > 0).sum(axis=1)).mean()),
            "corrupted_lines_fixed": float(np.mean([first[i, line_masks(1, n_pe, initial, fixed[i])[0]].sum()
                                                    for i in range(n)])),
            "corrupted_lines_oracle": float(np.mean([corrupted[i, np.clip(count[i] - 1, 0, None), np.arange(n_pe)]
                                                     [count[i] > 0].sum() for i in range(n)])),
        }
    return {**record, "scores": scores}


def _key(region: str) -> str:
    return "ssim" if region == "image" else "roi_ssim"


def headroom(config: Config, data_dir: str | Path, split: str, mar_paths: list[str | Path],
             progress: bool = True, policy_paths: list[str | Path] | None = None) -> dict[str, Any]:
    """Measure the oracle's lead over the fixed order (module docstring) on ``split`` of
    ``data_dir`` under each MAR network of ``mar_paths``; returns the report.

    ``policy_paths``: one learned-policy checkpoint per MAR network (same order), e.g. MASC
    trained under that frozen network: each plays the measured slices under its network, and the
    report gives how much of the oracle's lead over the fixed order it captures."""
    hcfg: HeadroomConfig = config["headroom"]
    acq: AcquisitionConfig = config["acquisition"]
    sense = hcfg.recon == "sense"
    if sense and mar_paths:
        raise ValueError("recon sense is scored without a MAR network (none is trained on SENSE images): drop --mar")
    if not sense and not mar_paths:
        raise ValueError("the headroom is measured under a MAR network: give at least one --mar")
    policy_paths = list(policy_paths or [])
    if policy_paths and len(policy_paths) != len(mar_paths):
        raise ValueError(f"give one policy checkpoint per MAR network (the network it was trained under): "
                         f"{len(policy_paths)} --policy for {len(mar_paths)} --mar")
    device = resolve_device(hcfg.device)
    full = load_split(data_dir, split)
    if acq.initial + acq.budget > full.n_pe:
        raise ValueError(f"acquisition initial + budget ({acq.initial} + {acq.budget}) exceeds the data's "
                         f"{full.n_pe} phase-encoding lines")
    data = full.subset(measured_slices(full, hcfg.slices_per_subject))
    roi = data.periprosthetic_roi(hcfg.margin)
    fit_data = fit_roi = None
    if not hcfg.fit_split and len(set(data.subjects)) < hcfg.folds and split != "train":
        log.warning("%s/%s has %d subject(s), fewer than the %d folds the cross-fitted order needs: the fixed order "
                    "is fitted on the train split instead (headroom.fit_split=train)", data_dir, split,
                    len(set(data.subjects)), hcfg.folds)
        hcfg = dataclasses.replace(hcfg, fit_split="train")
    if hcfg.fit_split:
        if hcfg.fit_split == split:
            raise ValueError(f"headroom.fit_split {split!r} is the measured split: fit the fixed order on another "
                             "split (train), or leave fit_split empty to cross-fit it over subject folds")
        fit_full = load_split(data_dir, hcfg.fit_split)
        if fit_full.n_pe != full.n_pe:
            raise ValueError(f"split {hcfg.fit_split!r} has {fit_full.n_pe} phase-encoding lines, split {split!r} "
                             f"{full.n_pe}: the fixed order must be fitted on the measured protocol")
        fit_data = fit_full.subset(measured_slices(fit_full, hcfg.slices_per_subject))
        fit_roi = fit_data.periprosthetic_roi(hcfg.margin)
        log.info("fixed order fitted on %s/%s: %d slices of %d subjects", data_dir, hcfg.fit_split, len(fit_data),
                 len(set(fit_data.subjects)))
    log.info("headroom on %s/%s: %d slices of %d subjects, %d + %d of %d lines, region %s, beam %d, corruption "
             "%g (%s), %d MAR network(s)", data_dir, split, len(data), len(set(data.subjects)), acq.initial,
             acq.budget, data.n_pe, hcfg.region, hcfg.beam, hcfg.corruption, hcfg.corruption_kind, len(mar_paths))
    key = _key(hcfg.region)
    recon = zero_filled
    if sense:
        maps = torch.from_numpy(body_array(hcfg.coils, tuple(data.target.shape[1:]), config["sequence"].fov_mm))
        recon = SenseRecon(maps.to(device), hcfg.sense_iterations)
    runs = []
    for j, path in enumerate(mar_paths or [None]):
        mar, meta = (None, {}) if path is None else load_mar(path, device)
        if mar is not None:
            mar.eval()
        one = _measure_one(data, mar, acq, hcfg, roi, device, progress, recon, fit_data, fit_roi)
        scores = one.pop("scores")
        _judge_against_best(one, scores, key, data.subjects)
        if "gated" in scores:
            one["gated_vs_fixed"] = subject_tests(scores["gated"][key], scores["fixed"][key], data.subjects)
            one["lead_gated"] = subject_tests(scores["oracle"][key], scores["gated"][key], data.subjects)
        if policy_paths:
            _attach_policy(one, scores, policy_paths[j], data, mar, acq, roi, device, hcfg, key, progress)
        one.update({
            "mar": f"none ({hcfg.coils}-coil SENSE)" if path is None else str(path),
            "mar_metadata": {k: meta.get(k) for k in ("kind", "epoch", "code_version") if k in meta},
            "slices": {m: {k: v.tolist() for k, v in scores[m].items()} for m in scores},
            "means": {m: {k: float(np.mean(v)) for k, v in scores[m].items()} for m in scores},
            "lead": subject_tests(scores["oracle"][key], scores["fixed"][key], data.subjects),
            "lead_psnr": subject_tests(scores["oracle"][key.replace("ssim", "psnr")],
                                       scores["fixed"][key.replace("ssim", "psnr")], data.subjects),
            "fixed_vs_center_out": subject_tests(scores["fixed"][key], scores["center-out"][key], data.subjects),
        })
        log.info("headroom under %s: oracle %.4f, fixed %.4f, centre-out %.4f %s; lead %+.4f (subject p %.2g)",
                 one["mar"], one["means"]["oracle"][key], one["means"]["fixed"][key], one["means"]["center-out"][key],
                 key, one["lead"]["diff"], one["lead"]["p_ttest"])
        runs.append(one)
    report: dict[str, Any] = {
        "data": str(data_dir), "split": split, "n_slices": len(data), "n_subjects": len(set(data.subjects)),
        "labels": [data.label(i) for i in range(len(data))],
        "acquisition": {"initial": acq.initial, "budget": acq.budget, "n_pe": data.n_pe},
        "config": {"headroom": to_dict(hcfg)}, "metric": key, "runs": runs,
    }
    report["summary"] = summarise(report)
    return report


def _attach_policy(run: dict[str, Any], scores: dict[str, dict[str, np.ndarray]], path: str | Path,
                   data: SliceSet, mar: torch.nn.Module | None, acq: AcquisitionConfig, roi: torch.Tensor,
                   device: torch.device, hcfg: HeadroomConfig, key: str, progress: bool) -> None:
    """Play the learned policy ``path`` under ``mar`` and add its lines, scores, tests against
    the fitted and the better fixed order (``run["best_fixed"]``, :func:`_judge_against_best`),
    and captured share to ``run`` (and ``scores``). With corruption the policy plays the
    measurement's draws, sees the scanner's flags and may acquire a flagged line again; it is
    also tested against the gated order."""
    best = run["best_fixed"]
    run["policy"] = str(path)
    if hcfg.corruption > 0:
        run["policy_lines"], scores["policy"] = _play_reacquiring(path, data, mar, acq, roi, device, hcfg)
        run["policy_vs_gated"] = subject_tests(scores["policy"][key], scores["gated"][key], data.subjects)
    else:
        run["policy_lines"], scores["policy"] = _play_policy(path, data, mar, acq, roi, device, hcfg.batch_size,
                                                             progress)
    run["policy_vs_fixed"] = subject_tests(scores["policy"][key], scores["fixed"][key], data.subjects)
    run["policy_vs_best"] = subject_tests(scores["policy"][key], scores[best][key], data.subjects)
    run["captured"] = _captured(scores, key, best)
    log.info("policy %s: %.4f %s, %+.4f over the better fixed order (%s, subject p %.2g), %.0f%% of the oracle's "
             "lead", path, float(np.mean(scores["policy"][key])), key, run["policy_vs_best"]["diff"], best,
             run["policy_vs_best"]["p_ttest"], 100 * run["captured"])


def _judge_against_best(run: dict[str, Any], scores: dict[str, dict[str, np.ndarray]], key: str,
                        subjects: list[str]) -> None:
    """Name the run's better fixed order (:func:`_better_fixed`) and test the oracle's lead over
    it over subjects (``best_fixed``, ``lead_best``)."""
    best = _better_fixed({m: {key: float(np.mean(scores[m][key]))} for m in ("fixed", "center-out")}, key)
    run["best_fixed"] = best
    run["lead_best"] = subject_tests(scores["oracle"][key], scores[best][key], subjects)


def add_policies(config: Config, report: dict[str, Any], policy_paths: list[str | Path],
                 progress: bool = True) -> dict[str, Any]:
    """A headroom report with learned policies scored on its slices, one per MAR network (same
    order), without measuring the oracle and the fixed order again: how a policy trained after
    the gate is judged against the headroom it was trained for. Returns a new report."""
    import copy

    runs = report["runs"]
    if len(policy_paths) != len(runs):
        raise ValueError(f"give one policy checkpoint per MAR network of the report: {len(policy_paths)} --policy "
                         f"for {len(runs)} network(s) ({', '.join(r['mar'] for r in runs)})")
    h, rec = report["config"]["headroom"], report["acquisition"]
    if h.get("recon") == "sense":
        raise ValueError("learned policies are scored on the zero-filled image: this report measured SENSE")
    if h.get("corruption", 0) > 0 and "gated" not in runs[0]["slices"]:
        raise ValueError("this corruption report has no gated order (it was measured before the scanner's flags "
                         "were modelled): measure it again, with --policy")
    acq: AcquisitionConfig = config["acquisition"]
    if (acq.initial, acq.budget) != (rec["initial"], rec["budget"]):
        raise ValueError(f"the report measured {rec['initial']} + {rec['budget']} lines, the config gives "
                         f"{acq.initial} + {acq.budget}: pass the same --set acquisition.* as the measurement")
    full = load_split(report["data"], report["split"])
    where = {full.label(i): i for i in range(len(full))}
    missing = [lab for lab in report["labels"] if lab not in where]
    if missing:
        raise ValueError(f"{report['data']}/{report['split']} no longer holds the measured slices "
                         f"({len(missing)} missing, e.g. {missing[0]})")
    data = full.subset(np.asarray([where[lab] for lab in report["labels"]]))
    roi = data.periprosthetic_roi(h["margin"])
    known = {f.name for f in dataclasses.fields(HeadroomConfig)}
    hcfg = HeadroomConfig(**{k: v for k, v in h.items() if k in known})  # the measurement's settings
    device = resolve_device(h.get("device", "auto"))
    key = report["metric"]
    out = copy.deepcopy(report)
    for run, path in zip(out["runs"], policy_paths):
        mar = load_mar(run["mar"], device)[0].eval()
        scores = {m: {k: np.asarray(v) for k, v in run["slices"][m].items()} for m in (*METHODS, "gated")
                  if m in run["slices"]}
        _judge_against_best(run, scores, key, data.subjects)  # a report written before the rule has none
        _attach_policy(run, scores, path, data, mar, acq, roi, device, hcfg, key, progress)
        run["slices"]["policy"] = {k: v.tolist() for k, v in scores["policy"].items()}
        run["means"]["policy"] = {k: float(np.mean(v)) for k, v in scores["policy"].items()}
    out["summary"] = summarise(out)
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
    attempts, _ = draw_attempts(data.kspace_metal, data.slices, hcfg.corruption_model(), hcfg.attempts, hcfg.seed)
    served = replace(data, kspace_metal=kspace_of(attempts, count))
    return played["lines"].tolist(), _scores(served, count > 0, mar, roi, device, hcfg.batch_size)


def _captured(scores: dict[str, dict[str, np.ndarray]], key: str, best: str) -> float:
    """The share of the oracle's lead over the better fixed order ``best`` that the policy
    captures (NaN when the oracle does not lead)."""
    lead = float(np.mean(scores["oracle"][key]) - np.mean(scores[best][key]))
    gain = float(np.mean(scores["policy"][key]) - np.mean(scores[best][key]))
    return gain / lead if lead > 0 else math.nan


def _better_fixed(means: dict[str, dict[str, float]], key: str) -> str:
    """The better of the two fixed orders (the fitted one, or centre-out) by their mean ``key``:
    the baseline the gate and a learned policy are measured against."""
    return max(("fixed", "center-out"), key=lambda m: means[m][key])


def _pooled_over_subjects(runs: list[dict[str, Any]], method: str, key: str, subjects: list[str],
                          best: bool = False) -> tuple[np.ndarray, dict[str, float]]:
    """Each subject's ``method - fixed`` (its slices' mean; with ``best``, minus each run's
    better fixed order), averaged over the MAR networks, and the paired tests against zero."""
    per_subject = [subject_means(np.asarray(r["slices"][method][key])
                                 - np.asarray(r["slices"][_better_fixed(r["means"], key) if best else "fixed"][key]),
                                 subjects)[1] for r in runs]
    pooled = np.mean(per_subject, axis=0)
    return pooled, paired_tests(pooled, np.zeros_like(pooled))


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """Mean and spread over the MAR networks, a test on the subjects' leads averaged over them,
    and the gate's verdict."""
    key, runs = report["metric"], report["runs"]
    hcfg = report["config"]["headroom"]
    labels = report["labels"]
    subjects = [lab.rsplit("/", 1)[0] for lab in labels]
    leads = np.array([r["lead"]["diff"] for r in runs])
    pooled, test = _pooled_over_subjects(runs, "oracle", key, subjects)
    lead = mean_std(leads)
    # the gate reads the lead over the better fixed order (the fitted one, or centre-out)
    best_fixed = [_better_fixed(r["means"], key) for r in runs]
    best_leads = np.array([r["means"]["oracle"][key] - r["means"][b][key] for r, b in zip(runs, best_fixed)])
    pooled_best, test_best = _pooled_over_subjects(runs, "oracle", key, subjects, best=True)
    lead_best = mean_std(best_leads)
    passes = bool(lead_best["mean"] >= hcfg["gate"])
    verdict = ("adaptive line choice can pay here: train MASC for it" if passes
               else "a fixed order refit on this population is the method to deploy here")
    if len(set(subjects)) < 3:  # no test over subjects: say what the number is
        verdict = (f"{len(set(subjects))} subject(s): too few to decide (the lead is "
                   f"{'above' if passes else 'below'} the gate here; measure at least 3 subjects)")
    out: dict[str, Any] = {}
    if runs and all("gated" in r["means"] for r in runs):  # corruption: the fitted order with navigator gating
        gated_gain = np.array([r["means"]["gated"][key] - r["means"][b][key] for r, b in zip(runs, best_fixed)])
        out["gated"] = {
            "means": mean_std(np.array([r["means"]["gated"][key] for r in runs])),
            "gain": mean_std(gated_gain),
            "captured": mean_std(gated_gain / np.maximum(best_leads, 1e-12)),
        }
    if runs and all("policy" in r for r in runs):
        pooled_gain, gain_test = _pooled_over_subjects(runs, "policy", key, subjects, best=True)
        out["policy"] = {
            "means": mean_std(np.array([r["means"]["policy"][key] for r in runs])),
            "gain_over_fixed": mean_std(np.array([r["policy_vs_fixed"]["diff"] for r in runs])),
            "gain": mean_std(np.array([r["policy_vs_best"]["diff"] for r in runs])),
            "captured": mean_std(np.array([r["captured"] for r in runs])),
            "captured_per_mar": [r["captured"] for r in runs],
            "p_subjects": gain_test["p_ttest"], "p_wilcoxon_subjects": gain_test["p_wilcoxon"],
            "subjects_ahead": int((pooled_gain > 0).sum()),
        }
        if all("policy_vs_gated" in r for r in runs):
            per_subject = [subject_means(np.asarray(r["slices"]["policy"][key]) - np.asarray(r["slices"]["gated"][key]),
                                         subjects)[1] for r in runs]
            pooled_vs_gated = np.mean(per_subject, axis=0)
            vs_gated = paired_tests(pooled_vs_gated, np.zeros_like(pooled_vs_gated))
            out["policy"]["vs_gated"] = {
                "diff": mean_std(np.array([r["policy_vs_gated"]["diff"] for r in runs])),
                "p_subjects": vs_gated["p_ttest"], "subjects_ahead": int((pooled_vs_gated > 0).sum()),
            }
    return {
        **out,
        "metric": key,
        "lead": lead,
        "lead_per_mar": leads.tolist(),
        "lead_psnr": mean_std(np.array([r["lead_psnr"]["diff"] for r in runs])),
        "means": {m: mean_std(np.array([r["means"][m][key] for r in runs])) for m in METHODS},
        "p_subjects": test["p_ttest"], "p_wilcoxon_subjects": test["p_wilcoxon"],
        "subjects_oracle_ahead": int((pooled > 0).sum()), "n_subjects": len(pooled),
        "lead_best": lead_best, "best_fixed": best_fixed,
        "p_subjects_best": test_best["p_ttest"], "subjects_oracle_ahead_best": int((pooled_best > 0).sum()),
        "gate": hcfg["gate"], "passes": passes, "verdict": verdict,
    }


def _fmt(value: float, digits: int = 4) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def render_headroom(report: dict[str, Any]) -> str:
    """The report as Markdown."""
    s, acq, key = report["summary"], report["acquisition"], report["metric"]
    h = report["config"]["headroom"]
    region = "whole image" if h["region"] == "image" else f"periprosthetic region (implant + {h['margin']} px)"
    oracle = "greedy oracle" if h["beam"] == 1 else f"beam-{h['beam']} oracle"
    if h.get("corruption", 0) > 0:
        oracle = (f"{h['corruption']:.0%} of acquisitions corrupted ({h['corruption_kind']}); greedy oracle that may "
                  f"acquire a line again (up to {h['attempts']} times)")
    if h.get("recon") == "sense":
        oracle += f"; {h['coils']}-coil CG-SENSE ({h['sense_iterations']} iterations), no MAR network"
    lines = [
        f"# Headroom of adaptive line choice: {report['data']} / {report['split']}",
        "",
        f"{report['n_slices']} slices of {report['n_subjects']} subjects, {acq['initial']} + {acq['budget']} of "
        f"{acq['n_pe']} lines, scored in the {region} ({key}); {_fitted(h)}; {oracle}"
        + ("." if h.get("recon") == "sense" else f"; {len(report['runs'])} MAR network(s)."),
        "",
        f"| MAR | oracle | fixed ({_fitted(h, short=True)}) | centre-out | lead (oracle - fixed) | subject p "
        "| lead, dB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["runs"]:
        m = r["means"]
        lines.append(f"| {Path(r['mar']).name} | {_fmt(m['oracle'][key])} | {_fmt(m['fixed'][key])} | "
                     f"{_fmt(m['center-out'][key])} | {r['lead']['diff']:+.4f} | {r['lead']['p_ttest']:.2g} | "
                     f"{r['lead_psnr']['diff']:+.2f} |")
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
        for r in report["runs"]:
            lines.append(f"| {Path(r['mar']).name} | {_fmt(r['means']['policy'][key])} | "
                         f"{r['policy_vs_fixed']['diff']:+.4f} | {r['policy_vs_best']['diff']:+.4f} "
                         f"({r['best_fixed']}) | {r['policy_vs_best']['p_ttest']:.2g} | {_percent(r['captured'])} |")
        lines += ["", f"The learned policies ({', '.join(Path(r['policy']).name for r in report['runs'])}) gain "
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


def write_headroom(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """``headroom.json`` and ``headroom.md`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "headroom.json", "md": out / "headroom.md"}
    paths["json"].write_text(json.dumps(report, indent=1))
    paths["md"].write_text(render_headroom(report))
    return paths


def describe(report: dict[str, Any]) -> str:
    """What a headroom report measured, in a few words (its row of :func:`render_candidates`)."""
    h, acq = report["config"]["headroom"], report["acquisition"]
    parts = [f"{acq['initial']} + {acq['budget']} lines"]
    parts.append("whole image" if h["region"] == "image" else f"implant + {h['margin']} px")
    if h.get("recon") == "sense":
        parts.append(f"{h['coils']}-coil SENSE, no MAR")
    if h.get("corruption", 0) > 0:
        parts.append(f"{h['corruption']:.0%} {h['corruption_kind']}, repeats allowed")
    if h["beam"] > 1:
        parts.append(f"beam {h['beam']}")
    if h.get("fit_split"):
        parts.append(f"fixed order fitted on {h['fit_split']}")
    return ", ".join(parts)


def render_candidates(reports: dict[str, dict[str, Any]]) -> str:
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
