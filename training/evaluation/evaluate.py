"""Evaluation harness: every sampling method with and without MAR, every test slice, per-step
curves, paired statistics, the paper's Table 1 layout and figures.

``evaluate`` produces a plain results dict (written as ``results.json``); the table and the
figures are rendered from it, so the numbers in ``table.md`` are exactly those in the json.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from masc_gadget.acquisition.episode import EpisodeBatch
from masc_gadget.models.checkpoint import load_mar
from masc_gadget.config import Config, to_dict
from masc_gadget.device import resolve_device
from masc_gadget.core.kspace import zero_filled
from masc_gadget.core.metrics import METRICS
from masc_gadget.core.ood import OodCalibration, early_switch, fallback_rule, initial_of, switch_point
from masc_gadget.acquisition.policies import (FixedOrder, SamplingPolicy, make_policy, select_next, select_trains,
                                              slice_rng)
from training.data import SliceSet, load_split, spread_subset
from training.oracle import NAME as ORACLE
from training.oracle import GreedyOracle
from training.population import NAME as POPULATION
from training.population import population_order
from training.scoring import do_nothing, score_batch
from training.evaluation.figures import plot_curves, plot_examples
from training.evaluation.stats import mean_std
from training.evaluation.tables import add_tests, render_table

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation settings (config section ``eval``)."""

    methods: tuple[str, ...] = ("center-out", "random", "random-lowbias", "equispaced")
    """Sampling methods to compare: policy names, ``oracle`` (the greedy one-step oracle, which
    reads the ground truth: the yardstick, not a deployable method) and ``population`` (the
    population-greedy fixed order, learned on the training split)."""
    accelerations: dict[str, tuple[int, int]] = field(
        default_factory=lambda: {"10x": (2, 18), "5x": (8, 32)}
    )
    """Named (initial, budget) settings; the paper's 10x is 2 + 18 and 5x is 8 + 32 of 200 lines."""
    reference: str = ""
    """Row the p-values are computed against, "method" (with MAR) or "method+nomar";
    empty: the first method with MAR."""
    batch_size: int = 32
    """Slices per forward pass."""
    examples: int = 3
    """Slices shown in examples.png (those with the most implant)."""
    seed: int = 0
    """Seed of the random policies (each slice gets its own stream)."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""
    max_slices: int = 0
    """Evaluate only the first N slices of the split (0 = all)."""
    population_slices: int = 64
    """Training slices the ``population`` order is computed on, evenly spread over the training
    split (0 = all; its cost grows as slices x lines x budget)."""
    population_data: str = ""
    """Dataset whose training split the ``population`` order is learned on; "" = the evaluated
    dataset. A held-out set without a training split (``masc simulate external``) names the
    dataset the methods were trained on."""

    def __post_init__(self) -> None:
        if not self.methods:
            raise ValueError("methods must name at least one sampling method")
        if not self.accelerations:
            raise ValueError("accelerations must contain at least one (initial, budget) setting")
        for name, (initial, budget) in self.accelerations.items():
            if initial < 1 or budget < 1:
                raise ValueError(f"accelerations.{name}: initial and budget must be >= 1, got {initial}, {budget}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.examples < 0 or self.max_slices < 0 or self.population_slices < 0:
            raise ValueError("examples, max_slices and population_slices must be >= 0")


@dataclass
class Trajectories:
    """Per-step metrics of one method at one acceleration (N slices, T = budget + 1 steps)."""

    lines: np.ndarray  # (N, initial + budget) acquisition order
    curves: dict[bool, dict[str, np.ndarray]]  # mar? -> metric -> (N, T)
    finals: dict[bool, torch.Tensor] = field(default_factory=dict)  # mar? -> (E, H, W) example images
    served_mar: np.ndarray | None = None  # (N,) bool: the final image served is the MAR network's


def run_method(policy: SamplingPolicy | GreedyOracle, data: SliceSet, initial: int, budget: int,
               mar: torch.nn.Module | None, seed: int, batch_size: int, device: torch.device,
               example_index: list[int] = (), progress: bool = False, lines_per_decision: int = 1,
               ood: OodCalibration | None = None, score: bool = True) -> Trajectories:
    """Run ``policy`` on every slice (batched), scoring the served zero-filled and MAR images
    (:func:`masc_gadget.core.served.served_images`, the gadget's pixels) after the initial lines
    and after each line. The policy observes what it observes in the gadget: the unclamped
    output of ``mar`` when it observes MAR (:meth:`SamplingPolicy.sees_mar`), else the
    zero-filled image. Random policies draw from ``slice_rng(seed, slice index in its subject)``,
    the gadget's stream of that slice. The :class:`GreedyOracle` chooses with the clean
    target, under ``mar`` when given, one line at a time. ``progress``: a bar over the slices
    (the oracle is slow). ``lines_per_decision`` k > 1: the policy chooses echo trains of k
    lines from the image before each train (:func:`select_trains`); the curves still have one
    point per line. ``ood``: the gadget's rule for serving a slice zero-filled when its MAR
    image's OOD score is too high (:func:`masc_gadget.core.ood.fallback_rule`), applied to the
    scored MAR images as the gadget applies it; an early rule (the network's early
    calibration) scores the images of the initial lines before the first choice (or, with its
    ``after_lines``, of that many lines: :func:`masc_gadget.core.ood.switch_point`) and switches
    the slices it flags to centre-out (:func:`masc_gadget.core.ood.early_switch`), as the engine
    does, whether or not the policy reads the image. ``score`` False plays the policy alone: the lines, no curves (and no network pass for
    a policy that reads no image)."""
    from tqdm.auto import tqdm

    early = ood is not None and ood.stage == "early"
    if early and (mar is None or isinstance(policy, GreedyOracle)):
        raise ValueError("an early OOD rule needs a MAR network and a policy (not the oracle)")
    n = len(data)
    settings = [False] + ([True] if mar is not None else [])
    play = _Play(policy, initial, budget, mar, ood, score, lines_per_decision, early,
                 (switch_point(ood, initial, lines_per_decision) or initial) - initial,  # lines chosen when scored
                 settings, {m: {k: np.zeros((n, budget + 1)) for k in METRICS} for m in settings},
                 {m: [] for m in settings}, {int(i): j for j, i in enumerate(example_index)}, np.zeros(n, dtype=bool))
    lines = np.zeros((n, initial + budget), dtype=np.int64)
    bar = tqdm(total=n, desc=getattr(policy, "name", "method"), unit="slice", leave=False, disable=not progress)
    for start in range(0, n, batch_size):
        index = list(range(start, min(start + batch_size, n)))
        lines[index] = _play_batch(play, data, index, seed, device)
        bar.update(len(index))
    bar.close()
    return Trajectories(lines, play.curves, {m: torch.stack([img for _, img in sorted(v, key=lambda x: x[0])])
                                             for m, v in play.finals.items() if v},
                        play.served_mar if mar is not None and score else None)


@dataclass
class _Play:
    """:func:`run_method`'s settings, and what it gathers over the batches (the curves per
    setting, MAR off / on, the example images, which slices were served their MAR image)."""

    policy: SamplingPolicy | GreedyOracle
    initial: int
    budget: int
    mar: torch.nn.Module | None
    ood: OodCalibration | None
    score: bool
    lines_per_decision: int
    early: bool
    t_switch: int
    settings: list[bool]
    curves: dict[bool, dict[str, np.ndarray]]
    finals: dict[bool, list[tuple[int, torch.Tensor]]]
    wanted: dict[int, int]
    served_mar: np.ndarray


def _play_batch(p: _Play, data: SliceSet, index: list[int], seed: int, device: torch.device) -> np.ndarray:
    """One batch of :func:`run_method`: the slices ``index`` played line by line, scored into
    ``p``; returns their lines in acquisition order."""
    policy, mar, k = p.policy, p.mar, p.lines_per_decision
    kspace = data.kspace_metal[index].to(device)
    target = data.target[index].to(device)
    episodes = EpisodeBatch(data.n_pe, p.initial, p.budget, len(index), device,
                            rngs=[slice_rng(seed, int(data.slices[i])) for i in index])
    for t in range(p.budget + 1):
        if not p.score and t == p.budget:
            break
        at_switch = p.early and t == p.t_switch
        needed = p.score or (policy.needs_image and not isinstance(policy, GreedyOracle)) or at_switch
        images = {False: zero_filled(kspace, episodes.mask)} if needed else {}  # what a policy observes
        if mar is not None and needed:
            images[True] = mar(images[False])
        if at_switch:  # the engine's decision pass at the switch point
            flagged, verdict = early_switch(p.ood, images[False], images[True], episodes.mask, mar,
                                            initial_of(p.ood, kspace, p.initial, episodes.mask))
            episodes.switch(None, flagged.cpu().numpy(), verdict.cpu().numpy())
        if p.score:  # what the gadget returns
            scores = score_batch(images[False], images.get(True), target, ood=p.ood, mask=episodes.mask, mar=mar,
                                 switched=torch.from_numpy(episodes.switched).to(device),
                                 early_score=torch.from_numpy(episodes.switch_score).to(device))
            for m in p.settings:
                for key, value in (scores.image if m else scores.zero_filled).items():
                    p.curves[m][key][index, t] = value.double().cpu().numpy()
        if t == p.budget:
            if mar is not None:
                p.served_mar[index] = scores.served.mar_used.cpu().numpy()
            scored = {False: scores.served.zero_filled, True: scores.served.image}
            p.finals.update({m: p.finals[m] + [(p.wanted[i], scored[m][b].cpu()) for b, i in enumerate(index)
                                               if i in p.wanted] for m in p.settings})
            break
        if isinstance(policy, GreedyOracle):
            episodes.acquire(policy.choose(episodes, kspace, target, mar))
            continue
        seen = None
        if policy.needs_image and (k == 1 or t % k == 0):
            seen = images[policy.sees_mar(mar is not None)].cpu().numpy()
        if k == 1:
            episodes.acquire(select_next(policy, episodes, images=seen))
            continue
        if t % k == 0:  # a new train, chosen from the image before it
            trains = select_trains(policy, episodes.states(images=seen), episodes.rngs, k)
        episodes.acquire(trains[:, t % k])
    return episodes.chosen()


def _score_method(config: Config, data: SliceSet, acc: str, method: str, policy: Any, mar: torch.nn.Module | None,
                  examples: list[int], results: dict[str, Any], figures: dict[str, Any], device: torch.device,
                  progress: bool) -> None:
    """One method at one acceleration of :func:`evaluate`, played and served under ``mar`` as the
    gadget serves it (its OOD rule from ``gadget.mar_fallback``): its rows into ``results``
    (with doing nothing, the reference of harm, once per acceleration) and its example images
    into ``figures``."""
    ecfg: EvalConfig = config["eval"]
    initial, budget = ecfg.accelerations[acc]
    k = config["acquisition"].lines_per_decision
    traj = run_method(policy, data, initial, budget, mar, ecfg.seed, ecfg.batch_size, device, examples,
                      progress=progress and isinstance(policy, GreedyOracle), lines_per_decision=k,
                      ood=fallback_rule(mar, config["gadget"].mar_fallback,
                                        switches_early=not isinstance(policy, GreedyOracle)))
    if acc not in results["accelerations"]:  # doing nothing: the reference of harm
        nothing = do_nothing(data, initial, budget, batch_size=ecfg.batch_size)
        results["accelerations"][acc] = {
            "initial": initial, "budget": budget, "n_pe": data.n_pe, "lines_per_decision": k,
            "factor": data.n_pe / (initial + budget), "rows": [],
            "nothing": {key: v.tolist() for key, v in nothing.items()},
        }
    block = results["accelerations"][acc]
    for row in result_rows(method, traj, initial, budget):
        block["rows"].append(row)
        if row["mar"] in traj.finals:
            masks = np.zeros((len(examples), data.n_pe), dtype=bool)
            for j, i in enumerate(examples):
                masks[j, traj.lines[i]] = True
            figures["rows"][(acc, row["key"])] = (traj.finals[row["mar"]], masks)


def pick_examples(data: SliceSet, count: int) -> list[int]:
    """Slices with the most implant, at most one per subject while possible."""
    if count <= 0:
        return []
    area = data.implant_mask.reshape(len(data), -1).sum(dim=1).numpy()
    order = np.argsort(-area, kind="stable")
    chosen, subjects = [], set()
    for i in order:
        if data.subjects[i] not in subjects:
            chosen.append(int(i))
            subjects.add(data.subjects[i])
        if len(chosen) == count:
            return chosen
    return (chosen + [int(i) for i in order if int(i) not in chosen])[:count]


def _row_key(method: str, mar: bool) -> str:
    return method if mar else f"{method}+nomar"


def load_policies(methods: list[str], checkpoint: str | Path | list[str | Path] | None, device: torch.device
                  ) -> tuple[dict[str, SamplingPolicy | GreedyOracle], dict[str, torch.nn.Module]]:
    """The policy of each method, and the MAR networks that learned methods bring with them
    (MASC fine-tuned end to end, the learned mask trained jointly), by method name.

    ``checkpoint``: the trained checkpoints of the learned methods (``masc``, ``dqn``,
    ``ss-ddqn``, ``loupe``), a list or one comma-separated string; each file's kind says which
    method it is."""
    from masc_gadget.acquisition.learned import KINDS, load_learned

    if isinstance(checkpoint, (str, Path)):
        paths = [p.strip() for p in str(checkpoint).split(",") if p.strip()]
    else:
        paths = [str(p) for p in (checkpoint or [])]
    learned: dict[str, tuple[SamplingPolicy, torch.nn.Module | None, str]] = {}
    for path in paths:
        policy, mar, meta = load_learned(path, device)
        kind = meta["kind"]
        if kind in learned:
            raise ValueError(f"two {kind} checkpoints given ({learned[kind][2]} and {path}); evaluate one per run")
        learned[kind] = (policy, mar, path)
    unused = sorted(set(learned) - set(methods))
    if unused:
        log.warning("--checkpoint gives a %s checkpoint that no method uses (add %s to --methods)",
                    ", ".join(unused), ",".join(unused))
    own_mar: dict[str, torch.nn.Module] = {}
    policies: dict[str, SamplingPolicy | GreedyOracle] = {}
    for name in methods:
        if name == ORACLE:
            policies[name] = GreedyOracle()
            continue
        if name == POPULATION:  # one order per acceleration, learned in evaluate()
            continue
        if name not in KINDS:
            policies[name] = make_policy(name)
            continue
        if name not in learned:
            raise ValueError(f"method {name!r} needs a trained checkpoint: pass --checkpoint CKPT[,CKPT...] "
                             f"(masc train {name})")
        policies[name], masc_mar, _ = learned[name]
        if masc_mar is not None:
            own_mar[name] = masc_mar.eval()
    return policies, own_mar


def population_policies(ecfg: EvalConfig, data_dir: str | Path, n_pe: int,
                        mar: torch.nn.Module | None, device: torch.device, progress: bool = False
                        ) -> tuple[dict[str, FixedOrder], dict[str, Any]]:
    """The ``population`` method's fixed order at each acceleration, learned on (a spread
    subsample of) the *training* split under ``mar``; and its record for results.json."""
    train = spread_subset(load_split(data_dir, "train"), ecfg.population_slices)
    if train.n_pe != n_pe:
        raise ValueError(f"the training split has {train.n_pe} PE lines, the evaluated split {n_pe}")
    orders = {}
    for acc, (initial, budget) in ecfg.accelerations.items():
        log.info("learning the population order for %s on %d training slices", acc, len(train))
        orders[acc] = FixedOrder(population_order(train, initial, budget, mar, device, ecfg.batch_size,
                                                  progress=progress),
                                 name=POPULATION)
    record = {"data": str(data_dir), "split": "train", "n_slices": len(train), "slices": [train.label(i) for i in range(len(train))],
              "orders": {acc: p.order.tolist() for acc, p in orders.items()}}
    return orders, record


def result_rows(method: str, traj: Trajectories, initial: int, budget: int) -> list[dict[str, Any]]:
    """The results.json rows of one method at one acceleration: with and without MAR."""
    rows = []
    for use_mar, curves in traj.curves.items():
        rows.append({
            "key": _row_key(method, use_mar),
            "method": method,
            "mar": use_mar,
            "per_slice": {k: v[:, -1].tolist() for k, v in curves.items()},
            "summary": {k: mean_std(v[:, -1]) for k, v in curves.items()},
            "curves": {"n_lines": list(range(initial, initial + budget + 1)),
                       **{k: {"mean": v.mean(axis=0).tolist(),
                              "std": (v.std(axis=0, ddof=1) if len(v) > 1 else 0 * v[0]).tolist()}
                          for k, v in curves.items()}},
            "lines": traj.lines.tolist(),
        })
        if use_mar and traj.served_mar is not None:  # slices served through the fallback (zero-filled)
            rows[-1]["fallback"] = int((~traj.served_mar).sum())
    return rows


def _selected_from(folder: Path, names: list[str]) -> set[str]:
    """The subjects of ``folder`` among a provenance's validation ``names``: ``FOLDER/sub-XXXX``
    of a selection over several folders, or bare names of a one-folder selection, which are
    this folder's only if every one of them is a subject of it (a selection on another folder
    shares some names: ``sub-0004`` of a simulated set is not ``sub-0004`` of an imported one)."""
    from sim_scanner.dataset.layout import SPLITS, split_files

    mine = {n.split("/", 1)[1] for n in names if n.startswith(f"{folder.name}/")}
    bare = {n for n in names if "/" not in n}
    if bare:
        everyone = {f.name.split(".")[0] for split in SPLITS for f in split_files(folder, split, allow_empty=True)}
        mine |= bare if bare <= everyone else set()
    return mine


def warn_repeated_anatomies(checkpoints: list[str], data_dir: str | Path, split: str) -> list[str]:
    """Log (and return) a warning for each checkpoint whose provenance says ``split`` of
    ``data_dir`` touched it: anatomies it was trained on (``training_data``, from ``masc models
    export``; :func:`training.data.repeats_training_anatomies`), subjects of this very data set
    (same manifest) that selected it (``provenance.subjects.val``) or calibrated its OOD rule
    (``ood.calibrated_on``)."""
    from masc_gadget.models.checkpoint import load_checkpoint
    from training.data import data_dirs, data_identity, repeats_training_anatomies
    from training.data import load_split as _load

    warnings = []
    for path in dict.fromkeys(p.strip() for p in checkpoints if p and p.strip()):
        meta = load_checkpoint(path).metadata
        trained_on = meta.get("training_data") or []
        for folder in data_dirs(data_dir):
            why = repeats_training_anatomies(folder, split, trained_on) if trained_on else None
            if why is not None:
                warnings.append(f"{path}: {why}")
            sha = data_identity(folder)["manifest_sha256"]
            scored = set(_load(folder, split).subjects)
            provenance = meta.get("provenance") or {}
            if any(d.get("manifest_sha256") == sha for d in provenance.get("data", [])):
                chose = scored & _selected_from(folder, (provenance.get("subjects") or {}).get("val", []))
                if chose:
                    warnings.append(f"{path}: {len(chose)} of the {len(scored)} subjects of {Path(folder).name}/{split} "
                                    f"selected it (its validation: {', '.join(sorted(chose)[:4])}): its score here is "
                                    "not an unseen one")
            for record in ((meta.get("ood") or {}).get("calibrated_on") or {}).get("data", []):
                calibrated = scored & set(record.get("subjects", [])) if record.get("manifest_sha256") == sha else set()
                if calibrated:
                    warnings.append(f"{path}: {len(calibrated)} of the {len(scored)} subjects of {Path(folder).name}/"
                                    f"{split} calibrated its OOD rule ({', '.join(sorted(calibrated)[:4])}): its "
                                    "fallback is tuned on what it is scored on")
    for warning in warnings:
        log.warning("%s", warning)
    return warnings


def evaluate(config: Config, data_dir: str | Path, split: str, methods: list[str] | None,
             mar_path: str | Path | None, progress: bool = True,
             checkpoint: str | Path | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Evaluate; returns (results dict for results.json, example images for the figure).

    ``checkpoint``: the trained checkpoints of the learned methods (:func:`load_policies`); a
    learned method whose checkpoint holds a MAR network (MASC's jointly fine-tuned one, the
    learned mask's) observes through it and its MAR rows score it, with or without
    ``mar_path``, as the gadget serves it. ``mar_path``: the MAR network of every other method
    (None: those are scored without MAR only)."""
    from tqdm.auto import tqdm

    ecfg: EvalConfig = config["eval"]
    methods = list(methods or ecfg.methods)
    device = resolve_device(ecfg.device)
    policies, own_mar = load_policies(methods, checkpoint, device)
    named = [str(p) for p in checkpoint] if isinstance(checkpoint, (list, tuple)) else str(checkpoint or "").split(",")
    touched = warn_repeated_anatomies([*named, str(mar_path or "")], data_dir, split)
    data = load_split(data_dir, split, ecfg.max_slices)
    mar = None
    mar_meta: dict[str, Any] = {}
    if mar_path is not None:
        mar, mar_meta = load_mar(mar_path, device)
        mar.eval()
    elif own_mar:
        log.warning("no --mar: %s with their own MAR network, every other method without MAR",
                    ", ".join(sorted(own_mar)))
    else:
        log.warning("no MAR checkpoint given: evaluating without MAR only")
    # a learned method that brings its MAR network observes and is served through it, as in the
    # gadget; --mar is the network of the other methods
    method_mar = {m: own_mar.get(m, mar) for m in methods}
    reference = ecfg.reference or _row_key(methods[0], method_mar[methods[0]] is not None)
    valid = {_row_key(m, x) for m in methods for x in ([False, True] if method_mar[m] is not None else [False])}
    if reference not in valid:
        raise ValueError(f"reference {reference!r} is not an evaluated row; choose one of {', '.join(sorted(valid))}")
    examples = pick_examples(data, ecfg.examples)
    population, population_record = {}, None
    if POPULATION in methods:
        population, population_record = population_policies(ecfg, ecfg.population_data or data_dir, data.n_pe,
                                                             mar, device, progress)
    results: dict[str, Any] = {
        "split": split,
        "data": str(data_dir),
        "n_slices": len(data),
        "slices": [data.label(i) for i in range(len(data))],
        "mar_checkpoint": None if mar_path is None else str(mar_path),
        "mar_metadata": {k: mar_meta.get(k) for k in ("kind", "epoch", "val", "code_version") if k in mar_meta},
        "reference": reference,
        "config": {"eval": to_dict(ecfg)},
        "population": population_record,
        "accelerations": {},
        "warnings": touched,
    }
    figures: dict[str, Any] = {"examples": examples, "labels": [data.label(i) for i in examples],
                               "target": data.target[examples], "metal": data.metal_image[examples], "rows": {}}
    jobs = [(acc, m) for acc in ecfg.accelerations for m in methods]
    bar = tqdm(jobs, desc="eval", unit="method", disable=not progress)
    with torch.no_grad():
        for acc, method in bar:
            initial, budget = ecfg.accelerations[acc]
            if initial + budget > data.n_pe:
                raise ValueError(f"accelerations.{acc}: initial + budget must be <= number of PE lines "
                                 f"({data.n_pe}), got {initial} + {budget}")
            bar.set_postfix(acc=acc, method=method)
            policy = population[acc] if method == POPULATION else policies[method]
            _score_method(config, data, acc, method, policy, method_mar[method], examples, results, figures,
                          device, progress)
    bar.close()
    add_tests(results)
    return results, figures


def write_results(results: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """results.json and table.md (rendered from it) in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / name for name in ("results.json", "table.md")}
    paths["results.json"].write_text(json.dumps(results, indent=1, allow_nan=True) + "\n")
    paths["table.md"].write_text(render_table(results))
    return paths


def write_outputs(results: dict[str, Any], figures: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """results.json, table.md, curves.png, examples.png in ``out_dir``."""
    paths = write_results(results, out_dir)
    paths.update({name: Path(out_dir) / name for name in ("curves.png", "examples.png")})
    plot_curves(results, paths["curves.png"])
    plot_examples(results, figures, paths["examples.png"])
    return paths
