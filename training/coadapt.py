"""Stage 2: co-adaptive training of the acquisition policy and the MAR network (Algorithm 1).

After each PPO rollout the policy is updated (artifact-aware PPO on MAR-processed observations
with rewards on MAR images), then the MAR U-Net is fine-tuned with MSE (Adam 1e-5) on the
undersampled images the rollout visited, and the environment's observations are recomputed
with the updated network. ``masc_train.mar_mode`` and the ``env`` section give the ablations of
the paper's Table 2:

* ``mar_mode: none`` + ``env.kspace: clean``: clean-trained PPO without MAR;
* ``mar_mode: none`` + ``env.kspace: metal``: metal-trained PPO without MAR (both evaluated
  with and without the frozen pre-trained MAR by ``masc eval --mar``);
* ``mar_mode: frozen``: PPO observing and rewarded through the frozen pre-trained MAR;
* ``mar_mode: joint``: MASC.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from masc_gadget import __version__
from masc_gadget.models.checkpoint import load_mar
from masc_gadget.config import Config, to_dict
from masc_gadget.device import resolve_device
from masc_gadget.acquisition.learned import KIND, policy_metadata
from masc_gadget.models.policy_net import PolicyNet
from training.csvlog import append_row, plot_training
from training.run import RUN_KEYS, Checkpoints, RunSettings, Trainer, TrainingRun, seeded, snapshot
from training.data import SliceSet, load_split, spread_subset
from training.distributed import Dist, setup
from training.imitation import ImitationConfig, imitate, load_or_make_demonstrations
from training.population import population_order
from training.rl.env import BatchedAcquisitionEnv, EnvConfig
from training.finetune import finetune_mar
from training.rl.ppo import Rollout, greedy_actions, make_optimizer, ppo_rounds

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MascTrainConfig:
    """Co-adaptive training (config section ``masc_train``)."""

    rollouts: int = 200
    """PPO updates (each after ``ppo.rollout_steps`` transitions)."""
    mar_mode: Literal["joint", "frozen", "none"] = "joint"
    """joint: fine-tune the MAR network after each rollout (MASC); frozen: observe and reward
    through the pre-trained MAR without updating it; none: no MAR (zero-filled images)."""
    mar_lr: float = 1e-5
    """Adam learning rate of the MAR fine-tuning (paper: 1e-5)."""
    mar_loss: Literal["mse", "pretrain"] = "mse"
    """Loss of the MAR fine-tuning: ``mse`` (paper) or ``pretrain``, the stage-1 loss
    ``L1 + lambda (1 - SSIM)`` with ``mar_train.lambda_ssim`` (MSE alone trades SSIM for PSNR)."""
    mar_epochs: int = 1
    """Passes over the rollout's visited images per MAR update."""
    mar_batch_size: int = 32
    """Images per MAR fine-tuning step."""
    val_every: int = 10
    """Validate (greedy episodes on the val split) every N rollouts, and after the last."""
    run: RunSettings = field(default_factory=RunSettings)
    """Seed, device and slice caps (:class:`training.run.RunSettings`; the seed of the networks' init, slice draws, action sampling and minibatches)."""
    FLAT_KEYS: ClassVar[dict[str, str]] = RUN_KEYS
    """The run keys written flat before 0.3, read under ``run``."""
    prior_slices: int = 32
    """With ``policy_net.prior_weight`` > 0: training slices (spread over the split) the
    population-greedy prior order is computed on, under the pre-trained MAR network (0 = all)."""

    def __post_init__(self) -> None:
        if self.prior_slices < 0:
            raise ValueError(f"prior_slices must be >= 0, got {self.prior_slices}")
        for name in ("rollouts", "mar_epochs", "mar_batch_size", "val_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.mar_lr <= 0:
            raise ValueError(f"mar_lr must be > 0, got {self.mar_lr}")
        if self.mar_loss not in ("mse", "pretrain"):
            raise ValueError(f"mar_loss must be 'mse' or 'pretrain', got {self.mar_loss!r}")


VAL_FIELDS = [f"val/{m}" for m in ("ssim", "psnr", "mse", "nmse", "mae", "return", "final_quality")]
ROI_FIELDS = [f"val/roi_{m}" for m in ("ssim", "psnr", "nmse")]
"""With ``env.region: implant``: the periprosthetic region's validation metrics, after VAL_FIELDS."""


def val_fields(ecfg: EnvConfig) -> list[str]:
    """The CSV's validation columns for this environment."""
    return VAL_FIELDS + (ROI_FIELDS if ecfg.region == "implant" else [])


class _Recorder:
    """Wraps the environment to remember which slice and mask every transition started from
    (the pre-action masks the MAR network is fine-tuned on), and the final served mask of every
    finished episode (:meth:`served`)."""

    def __init__(self, env: BatchedAcquisitionEnv) -> None:
        self.env = env
        self.slices: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []
        self.final_slices: list[torch.Tensor] = []
        self.final_masks: list[torch.Tensor] = []

    @property
    def budget(self) -> int:
        return self.env.budget

    @property
    def lines_per_decision(self) -> int:
        return self.env.lines_per_decision

    def reset(self):
        return self.env.reset()

    def step(self, actions):
        slices = self.env.slice_index.clone()
        self.slices.append(slices)
        self.masks.append(self.env.observation.mask.clone())
        result = self.env.step(actions)
        done, info = result[2], result[-1]
        self.final_slices.append(slices[done].cpu())
        self.final_masks.append(info["final_mask"][done].cpu())
        return result

    def served(self) -> tuple[np.ndarray, np.ndarray]:
        """Every finished episode so far: its training slice (E,) and final mask (E, PE) bool,
        the lines the policy served it with."""
        if not self.final_slices:
            return np.zeros(0, dtype=np.int64), np.zeros((0, self.env.observation.mask.shape[1]), dtype=bool)
        return torch.cat(self.final_slices).numpy(), torch.cat(self.final_masks).numpy()

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        slices, masks = torch.cat(self.slices), torch.cat(self.masks)
        self.slices, self.masks = [], []
        return slices, masks


@dataclass(eq=False)
class _MascTrainer(Trainer):
    """One co-adaptive training run as the shared loop (:meth:`~training.run.TrainingRun.loop`)
    drives it: a period is one PPO rollout and update (:func:`~training.rl.ppo.ppo_rounds`),
    then, in joint mode, the MAR fine-tuning on the images the rollout visited; every
    ``val_every`` rollouts, and after the last, a validation."""

    config: Config
    tcfg: MascTrainConfig
    total: int
    ecfg: EnvConfig
    data_dir: str | Path
    mar_path: str | Path | None
    run: TrainingRun
    train: SliceSet
    net: PolicyNet
    optimizer: torch.optim.Optimizer
    gen: torch.Generator
    mar: torch.nn.Module | None
    mar_meta: dict[str, Any]
    mar_opt: torch.optim.Optimizer | None
    lambda_ssim: float | None
    env: BatchedAcquisitionEnv
    val_env: BatchedAcquisitionEnv
    recorder: _Recorder
    rounds: Iterator[tuple[Rollout, dict[str, float]]]
    """PPO's rounds on the recorder's environments."""
    kspace: torch.Tensor
    target: torch.Tensor
    n_steps: int
    done: int = 0
    dist: Dist = Dist()
    clean_kspace: torch.Tensor | None = None
    """The clean k-space of the training slices, where ``mar_train.clean_fraction`` > 0."""
    stat_keys: list[str] = field(default_factory=list)
    """The last rollout's statistics, sorted (the CSV's columns after ``global_step``)."""
    name = "train masc"
    unit = "rollout"
    clock = "run"

    def train_period(self, bar: Any) -> dict[str, Any]:
        rollout, stats = next(self.rounds)
        self.done += 1
        slices, masks = self.recorder.take()
        if self.mar_opt is not None:
            stats["losses/mar"] = self._finetune(slices, masks)
            self.env.set_mar(self.mar)
            rollout.cursor.obs = self.env.observation
        self.stat_keys = sorted(stats)
        return {"rollout": self.done, "global_step": self.done * self.n_steps * self.ecfg.n_envs, **stats}

    def _finetune(self, slices: torch.Tensor, masks: torch.Tensor) -> float:
        """The MAR network fine-tuned on the rollout's (slice, pre-action mask) pairs; its loss."""
        tcfg, mcfg = self.tcfg, self.config["mar_train"]
        return finetune_mar(self.mar, self.mar_opt, self.kspace, self.target, slices, masks, tcfg.mar_epochs,
                            tcfg.mar_batch_size, self.gen, self.lambda_ssim, self.dist, self.clean_kspace,
                            mcfg.clean_fraction, anchor_snr=mcfg.anchor_snr)

    def due(self) -> bool:
        return self.done % self.tcfg.val_every == 0 or self.done == self.tcfg.rollouts

    def validate(self) -> dict[str, float]:
        """Greedy episodes on the validation split, through the current MAR network."""
        budget = self.config["acquisition"].budget
        self.val_env.set_mar(self.mar)
        k = self.val_env.lines_per_decision
        return self.val_env.validate(lambda obs: greedy_actions(self.net, obs, budget, k))

    def metadata(self, rollout: int, val_metrics: dict[str, float]) -> dict[str, Any]:
        config, mar = self.config, self.mar
        return policy_metadata(
            self.net, observes_mar=self.ecfg.observe_mar and mar is not None, mar=mar, rollout=rollout,
            val=val_metrics, best_val=self.run.best, code_version=__version__, data=str(self.data_dir),
            mar_pretrained=str(self.mar_path) if self.mar_path else None,
            mar_pretrained_epoch=self.mar_meta.get("epoch"),
            config={k: to_dict(config[k]) for k in ("acquisition", "env", "ppo", "policy_net", "masc_train")},
        )

    def checkpoints(self, metrics: dict[str, float]) -> Checkpoints:
        nets = {"policy": self.net, **({"mar": self.mar} if self.mar is not None else {})}
        states = {"optimizer": self.optimizer, "generator": self.gen,
                  **({"mar_optimizer": self.mar_opt} if self.mar_opt is not None else {})}
        return Checkpoints({"rollout": self.done}, nets, nets, self.metadata(self.done, metrics), snapshot(states),
                           sync=self.net)

    def columns(self, metrics: dict[str, float]) -> dict[str, Any]:
        return {f"val/{m}": v for m, v in metrics.items()}

    def fields(self, row: dict[str, Any]) -> list[str]:
        return list(dict.fromkeys(["rollout", "global_step", *self.stat_keys, "losses/mar", *val_fields(self.ecfg),
                                   "seconds"]))

    def report(self, row: dict[str, Any], metrics: dict[str, float], improved: bool) -> None:
        region = f", region SSIM {metrics['roi_ssim']:.4f}" if "roi_ssim" in metrics else ""
        log.info("rollout %d: return %.3f, val SSIM %.4f, PSNR %.2f%s%s", self.done,
                 row.get("charts/episodic_return", math.nan), metrics["ssim"], metrics["psnr"], region,
                 " *best*" if improved else "")
        if self.done:  # rollout 0 (the imitated or the prior policy) played no episode yet
            self._save_served()

    def postfix(self, row: dict[str, Any]) -> dict[str, str]:
        metric = self.run.metric
        return {"ret": f"{row['charts/episodic_return']:.3f}", f"best_{metric}": f"{self.run.best[metric]:.4f}"}

    def _save_served(self) -> None:
        """``<out>.served.npz``: the training slice and final served mask of every episode so
        far (this process's; a resumed run starts it anew), the masks MASC's own lines give
        ``masc train finetune``'s recipes to compare with."""
        slices, masks = self.recorder.served()
        np.savez_compressed(served_path(self.run.out), slice=slices, mask=np.packbits(masks, axis=1),
                            n_pe=masks.shape[1])


def served_path(out: str | Path) -> Path:
    """The co-adaptive run's record of its episodes' final served masks, beside ``out``."""
    out = Path(out)
    return out.with_name(out.stem + ".served.npz")


def load_served(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """A ``.served.npz`` record: training slices (E,) and final masks (E, PE) bool."""
    with np.load(path) as f:
        return f["slice"], np.unpackbits(f["mask"], axis=1, count=int(f["n_pe"])).astype(bool)


def warm_start(trainer: _MascTrainer, demos_path: str | Path | None, progress: bool) -> None:
    """Imitation of the greedy oracle (section ``imitation``) on training slices, before PPO;
    the imitated policy is validated and checkpointed as rollout 0 (its ``val/...`` columns end
    ``<out>.imitation.csv``), so model selection on the validation split keeps it when PPO does
    not improve on it."""
    icfg: ImitationConfig = trainer.config["imitation"]
    acq = trainer.config["acquisition"]
    demos = load_or_make_demonstrations(demos_path, trainer.train, icfg, trainer.ecfg, acq.initial, acq.budget,
                                        trainer.mar, next(trainer.net.parameters()).device, progress)
    history = imitate(trainer.net, demos, icfg, trainer.gen, progress)
    trainer.run.validated(trainer, history[-1], trainer.dist)
    fields = list(dict.fromkeys([*history[0], *val_fields(trainer.ecfg)]))
    for row in history:  # the main log keeps PPO's columns; rollout 0's validation ends this one
        append_row(_imitation_csv(trainer.run.out), row, fields)


def _imitation_csv(out: Path) -> Path:
    """The imitation warm start's log beside the run's own."""
    return out.with_name(out.stem + ".imitation.csv")


def _check(config: Config, mar_path: str | Path | None) -> None:
    """ValueError for settings that cannot train together: a MAR mode without its network, a
    policy that re-acquires lines without corrupted acquisitions (or the reverse)."""
    tcfg: MascTrainConfig = config["masc_train"]
    ecfg: EnvConfig = config["env"]
    if tcfg.mar_mode != "none" and not mar_path:
        raise ValueError(f"mar_mode {tcfg.mar_mode!r} needs a pre-trained MAR checkpoint (--mar); "
                         "use --set masc_train.mar_mode=none to train without MAR")
    if ecfg.corruption.enabled != config["policy_net"].reacquire:
        raise ValueError("a policy that may acquire a flagged line again needs corrupted acquisitions, and the "
                         "reverse: set env.corruption > 0 together with policy_net.reacquire=true "
                         f"(got env.corruption.probability={ecfg.corruption.probability}, policy_net.reacquire="
                         f"{str(config['policy_net'].reacquire).lower()})")


def _policy(config: Config, ecfg: EnvConfig, train: SliceSet, mar: torch.nn.Module | None, device: torch.device,
            fresh: bool, progress: bool) -> PolicyNet:
    """The seeded policy network; with ``policy_net.prior_weight`` > 0 and a ``fresh`` run it
    starts from the population-greedy order, and PPO learns where to leave it."""
    tcfg: MascTrainConfig = config["masc_train"]
    acq, pncfg = config["acquisition"], config["policy_net"]
    net = seeded(tcfg.run.seed, lambda: PolicyNet(train.n_pe, *train.target.shape[1:], pncfg,
                                              prior_lines=acq.budget if pncfg.prior_weight > 0 else 0).to(device))
    net.prior_train = acq.lines_per_decision  # the prior marks the order's next echo train
    if net.prior_lines and fresh:
        spread = spread_subset(train, tcfg.prior_slices)
        order = population_order(spread, acq.initial, acq.budget, mar, device, tcfg.mar_batch_size, progress=progress,
                                 roi=spread.periprosthetic_roi(ecfg.margin) if ecfg.region == "implant" else None)
        net.set_prior(order)
        log.info("prior: the population order of %d training slices, bonus %.2f: %s",
                 min(len(train), tcfg.prior_slices or len(train)), pncfg.prior_weight, order.tolist())
    return net


def _masc_trainer(config: Config, data_dir: str | Path, mar_path: str | Path | None, run: TrainingRun, dist: Dist,
                  device: torch.device, progress: bool) -> _MascTrainer:
    """The co-adaptive run's trainer: its splits, MAR network (none in mode ``none``), policy,
    optimizers and action stream, resumed from the run's last checkpoint when there is one, and
    its training (recorded) and validation environments."""
    tcfg: MascTrainConfig = config["masc_train"]
    ecfg: EnvConfig = config["env"]
    acq = config["acquisition"]
    if tcfg.mar_mode == "none":
        ecfg = dataclasses.replace(ecfg, observe_mar=False, reward_mar=False)
    train = load_split(data_dir, "train", tcfg.run.max_train_slices)
    val = load_split(data_dir, "val", tcfg.run.max_val_slices)
    run.describe(data_dir, train=train, val=val)
    acq.check(train.n_pe)
    mar, mar_meta = load_mar(mar_path, device) if tcfg.mar_mode != "none" else (None, {})
    gen = torch.Generator().manual_seed(tcfg.run.seed + dist.rank)  # each rank samples its own actions
    net = _policy(config, ecfg, train, mar, device, run.checkpoint is None, progress)
    optimizer = make_optimizer(net, config["ppo"])
    mar_opt = torch.optim.Adam(mar.parameters(), lr=tcfg.mar_lr) if tcfg.mar_mode == "joint" else None
    done = run.restore({"policy": net, "mar": mar}, {"optimizer": optimizer, "generator": gen,
                                                     "mar_optimizer": mar_opt}, "rollout",
                       optional=("mar", "mar_optimizer"))
    if run.checkpoint is not None and dist.rank:  # a resumed rank keeps its own action stream
        gen.manual_seed(tcfg.run.seed + dist.rank + 7919 * done)
    elif run.checkpoint is None and dist.main:
        _imitation_csv(run.out).unlink(missing_ok=True)
    k = acq.lines_per_decision
    # each rank draws its own slices: seed + rank (rank 0 as one process)
    env = BatchedAcquisitionEnv(train, ecfg, acq.initial, acq.budget, mar, device,
                                seed=tcfg.run.seed + done + 1_000_003 * dist.rank, lines_per_decision=k)
    val_env = BatchedAcquisitionEnv(val, ecfg, acq.initial, acq.budget, mar, device, seed=tcfg.run.seed,
                                    lines_per_decision=k)
    recorder = _Recorder(env)
    kspace = train.kspace_clean if ecfg.kspace == "clean" else train.kspace_metal
    n_steps = config["ppo"].steps_per_env(ecfg.n_envs)
    log.info("co-adaptive training: %d train / %d val slices, %d envs x %d steps per rollout, MAR %s, "
             "k-space %s, %d rollouts on %s%s", len(train), len(val), ecfg.n_envs, n_steps, tcfg.mar_mode,
             ecfg.kspace, tcfg.rollouts, device, f", rank {dist.rank} of {dist.world}" if dist.active else "")
    return _MascTrainer(
        config, tcfg, tcfg.rollouts, ecfg, data_dir, mar_path, run, train, net, optimizer, gen, mar, mar_meta,
        mar_opt, config["mar_train"].lambda_ssim if tcfg.mar_loss == "pretrain" else None, env, val_env, recorder,
        ppo_rounds(recorder, net, config["ppo"], optimizer, gen, dist), kspace.to(device), train.target.to(device),
        n_steps, done, dist,
        train.kspace_clean.to(device) if config["mar_train"].clean_fraction > 0 and mar_opt is not None else None)


def train_masc(config: Config, data_dir: str | Path, mar_path: str | Path | None, out: str | Path,
               resume: str | Path | None = None, progress: bool = True,
               demos: str | Path | None = None) -> dict[str, Any]:
    """Co-adaptive training; the best checkpoint (validation SSIM of greedy episodes) goes to
    ``out`` (policy + MAR, loadable by the gadget and ``masc eval``), the latest to
    ``<out>.last.pt``, the per-rollout log to ``<out>.csv``. Returns the best validation metrics.
    With ``imitation.slices > 0`` a fresh run first imitates the greedy oracle
    (:func:`warm_start`); ``demos`` is the file its demonstrations are kept in (shared by seeds).

    The rollouts run in the shared trainer loop (:meth:`~training.run.TrainingRun.loop`); a
    rollout, its MAR fine-tuning, validation and log row are :class:`_MascTrainer`'s."""
    dist = setup()
    tcfg: MascTrainConfig = config["masc_train"]
    device = resolve_device(dist.device(tcfg.run.device))
    _check(config, mar_path)
    run = TrainingRun(out, config["env"].selection_metric, higher_is_better=True, main=dist.main, resume=resume,
                      kind=KIND, map_location=device)
    trainer = _masc_trainer(config, data_dir, mar_path, run, dist, device, progress)
    if dist.active and config["imitation"].slices > 0:
        raise ValueError("the imitation warm start runs on one process; drop imitation.slices under torchrun")
    started = time.perf_counter()
    if config["imitation"].slices > 0 and trainer.done == 0:
        warm_start(trainer, demos, progress)
        trainer.env.set_mar(trainer.mar)
    elif trainer.net.prior_lines and trainer.done == 0:
        # the prior alone is rollout 0: selection on val keeps it when PPO does not improve on it
        run.validated(trainer, {}, dist)
    run.best["seconds"] = run.loop(trainer, dist, progress, started)
    if dist.main and run.csv.exists():
        figure = plot_training(run.csv, run.out.with_suffix(".png"), _imitation_csv(run.out))
        log.info("training curves: %s", figure)
    return run.best
