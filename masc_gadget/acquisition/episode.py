"""Acquisition episodes: which phase-encoding (PE) lines of a slice are acquired, in what order.

An episode is one slice with ``n_pe`` PE lines. The ``initial`` lines around the k-space centre
are acquired first, then a sampling policy (:mod:`masc_gadget.acquisition.policies`) chooses ``budget``
further lines one at a time; an acquired line is never chosen again, so every method acquires
exactly ``initial + budget`` lines. Paper setting: 10x = 2 + 18, 5x = 8 + 32 of ~200 PE lines.

Line ``k`` is row ``k`` of centred k-space (``fft2c``): the centre, DC, is line ``n_pe // 2``.
:class:`AcquisitionState` is what a policy sees of one episode; :class:`EpisodeBatch` is the one
record of a batch of episodes that the engine, the simulated scanner, the training environment
and the evaluation all keep their episodes in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from masc_gadget.config import quote
from masc_gadget.core.kspace import initial_lines


@dataclass(frozen=True)
class AcquisitionConfig:
    """How many PE lines each slice gets and which policy chooses them (section ``acquisition``)."""

    initial: int = 2
    """Centre lines acquired before the policy starts; paper 10x: 2, 5x: 8."""
    budget: int = 18
    """Lines chosen by the policy after the initial ones; paper 10x: 18, 5x: 32."""
    lines_per_decision: int = 1
    """Lines chosen per decision (k): a turbo spin echo acquires an echo train of several lines
    per TR, so the policy chooses k distinct free lines at once (the last train of an episode
    may be shorter). 1: one line per decision."""
    policy: str = "center-out"
    """Sampling policy name (``masc_gadget.acquisition.policies.POLICIES``): center-out, random,
    random-lowbias, equispaced, or a learned policy whose checkpoint is ``gadget.policy_checkpoint``:
    masc, dqn, ss-ddqn, loupe."""
    seed: int = 0
    """Seed of the per-slice random streams of random policies (``slice_rng(seed, slice, ...)``)."""

    def __post_init__(self) -> None:
        check_counts(self.initial, self.budget)
        k = self.lines_per_decision
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.budget:
            raise ValueError(f"lines_per_decision must be an integer in [1, budget = {self.budget}], got {k!r}")
        if not self.policy:
            raise ValueError("policy must be a non-empty policy name, got ''")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.seed >= 2**63:
            raise ValueError(f"seed must be below 2**63, got {quote(self.seed)}")

    @property
    def total(self) -> int:
        """Lines acquired per slice, ``initial + budget``."""
        return self.initial + self.budget

    def check(self, n_pe: int) -> None:
        """Raise ValueError unless an episode of this size fits a slice with ``n_pe`` PE lines."""
        check_episode(n_pe, self.initial, self.budget)


MAX_LINES = 65535
"""The most lines a count may name: the ISMRMRD line index (``kspace_encode_step_1``) is 16 bits."""


def check_counts(initial: int, budget: int) -> None:
    """The one rule on an episode's line counts: ValueError unless ``initial >= 1`` (the
    reconstruction needs the k-space centre), ``budget >= 1`` (an episode has at least one
    choice) and neither beyond :data:`MAX_LINES`."""
    if initial < 1:
        raise ValueError(f"initial must be >= 1 centre line, got {initial}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1 line, got {budget}")
    for name, value in (("initial", initial), ("budget", budget)):
        if value > MAX_LINES:
            raise ValueError(f"{name} must be at most {MAX_LINES} lines, got {quote(value)}")


def check_episode(n_pe: int, initial: int, budget: int) -> None:
    """Raise ValueError stating the rule unless :func:`check_counts` holds and
    ``initial + budget <= n_pe``."""
    if n_pe < 1:
        raise ValueError(f"number of PE lines must be >= 1, got {n_pe}")
    check_counts(initial, budget)
    if initial + budget > n_pe:
        raise ValueError(
            f"initial + budget must be <= number of PE lines ({n_pe}), got {initial} + {budget}"
        )


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
    switched: bool = False
    """The early OOD rule switched this slice to the safe order: its remaining lines are
    centre-out's whatever the policy (:func:`~masc_gadget.acquisition.policies.select_lines`)."""

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


def _as_lines(lines: Any, n: int, name: str) -> np.ndarray:
    """(n,) int64 host array of PE line indices; ValueError for a wrong dtype or shape."""
    a = lines.detach().cpu().numpy() if isinstance(lines, torch.Tensor) else np.asarray(lines)
    if a.dtype == bool or a.dtype.kind not in "iu":
        raise ValueError(f"actions must be integer PE line indices, got dtype {a.dtype}")
    if a.shape != (n,):
        raise ValueError(
            f"actions must be ({n},) line indices, one per {name}, got shape {tuple(a.shape)}"
        )
    return a.astype(np.int64, copy=False)


