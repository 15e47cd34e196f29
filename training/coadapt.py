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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from masc_gadget import __version__
from masc_gadget.models.checkpoint import Checkpoint, load_mar
from masc_gadget.config import Config, to_dict
from masc_gadget.device import resolve_device
from masc_gadget.acquisition.learned import KIND, policy_metadata
from masc_gadget.models.policy_net import PolicyNet
from training.csvlog import append_row, plot_training
from training.run import TrainingRun, seeded
from training.data import SliceSet, load_split, spread_subset
from training.distributed import Dist, setup
from training.imitation import ImitationConfig, imitate, load_or_make_demonstrations
from training.population import population_order
from training.rl.env import BatchedAcquisitionEnv, EnvConfig
from training.finetune import finetune_mar
from training.rl.ppo import Rollout, greedy_actions, make_optimizer, run_ppo

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
    max_train_slices: int = 0
    """Use only the first N training slices (0 = all)."""
    max_val_slices: int = 0
    """Use only the first N validation slices (0 = all)."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""
    seed: int = 0
    """Seed of the networks' init, slice draws, action sampling and minibatches."""
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


def _resume(ck: Checkpoint, net: PolicyNet, optimizer: torch.optim.Optimizer, gen: torch.Generator,
            mar: torch.nn.Module | None, mar_opt: torch.optim.Optimizer | None) -> int:
    """Load a ``.last.pt`` checkpoint into the networks, optimizers and generator; returns the
    rollouts done."""
    net.load_state_dict(ck.state_dicts["policy"])
    optimizer.load_state_dict(ck.extra["optimizer"])
    gen.set_state(ck.extra["generator"])
    if mar is not None and "mar" in ck.state_dicts:
        mar.load_state_dict(ck.state_dicts["mar"])
    if mar_opt is not None and "mar_optimizer" in ck.extra:
        mar_opt.load_state_dict(ck.extra["mar_optimizer"])
    return int(ck.metadata["rollout"])


@dataclass(eq=False)
class _Run:
    """One co-adaptive training run: what :meth:`after_rollout`, the ``on_rollout`` hook of
    :func:`~training.rl.ppo.run_ppo`, needs between two rollouts."""

    config: Config
    ecfg: EnvConfig
    data_dir: str | Path
    mar_path: str | Path | None
    files: TrainingRun
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
    kspace: torch.Tensor
    target: torch.Tensor
    n_steps: int
    bar: Any = None
    t0: float = 0.0
    dist: Dist = Dist()
    clean_kspace: torch.Tensor | None = None
    """The clean k-space of the training slices, where ``mar_train.clean_fraction`` > 0."""

    @property
    def tcfg(self) -> MascTrainConfig:
        return self.config["masc_train"]

    @property
    def best(self) -> dict[str, Any]:
        return self.files.best

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
            val=val_metrics, best_val=self.best, code_version=__version__, data=str(self.data_dir),
            mar_pretrained=str(self.mar_path) if self.mar_path else None,
            mar_pretrained_epoch=self.mar_meta.get("epoch"),
            config={k: to_dict(config[k]) for k in ("acquisition", "env", "ppo", "policy_net", "masc_train")},
        )

    def after_rollout(self, rollout_number: int, rollout: Rollout, stats: dict[str, float]) -> None:
        """After the PPO update of rollout ``rollout_number`` (from 1): fine-tune the MAR network
        on the images the rollout visited (joint mode), validate and checkpoint every
        ``val_every`` rollouts, append the CSV row."""
        tcfg = self.tcfg
        slices, masks = self.recorder.take()
        if self.mar_opt is not None:
            stats["losses/mar"] = finetune_mar(self.mar, self.mar_opt, self.kspace, self.target, slices, masks,
                                               tcfg.mar_epochs, tcfg.mar_batch_size, self.gen, self.lambda_ssim,
                                               self.dist, self.clean_kspace,
                                               self.config["mar_train"].clean_fraction,
                                               anchor_snr=self.config["mar_train"].anchor_snr)
            self.env.set_mar(self.mar)
            rollout.cursor.obs = self.env.observation
        row: dict[str, Any] = {"rollout": rollout_number,
                               "global_step": rollout_number * self.n_steps * self.ecfg.n_envs, **stats}
        if rollout_number % tcfg.val_every == 0 or rollout_number == tcfg.rollouts:
            row.update(self._validate_and_save(rollout_number, stats))
            self._save_served()
        row["seconds"] = time.perf_counter() - self.t0
        self._append_csv(row, stats)
        metric = self.files.metric
        self.bar.set_postfix(ret=f"{stats['charts/episodic_return']:.3f}",
                             **{f"best_{metric}": f"{self.best[metric]:.4f}"})
        self.bar.update()

    def _validate_and_save(self, rollout_number: int, stats: dict[str, float]) -> dict[str, float]:
        """Validate; save the best checkpoint when SSIM improved and the latest always.
        Returns the ``val/...`` columns."""
        val_metrics = self.validate()
        nets = {"policy": self.net, **({"mar": self.mar} if self.mar is not None else {})}
        extra = {"optimizer": self.optimizer.state_dict(), "generator": self.gen.get_state()}
        if self.mar_opt is not None:
            extra["mar_optimizer"] = self.mar_opt.state_dict()
        improved = self.files.record(val_metrics, {"rollout": rollout_number}, nets, nets,
                                     self.metadata(rollout_number, val_metrics), extra, dist=self.dist,
                                     sync=self.net)
        region = f", region SSIM {val_metrics['roi_ssim']:.4f}" if "roi_ssim" in val_metrics else ""
        log.info("rollout %d: return %.3f, val SSIM %.4f, PSNR %.2f%s%s", rollout_number,
                 stats["charts/episodic_return"], val_metrics["ssim"], val_metrics["psnr"], region,
                 " *best*" if improved else "")
        return {f"val/{m}": v for m, v in val_metrics.items()}

    def _save_served(self) -> None:
        """``<out>.served.npz``: the training slice and final served mask of every episode so
        far (this process's; a resumed run starts it anew), the masks MASC's own lines give
        ``masc train finetune``'s recipes to compare with."""
        if self.dist.main:
            slices, masks = self.recorder.served()
            np.savez_compressed(served_path(self.files.out), slice=slices, mask=np.packbits(masks, axis=1),
                                n_pe=masks.shape[1])

    def _append_csv(self, row: dict[str, Any], stats: dict[str, float]) -> None:
        fields = ["rollout", "global_step", *sorted(stats), "losses/mar", *val_fields(self.ecfg), "seconds"]
        self.files.log_row(row, list(dict.fromkeys(fields)))


