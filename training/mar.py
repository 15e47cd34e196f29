"""Stage 1: MAR U-Net pre-training on paired metal / clean images.

Loss (the paper's Eq. 3): ``L1 + lambda * (1 - SSIM)`` between g(I) and the clean image, both
divided by the clean image's maximum (the metric convention, so the loss does not depend on the
arbitrary signal scale). The paper pre-trains on fully sampled metal images; the MAR network later
sees undersampled images, so ``input: undersampled`` (zero-filled images from the baseline
policies at a random number of acquired lines) and ``mixed`` (half and half) are offered too.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from masc_gadget import __version__
from masc_gadget.acquisition.episode import AcquisitionConfig
from masc_gadget.config import Config, to_dict
from masc_gadget.device import resolve_device
from masc_gadget.core.kspace import zero_filled
from masc_gadget.core.metrics import scale_by_target, slice_metrics, ssim
from masc_gadget.models.unet import build_mar
from masc_gadget.acquisition.policies import make_policy, run_episode
from training.run import RUN_KEYS, Checkpoints, RunSettings, Trainer, TrainingRun, seeded, snapshot
from training.distributed import Dist, setup, shard
from training.csvlog import plot_epochs
from training.data import SliceSet, data_dirs, load_split

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MarTrainConfig:
    """MAR pre-training (config section ``mar_train``)."""

    epochs: int = 100
    """Training epochs (paper: 100)."""
    batch_size: int = 16
    """Slices per optimisation step."""
    lr: float = 1e-4
    """Adam learning rate."""
    lambda_ssim: float = 1.0
    """Weight of (1 - SSIM) against L1 in the loss (the paper does not give its value)."""
    input: Literal["full", "undersampled", "mixed"] = "full"
    """Network input: fully sampled metal images (paper), zero-filled undersampled ones drawn from
    the baseline policies, or half of each."""
    clean_fraction: float = 0.0
    """Fraction of the training and validation inputs built from the *clean* k-space (the same
    slice without the implant's field), target unchanged: a fully sampled one is an identity
    pair, an undersampled one asks for de-aliasing only. They teach the residual network to leave
    alone what needs no correction (the do-no-harm recipe uses 0.25; 0 draws nothing, so the
    random streams of earlier recipes are unchanged)."""
    anchor_snr: tuple[float, float] = (0.0, 0.0)
    """With ``clean_fraction`` > 0: the clean anchors carry complex Gaussian acquisition noise at
    an SNR drawn uniformly from this range (:func:`acquisition_noise`), the target staying
    noiseless, so the network learns to denoise rather than to invent; (0, 0): noiseless anchors
    (the earlier recipe; draws nothing)."""
    policies: tuple[str, ...] = ("center-out", "random", "random-lowbias", "equispaced")
    """Policies that draw the undersampling masks of ``undersampled`` / ``mixed`` inputs."""
    run: RunSettings = field(default_factory=RunSettings)
    """Seed, device and slice caps (:class:`training.run.RunSettings`; the seed of weight init, shuffling and masks)."""
    FLAT_KEYS: ClassVar[dict[str, str]] = RUN_KEYS
    """The run keys written flat before 0.3, read under ``run``."""

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0.0 <= self.clean_fraction <= 1.0:
            raise ValueError(f"clean_fraction must be in [0, 1], got {self.clean_fraction}")
        if self.lambda_ssim < 0:
            raise ValueError(f"lambda_ssim must be >= 0, got {self.lambda_ssim}")
        check_snr_range(self.anchor_snr)
        if not self.policies:
            raise ValueError("policies must name at least one sampling policy")
        for name in self.policies:
            make_policy(name)  # unknown names raise, listing the known ones


def check_snr_range(snr: tuple[float, float]) -> None:
    """An anchor SNR range is (0, 0) (no noise) or 0 < low <= high."""
    low, high = snr
    if (low, high) != (0.0, 0.0) and not 0 < low <= high:
        raise ValueError(f"anchor_snr must be (0, 0) or a range 0 < low <= high, got {tuple(snr)}")


def acquisition_noise(kspace: torch.Tensor, snr: torch.Tensor, generator: torch.Generator | None = None,
                      seeds: torch.Tensor | None = None) -> torch.Tensor:
    """(B, PE, RO) complex: Gaussian acquisition noise for B slices at SNR ``snr`` (B,): the mean
    tissue signal of ``|ifft2c(kspace)|`` (pixels above 10 % of the slice's maximum) over the
    noise std, the simulator's definition. Drawn from ``generator``, or one stream per slice from
    ``seeds`` (B,) int (the same noise however the slices are batched)."""
    from masc_gadget.core.kspace import ifft2c

    image = ifft2c(kspace).abs()
    level = torch.stack([c[c > 0.1 * c.max()].mean() if c.max() > 0 else c.new_zeros(()) for c in image])
    sigma = (level / snr.to(level)).reshape(-1, 1, 1) / 2 ** 0.5
    shape = kspace.shape[1:]
    if seeds is not None:
        draws = [torch.randn((2, *shape), generator=torch.Generator().manual_seed(int(s))) for s in seeds]
        real, imag = torch.stack(draws).unbind(dim=1)
    else:
        real, imag = torch.randn(kspace.shape, generator=generator), torch.randn(kspace.shape, generator=generator)
    return torch.complex(real, imag).to(kspace.device, kspace.dtype) * sigma.to(kspace.device)


def draw_anchor_noise(n: int, snr: tuple[float, float], rng: np.random.Generator
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per slice: the anchor's SNR (n,) and noise seed (n,), or None for noiseless anchors
    (drawing nothing)."""
    if tuple(snr) == (0.0, 0.0):
        return None
    return (torch.from_numpy(rng.uniform(snr[0], snr[1], size=n)),
            torch.from_numpy(rng.integers(0, 2 ** 62, size=n)))


def mar_loss(pred: torch.Tensor, target: torch.Tensor, lambda_ssim: float) -> torch.Tensor:
    """``L1 + lambda (1 - SSIM)`` on images scaled by the target's per-slice maximum."""
    p, t = scale_by_target(pred, target)
    return (p - t).abs().mean() + lambda_ssim * (1.0 - ssim(p, t).mean())


def draw_masks(n: int, n_pe: int, acq: AcquisitionConfig, policies: tuple[str, ...],
               rng: np.random.Generator) -> torch.Tensor:
    """(n, n_pe) bool masks: a random baseline policy stopped after a random number of lines
    between ``initial`` and ``initial + budget`` (what the MAR network meets during a scan)."""
    objects = [make_policy(name) for name in policies]
    masks = np.zeros((n, n_pe), dtype=bool)
    for i in range(n):
        policy = objects[int(rng.integers(len(objects)))]
        lines = run_episode(policy, n_pe, acq.initial, acq.budget, rng)
        masks[i, lines[: int(rng.integers(acq.initial, acq.initial + acq.budget + 1))]] = True
    return torch.from_numpy(masks)


def draw_clean(n: int, fraction: float, rng: np.random.Generator) -> torch.Tensor | None:
    """(n,) bool: which slices' inputs come from the clean k-space (None when ``fraction`` is 0,
    drawing nothing)."""
    return torch.from_numpy(rng.random(n) < fraction) if fraction > 0 else None


def network_inputs(data: SliceSet, index: torch.Tensor, mode: str, masks: torch.Tensor | None,
                   device: torch.device, positions: torch.Tensor | None = None,
                   clean: torch.Tensor | None = None,
                   noise: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """(B, H, W) input images for slices ``index``: full metal images and / or zero-filled ones
    (``mixed``: by the parity of each slice's ``positions`` in its minibatch, default 0, 1, ...);
    where ``clean[index]`` is set, of the clean k-space instead of the metal one, with the
    acquisition noise of ``noise`` (:func:`draw_anchor_noise`: SNR and seed per slice) when given."""
    from masc_gadget.core.kspace import ifft2c

    pick = None if clean is None else clean[index].to(device)
    anchor_k = None
    if pick is not None and noise is not None:
        k_clean = data.kspace_clean[index].to(device)
        anchor_k = k_clean + acquisition_noise(k_clean, noise[0][index], seeds=noise[1][index])
    full = data.metal_image[index].to(device)
    if pick is not None:
        anchor_full = data.target[index].to(device) if anchor_k is None else ifft2c(anchor_k).abs()
        full = torch.where(pick[:, None, None], anchor_full, full)
    if mode == "full":
        return full
    kspace = data.kspace_metal[index].to(device)
    if pick is not None:
        anchor = data.kspace_clean[index].to(device) if anchor_k is None else anchor_k
        kspace = torch.where(pick[:, None, None], anchor, kspace)
    under = zero_filled(kspace, masks[index].to(device))
    if mode == "undersampled":
        return under
    positions = torch.arange(len(index)) if positions is None else positions
    half = positions.to(device) % 2 == 1
    return torch.where(half[:, None, None], under, full)


@torch.no_grad()
def validate(model: torch.nn.Module, data: SliceSet, mode: str, masks: torch.Tensor | None,
             lambda_ssim: float, batch_size: int, device: torch.device,
             clean: torch.Tensor | None = None,
             noise: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
    """Mean loss and metrics of ``model`` on ``data`` (and of the uncorrected input). With
    ``clean`` (the do-no-harm recipe) also ``identity_ssim``: the SSIM of the output against the
    input for the fully sampled clean images, which need no change."""
    model.eval()
    sums: dict[str, float] = {}
    n = len(data)
    for start in range(0, n, batch_size):
        index = torch.arange(start, min(start + batch_size, n))
        inputs = network_inputs(data, index, mode, masks, device, clean=clean, noise=noise)
        target = data.target[index].to(device)
        pred = model(inputs)
        batch = {"loss": float(mar_loss(pred, target, lambda_ssim)) * len(index),
                 "input_loss": float(mar_loss(inputs, target, lambda_ssim)) * len(index)}
        if clean is not None:
            batch["identity_ssim"] = float(slice_metrics(model(target), target)["ssim"].sum())
        for key, value in slice_metrics(pred, target).items():
            batch[key] = float(value.sum())
        for key, value in slice_metrics(inputs, target).items():
            batch[f"input_{key}"] = float(value.sum())
        for key, value in batch.items():
            sums[key] = sums.get(key, 0.0) + value
    return {key: value / n for key, value in sums.items()}


def train_epoch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, train: SliceSet,
                order: torch.Tensor, masks: torch.Tensor | None, tcfg: MarTrainConfig,
                device: torch.device, dist: Dist = Dist(), clean: torch.Tensor | None = None,
                noise: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
    """One pass over ``train`` in ``order`` (minibatches of ``tcfg.batch_size``); returns the
    mean training loss. Under ``torchrun`` each rank trains on its share of every global
    minibatch (:func:`~training.distributed.shard`), its loss weighted by that share, so the
    all-reduced gradient is the global minibatch's; a last minibatch smaller than the number of
    ranks is skipped."""
    model.train()
    total = torch.zeros(2, dtype=torch.float64)
    for start in range(0, len(train), tcfg.batch_size):
        index = order[start : start + tcfg.batch_size]
        if len(index) < max(2, dist.world) and len(train) >= 2:
            continue  # BatchNorm needs two samples, and every rank one
        positions = shard(torch.arange(len(index)), dist)
        local = index[positions]
        inputs = network_inputs(train, local, tcfg.input, masks, device, positions, clean, noise)
        loss = mar_loss(model(inputs), train.target[local].to(device), tcfg.lambda_ssim)
        optimizer.zero_grad(set_to_none=True)
        (loss * (len(local) * dist.world / len(index))).backward()
        optimizer.step()
        total += torch.tensor([float(loss.detach()) * len(local), len(local)], dtype=torch.float64)
    if dist.active:
        torch.distributed.all_reduce(total)
    return float(total[0] / max(float(total[1]), 1.0))


@dataclass(eq=False)
class _MarTrainer(Trainer):
    """MAR pre-training as the shared loop (:meth:`~training.run.TrainingRun.loop`) drives it:
    a period is an epoch over freshly drawn masks (and clean anchors), validated on fixed ones."""

    config: Config
    tcfg: MarTrainConfig
    total: int
    data_dir: str | Path | list[str | Path]
    run: TrainingRun
    train: SliceSet
    val: SliceSet
    model: torch.nn.Module
    net: torch.nn.Module
    """The model as trained: under DistributedDataParallel with several ranks, else itself."""
    optimizer: torch.optim.Optimizer
    shuffle: torch.Generator
    rng: np.random.Generator
    device: torch.device
    dist: Dist
    val_inputs: tuple[torch.Tensor | None, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]
    """The validation's masks, clean picks and anchor noise, drawn once."""
    done: int = 0
    name = "train mar"
    unit = "epoch"

    def train_period(self, bar: Any) -> dict[str, Any]:
        tcfg, acq, train = self.tcfg, self.config["acquisition"], self.train
        masks = draw_masks(len(train), train.n_pe, acq, tcfg.policies, self.rng) if tcfg.input != "full" else None
        clean = draw_clean(len(train), tcfg.clean_fraction, self.rng)
        noise = draw_anchor_noise(len(train), tcfg.anchor_snr, self.rng) if clean is not None else None
        loss = train_epoch(self.net, self.optimizer, train,
                           torch.randperm(len(train), generator=self.shuffle), masks, tcfg, self.device, self.dist,
                           clean, noise)
        self.done += 1
        return {"epoch": self.done, "train_loss": loss}

    def validate(self) -> dict[str, float]:
        masks, clean, noise = self.val_inputs
        return validate(self.model, self.val, self.tcfg.input, masks, self.tcfg.lambda_ssim, self.tcfg.batch_size,
                        self.device, clean, noise if clean is not None else None)

    def metadata(self, epoch: int, val_metrics: dict[str, float]) -> dict[str, Any]:
        return {"kind": "mar", "code_version": __version__, "mar_model": to_dict(self.config["mar_model"]),
                "mar_train": to_dict(self.tcfg), "acquisition": to_dict(self.config["acquisition"]),
                "data": ",".join(str(d) for d in data_dirs(self.data_dir)), "epoch": epoch, "val": val_metrics,
                "best_val": self.run.best, "numpy_rng_state": json.dumps(self.rng.bit_generator.state)}

    def checkpoints(self, metrics: dict[str, float]) -> Checkpoints:
        return Checkpoints({"epoch": self.done}, {"mar": self.model}, {"mar": self.model},
                           self.metadata(self.done, metrics),
                           snapshot({"optimizer": self.optimizer, "shuffle_state": self.shuffle}))

    def report(self, row: dict[str, Any], metrics: dict[str, float], improved: bool) -> None:
        log.info("epoch %d: train loss %.4f, val loss %.4f, val SSIM %.4f (input %.4f), PSNR %.2f%s%s",
                 self.done, row["train_loss"], metrics["loss"], metrics["ssim"], metrics["input_ssim"],
                 metrics["psnr"],
                 f", identity SSIM {metrics['identity_ssim']:.4f}" if "identity_ssim" in metrics else "",
                 " *best*" if improved else "")

    def postfix(self, row: dict[str, Any]) -> dict[str, str]:
        return {"loss": f"{row['train_loss']:.4f}", "val_ssim": f"{row['val_ssim']:.4f}"}


def _mar_trainer(config: Config, data_dir: str | Path, run: TrainingRun, dist: Dist,
                 device: torch.device) -> _MarTrainer:
    """The MAR pre-training's trainer: its splits, seeded network, optimizer and random streams,
    resumed from the run's last checkpoint when there is one, and its validation inputs."""
    tcfg: MarTrainConfig = config["mar_train"]
    train = load_split(data_dir, "train", tcfg.run.max_train_slices)
    val = load_split(data_dir, "val", tcfg.run.max_val_slices)
    run.describe(data_dir, train=train, val=val)
    if tcfg.input != "full":
        config["acquisition"].check(train.n_pe)
    model = seeded(tcfg.run.seed, lambda: build_mar(config["mar_model"]).to(device))
    optimizer = torch.optim.Adam(model.parameters(), lr=tcfg.lr)
    shuffle, rng = torch.Generator().manual_seed(tcfg.run.seed), np.random.default_rng(tcfg.run.seed)
    done = run.restore({"mar": model}, {"optimizer": optimizer, "shuffle_state": shuffle, "numpy_rng_state": rng},
                       "epoch")
    val_inputs = (
        draw_masks(len(val), val.n_pe, config["acquisition"], tcfg.policies, np.random.default_rng(tcfg.run.seed + 1))
        if tcfg.input != "full" else None,
        draw_clean(len(val), tcfg.clean_fraction, np.random.default_rng(tcfg.run.seed + 2)),
        draw_anchor_noise(len(val), tcfg.anchor_snr, np.random.default_rng(tcfg.run.seed + 3)))
    return _MarTrainer(config, tcfg, tcfg.epochs, data_dir, run, train, val, model, dist.wrap(model), optimizer,
                       shuffle, rng, device, dist, val_inputs, done)


def train_mar(config: Config, data_dir: str | Path, out: str | Path, resume: str | Path | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Pre-train the MAR network; the best checkpoint (lowest validation loss) goes to ``out``,
    the latest (for ``resume``) to ``<out>.last.pt`` and the per-epoch log to ``<out>.csv``.

    Under ``torchrun`` the ranks share every minibatch (DistributedDataParallel, module
    :mod:`training.distributed`); rank 0 writes the checkpoints and the log, every rank
    validates (the same model, the same numbers)."""
    dist = setup()
    tcfg: MarTrainConfig = config["mar_train"]
    device = resolve_device(dist.device(tcfg.run.device))
    run = TrainingRun(out, "loss", higher_is_better=False, main=dist.main, resume=resume)
    trainer = _mar_trainer(config, data_dir, run, dist, device)
    log.info("MAR pre-training: %d train / %d val slices, input %s, %d epochs on %s%s",
             len(trainer.train), len(trainer.val), tcfg.input, tcfg.epochs, device,
             f", rank {dist.rank} of {dist.world}" if dist.active else "")
    run.loop(trainer, dist, progress)
    run.finish({"mar": trainer.model}, trainer.metadata(tcfg.epochs, run.best))  # e.g. resumed a finished run
    if dist.main and run.csv.exists():
        figure = plot_epochs(run.csv, run.out.with_suffix(".png"), MAR_PANELS, "val_loss", higher_is_better=False)
        log.info("learning curve: %s", figure)
    return run.best


MAR_PANELS = (
    ("loss: L1 + lambda (1 - SSIM)", (("train_loss", "training"), ("val_loss", "validation"))),
    ("validation SSIM", (("val_ssim", "MAR output"), ("val_input_ssim", "its input"))),
    ("do no harm: clean, fully sampled in", (("val_identity_ssim", "SSIM of the output"),)),
)
"""The panels of ``masc train mar``'s learning curve (``<out>.png``)."""
