"""The acquisition MDP (DESIGN.md "Acquisition episode"), batched on the device.

State ``s_t = (I_t, M_t, steps left)``: ``I_t = |F^-1(K * M_t)|`` the zero-filled magnitude image of
the acquired phase-encoding (PE) lines ``M_t`` of one slice's k-space ``K``. An episode starts with
the ``initial`` centre lines acquired; the policy then chooses ``budget`` lines one at a time and
an acquired line can never be chosen again. The reward of a choice is

    r_t = alpha * (Q(x_{t+1}, I*) - Q(x_t, I*)),   Q = l_ssim * SSIM + l_nmse * (1 - NMSE),

with ``x = g(I)`` (the MAR network's output, paper Stage 2) or ``x = I`` and ``I*`` the clean fully
sampled image, so an episode's rewards sum to ``alpha * (Q_final - Q_initial)``.

:class:`BatchedAcquisitionEnv` steps ``n_envs`` episodes (slices) together: one batched masked
IFFT and ONE batched MAR forward per step, for all of them (the per-env current quality is kept,
so a step never recomputes the previous state). Everything runs under ``torch.no_grad``.
:mod:`training.rl.gym_env` wraps it as a single-episode Gymnasium environment.

With ``corruption`` (its probability > 0) each acquisition of a line may be corrupted and flagged by the scanner
(:mod:`training.rl.corruption`); the observation then also holds the flagged lines
(``repeatable``), an action may name one of them to acquire it again (:class:`RepeatEpisodes`:
every acquisition spends a step), and the image is made of each line's latest acquisition.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np
import torch
from torch import nn

from masc_gadget.acquisition.episode import EpisodeBatch, check_episode
from masc_gadget.device import resolve_device
from masc_gadget.core.kspace import to_hybrid, zero_filled_hybrid
from masc_gadget.core.metrics import QualityReference
from training.data import REGIONS, SliceSet
from training.oracle import kspace_of
from training.rl.corruption import CorruptionModel, RepeatEpisodes, corrupt_slice, draw_flagged, repeatable_lines
from training.scoring import score_batch

__all__ = ["BatchedAcquisitionEnv", "EnvConfig", "Observation", "RepeatEpisodes", "repeatable_lines"]


@dataclass(frozen=True)
class EnvConfig:
    """The acquisition environment: reward, what is acquired and observed (section ``env``).

    The episode length (``initial`` centre lines, then ``budget`` choices) comes from the
    ``acquisition`` section.
    """

    alpha: float = 100.0
    """Reward scale: ``r_t = alpha * (Q_{t+1} - Q_t)`` (paper)."""
    l_ssim: float = 0.5
    """Weight of SSIM in ``Q = l_ssim * SSIM + l_nmse * (1 - NMSE)`` (paper: 0.5)."""
    l_nmse: float = 0.5
    """Weight of ``1 - NMSE`` in Q (paper: 0.5)."""
    kspace: Literal["metal", "clean"] = "metal"
    """Whose k-space is acquired: ``metal`` (the implant's field, the paper's setting) or
    ``clean`` (the "clean-trained" ablation). The target of Q is always the clean fully sampled
    image."""
    observe_mar: bool = True
    """The policy observes the MAR image ``g(I)`` instead of the zero-filled ``I`` (paper's
    artifact-aware agent). Without a MAR network the zero-filled image is observed."""
    reward_mar: bool = True
    """Rewards are computed on ``Q(g(I))`` (paper Stage 2) instead of ``Q(I)``. Without a MAR
    network they are computed on the zero-filled image."""
    n_envs: int = 16
    """Episodes (slices) stepped together in one batch on the device."""
    region: str = "image"
    """Where Q is computed: ``image`` (the whole image, the paper) or ``implant``, the
    periprosthetic region (each slice's implant dilated by ``margin`` pixels,
    :meth:`training.data.SliceSet.periprosthetic_roi`): the area a radiologist reads around an
    implant. Validation then also reports the region's metrics (``roi_ssim``, ...), and the
    checkpoint kept is the one with the best ``roi_ssim``."""
    margin: int = 8
    """With ``region: implant``: pixels the implant is dilated by."""
    corruption: CorruptionModel = field(default_factory=CorruptionModel)
    """The k-space corruption of each acquisition and the scanner's flags (a bare number: its
    probability; 0, the default: none; :class:`training.rl.corruption.CorruptionModel`). With
    corruption, an acquired line whose latest acquisition is flagged may be acquired again, up to
    ``attempts`` times: that spends a line of the budget, and the new acquisition replaces the
    flagged one; :meth:`BatchedAcquisitionEnv.evaluate` replays the draws of ``seed``, those of
    ``masc check headroom`` with the same section (training episodes draw from the env's own
    stream)."""

    FLAT_KEYS: ClassVar[dict[str, str]] = {
        "corruption_kind": "corruption.kind", "attempts": "corruption.attempts",
        "detection": "corruption.detection", "false_alarm": "corruption.false_alarm",
        "corruption_seed": "corruption.seed"}
    """The corruption keys written flat before 0.3, read under ``corruption``."""

    def __post_init__(self) -> None:
        for name in ("alpha", "l_ssim", "l_nmse"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if self.l_ssim < 0 or self.l_nmse < 0 or self.l_ssim + self.l_nmse <= 0:
            raise ValueError(
                f"l_ssim and l_nmse must be >= 0 with a positive sum, got {self.l_ssim} and {self.l_nmse}"
            )
        if self.kspace not in ("metal", "clean"):
            raise ValueError(f"kspace must be 'metal' or 'clean', got {self.kspace!r}")
        for name in ("observe_mar", "reward_mar"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.n_envs, bool) or not isinstance(self.n_envs, int) or self.n_envs < 1:
            raise ValueError(f"n_envs must be an integer >= 1, got {self.n_envs!r}")
        if self.region not in REGIONS:
            raise ValueError(f"region must be one of {', '.join(REGIONS)}, got {self.region!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin must be an integer >= 0 (pixels), got {self.margin!r}")
        if not isinstance(self.corruption, CorruptionModel):
            raise TypeError(f"corruption must be a CorruptionModel, got {self.corruption!r}")

    @property
    def selection_metric(self) -> str:
        """The validation metric the kept checkpoint maximises: ``ssim``, or ``roi_ssim`` in the
        periprosthetic region."""
        return "ssim" if self.region == "image" else "roi_ssim"


class Observation(NamedTuple):
    """What the policy sees for B episodes (tensors on the env's device, never modified later)."""

    image: torch.Tensor
    """(B, H, W) float32: ``g(I_t)`` if ``observe_mar`` (and a MAR network is set), else ``I_t``."""
    mask: torch.Tensor
    """(B, PE) bool, True for acquired lines."""
    steps_left: torch.Tensor
    """(B,) long, lines still to choose in the episode."""
    repeatable: torch.Tensor | None = None
    """(B, PE) bool with corruption (``EnvConfig.corruption``), else None: acquired lines whose
    latest acquisition the scanner flagged, with attempts left; the policy may acquire them
    again."""


class _Measured(NamedTuple):
    observed: torch.Tensor  # (B, H, W) image the policy sees
    quality: torch.Tensor  # (B,) Q of the reward image
    zero_filled: torch.Tensor  # (B, H, W) I
    corrected: torch.Tensor | None  # (B, H, W) g(I), None when no MAR forward was needed


class _NewEpisodes(NamedTuple):
    """The episodes an autoreset starts (:meth:`BatchedAcquisitionEnv._autoreset`)."""

    slices: torch.Tensor
    kspace: torch.Tensor
    ref: Any
    mask: torch.Tensor
    attempts: torch.Tensor | None
    flags: torch.Tensor | None


class BatchedAcquisitionEnv:
    """Many slices at once on the device: batched masked IFFT and ONE batched MAR forward per step.

    Slices are drawn uniformly (with replacement) by a private ``torch.Generator(seed)``; the
    global torch / numpy RNGs are never touched. Every episode has exactly ``budget`` steps, so
    envs started together finish together.

    The MAR network, if any, is always run in eval mode (BatchNorm uses its running statistics, so
    an image's correction does not depend on the other slices of the batch and the running
    statistics are not updated); its train / eval mode is restored after each forward. It must
    be on ``device``.

    Args:
        data: the slices (k-space and clean targets are copied to ``device`` once).
        cfg: environment settings; ``cfg.n_envs`` is the batch size B.
        initial: centre lines acquired at the start of an episode (>= 1).
        budget: lines chosen by the policy per episode (>= 1, ``initial + budget <= PE``).
        mar: the MAR network g, ``(B, H, W) -> (B, H, W)``, or None (then ``observe_mar`` and
            ``reward_mar`` fall back to the zero-filled image).
        device: cpu, cuda, cuda:N or auto.
        seed: seed of the slice draws.
        autoreset: finished envs start a new episode inside :meth:`step` (the returned
            observation is the new episode's first one). With False a finished env keeps its
            final state until :meth:`reset`, and stepping it is an error (the single-episode
            Gymnasium view uses this).
        lines_per_decision: k, lines acquired per step (an echo train): actions are then
            (B, k), -1 beyond an episode's lines left; one reconstruction and MAR forward after
            the whole train, whose reward is the train's improvement. 1: (B,) actions.
    """

    def __init__(self, data: SliceSet, cfg: EnvConfig, initial: int, budget: int,
                 mar: nn.Module | None = None, device: str | torch.device = "cpu", seed: int = 0,
                 autoreset: bool = True, lines_per_decision: int = 1) -> None:
        if len(data) < 1:
            raise ValueError("data must hold at least one slice, got an empty SliceSet")
        n_pe = data.n_pe
        check_episode(n_pe, initial, budget)
        if isinstance(lines_per_decision, bool) or not isinstance(lines_per_decision, int) or lines_per_decision < 1:
            raise ValueError(f"lines_per_decision must be an integer >= 1, got {lines_per_decision!r}")
        self.lines_per_decision = lines_per_decision
        self.cfg = cfg
        self.device = resolve_device(device)
        self.autoreset = bool(autoreset)
        self._initial = int(initial)
        self._budget = int(budget)
        kspace = data.kspace_metal if cfg.kspace == "metal" else data.kspace_clean
        if tuple(kspace.shape[1:]) != tuple(data.target.shape[1:]):
            raise ValueError(
                f"k-space (N, PE, RO) {tuple(kspace.shape)} and target (N, H, W) "
                f"{tuple(data.target.shape)} must have H = PE and W = RO"
            )
        # (N, PE, RO) complex, the readout transform done once (to_hybrid): each step's
        # reconstruction is then one 1D inverse FFT
        self._kspace_all = to_hybrid(kspace.to(self.device))
        self._corruption = cfg.corruption if cfg.corruption.enabled else None
        if self._corruption is not None:
            if lines_per_decision != 1:
                raise ValueError("with corruption the policy chooses one line per decision (a repeat is one "
                                 "acquisition): set lines_per_decision 1")
            self._raw_all = kspace.to(self.device)  # each episode's attempts are drawn from it
            self._slices_all = np.asarray(data.slices, dtype=np.int64)
            self._draws = np.random.default_rng(int(seed))  # training episodes' corruption draws
        self._target_all = data.target.to(self.device, torch.float32)  # (N, H, W)
        # (N, H, W) bool where Q is computed, None for the whole image
        self._roi_all = data.periprosthetic_roi(cfg.margin).to(self.device) if cfg.region == "implant" else None
        self._n_slices = len(data)
        self._generator = torch.Generator().manual_seed(int(seed))
        self._n_pe = int(n_pe)
        self._episodes: EpisodeBatch | None = None  # the current episodes, from reset()
        self.mar: nn.Module | None = None
        self._check_mar(mar)
        self.mar = mar
        self._started = False

    # ------------------------------------------------------------------ properties
    @property
    def n_envs(self) -> int:
        """Number of episodes stepped together (B)."""
        return self.cfg.n_envs

    @property
    def n_pe(self) -> int:
        """Number of PE lines (the action count)."""
        return self._n_pe

    @property
    def image_shape(self) -> tuple[int, int]:
        """(H, W) of the observed images."""
        return int(self._target_all.shape[1]), int(self._target_all.shape[2])

    @property
    def initial(self) -> int:
        """Centre lines acquired at the start of each episode."""
        return self._initial

    @property
    def budget(self) -> int:
        """Lines chosen by the policy per episode."""
        return self._budget

    @property
    def n_slices(self) -> int:
        """Slices in the data set the episodes are drawn from."""
        return self._n_slices

    @property
    def slice_index(self) -> torch.Tensor:
        """(B,) long: slice of each env's current episode."""
        self._require_started()
        return self._slice.clone()

    @property
    def current_quality(self) -> torch.Tensor:
        """(B,) float32: Q of each env's current state (of ``g(I)`` or ``I`` per ``reward_mar``)."""
        self._require_started()
        return self._quality.clone()

    @property
    def observation(self) -> Observation:
        """The current observation of every env."""
        self._require_started()
        return Observation(self._image, self._mask, self._steps_left, self._repeatable())

    # ------------------------------------------------------------------ internals
    def _require_started(self) -> None:
        if not self._started:
            raise RuntimeError("call reset() before using the environment")

    def _check_mar(self, mar: nn.Module | None) -> None:
        if mar is None:
            return
        if not isinstance(mar, nn.Module):
            raise TypeError(f"mar must be a torch.nn.Module or None, got {type(mar).__name__}")
        for p in mar.parameters():
            if p.device != self.device:
                raise ValueError(
                    f"mar has parameters on {p.device} but the env runs on {self.device}; "
                    f"move it with mar.to({str(self.device)!r})"
                )
            break

    def _correct(self, images: torch.Tensor) -> torch.Tensor:
        """g(I) for (B, H, W) images, in eval mode (the module's mode is restored)."""
        mar = self.mar
        was_training = mar.training
        mar.eval()
        try:
            out = mar(images)
        finally:
            if was_training:
                mar.train()
        if out.shape != images.shape:
            raise ValueError(
                f"mar must map (B, H, W) images to the same shape, got {tuple(out.shape)} "
                f"for input {tuple(images.shape)}"
            )
        return out.to(torch.float32)

    def _new_episodes(self, b: int) -> EpisodeBatch:
        """``b`` episodes with their initial centre lines acquired."""
        kind = EpisodeBatch if self._corruption is None else RepeatEpisodes
        return kind(self.n_pe, self._initial, self._budget, b, self.device, name="env")

    def _draw_attempts(self, slices: torch.Tensor, positions: np.ndarray | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every attempt of every line of ``slices`` ((n,) long): ((n, A, PE, RO) raw k-space,
        (n, A, PE) bool flags). ``positions``: draw each slice's stream from its position in the
        data (:func:`~training.rl.corruption.draw_flagged`, ``corruption.seed``), as ``masc
        headroom`` does; None: from the env's own stream (training)."""
        index = slices.cpu().numpy()
        raw = self._raw_all[slices]
        if positions is not None:
            attempts, _, flags = draw_flagged(raw, self._slices_all[index], self._corruption,
                                              self._corruption.attempts, self._corruption.seed, positions=positions)
        else:
            drawn = [corrupt_slice(raw[j], self._corruption, self._corruption.attempts, self._draws)
                     for j in range(len(index))]
            attempts = torch.stack([d[0] for d in drawn])
            flags = np.stack([d[2] for d in drawn])
        return attempts, torch.from_numpy(flags).to(self.device)

    def _current(self, episodes: EpisodeBatch, attempts: torch.Tensor | None, rows: Any = None) -> torch.Tensor:
        """(B, PE, RO) hybrid k-space of each line's latest acquisition."""
        counts = episodes.counts if rows is None else episodes.counts[rows]
        return to_hybrid(kspace_of(attempts, counts))

    def _repeatable(self) -> torch.Tensor | None:
        if self._corruption is None:
            return None
        return repeatable_lines(self._flags, self._episodes.counts)

    def _reference(self, slices: torch.Tensor) -> QualityReference:
        """The reward's target side for these slices ((n,) long), computed once per episode."""
        return QualityReference(self._target_all[slices], self.cfg.l_ssim, self.cfg.l_nmse,
                                None if self._roi_all is None else self._roi_all[slices])

    def _measure(self, kspace: torch.Tensor, mask: torch.Tensor, ref: QualityReference,
                 force_mar: bool = False) -> _Measured:
        """One batched recon (+ one MAR forward if needed) and Q of the reward image.

        kspace: (B, PE, RO) complex, in to_hybrid's form; mask: (B, PE) bool; ref: the B clean
        targets.
        """
        zf = zero_filled_hybrid(kspace, mask).to(torch.float32)
        use_mar = self.mar is not None
        corrected = None
        if use_mar and (self.cfg.observe_mar or self.cfg.reward_mar or force_mar):
            corrected = self._correct(zf)
        observed = corrected if (use_mar and self.cfg.observe_mar) else zf
        rewarded = corrected if (use_mar and self.cfg.reward_mar) else zf
        q = ref(rewarded).to(torch.float32)
        return _Measured(observed, q, zf, corrected)

    def _draw(self, n: int) -> torch.Tensor:
        """(n,) long slice indices on the device, uniform, from the private generator."""
        return torch.randint(self._n_slices, (n,), generator=self._generator).to(self.device)

    def _as_indices(self, indices: Sequence[int] | np.ndarray | torch.Tensor, n: int | None,
                    what: str) -> torch.Tensor:
        idx = torch.as_tensor(np.asarray(indices) if not isinstance(indices, torch.Tensor) else indices)
        if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex() or idx.ndim != 1:
            raise ValueError(f"{what} must be a 1-D sequence of integer slice indices, got {idx.dtype} "
                             f"of shape {tuple(idx.shape)}")
        if n is not None and idx.numel() != n:
            raise ValueError(f"{what} must give one slice per env ({n}), got {idx.numel()}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self._n_slices):
            bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
            raise ValueError(f"{what} must be in [0, {self._n_slices}), got {bad}")
        return idx.long().to(self.device)

    # ------------------------------------------------------------------ API
    def _acquire(self, episodes: EpisodeBatch, actions: Any, allow_finished: bool = False) -> None:
        """One step of every episode: a line ((B,) actions) or a train ((B, k), -1 padded)."""
        if self.lines_per_decision == 1:
            episodes.acquire(actions, allow_finished=allow_finished)
            return
        a = torch.as_tensor(np.asarray(actions) if not isinstance(actions, torch.Tensor) else actions)
        b, k = len(episodes), self.lines_per_decision
        if tuple(a.shape) != (b, k):
            raise ValueError(f"actions must be ({b}, {k}) trains of lines (-1 beyond an episode's lines left), "
                             f"got shape {tuple(a.shape)}")
        a = a.cpu().long()
        expected = np.minimum(episodes.steps_left, k)
        given = (a >= 0).sum(dim=1).numpy()
        if (a[:, :1] < 0).any() or ((a >= 0).long().diff(dim=1) > 0).any() or (
                (given != expected) & ~episodes.done).any():
            raise ValueError(f"each train must hold min(k, lines left) = {expected.tolist()} lines first, then -1; "
                             f"got {a.tolist()}")
        for j in range(k):
            rows = np.flatnonzero(a[:, j].numpy() >= 0)
            if rows.size:
                episodes.acquire(a[rows, j], rows=rows, allow_finished=allow_finished)

    @torch.no_grad()
    def reset(self, indices: Sequence[int] | np.ndarray | torch.Tensor | None = None) -> Observation:
        """Start a new episode in every env: the ``initial`` centre lines acquired.

        Args:
            indices: (B,) slice of each env; None draws them with the env's generator.

        Returns:
            the first observation of the new episodes.
        """
        b = self.n_envs
        slices = self._draw(b) if indices is None else self._as_indices(indices, b, "indices")
        self._slice = slices
        self._kspace = self._kspace_all[slices]  # (B, PE, RO)
        self._ref = self._reference(slices)  # Q's target side, (B, H, W) clean images
        self._episodes = self._new_episodes(b)
        if self._corruption is not None:
            self._attempts, self._flags = self._draw_attempts(slices)
            self._kspace = self._current(self._episodes, self._attempts)
        self._mask = self._episodes.mask
        self._steps_left = self._episodes.steps_left_tensor()
        self._return = torch.zeros(b, dtype=torch.float32, device=self.device)
        m = self._measure(self._kspace, self._mask, self._ref)
        self._image, self._quality = m.observed, m.quality
        self._started = True
        return self.observation

    @torch.no_grad()
    def step(self, actions: torch.Tensor | Sequence[int] | np.ndarray
             ) -> tuple[Observation, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Acquire one line in every env.

        Args:
            actions: (B,) long, the PE line each env acquires; must not be acquired yet (with
                corruption: or be one of the observation's ``repeatable`` lines, acquired again).

        Returns:
            ``(observation, rewards (B,) float32, terminated (B,) bool, info)``. A terminated env
            has chosen its ``budget`` lines; with ``autoreset`` it has already started a new
            episode and ``observation`` is that episode's first one. ``info``:

            * ``final_quality`` (B,): Q of the final state where terminated, NaN elsewhere;
            * ``episode_return`` (B,): sum of the episode's rewards where terminated, NaN elsewhere;
            * ``final_mask`` (B, PE) bool: the mask after this action, before any reset (for a
              terminated env, the episode's final mask);
            * ``final_image`` (B, H, W): the observed image after this action, before any reset;
            * ``slice_index`` (B,) long: the slice of the episode that just stepped.

        Raises:
            ValueError: an action is out of range or an already-acquired line (the message names
                the env and the line), or (without autoreset) an env has finished its episode.
        """
        self._require_started()
        episodes = self._episodes
        if self._corruption is None:
            self._acquire(episodes, actions, allow_finished=self.autoreset)
        else:  # a flagged line may be acquired again; its latest acquisition is the one used
            episodes.acquire(actions, allow_finished=self.autoreset,
                             repeatable=self._repeatable().cpu().numpy())
            self._kspace = self._current(episodes, self._attempts)
        b = self.n_envs
        mask = episodes.mask
        steps_left = episodes.steps_left_tensor()
        done_cpu = episodes.done
        done = torch.from_numpy(done_cpu).to(self.device)
        slice_stepped = self._slice

        reset_envs = np.flatnonzero(done_cpu) if self.autoreset else np.zeros(0, dtype=np.int64)
        new = self._autoreset(episodes, reset_envs) if len(reset_envs) else None
        if new is not None:  # one recon + one MAR forward for the stepped states and the new episodes together
            m = self._measure(torch.cat([self._kspace, new.kspace]), torch.cat([mask, new.mask]),
                              self._ref.cat(new.ref))
            image, q = m.observed[:b], m.quality[:b]
        else:
            m = self._measure(self._kspace, mask, self._ref)
            image, q = m.observed, m.quality

        rewards = self.cfg.alpha * (q - self._quality)
        returns = self._return + rewards
        nan = torch.full_like(q, float("nan"))
        info = {
            "final_quality": torch.where(done, q, nan),
            "episode_return": torch.where(done, returns, nan),
            "final_mask": mask,
            "final_image": image,
            "slice_index": slice_stepped,
        }

        if new is not None:
            image, q = self._install(new, reset_envs, slice_stepped, image, q, m.observed[b:], m.quality[b:])
            mask, steps_left = episodes.mask, episodes.steps_left_tensor()
            returns = torch.where(done, torch.zeros_like(returns), returns)

        self._mask, self._image, self._quality = mask, image, q
        self._steps_left, self._return = steps_left, returns
        return self.observation, rewards, done, info

    def _autoreset(self, episodes: EpisodeBatch, envs: np.ndarray) -> _NewEpisodes:
        """Draw the slices of the envs that start a new episode (autoreset) and reset their
        episodes (``episodes.mask`` read before keeps the stepped masks)."""
        slices = self._draw(len(envs))
        kspace = self._kspace_all[slices]
        attempts = flags = None
        if self._corruption is not None:  # the new episodes' draws; their initial lines are attempt 0
            attempts, flags = self._draw_attempts(slices)
            kspace = to_hybrid(attempts[:, 0])
        ref = self._reference(slices)
        episodes.reset(envs)
        mask = torch.from_numpy(episodes.masks[envs]).to(self.device)
        return _NewEpisodes(slices, kspace, ref, mask, attempts, flags)

    def _install(self, new: _NewEpisodes, reset_envs: np.ndarray, slice_stepped: torch.Tensor, image: torch.Tensor,
                 q: torch.Tensor, new_image: torch.Tensor, new_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put the new episodes in their envs (slices, k-space, reference, corruption draws);
        returns the next observation's images and qualities (the stepped ones, with the new
        episodes' first ones in their envs)."""
        envs = torch.from_numpy(reset_envs).to(self.device)
        slices = slice_stepped.clone()
        slices[envs] = new.slices
        kspace = self._kspace.clone()
        kspace[envs] = new.kspace
        ref = self._ref.replace(envs, new.ref)
        if self._corruption is not None:
            self._attempts = self._attempts.clone()
            self._attempts[envs] = new.attempts
            self._flags = self._flags.clone()
            self._flags[envs] = new.flags
        next_image = image.clone()
        next_image[envs] = new_image
        next_q = q.clone()
        next_q[envs] = new_q
        self._slice, self._kspace, self._ref = slices, kspace, ref
        return next_image, next_q

    @torch.no_grad()
    def observe(self, slices: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """(n, H, W): what the policy sees of slices ``slices`` ((n,) long) with lines ``masks``
        ((n, PE) bool) acquired, recomputed from the k-space (``g(I)`` with ``observe_mar`` and
        a MAR network, else ``I``). A replay memory stores (slice, mask) pairs and calls this
        for its minibatches instead of storing images."""
        slices = self._as_indices(slices, None, "slices")
        masks = masks.to(self.device)
        if masks.dtype != torch.bool or tuple(masks.shape) != (slices.numel(), self._n_pe):
            raise ValueError(f"masks must be bool ({slices.numel()}, {self._n_pe}), got {masks.dtype} "
                             f"{tuple(masks.shape)}")
        zf = zero_filled_hybrid(self._kspace_all[slices], masks).to(torch.float32)
        return self._correct(zf) if (self.mar is not None and self.cfg.observe_mar) else zf

    @torch.no_grad()
    def set_mar(self, mar: nn.Module | None) -> None:
        """Use ``mar`` from now on (a new network, or the same one after its weights changed).

        The current observations and qualities are recomputed with it (one recon + one MAR
        forward), so the next rewards compare states under the same network. An episode that
        spans the change therefore no longer sums exactly to ``alpha * (Q_final - Q_initial)``.
        """
        self._check_mar(mar)
        self.mar = mar
        if self._started:
            m = self._measure(self._kspace, self._mask, self._ref)
            self._image, self._quality = m.observed, m.quality

    def validate(self, policy_fn: Callable[[Observation], torch.Tensor]) -> dict[str, float]:
        """The means over every slice of :meth:`evaluate`'s metrics, ``return`` and
        ``final_quality``: what a trainer validates a policy by."""
        result = self.evaluate(policy_fn)
        metrics = {k: float(v.mean()) for k, v in result["metrics"].items()}
        metrics["return"] = float(result["returns"].mean())
        metrics["final_quality"] = float(result["final_quality"].mean())
        return metrics

    @torch.no_grad()
    def _evaluate_batch(self, policy_fn: Callable[[Observation], torch.Tensor], idx: torch.Tensor
                        ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One deterministic episode on each slice of ``idx`` (:meth:`evaluate`): its parts (the
        qualities, return, served image, mask, lines, and with corruption the counts) and the
        served image's metrics."""
        kspace, target, ref = self._kspace_all[idx], self._target_all[idx], self._reference(idx)
        episodes = self._new_episodes(idx.numel())
        attempts = flags = None
        if self._corruption is not None:  # the slices' own draws, as masc check headroom draws them
            attempts, flags = self._draw_attempts(idx, positions=idx.cpu().numpy())
            kspace = self._current(episodes, attempts)
        m = self._measure(kspace, episodes.mask, ref)
        q0 = m.quality
        q, ret = q0, torch.zeros_like(q0)
        n_steps = math.ceil(self._budget / self.lines_per_decision)
        for t in range(n_steps):
            repeatable = None if flags is None else repeatable_lines(flags, episodes.counts)
            actions = policy_fn(Observation(m.observed, episodes.mask, episodes.steps_left_tensor(), repeatable))
            if attempts is None:
                self._acquire(episodes, actions)
            else:
                episodes.acquire(actions, repeatable=repeatable.cpu().numpy())
                kspace = self._current(episodes, attempts)
            m = self._measure(kspace, episodes.mask, ref, force_mar=t == n_steps - 1)
            ret = ret + self.cfg.alpha * (m.quality - q)
            q = m.quality
        # the final image as the gadget serves it (clamped, float32), scored
        scores = score_batch(m.zero_filled, m.corrected if self.mar is not None else None, target,
                             roi=None if self._roi_all is None else self._roi_all[idx])
        parts = {"initial_quality": q0, "final_quality": q, "returns": ret, "images": scores.served.image,
                 "masks": episodes.mask, "lines": torch.from_numpy(episodes.chosen()[:, self._initial:])}
        if attempts is not None:
            parts["counts"] = torch.from_numpy(episodes.counts.copy())
        return parts, {**scores.image, **{f"roi_{k}": v for k, v in scores.roi.items()}}

    def evaluate(self, policy_fn: Callable[[Observation], torch.Tensor],
                 indices: Sequence[int] | np.ndarray | torch.Tensor | None = None,
                 batch_size: int = 64) -> dict[str, Any]:
        """One episode on each slice (every slice, or ``indices``), deterministically.

        Uses its own state: the envs' current episodes and the slice generator are untouched.
        ``policy_fn(obs) -> (b,) actions`` gets batches of up to ``batch_size`` episodes (b may
        be smaller than ``n_envs``) and should be greedy for deterministic results.

        Returns:
            a dict of CPU tensors, N = number of slices evaluated:

            * ``index`` (N,) long: the slices;
            * ``initial_quality`` / ``final_quality`` (N,): Q before the first and after the last
              choice (of ``g(I)`` or ``I`` per ``reward_mar``, as the rewards);
            * ``returns`` (N,): sum of the episode's rewards;
            * ``images`` (N, H, W): final reconstruction as the gadget serves it
              (:func:`training.scoring.score_batch`), ``g(I)`` when a MAR network is
              set, else ``I``;
            * ``masks`` (N, PE) bool: final masks;
            * ``lines`` (N, budget) long: the chosen lines in order (with corruption a line
              that appears twice was acquired again);
            * ``counts`` (N, PE) long, with corruption only: each line's acquisitions;
            * ``metrics``: :func:`masc_gadget.core.metrics.slice_metrics` of ``images`` (each (N,));
              with ``region: implant`` also :func:`masc_gadget.core.metrics.roi_metrics` in the
              periprosthetic region, as ``roi_ssim``, ``roi_psnr``, ...
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if indices is None:
            idx_all = torch.arange(self._n_slices, device=self.device)
        else:
            idx_all = self._as_indices(indices, None, "indices")
        if idx_all.numel() == 0:
            raise ValueError("indices must name at least one slice, got none")
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in (
            "initial_quality", "final_quality", "returns", "images", "masks", "lines")}
        metric_parts: dict[str, list[torch.Tensor]] = {}
        for start in range(0, idx_all.numel(), batch_size):
            batch, metrics = self._evaluate_batch(policy_fn, idx_all[start:start + batch_size])
            for key, value in batch.items():
                parts.setdefault(key, []).append(value)
            for key, value in metrics.items():
                metric_parts.setdefault(key, []).append(value)
        out: dict[str, Any] = {k: torch.cat(v).cpu() for k, v in parts.items()}
        out["index"] = idx_all.cpu()
        out["metrics"] = {k: torch.cat(v).cpu() for k, v in metric_parts.items()}
        return out
