"""k-space-local corruption, and re-acquiring a line as a legal action: the fourth place the
headroom gate looks for per-slice adaptivity (:mod:`training.evaluation.headroom`).

A fixed order cannot know which of its lines came back corrupted; a policy that watches the data
can spend a line of its budget on acquiring a corrupted one again. :class:`CorruptionModel`
corrupts each *acquisition* of a line independently with ``probability``:

- ``motion``: the patient moved during that line; the line carries the phase of a rigid shift
  along the readout (up to ``shift`` pixels) and a random phase offset;
- ``spike``: a k-space spike, one readout sample raised by ``spike`` times the slice's largest
  k-space magnitude, at a random phase.

:func:`draw_attempts` draws every slice's acquisitions up front, seeded per slice (its position in
the set and its index in its subject, :func:`~masc_gadget.acquisition.policies.slice_rng`): attempt ``a`` of line ``k`` is the same
whoever acquires it, so methods are compared on the same draws; the greedy oracle that may
acquire a line again, a yardstick on those draws, lives with the other oracles
(:class:`training.oracle.ReacquireOracle`), and so does :func:`training.oracle.kspace_of`, the
k-space of each line's latest attempt.
:class:`RepeatEpisodes` are the episodes of a policy that may acquire a flagged line again
(every acquisition spends a step), :func:`repeatable_lines` the lines it may repeat now, and
:class:`GatedOrder` the rule a scanner plays with navigator gating: a fixed order that acquires
each flagged line again first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from masc_gadget.acquisition.episode import EpisodeBatch, _as_lines
from masc_gadget.acquisition.policies import slice_rng

__all__ = ["KINDS", "CorruptionModel", "GatedOrder", "RepeatEpisodes", "repeatable_lines", "corrupt_slice",
           "draw_attempts", "draw_flagged"]

KINDS = ("motion", "spike")


@dataclass(frozen=True)
class CorruptionModel:
    """Each acquisition of a line is corrupted with ``probability`` (module docstring): the
    ``corruption`` section of ``env`` and ``headroom`` (a bare number there is the probability,
    :attr:`SHORTHAND_KEY`)."""

    probability: float = 0.0
    """0: none."""
    SHORTHAND_KEY: ClassVar[str] = "probability"
    """A config may give the section as a bare number: this setting (``corruption: 0.1``)."""
    kind: str = "motion"
    shift: float = 4.0
    """Largest rigid shift along the readout, in pixels (``motion``)."""
    spike: float = 0.5
    """Spike height, times the slice's largest k-space magnitude (``spike``)."""
    detection: float = 0.9
    """The scanner's flag: the probability that a corrupted acquisition is flagged (a
    navigator's or a spike detector's sensitivity)."""
    false_alarm: float = 0.02
    """The probability that a clean acquisition is flagged all the same."""
    attempts: int = 3
    """Acquisitions of one line at most (the first and its repeats)."""
    seed: int = 0
    """The seed of the draws every method is compared on (:func:`draw_attempts`; the environment's
    validation, ``masc check headroom``); training episodes draw from the environment's own stream."""

    @property
    def enabled(self) -> bool:
        return self.probability > 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"the corruption probability must be in [0, 1], got {self.probability}")
        if self.kind not in KINDS:
            raise ValueError(f"the corruption kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.shift < 0 or self.spike < 0:
            raise ValueError(f"shift and spike must be >= 0, got {self.shift} and {self.spike}")
        for name in ("detection", "false_alarm"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {getattr(self, name)}")
        for name, least in (("attempts", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def draw_attempts(kspace: torch.Tensor, slices: np.ndarray, model: CorruptionModel, attempts: int,
                  seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """Every slice's ``attempts`` acquisitions of every line.

    Args:
        kspace: (N, PE, RO) complex, the uncorrupted k-space.
        slices: (N,) the index of each slice in its subject (with ``seed`` and its position in
            the set, its random stream).
        attempts: acquisitions drawn per line (>= 1).

    Returns:
        ``(attempt_kspace, corrupted)``: (N, attempts, PE, RO) complex, and (N, attempts, PE) bool,
        which acquisitions are corrupted."""
    out, corrupted, _ = draw_flagged(kspace, slices, model, attempts, seed)
    return out, corrupted


def draw_flagged(kspace: torch.Tensor, slices: np.ndarray, model: CorruptionModel, attempts: int,
                 seed: int = 0, positions: np.ndarray | None = None) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """:func:`draw_attempts` and the scanner's flags: ``(attempt_kspace, corrupted, flagged)``,
    ``flagged`` (N, attempts, PE) bool drawn after the corruption from each slice's stream
    (:attr:`CorruptionModel.detection`, :attr:`CorruptionModel.false_alarm`). ``positions``:
    each slice's position in its set (default 0, 1, ...: ``kspace`` is the whole set)."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    n = kspace.shape[0]
    out = kspace[:, None].repeat(1, attempts, 1, 1)
    corrupted = np.zeros((n, attempts, kspace.shape[1]), dtype=bool)
    flagged = np.zeros_like(corrupted)
    positions = np.arange(n) if positions is None else np.asarray(positions)
    for i in range(n):
        out[i], corrupted[i], flagged[i] = corrupt_slice(kspace[i], model, attempts,
                                                         slice_rng(seed, int(positions[i]), int(slices[i])))
    return out, corrupted, flagged


def corrupt_slice(kspace: torch.Tensor, model: CorruptionModel, attempts: int, rng: np.random.Generator
                  ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """One slice's (PE, RO) k-space acquired ``attempts`` times per line, drawn from ``rng``:
    ``(attempt_kspace (attempts, PE, RO), corrupted (attempts, PE) bool, flagged (attempts, PE)
    bool)``."""
    n_pe, n_ro = kspace.shape
    out = kspace[None].repeat(attempts, 1, 1)
    hit = rng.random((attempts, n_pe)) < model.probability
    a, k = np.nonzero(hit)
    if a.size and model.kind == "motion":
        ro = torch.arange(n_ro, dtype=torch.float64) - n_ro // 2
        shift = torch.from_numpy(rng.uniform(-model.shift, model.shift, a.size))
        offset = torch.from_numpy(rng.uniform(-math.pi, math.pi, a.size))
        phase = torch.polar(torch.ones(a.size, n_ro, dtype=torch.float64),
                            -2 * math.pi * shift[:, None] * ro[None] / n_ro + offset[:, None])
        out[a, k] = out[a, k] * phase.to(out.dtype).to(out.device)
    elif a.size:
        where = torch.from_numpy(rng.integers(0, n_ro, a.size))
        height = model.spike * float(kspace.abs().max())
        spikes = torch.polar(torch.full((a.size,), height, dtype=torch.float64),
                             torch.from_numpy(rng.uniform(-math.pi, math.pi, a.size))).to(out.dtype)
        out[torch.from_numpy(a), torch.from_numpy(k), where] += spikes.to(out.device)
    u = rng.random((attempts, n_pe))
    flagged = np.where(hit, u < model.detection, u < model.false_alarm)
    return out, hit, flagged


class RepeatEpisodes(EpisodeBatch):
    """Episodes in which a line may be acquired again (``EnvConfig.corruption``): every
    acquisition, first or repeat, spends a step of the budget. ``counts`` (B, PE) int64 holds
    each line's acquisitions (the mask is ``counts > 0``) and ``order`` lists the acquisitions in
    their order, repeats included."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.counts = np.zeros((0, 0), dtype=np.int64)
        super().__init__(*args, **kwargs)

    def reset(self, rows: Any = None, rngs: Any = None) -> None:
        if self.counts.shape != self.masks.shape:
            self.counts = np.zeros(self.masks.shape, dtype=np.int64)
        super().reset(rows, rngs)
        rows = self._rows(rows)
        self.counts[rows] = self._first

    def _set(self, rows: np.ndarray, a: np.ndarray) -> None:
        super()._set(rows, a)
        self.counts[rows, a] += 1

    def acquire(self, lines: Any, rows: Any = None, allow_finished: bool = False,
                repeatable: np.ndarray | None = None) -> None:
        """As :meth:`EpisodeBatch.acquire`, and a line already acquired is acquired again where
        ``repeatable`` (B, PE) bool allows it (ValueError naming the episode and the line
        elsewhere; nothing is changed then)."""
        rows = self._rows(rows)
        a = _as_lines(lines, rows.size, self.name)
        inside = (a >= 0) & (a < self.n_pe)
        again = np.zeros(rows.size, dtype=bool)
        again[inside] = self.masks[rows[inside], a[inside]]
        if again.any():
            allowed = (np.zeros(again.sum(), dtype=bool) if repeatable is None
                       else np.asarray(repeatable)[rows[again], a[again]])
            if not allowed.all():
                i = int(np.flatnonzero(again)[np.flatnonzero(~allowed)[0]])
                raise ValueError(f"{self.name} {i}: line {a[i]} is already acquired and its last acquisition "
                                 "was not flagged (or it has no attempts left); only a flagged line may be "
                                 "acquired again")
            if not allow_finished and self.done[rows[again]].any():
                i = int(np.flatnonzero(again & self.done[rows])[0])
                raise ValueError(f"{self.name} {i} has finished its episode ({self.budget} lines chosen); "
                                 "call reset() before stepping it again")
        if (~again).any():
            super().acquire(a[~again], rows[~again], allow_finished=allow_finished)
        r, line = rows[again], a[again]
        self.order[r, self.n_acquired[r]] = line
        self.n_acquired[r] += 1
        self.counts[r, line] += 1


def repeatable_lines(flags: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
    """(B, PE) bool: acquired lines whose latest acquisition is flagged (``flags`` (B, A, PE)
    bool, every attempt's flag) and that have attempts left (``counts`` (B, PE) acquisitions)."""
    attempts = flags.shape[1]
    c = torch.from_numpy(counts).to(flags.device)
    latest = flags.gather(1, (c - 1).clamp(0, attempts - 1)[:, None])[:, 0]
    return latest & (c > 0) & (c < attempts)


class GatedOrder:
    """A fixed order with navigator gating, as a policy of
    :meth:`training.rl.env.BatchedAcquisitionEnv.evaluate` (observation -> (B,) lines): while an
    acquired line is flagged (and has attempts left) it is acquired again, the most central
    first; otherwise the next line of ``order`` not yet acquired. A rule, not a learned policy:
    the bar a learned one that may repeat lines has to clear."""

    def __init__(self, order: np.ndarray, n_pe: int) -> None:
        self.order = torch.as_tensor(np.asarray(order), dtype=torch.int64)
        self.distance = (torch.arange(n_pe) - n_pe // 2).abs().float()

    def __call__(self, obs: Any) -> torch.Tensor:
        mask, flagged = obs.mask.cpu(), obs.repeatable.cpu()
        free = ~mask[:, self.order]
        following = self.order[free.to(torch.uint8).argmax(dim=1)]
        central = torch.where(flagged, -self.distance, torch.tensor(-math.inf)).argmax(dim=1)
        return torch.where(flagged.any(dim=1), central, following)