class EpisodeBatch:
    """B acquisition episodes of one size, one slice each: the one record of which PE lines
    are acquired, in what order, and how many choices are left.

    The acquisition engine (one batch of one per slice, lines arriving from the scanner), the
    simulated scanner (one batch per subject), the training environment and the offline
    evaluation (one batch of many slices, stepped in lockstep) all keep their episodes here.

    An episode counts every acquired line, whoever chose it: ``step = n_acquired - initial``
    lines beyond the initial ones, ``steps_left = initial + budget - n_acquired`` (at least 0),
    so a scanner that acquires the initial lines itself, or streams lines nobody asked for,
    is tracked the same way as a policy's choices.

    State, on the host: ``masks`` (B, n_pe) bool, replaced (never written in place) on every
    change, so a mask handed out earlier is never modified; ``n_acquired`` (B,) and the arrival
    order ``order`` (B, n_pe) (-1 = not yet). :attr:`mask` is the same on ``device`` (on the
    CPU it shares the host memory; elsewhere it is copied once per change, when asked for), so
    counting and checking lines never waits for a device. ``rngs``: one ``numpy.random.Generator`` per episode for random policies
    (``slice_rng(seed, slice)``), kept across its steps.

    Args:
        n_pe, initial, budget: the episode size (:func:`check_episode`).
        batch: B.
        device: where ``mask`` lives.
        rngs: B generators, or None (deterministic policies only).
        start: True: every episode starts with its ``initial`` centre lines acquired;
            False: empty (the lines, initial ones included, come from :meth:`record`).
        name: what an episode is called in error messages ("env", "slice", ...).
    """

    def __init__(self, n_pe: int, initial: int, budget: int, batch: int,
                 device: str | torch.device = "cpu",
                 rngs: Sequence[np.random.Generator | None] | None = None,
                 start: bool = True, name: str = "episode") -> None:
        check_episode(n_pe, initial, budget)
        if batch < 0:
            raise ValueError(f"batch must be >= 0 episodes, got {batch}")
        self.n_pe, self.initial, self.budget = int(n_pe), int(initial), int(budget)
        self.device = torch.device(device)
        self.name = name
        self.rngs: list[np.random.Generator | None] = [None] * batch if rngs is None else list(rngs)
        if len(self.rngs) != batch:
            raise ValueError(f"need one rng per {name}: got {len(self.rngs)} rngs for {batch}")
        self.initial_lines = initial_lines(self.n_pe, self.initial)
        self._first = np.zeros(self.n_pe, dtype=bool)  # (n_pe,) the initial mask
        self._first[self.initial_lines] = True
        self.masks = np.zeros((batch, self.n_pe), dtype=bool)
        self._mask: torch.Tensor | None = None  # masks on the device, made when asked for
        self.switched = np.zeros(batch, dtype=bool)
        """(B,) bool: switched to the safe order by the early OOD rule (:meth:`switch`)."""
        self.switch_score = np.full(batch, np.nan, dtype=np.float32)
        """(B,) the early OOD score of each episode (NaN: not scored)."""
        self.n_acquired = np.zeros(batch, dtype=np.int64)
        self.order = np.full((batch, self.n_pe), -1, dtype=np.int64)
        if start:
            self.reset()

    # --- counts ---------------------------------------------------------------------------------

    @property
    def mask(self) -> torch.Tensor:
        """(B, n_pe) bool on ``device``: :attr:`masks`, never modified later."""
        if self._mask is None:
            self._mask = torch.from_numpy(self.masks).to(self.device)
        return self._mask

    def _replace(self, masks: np.ndarray) -> None:
        self.masks, self._mask = masks, None

    def __len__(self) -> int:
        return int(self.n_acquired.size)

    @property
    def total(self) -> int:
        """Lines per episode once its budget is spent, ``initial + budget``."""
        return self.initial + self.budget

    @property
    def steps_left(self) -> np.ndarray:
        """(B,) int64 choices still to make, ``max(total - n_acquired, 0)``."""
        return np.maximum(self.total - self.n_acquired, 0)

    @property
    def step(self) -> np.ndarray:
        """(B,) int64 lines acquired beyond the initial ones (negative before they are in)."""
        return self.n_acquired - self.initial

    @property
    def done(self) -> np.ndarray:
        """(B,) bool: the episode has all its ``initial + budget`` lines."""
        return self.n_acquired >= self.total

    @property
    def deciding(self) -> np.ndarray:
        """(B,) bool: the initial lines are in and choices are left (a policy decides next)."""
        return (self.n_acquired >= self.initial) & (self.n_acquired < self.total)

    def is_deciding(self, row: int) -> bool:
        """:attr:`deciding` of one episode, without building the (B,) array."""
        return self.initial <= self.n_acquired[row] < self.total

    def is_done(self, row: int) -> bool:
        """:attr:`done` of one episode."""
        return bool(self.n_acquired[row] >= self.total)

    def steps_left_tensor(self) -> torch.Tensor:
        """:attr:`steps_left` as a (B,) long tensor on ``device``."""
        return torch.from_numpy(self.steps_left).to(self.device)

    def lines(self, row: int) -> list[int]:
        """Acquired lines of episode ``row`` in arrival order."""
        return [int(v) for v in self.order[row, : self.n_acquired[row]]]

    def chosen(self) -> np.ndarray:
        """(B, initial + budget) int64: the lines of finished episodes in arrival order."""
        if not self.done.all():
            raise ValueError(f"every {self.name} must be finished to list its lines")
        return self.order[:, : self.total].copy()

    # --- changes --------------------------------------------------------------------------------

    def _rows(self, rows: Any) -> np.ndarray:
        if rows is None:
            return np.arange(len(self))
        return np.asarray(rows, dtype=np.int64).reshape(-1)

    def reset(self, rows: Any = None, rngs: Sequence[np.random.Generator | None] | None = None) -> None:
        """Start episodes ``rows`` (all: None) again with their initial centre lines acquired;
        ``rngs``: their new generators (default: keep the old ones)."""
        rows = self._rows(rows)
        if rows.size == 0:
            return
        masks = self.masks.copy()
        masks[rows] = self._first
        self._replace(masks)
        self.n_acquired[rows] = self.initial
        self.order[rows] = -1
        self.order[rows, : self.initial] = self.initial_lines
        self.switched[rows] = False
        self.switch_score[rows] = np.nan
        if rngs is not None:
            if len(rngs) != rows.size:
                raise ValueError(f"need one rng per reset {self.name}: got {len(rngs)} for {rows.size}")
            for r, rng in zip(rows, rngs):
                self.rngs[r] = rng

    def acquire(self, lines: Any, rows: Any = None, allow_finished: bool = False) -> None:
        """Episode ``rows[i]`` (all: None) acquires line ``lines[i]``: one step each.

        Raises ValueError naming the episode and the line for a line out of range or already
        acquired, or (unless ``allow_finished``) an episode that has no choice left; nothing is
        changed then.
        """
        rows = self._rows(rows)
        a = _as_lines(lines, rows.size, self.name)
        finished = np.zeros(rows.size, dtype=bool) if allow_finished else self.done[rows]
        out_of_range = (a < 0) | (a >= self.n_pe)
        taken = self.masks[rows, a.clip(0, self.n_pe - 1)]
        bad = finished | out_of_range | taken
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            if finished[i]:
                raise ValueError(f"{self.name} {i} has finished its episode ({self.budget} lines "
                                 "chosen); call reset() before stepping it again")
            if out_of_range[i]:
                raise ValueError(f"{self.name} {i}: action (PE line) must be in [0, {self.n_pe}), "
                                 f"got {a[i]}")
            raise ValueError(f"{self.name} {i}: line {a[i]} is already acquired; an action must "
                             "be a line not yet acquired (mask False)")
        self._set(rows, a)

    def _set(self, rows: np.ndarray, a: np.ndarray) -> None:
        masks = self.masks.copy()
        masks[rows, a] = True
        self._replace(masks)
        self.order[rows, self.n_acquired[rows]] = a
        self.n_acquired[rows] += 1

    def record(self, row: int, line: int) -> bool:
        """A line the scanner acquired for episode ``row``, asked for or not, budget spent or
        not (the scanner is the authority). Returns False, changing nothing, for a line that
        is already acquired (a repeat). ``line`` must be in [0, n_pe)."""
        if not 0 <= line < self.n_pe:
            raise ValueError(f"{self.name} {row}: line must be in [0, {self.n_pe}), got {line}")
        if self.masks[row, line]:
            return False
        self._set(np.array([row]), np.array([line], dtype=np.int64))
        return True

    def switch(self, rows: Any, flagged: Any, scores: Any) -> None:
        """The early OOD rule's verdict on episodes ``rows`` (all: None): their scores, and those
        ``flagged`` continue with centre-out's lines (:attr:`switched`; kept until reset)."""
        rows = self._rows(rows)
        flagged = np.asarray(flagged, dtype=bool).reshape(-1)
        scores = np.asarray(scores, dtype=np.float32).reshape(-1)
        if flagged.shape != rows.shape or scores.shape != rows.shape:
            raise ValueError(f"need one verdict and score per {self.name}: {rows.size} rows, "
                             f"{flagged.size} verdicts, {scores.size} scores")
        self.switched[rows] |= flagged
        self.switch_score[rows] = scores

    def scored(self, rows: Any = None) -> np.ndarray:
        """(k,) bool: whether the early rule has scored episodes ``rows`` (all: None)."""
        return ~np.isnan(self.switch_score[self._rows(rows)])

    # --- policies -------------------------------------------------------------------------------

    def states(self, rows: Any = None, images: Sequence[np.ndarray] | np.ndarray | None = None
               ) -> list[AcquisitionState]:
        """The :class:`AcquisitionState` of episodes ``rows`` (all: None), with ``images[i]``
        as the image of ``rows[i]`` (None: no image)."""
        rows = self._rows(rows)
        masks = self.masks[rows]
        if images is None:
            images = [None] * rows.size
        steps_left, step = self.steps_left, self.step
        return [
            AcquisitionState(mask=m, steps_left=int(steps_left[r]), step=max(int(step[r]), 0),
                             image=image, n_initial=self.initial, switched=bool(self.switched[r]))
            for r, m, image in zip(rows, masks, images)
        ]