def served_path(out: str | Path) -> Path:
    """The co-adaptive run's record of its episodes' final served masks, beside ``out``."""
    out = Path(out)
    return out.with_name(out.stem + ".served.npz")


def load_served(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """A ``.served.npz`` record: training slices (E,) and final masks (E, PE) bool."""
    with np.load(path) as f:
        return f["slice"], np.unpackbits(f["mask"], axis=1, count=int(f["n_pe"])).astype(bool)


def warm_start(run: _Run, train: SliceSet, demos_path: str | Path | None, progress: bool) -> None:
    """Imitation of the greedy oracle (section ``imitation``) on training slices, before PPO;
    the imitated policy is validated and checkpointed as rollout 0 (its ``val/...`` columns end
    ``<out>.imitation.csv``), so model selection on the validation split keeps it when PPO does
    not improve on it."""
    icfg: ImitationConfig = run.config["imitation"]
    acq = run.config["acquisition"]
    demos = load_or_make_demonstrations(demos_path, train, icfg, run.ecfg, acq.initial, acq.budget, run.mar,
                                        next(run.net.parameters()).device, progress)
    history = imitate(run.net, demos, icfg, run.gen, progress)
    history[-1].update(run._validate_and_save(0, {"charts/episodic_return": math.nan}))
    fields = list(dict.fromkeys([*history[0], *val_fields(run.ecfg)]))
    for row in history:  # the main log keeps PPO's columns; rollout 0's validation ends this one
        append_row(_imitation_csv(run.files.out), row, fields)


def _imitation_csv(out: Path) -> Path:
    """The imitation warm start's log beside the run's own."""
    return out.with_name(out.stem + ".imitation.csv")


def train_masc(config: Config, data_dir: str | Path, mar_path: str | Path | None, out: str | Path,
               resume: str | Path | None = None, progress: bool = True,
               demos: str | Path | None = None) -> dict[str, Any]:
    """Co-adaptive training; the best checkpoint (validation SSIM of greedy episodes) goes to
    ``out`` (policy + MAR, loadable by the gadget and ``masc eval``), the latest to
    ``<out>.last.pt``, the per-rollout log to ``<out>.csv``. Returns the best validation metrics.
    With ``imitation.slices > 0`` a fresh run first imitates the greedy oracle
    (:func:`warm_start`); ``demos`` is the file its demonstrations are kept in (shared by seeds).

    The PPO loop is :func:`~training.rl.ppo.run_ppo`; the MAR fine-tuning, validation,
    checkpoints and the log happen in its hook, :meth:`_Run.after_rollout`."""
    from tqdm.auto import tqdm

    dist = setup()
    tcfg: MascTrainConfig = config["masc_train"]
    ecfg: EnvConfig = config["env"]
    pcfg = config["ppo"]
    acq = config["acquisition"]
    device = resolve_device(dist.device(tcfg.device))
    if tcfg.mar_mode != "none" and not mar_path:
        raise ValueError(f"mar_mode {tcfg.mar_mode!r} needs a pre-trained MAR checkpoint (--mar); "
                         "use --set masc_train.mar_mode=none to train without MAR")
    if (ecfg.corruption > 0) != config["policy_net"].reacquire:
        raise ValueError("a policy that may acquire a flagged line again needs corrupted acquisitions, and the "
                         "reverse: set env.corruption > 0 together with policy_net.reacquire=true "
                         f"(got env.corruption={ecfg.corruption}, policy_net.reacquire="
                         f"{str(config['policy_net'].reacquire).lower()})")
    files = TrainingRun(out, ecfg.selection_metric, higher_is_better=True, main=dist.main, resume=resume, kind=KIND,
                        map_location=device)
    if tcfg.mar_mode == "none":
        ecfg = EnvConfig(**{**to_dict(ecfg), "observe_mar": False, "reward_mar": False})
    train = load_split(data_dir, "train", tcfg.max_train_slices)
    val = load_split(data_dir, "val", tcfg.max_val_slices)
    files.describe(data_dir, train=train, val=val)
    acq.check(train.n_pe)
    mar = None
    mar_meta: dict[str, Any] = {}
    if tcfg.mar_mode != "none":
        mar, mar_meta = load_mar(mar_path, device)
    n_steps = pcfg.steps_per_env(ecfg.n_envs)

    gen = torch.Generator().manual_seed(tcfg.seed + dist.rank)  # each rank samples its own actions
    pncfg = config["policy_net"]
    net = seeded(tcfg.seed, lambda: PolicyNet(train.n_pe, *train.target.shape[1:], pncfg,
                                              prior_lines=acq.budget if pncfg.prior_weight > 0 else 0).to(device))
    net.prior_train = acq.lines_per_decision  # the prior marks the order's next echo train
    if net.prior_lines and resume is None:
        # the policy starts from the population-greedy order; PPO learns where to leave it
        spread = spread_subset(train, tcfg.prior_slices)
        order = population_order(spread, acq.initial, acq.budget, mar, device, tcfg.mar_batch_size, progress=progress,
                                 roi=spread.periprosthetic_roi(ecfg.margin) if ecfg.region == "implant" else None)
        net.set_prior(order)
        log.info("prior: the population order of %d training slices, bonus %.2f: %s",
                 min(len(train), tcfg.prior_slices or len(train)), pncfg.prior_weight, order.tolist())
    optimizer = make_optimizer(net, pcfg)
    mar_opt = torch.optim.Adam(mar.parameters(), lr=tcfg.mar_lr) if tcfg.mar_mode == "joint" else None
    lambda_ssim = config["mar_train"].lambda_ssim if tcfg.mar_loss == "pretrain" else None
    start = 0
    if files.checkpoint is not None:
        start = _resume(files.checkpoint, net, optimizer, gen, mar, mar_opt)
        log.info("resumed from %s after rollout %d", resume, start)
        if dist.rank:  # a resumed rank keeps its own action stream
            gen.manual_seed(tcfg.seed + dist.rank + 7919 * start)
    elif dist.main:
        _imitation_csv(files.out).unlink(missing_ok=True)

    k = acq.lines_per_decision
    # each rank draws its own slices: seed + rank (rank 0 as one process)
    env = BatchedAcquisitionEnv(train, ecfg, acq.initial, acq.budget, mar, device,
                                seed=tcfg.seed + start + 1_000_003 * dist.rank, lines_per_decision=k)
    val_env = BatchedAcquisitionEnv(val, ecfg, acq.initial, acq.budget, mar, device, seed=tcfg.seed,
                                    lines_per_decision=k)
    kspace = train.kspace_clean if ecfg.kspace == "clean" else train.kspace_metal
    run = _Run(config, ecfg, data_dir, mar_path, files, net, optimizer, gen, mar, mar_meta, mar_opt, lambda_ssim,
               env, val_env, _Recorder(env), kspace.to(device), train.target.to(device), n_steps, dist=dist,
               clean_kspace=(train.kspace_clean.to(device)
                             if config["mar_train"].clean_fraction > 0 and mar_opt is not None else None))

    log.info("co-adaptive training: %d train / %d val slices, %d envs x %d steps per rollout, MAR %s, "
             "k-space %s, %d rollouts on %s%s", len(train), len(val), ecfg.n_envs, n_steps, tcfg.mar_mode,
             ecfg.kspace, tcfg.rollouts, device, f", rank {dist.rank} of {dist.world}" if dist.active else "")
    if dist.active and config["imitation"].slices > 0:
        raise ValueError("the imitation warm start runs on one process; drop imitation.slices under torchrun")
    run.t0 = time.perf_counter()
    if config["imitation"].slices > 0 and start == 0:
        warm_start(run, train, demos, progress)
        env.set_mar(mar)
    elif net.prior_lines and start == 0:
        # the prior alone is rollout 0: selection on val keeps it when PPO does not improve on it
        run._validate_and_save(0, {"charts/episodic_return": math.nan})
    run.bar = tqdm(desc="train masc", unit="rollout", disable=not (progress and dist.main), initial=start,
                   total=tcfg.rollouts)
    run_ppo(run.recorder, net, pcfg, optimizer, gen, max(0, tcfg.rollouts - start),
            on_rollout=run.after_rollout, start_iteration=start + 1, dist=dist)
    run.bar.close()
    run.best["seconds"] = time.perf_counter() - run.t0
    if dist.main and files.csv.exists():
        figure = plot_training(files.csv, files.out.with_suffix(".png"), _imitation_csv(files.out))
        log.info("training curves: %s", figure)
    return run.best
