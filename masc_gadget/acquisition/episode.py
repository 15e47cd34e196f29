"""Acquisition episodes: which phase-encoding (PE) lines of a slice are acquired, in what order.

An episode is one slice with ``n_pe`` PE lines. The ``initial`` lines around the k-space centre
are acquired first, then a sampling policy (:mod:`masc_gadget.acquisition.policies`) chooses ``budget``
further lines one at a time; an acquired line is never chosen again, so every method acquires
exactly ``initial + budget`` lines. Paper setting: 10x = 2 + 18, 5x = 8 + 32 of ~200 PE lines.

Line ``k`` is row ``k`` of centred k-space (``fft2c``): the centre, DC, is line ``n_pe // 2``.
This module is numpy only; the policies and the streaming gadget share its state record.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AcquisitionConfig:
    """How many PE lines each slice gets and which policy chooses them (section ``acquisition``)."""

    initial: int = 2
    """Centre lines acquired before the policy starts; paper 10x: 2, 5x: 8."""
    budget: int = 18
    """Lines chosen by the policy, one at a time, after the initial ones; paper 10x: 18, 5x: 32."""
    policy: str = "center-out"
    """Sampling policy name (``masc_gadget.acquisition.policies.POLICIES``): center-out, random,
    random-lowbias, equispaced, or a learned policy registered by another package."""
    seed: int = 0
    """Seed of the per-slice random streams of random policies (``slice_rng(seed, slice, ...)``)."""

    def __post_init__(self) -> None:
        if self.initial < 1:
            raise ValueError(f"initial must be >= 1 centre line, got {self.initial}")
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1 line, got {self.budget}")
        if not self.policy:
            raise ValueError("policy must be a non-empty policy name, got ''")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    @property
    def total(self) -> int:
        """Lines acquired per slice, ``initial + budget``."""
        return self.initial + self.budget

    def check(self, n_pe: int) -> None:
        """Raise ValueError unless an episode of this size fits a slice with ``n_pe`` PE lines."""
        check_episode(n_pe, self.initial, self.budget)


def check_episode(n_pe: int, initial: int, budget: int) -> None:
    """Raise ValueError stating the rule unless ``1 <= initial``, ``0 <= budget`` and
    ``initial + budget <= n_pe``."""
    if n_pe < 1:
        raise ValueError(f"number of PE lines must be >= 1, got {n_pe}")
    if initial < 1:
        raise ValueError(f"initial must be >= 1 centre line, got {initial}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0 lines, got {budget}")
    if initial + budget > n_pe:
        raise ValueError(
            f"initial + budget must be <= number of PE lines ({n_pe}), got {initial} + {budget}"
        )


def initial_lines(n_pe: int, initial: int) -> np.ndarray:
    """The ``initial`` lines centred on the k-space centre ``n_pe // 2``: (initial,) int64, sorted.

    An even count has one more line below the centre than above it, e.g. n_pe=200:
    initial=2 -> [99, 100], initial=3 -> [99, 100, 101], initial=4 -> [98, 99, 100, 101].
    """
    if not 1 <= initial <= n_pe:
        raise ValueError(
            f"initial must be between 1 and the number of PE lines ({n_pe}), got {initial}"
        )
    start = n_pe // 2 - initial // 2
    return np.arange(start, start + initial, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class AcquisitionState:
    """What a policy sees before choosing the next line of one slice.

    States are immutable: :meth:`after` returns a new one. ``mask`` is copied and made
    read-only, so a caller mutating its own array cannot change a state.
    """

    mask: np.ndarray
    """(n_pe,) bool, True for lines already acquired (by the policy, initially, or by a scanner
    on its own)."""
    steps_left: int
    """Lines the policy may still choose in this episode."""
    step: int
    """Lines chosen (or acquired after the initial ones) so far."""
    image: np.ndarray | None = None
    """(H, W) current magnitude image (possibly MAR-corrected); only learned policies
    (``needs_image``) use it."""
    n_initial: int | None = None
    """Centre lines acquired before the policy started; None = ``mask.sum() - step`` (at
    least 1). Set by :meth:`initial`; the equispaced pattern depends on it."""

    def __post_init__(self) -> None:
        mask = np.array(self.mask, dtype=bool, copy=True)
        if mask.ndim != 1 or mask.size == 0:
            raise ValueError(f"mask must be a non-empty 1-D (n_pe,) array, got shape {mask.shape}")
        mask.setflags(write=False)
        object.__setattr__(self, "mask", mask)
        if self.steps_left < 0:
            raise ValueError(f"steps_left must be >= 0, got {self.steps_left}")
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")
        if self.n_initial is not None and not 1 <= self.n_initial <= mask.size:
            raise ValueError(
                f"n_initial must be between 1 and the number of PE lines ({mask.size}), "
                f"got {self.n_initial}"
            )

    @property
    def n_pe(self) -> int:
        """Number of PE lines of the slice."""
        return int(self.mask.size)

    @property
    def n_acquired(self) -> int:
        return int(self.mask.sum())

    @property
    def initial_count(self) -> int:
        """Centre lines acquired before the policy started (``n_initial`` or inferred)."""
        if self.n_initial is not None:
            return self.n_initial
        return max(self.n_acquired - self.step, 1)

    @property
    def budget(self) -> int:
        """Lines the policy chooses in the whole episode, ``step + steps_left``."""
        return self.step + self.steps_left

    def free_lines(self) -> np.ndarray:
        """Lines not yet acquired: (n_free,) int64, ascending."""
        return np.flatnonzero(~self.mask).astype(np.int64)

    @classmethod
    def initial(cls, n_pe: int, initial: int, budget: int) -> AcquisitionState:
        """The start of an episode: the ``initial`` centre lines acquired, ``budget`` to go."""
        check_episode(n_pe, initial, budget)
        mask = np.zeros(n_pe, dtype=bool)
        mask[initial_lines(n_pe, initial)] = True
        return cls(mask=mask, steps_left=budget, step=0, n_initial=initial)

    def after(self, line: int, image: np.ndarray | None = None) -> AcquisitionState:
        """The state with ``line`` acquired: one step more, one step fewer left.

        ``image`` is the image reconstructed with that line (None drops the old, stale one).
        A line acquired when no steps are left (a scanner streaming more than the budget) is
        recorded with ``steps_left`` staying 0.
        """
        if isinstance(line, (bool, np.bool_)) or not isinstance(line, (int, np.integer)):
            raise TypeError(f"line must be an integer PE line index, got {line!r}")
        if not 0 <= line < self.n_pe:
            raise ValueError(f"line must be in [0, {self.n_pe}) (n_pe = {self.n_pe}), got {line}")
        if self.mask[line]:
            raise ValueError(f"line {line} is already acquired (n_pe = {self.n_pe})")
        mask = self.mask.copy()
        mask[line] = True
        return dataclasses.replace(
            self,
            mask=mask,
            steps_left=max(self.steps_left - 1, 0),
            step=self.step + 1,
            image=image,
        )
