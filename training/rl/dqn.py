"""The value-based baselines of the paper's Table 1: DQN and SS-DDQN.

``masc train dqn`` (Mnih et al. 2015) and ``masc train ss-ddqn`` (Pineda et al. 2020, the
subject-specific Double DQN of "Active MR k-space sampling with reinforcement learning") learn a
Q-value per phase-encoding line (:class:`~masc_gadget.models.q_net.QNet`) on the same batched
acquisition environment, rewards and splits as MASC, and write checkpoints that ``masc eval``
and the gadget play greedily. What differs between the two:

============  ==========================================  ============================================
              dqn                                         ss-ddqn
============  ==========================================  ============================================
network       image + mask                                reconstruction + its k-space + mask
              (``spectral: false``)                       (``spectral: true``)
target        ``r + gamma max_a' Q_target(s', a')``       ``r + gamma Q_target(s', argmax_a' Q(s', a'))``
============  ==========================================  ============================================

Both: epsilon-greedy exploration (uniform over the *free* lines) decaying linearly, a replay
memory, a target network copied every ``target_update`` transitions, the smooth-L1 (Huber) TD
loss, gradient-norm clipping, Adam. Acquired lines are masked out of the argmax and out of the
bootstrap target's max / argmax.

**The replay memory stores no images.** A transition is (slice index, acquired-lines mask
before the action, action, reward, lines left), packed into a few bytes
(:meth:`MaskReplay.bytes_per_transition`: ``ceil(PE / 8) + 12``, 37 bytes at 200 lines); the
states' images are recomputed from the k-space for each minibatch
(:meth:`~training.rl.env.BatchedAcquisitionEnv.observe`: one masked inverse FFT, plus the MAR
forward when the agent observes MAR images). Storing the two images of a transition instead
costs ``2 H W 4`` bytes (400 kB at 256 x 200): 8 GB for 20,000 transitions, where this memory
takes 0.7 MB. The MAR network, when there is one, is the frozen pre-trained one, so a recomputed
image is the image the agent saw.

Under ``torchrun`` every rank runs its own environments (slices drawn with ``seed + rank``),
exploration stream and replay memory; each gradient step averages the ranks' minibatch gradients,
so the online networks stay equal (checked at every validation), and rank 0 writes. ``steps``
counts the transitions of one rank.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from masc_gadget import __version__
from masc_gadget.acquisition.learned import q_metadata
from masc_gadget.config import Config, to_dict
from masc_gadget.device import resolve_device
from masc_gadget.models.checkpoint import load_mar
from masc_gadget.models.q_net import QNet, masked_q
from training.run import RUN_KEYS, Checkpoints, RunSettings, Trainer, TrainingRun, seeded, snapshot
from training.data import load_split
from training.distributed import Dist, setup
from training.rl.env import BatchedAcquisitionEnv, EnvConfig

log = logging.getLogger(__name__)

__all__ = ["DQNConfig", "MaskReplay", "VARIANTS", "td_targets", "train_dqn"]

VARIANTS = {"dqn": {"double": False, "spectral": False}, "ss-ddqn": {"double": True, "spectral": True}}
"""What each value-based baseline is: Double-DQN target, spectral input."""


@dataclass(frozen=True)
class DQNConfig:
    """DQN / SS-DDQN training (config section ``dqn``); the network is section ``q_net``."""

    steps: int = 20000
    """Environment transitions to train on (all environments together)."""
    replay_size: int = 20000
    """Transitions the replay memory holds (oldest dropped first)."""
    batch_size: int = 64
    """Transitions per gradient step."""
    lr: float = 1e-4
    """Adam learning rate."""
    gamma: float = 1.0
    """Discount; episodes have ``budget`` steps, so 1 optimises the episode's total improvement
    (as PPO does here)."""
    eps_start: float = 1.0
    """Exploration rate at the start: the share of actions drawn uniformly among free lines."""
    eps_end: float = 0.05
    """Exploration rate after the decay."""
    eps_fraction: float = 0.5
    """Share of ``steps`` over which epsilon decays linearly from eps_start to eps_end."""
    learning_starts: int = 1000
    """Transitions collected before the first gradient step."""
    updates_per_step: int = 1
    """Gradient steps per batched environment step (which adds ``env.n_envs`` transitions)."""
    target_update: int = 1000
    """Transitions between copies of the online network into the target network."""
    max_grad_norm: float = 10.0
    """Global gradient-norm clip."""
    val_every: int = 2000
    """Validate (greedy episodes on the val split) and checkpoint every N transitions, and at the end."""
    run: RunSettings = field(default_factory=RunSettings)
    """Seed, device and slice caps (:class:`training.run.RunSettings`; the seed of the network init, slice draws, exploration and minibatches)."""
    FLAT_KEYS: ClassVar[dict[str, str]] = RUN_KEYS
    """The run keys written flat before 0.3, read under ``run``."""

    def __post_init__(self) -> None:
        for name in ("steps", "replay_size", "batch_size", "updates_per_step", "target_update", "val_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.learning_starts, bool) or not isinstance(self.learning_starts, int) or self.learning_starts < 0:
            raise ValueError(f"learning_starts must be an integer >= 0, got {self.learning_starts!r}")
        if not self.lr > 0 or not self.max_grad_norm > 0:
            raise ValueError(f"lr and max_grad_norm must be > 0, got {self.lr} and {self.max_grad_norm}")
        for name in ("gamma", "eps_start", "eps_end"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.0 < self.eps_fraction <= 1.0:
            raise ValueError(f"eps_fraction must be in (0, 1], got {self.eps_fraction}")

    def epsilon(self, transitions: int) -> float:
        """The exploration rate after ``transitions`` transitions (linear decay, then flat)."""
        progress = min(1.0, transitions / max(1.0, self.eps_fraction * self.steps))
        return self.eps_start + progress * (self.eps_end - self.eps_start)


class MaskReplay:
    """A ring buffer of transitions that stores masks, not images (module docstring).

    Per transition: the slice (int32), the mask before the action (bit-packed, ``ceil(PE/8)``
    bytes), the action (int16), the reward (float32) and the lines left before the action
    (int16). The next state is implied: the mask plus the action, one line less to choose; the
    episode ends when none is left.
    """

    def __init__(self, capacity: int, n_pe: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        if not 1 <= n_pe <= 32767:
            raise ValueError(f"n_pe must be in [1, 32767], got {n_pe}")
        self.capacity, self.n_pe = capacity, n_pe
        self.slices = np.zeros(capacity, dtype=np.int32)
        self.masks = np.zeros((capacity, (n_pe + 7) // 8), dtype=np.uint8)
        self.actions = np.zeros(capacity, dtype=np.int16)
        self.rewards = np.zeros(capacity, dtype=np.float32)
        self.steps_left = np.zeros(capacity, dtype=np.int16)
        self.size = 0
        self.cursor = 0

    @staticmethod
    def bytes_per_transition(n_pe: int) -> int:
        """Bytes one transition takes: ``ceil(n_pe / 8)`` of mask + 4 (slice) + 2 (action) + 4
        (reward) + 2 (lines left)."""
        return (n_pe + 7) // 8 + 4 + 2 + 4 + 2

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer's arrays (allocated in full at construction)."""
        return sum(a.nbytes for a in (self.slices, self.masks, self.actions, self.rewards, self.steps_left))

    def __len__(self) -> int:
        return self.size

    def add(self, slices: torch.Tensor, masks: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor,
            steps_left: torch.Tensor) -> None:
        """Store B transitions: (B,) slices, (B, PE) bool masks *before* the actions, (B,)
        actions, rewards, lines left before the actions (>= 1)."""
        masks_np = masks.detach().cpu().numpy()
        if masks_np.dtype != bool or masks_np.ndim != 2 or masks_np.shape[1] != self.n_pe:
            raise ValueError(f"masks must be bool (B, {self.n_pe}), got {masks_np.dtype} {masks_np.shape}")
        b = masks_np.shape[0]
        rows = (self.cursor + np.arange(b)) % self.capacity
        self.slices[rows] = slices.detach().cpu().numpy()
        self.masks[rows] = np.packbits(masks_np, axis=1)
        self.actions[rows] = actions.detach().cpu().numpy()
        self.rewards[rows] = rewards.detach().cpu().numpy()
        self.steps_left[rows] = steps_left.detach().cpu().numpy()
        self.cursor = int((self.cursor + b) % self.capacity)
        self.size = min(self.capacity, self.size + b)

    def sample(self, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """A minibatch drawn uniformly (with replacement) with ``generator``: ``slices``,
        ``masks`` (before), ``next_masks`` (after), ``actions``, ``rewards``, ``steps_left``
        (before), ``done`` (no line left after the action); CPU tensors."""
        if self.size == 0:
            raise ValueError("the replay memory is empty")
        rows = torch.randint(self.size, (batch_size,), generator=generator).numpy()
        masks = torch.from_numpy(np.unpackbits(self.masks[rows], axis=1, count=self.n_pe).astype(bool))
        actions = torch.from_numpy(self.actions[rows].astype(np.int64))
        next_masks = masks.clone()
        next_masks[torch.arange(batch_size), actions] = True
        steps_left = torch.from_numpy(self.steps_left[rows].astype(np.int64))
        return {"slices": torch.from_numpy(self.slices[rows].astype(np.int64)), "masks": masks,
                "next_masks": next_masks, "actions": actions, "rewards": torch.from_numpy(self.rewards[rows]),
                "steps_left": steps_left, "done": steps_left <= 1}

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain data, for a ``.last.pt`` checkpoint."""
        return {"slices": torch.from_numpy(self.slices[:self.size].copy()),
                "masks": torch.from_numpy(self.masks[:self.size].copy()),
                "actions": torch.from_numpy(self.actions[:self.size].copy()),
                "rewards": torch.from_numpy(self.rewards[:self.size].copy()),
                "steps_left": torch.from_numpy(self.steps_left[:self.size].copy()),
                "cursor": self.cursor, "size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        size = int(state["size"])
        if size > self.capacity or tuple(state["masks"].shape[1:]) != self.masks.shape[1:]:
            raise ValueError(f"replay state of {size} transitions of width {tuple(state['masks'].shape[1:])} does "
                             f"not fit a memory of {self.capacity} x {self.masks.shape[1:]}")
        for name in ("slices", "masks", "actions", "rewards", "steps_left"):
            getattr(self, name)[:size] = state[name].numpy()
        self.size, self.cursor = size, int(state["cursor"]) % self.capacity


def td_targets(rewards: torch.Tensor, done: torch.Tensor, next_masks: torch.Tensor, q_next_target: torch.Tensor,
               q_next_online: torch.Tensor | None, gamma: float) -> torch.Tensor:
    """The bootstrap targets ``r + gamma (1 - done) Q'`` of B transitions.

    ``q_next_target`` / ``q_next_online``: (B, PE) Q of the next states from the target and the
    online network. DQN (``q_next_online`` None): ``Q' = max`` of the target's Q over the free
    lines of the next state. Double DQN: the online network picks the free line
    (``argmax Q_online``), the target network values it. Lines acquired in the next state never
    count; a terminal transition's target is its reward."""
    free_target = masked_q(q_next_target, next_masks)
    if q_next_online is None:
        bootstrap = free_target.max(dim=1).values
    else:
        best = masked_q(q_next_online, next_masks).argmax(dim=1, keepdim=True)
        bootstrap = q_next_target.gather(1, best).squeeze(1)
    bootstrap = torch.where(done | next_masks.all(dim=1), torch.zeros_like(bootstrap), bootstrap)
    return rewards + gamma * bootstrap


@torch.no_grad()
def greedy_q(net: QNet, image: torch.Tensor, mask: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
    """(B,) the free line with the largest Q (ties: the lowest line)."""
    return net.scores(image, mask, frac).argmax(dim=1)


def explore(greedy: torch.Tensor, mask: torch.Tensor, epsilon: float, generator: torch.Generator) -> torch.Tensor:
    """Epsilon-greedy: each action is replaced, with probability ``epsilon``, by a line drawn
    uniformly among the free lines of its mask (draws from ``generator``, on the CPU)."""
    free = (~mask).float().cpu()
    uniform = torch.multinomial(free, 1, generator=generator).squeeze(1)
    coin = torch.rand(greedy.shape[0], generator=generator) < epsilon
    return torch.where(coin, uniform, greedy.cpu()).to(greedy.device)


def td_update(net: QNet, target: QNet, optimizer: torch.optim.Optimizer, env: BatchedAcquisitionEnv,
              batch: dict[str, torch.Tensor], cfg: DQNConfig, double: bool, dist: Dist = Dist()) -> dict[str, float]:
    """One gradient step on a replay minibatch; the states' images are recomputed by ``env``.
    Under ``torchrun`` the gradients are averaged over the ranks' minibatches."""
    device = next(net.parameters()).device
    b = {k: v.to(device) for k, v in batch.items()}
    budget = env.budget
    images = env.observe(b["slices"], b["masks"])
    next_images = env.observe(b["slices"], b["next_masks"])
    frac = b["steps_left"].float() / budget
    next_frac = (b["steps_left"] - 1).clamp(min=0).float() / budget
    with torch.no_grad():
        q_target = target(next_images, b["next_masks"], next_frac)
        q_online = net(next_images, b["next_masks"], next_frac) if double else None
        y = td_targets(b["rewards"], b["done"], b["next_masks"], q_target, q_online, cfg.gamma)
    q = net(images, b["masks"], frac).gather(1, b["actions"].unsqueeze(1)).squeeze(1)
    loss = F.smooth_l1_loss(q, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    dist.average_gradients(net)
    grad_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.max_grad_norm)
    optimizer.step()
    return {"losses/td": float(loss.detach()), "losses/q": float(q.detach().mean()),
            "losses/grad_norm": float(grad_norm)}


VAL_FIELDS = [f"val/{m}" for m in ("ssim", "psnr", "mse", "nmse", "mae", "return", "final_quality")]


FIELDS = ["transitions", "charts/epsilon", "charts/episodic_return", "losses/td", "losses/q", "losses/grad_norm",
          *VAL_FIELDS, "seconds"]
"""The columns of the CSV log."""


@dataclass(eq=False)
class _DQNTrainer(Trainer):
    """DQN / SS-DDQN as the shared loop (:meth:`~training.run.TrainingRun.loop`) drives it: a
    period is the transitions between two validations (every ``val_every``, and at the end)."""

    config: Config
    cfg: DQNConfig
    total: int
    variant: str
    data_dir: str | Path
    mar_path: str | Path | None
    mar_meta: dict[str, Any]
    run: TrainingRun
    net: QNet
    target: QNet
    optimizer: torch.optim.Optimizer
    gen: torch.Generator
    replay: MaskReplay
    env: BatchedAcquisitionEnv
    val_env: BatchedAcquisitionEnv
    observes_mar: bool
    dist: Dist
    done: int = 0
    """Transitions of this rank so far."""
    next_val: int = 0
    """The transitions at which the next validation is due."""
    next_target: int = 0
    """The transitions at which the target network is next copied from the online one."""
    obs: Any = None
    """The training environments' current observation."""
    returns: list[float] = field(default_factory=list)
    """The returns of the episodes finished since the last validation."""
    stats: list[dict[str, float]] = field(default_factory=list)
    """The gradient steps' statistics since the last validation."""
    unit = "transition"
    clock = "run"

    @property
    def name(self) -> str:
        return f"train {self.variant}"

    def train_period(self, bar: Any) -> dict[str, Any]:
        cfg = self.cfg
        while True:
            epsilon = self._step()
            bar.update(self.env.n_envs)
            if self.done >= self.next_val or self.done >= cfg.steps:
                break
        self.next_val += cfg.val_every
        self.net.eval()
        row: dict[str, Any] = {"transitions": self.done, "charts/epsilon": epsilon,
                               "charts/episodic_return": float(np.mean(self.returns)) if self.returns else math.nan}
        for key in ("losses/td", "losses/q", "losses/grad_norm"):
            row[key] = float(np.mean([s[key] for s in self.stats])) if self.stats else math.nan
        self.returns, self.stats = [], []
        return row

    def _step(self) -> float:
        """One batched environment step, epsilon-greedy, its transitions stored; then the
        gradient steps (once the memory holds enough) and the target network's copy when due.
        Returns the step's epsilon."""
        cfg, net, obs = self.cfg, self.net, self.obs
        epsilon = cfg.epsilon(self.done)
        net.eval()
        actions = explore(greedy_q(net, obs.image, obs.mask, obs.steps_left.float() / self.env.budget), obs.mask,
                          epsilon, self.gen)
        slices, masks, steps_left = self.env.slice_index, obs.mask.clone(), obs.steps_left.clone()
        self.obs, rewards, _done, info = self.env.step(actions)
        self.replay.add(slices, masks, actions, rewards, steps_left)
        self.returns += info["episode_return"][torch.isfinite(info["episode_return"])].cpu().tolist()
        self.done += self.env.n_envs
        if len(self.replay) >= max(cfg.learning_starts, cfg.batch_size):
            net.train()
            for _ in range(cfg.updates_per_step):
                self.stats.append(td_update(net, self.target, self.optimizer, self.env,
                                            self.replay.sample(cfg.batch_size, self.gen), cfg,
                                            VARIANTS[self.variant]["double"], self.dist))
        if self.done >= self.next_target:
            self.target.load_state_dict(net.state_dict())
            self.next_target += cfg.target_update
        return epsilon

    def validate(self) -> dict[str, float]:
        budget = self.env.budget
        return self.val_env.validate(lambda obs: greedy_q(self.net, obs.image, obs.mask,
                                                          obs.steps_left.float() / budget))

    def metadata(self, val_metrics: dict[str, float]) -> dict[str, Any]:
        config = self.config
        return q_metadata(self.net, self.variant, self.observes_mar, transitions=self.done, val=val_metrics,
                          best_val=self.run.best, code_version=__version__, data=str(self.data_dir),
                          mar_checkpoint=str(self.mar_path) if self.mar_path else None,
                          mar_epoch=self.mar_meta.get("epoch"),
                          config={k: to_dict(config[k]) for k in ("acquisition", "env", "q_net", "dqn")})

    def checkpoints(self, metrics: dict[str, float]) -> Checkpoints:
        return Checkpoints({"transitions": self.done}, {"q": self.net}, {"q": self.net, "target": self.target},
                           self.metadata(metrics),
                           snapshot({"optimizer": self.optimizer, "generator": self.gen, "replay": self.replay}),
                           sync=self.net)

    def columns(self, metrics: dict[str, float]) -> dict[str, Any]:
        return {f"val/{k}": v for k, v in metrics.items()}

    def fields(self, row: dict[str, Any]) -> list[str]:
        return FIELDS

    def report(self, row: dict[str, Any], metrics: dict[str, float], improved: bool) -> None:
        log.info("%s: %d transitions, epsilon %.3f, val SSIM %.4f, PSNR %.2f%s", self.variant, self.done,
                 row["charts/epsilon"], metrics["ssim"], metrics["psnr"], " *best*" if improved else "")

    def postfix(self, row: dict[str, Any]) -> dict[str, str]:
        return {"ret": f"{row['charts/episodic_return']:.3f}", "best_ssim": f"{self.run.best['ssim']:.4f}"}


def _dqn_trainer(config: Config, data_dir: str | Path, mar_path: str | Path | None, variant: str,
                 run: TrainingRun, dist: Dist, device: torch.device) -> _DQNTrainer:
    """The baseline's trainer: its splits, seeded online and target networks, optimizer, random
    stream and replay memory, resumed from the run's last checkpoint when there is one, and its
    training and validation environments (the training one reset)."""
    cfg: DQNConfig = config["dqn"]
    ecfg: EnvConfig = config["env"]
    acq = config["acquisition"]
    train = load_split(data_dir, "train", cfg.run.max_train_slices)
    val = load_split(data_dir, "val", cfg.run.max_val_slices)
    run.describe(data_dir, train=train, val=val)
    acq.check(train.n_pe)
    if acq.lines_per_decision != 1:
        raise ValueError(f"{variant} learns one Q-value per line and chooses one line per decision; train it with "
                         "acquisition.lines_per_decision=1 (served with a larger k, it plays the top k Q-values)")
    mar, mar_meta = (load_mar(mar_path, device) if mar_path else (None, {}))
    if mar is not None:
        mar.eval().requires_grad_(False)
    net = seeded(cfg.run.seed, lambda: QNet(train.n_pe, *train.target.shape[1:], config["q_net"],
                                        spectral=VARIANTS[variant]["spectral"]).to(device))
    target = copy.deepcopy(net).eval().requires_grad_(False)
    optimizer = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.run.seed + dist.rank)  # each rank explores on its own stream
    replay = MaskReplay(cfg.replay_size, train.n_pe)
    done = run.restore({"q": net, "target": target}, {"optimizer": optimizer, "generator": gen, "replay": replay},
                       "transitions")
    if done and dist.rank:  # the checkpoint holds rank 0's stream and memory; other ranks start their own
        gen.manual_seed(cfg.run.seed + dist.rank + 7919 * done)
    env = BatchedAcquisitionEnv(train, ecfg, acq.initial, acq.budget, mar, device,
                                seed=cfg.run.seed + done + 1_000_003 * dist.rank)
    val_env = BatchedAcquisitionEnv(val, ecfg, acq.initial, acq.budget, mar, device, seed=cfg.run.seed)
    log.info("%s: %d train / %d val slices, %d envs, %d transitions, replay %d (%.1f MB, no images), MAR %s, on %s",
             variant, len(train), len(val), ecfg.n_envs, cfg.steps, cfg.replay_size, replay.nbytes / 1e6,
             "frozen" if mar is not None else "none", device)
    return _DQNTrainer(config, cfg, cfg.steps, variant, data_dir, mar_path, mar_meta, run, net, target, optimizer,
                       gen, replay, env, val_env, ecfg.observe_mar and mar is not None, dist, done,
                       next_val=(done // cfg.val_every + 1) * cfg.val_every,
                       next_target=(done // cfg.target_update + 1) * cfg.target_update, obs=env.reset())


def train_dqn(config: Config, data_dir: str | Path, mar_path: str | Path | None, out: str | Path,
              variant: str = "dqn", resume: str | Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Train DQN or SS-DDQN (``variant``); the best checkpoint (validation SSIM of greedy
    episodes) goes to ``out``, the latest (with the replay memory, for ``resume``) to
    ``<out>.last.pt``, the log to ``<out>.csv``. With ``mar_path`` the agent observes and is
    rewarded through that frozen MAR network (env section), else through the zero-filled
    images. Returns the best validation metrics."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    dist = setup()
    cfg: DQNConfig = config["dqn"]
    if config["env"].corruption.enabled:
        raise ValueError("env.corruption (re-acquiring flagged lines) is trained with MASC (masc train masc, "
                         "policy_net.reacquire=true); the DQN baselines acquire each line once: set env.corruption=0")
    device = resolve_device(dist.device(cfg.run.device))
    run = TrainingRun(out, "ssim", higher_is_better=True, main=dist.main, resume=resume, kind=variant,
                      map_location=device)
    trainer = _dqn_trainer(config, data_dir, mar_path, variant, run, dist, device)
    run.best["seconds"] = run.loop(trainer, dist, progress)
    run.finish({"q": trainer.net}, trainer.metadata(run.best))  # a resumed run that had nothing left to do
    return run.best
